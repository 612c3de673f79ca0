"""The small PNG codec: round trips through every filter, and clear errors on bad files."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from stages.png import MAX_SIDE, PNG_SIGNATURE, PngError, decode_png, encode_png

SEED = 7


def _image(height: int, width: int) -> np.ndarray:
    """A seeded random uint8 RGB image."""
    print(f"seed {SEED}")
    return np.random.default_rng(SEED).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _png(ihdr: bytes, raw: bytes, *, chunks: bytes = b"") -> bytes:
    """A PNG assembled by hand from an IHDR body and raw (filtered) scanlines."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    return (
        PNG_SIGNATURE
        + chunk(b"IHDR", ihdr)
        + chunks
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("filter_type", range(5), ids=["none", "sub", "up", "average", "paeth"])
def test_round_trip_through_each_filter(filter_type: int) -> None:
    """Encoding with each of the five row filters decodes back to the same pixels."""
    image = _image(13, 17)
    data = encode_png(image, filter_type)
    assert data.startswith(PNG_SIGNATURE)
    decoded = decode_png(data)
    assert decoded.dtype == np.uint8
    assert np.array_equal(decoded, image)


def test_grey_and_alpha_images_become_rgb() -> None:
    """Grey is repeated into three channels and alpha is dropped."""
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    raw = b"".join(b"\x00" + row.tobytes() for row in grey)
    out = decode_png(_png(struct.pack(">IIBBBBB", 4, 3, 8, 0, 0, 0, 0), raw))
    assert np.array_equal(out, np.repeat(grey[..., None], 3, axis=2))
    rgba = _image(2, 3)
    alpha = np.concatenate((rgba, np.full((2, 3, 1), 9, np.uint8)), axis=2)
    raw = b"".join(b"\x00" + row.tobytes() for row in alpha.reshape(2, -1))
    out = decode_png(_png(struct.pack(">IIBBBBB", 3, 2, 8, 6, 0, 0, 0), raw))
    assert np.array_equal(out, rgba)


def test_ancillary_chunks_are_skipped() -> None:
    """Chunks other than IHDR, IDAT and IEND are checked for CRC but otherwise ignored."""
    body = b"Comment\x00hello"
    text = struct.pack(">I", len(body)) + b"tEXt" + body
    text += struct.pack(">I", zlib.crc32(b"tEXt" + body))
    raw = b"\x00" + bytes(range(6))
    out = decode_png(_png(struct.pack(">IIBBBBB", 2, 1, 8, 2, 0, 0, 0), raw, chunks=text))
    assert out.tolist() == [[[0, 1, 2], [3, 4, 5]]]


def _corrupt_crc(data: bytes) -> bytes:
    """Flip one byte inside the IDAT chunk's body, so its CRC no longer matches."""
    at = data.index(b"IDAT") + 6
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _bad_filter(_: bytes) -> bytes:
    """A valid file whose single row names filter type 9."""
    return _png(struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0), b"\x09abc")


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda d: b"GIF89a" + d, "bad signature"),
        (_corrupt_crc, "IDAT.* fails its CRC check"),
        (lambda d: d[:-20], "truncated"),
        (lambda d: d[:-12], "missing IEND"),
        (_bad_filter, "unknown filter type 9"),
        (
            lambda _: _png(struct.pack(">IIBBBBB", 1, 1, 16, 2, 0, 0, 0), b"\x00" + bytes(6)),
            "bit depth 16 is not supported",
        ),
        (
            lambda _: _png(struct.pack(">IIBBBBB", 1, 1, 8, 3, 0, 0, 0), b"\x00\x00"),
            "colour type 3",
        ),
        (
            lambda _: _png(struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 1), b"\x00" + bytes(3)),
            "interlaced",
        ),
        (
            lambda _: _png(struct.pack(">IIBBBBB", MAX_SIDE + 1, 1, 8, 2, 0, 0, 0), b""),
            "each side must be 1 to 1024",
        ),
        (
            lambda _: _png(struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0), b"\x00" * 7),
            "holds 7 bytes; a 2x2 image needs 14",
        ),
        (
            lambda _: _png(struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0), b"\x00" * 10**6),
            "holds 15 bytes",
        ),
    ],
    ids=[
        "signature",
        "crc",
        "truncated",
        "no-iend",
        "filter",
        "depth",
        "palette",
        "interlaced",
        "too-large",
        "short-data",
        "zlib-bomb",
    ],
)
def test_bad_files_raise_png_error_saying_why(mangle, message: str) -> None:
    """Each kind of corrupt or unsupported file raises PngError with a specific message."""
    with pytest.raises(PngError, match=message):
        decode_png(mangle(encode_png(_image(4, 4))))


def test_undecodable_image_data_is_a_png_error() -> None:
    """IDAT bytes that are not zlib data raise PngError, not zlib.error."""
    data = _png(struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0), b"")
    at = data.index(b"IDAT")
    length = struct.unpack(">I", data[at - 4 : at])[0]
    body = b"\x00" * length
    bad = data[: at + 4] + body + struct.pack(">I", zlib.crc32(b"IDAT" + body))
    bad += data[at + 4 + length + 4 :]
    with pytest.raises(PngError, match="does not inflate"):
        decode_png(bad)


def test_encoder_refuses_what_it_cannot_write() -> None:
    """Only uint8 RGB arrays and filter types 0-4 are accepted."""
    with pytest.raises(ValueError, match=r"expected uint8 \(H, W, 3\)"):
        encode_png(np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="unknown PNG filter type 5"):
        encode_png(np.zeros((2, 2, 3), np.uint8), 5)
