"""Preprocessing and tokenising: what the encoder and decoder receive, and what is refused."""

from __future__ import annotations

import struct
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pipeline import Context
from stages.model import BOS, TINY_VLM
from stages.payloads import VLMRequest
from stages.preprocess import (
    MAX_JPEG_SCANS,
    PRESHRINK_PIXELS,
    InvalidRequest,
    Preprocess,
    prepare,
    to_rgb,
)
from stages.samples import encode_png
from stages.tokenizer import TextStream, encode
from tests.stages.conftest import encoded

SEED = 11


def _rgb(height: int, width: int) -> np.ndarray:
    """A seeded random uint8 RGB image."""
    print(f"seed {SEED}")
    return np.random.default_rng(SEED).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_tokens_are_bos_then_utf8_bytes() -> None:
    """A prompt becomes BOS followed by its UTF-8 bytes."""
    assert encode("hé") == [BOS, ord("h"), 0xC3, 0xA9]


def test_text_stream_holds_back_split_characters() -> None:
    """A multi-byte character split across chunks appears once it is complete; specials vanish."""
    stream = TextStream()
    rainbow = list("🌈".encode())
    assert stream.push([ord("a"), *rainbow[:2]]) == "a"
    assert stream.push([*rainbow[2:], 257, ord("b")]) == "🌈b"
    assert stream.push([0xF0]) == ""
    assert stream.flush() == "\ufffd"


def test_png_bytes_and_raw_pixels_give_identical_inputs() -> None:
    """The same image sent as PNG or as a pixel tensor preprocesses to the same pixels."""
    image = _rgb(45, 70)
    png, ids_png = prepare(VLMRequest(prompt="hi", image=encode_png(image)))
    raw, ids_raw = prepare(VLMRequest(prompt="hi", pixels=torch.from_numpy(image)))
    assert torch.equal(png, raw)
    assert ids_png == ids_raw == [BOS, ord("h"), ord("i")]


def test_a_numpy_array_of_any_layout_is_taken_for_pixels() -> None:
    """In process, as over the wire: a flipped view (BGR to RGB) failed with a bare
    ValueError about negative strides, and an array of objects with a bare TypeError."""
    image = _rgb(20, 30)
    want, _ = prepare(VLMRequest(prompt="hi", pixels=torch.from_numpy(image[..., ::-1].copy())))
    got, _ = prepare(VLMRequest(prompt="hi", pixels=image[..., ::-1]))  # type: ignore[arg-type]
    assert torch.equal(got, want)
    with pytest.raises(InvalidRequest, match="got object of shape"):
        prepare(VLMRequest(prompt="hi", pixels=image.astype(object)))  # type: ignore[arg-type]


def test_pixels_are_resized_and_normalised_to_the_encoder_input() -> None:
    """Any image becomes float32 (3, 32, 32) in [-1, 1]; a 32x32 image is only rescaled."""
    pixels, _ = prepare(VLMRequest(prompt="x", pixels=torch.from_numpy(_rgb(300, 17))))
    assert pixels.dtype == torch.float32
    assert tuple(pixels.shape) == (3, TINY_VLM.image_size, TINY_VLM.image_size)
    assert pixels.is_contiguous()
    assert float(pixels.min()) >= -1.0 and float(pixels.max()) <= 1.0
    exact = _rgb(32, 32)
    pixels, _ = prepare(VLMRequest(prompt="x", pixels=torch.from_numpy(exact)))
    expected = torch.from_numpy(exact).permute(2, 0, 1).float() / 255.0 * 2 - 1
    torch.testing.assert_close(pixels, expected)


def test_a_large_image_is_shrunk_close_to_the_float_way() -> None:
    """An image over a megapixel is first shrunk in uint8: what the encoder gets is within a
    rounding step of resizing it all in float32 at once."""
    y, x = np.mgrid[0:1200, 0:1000]
    image = np.stack((x % 256, y % 256, (x + y) % 256), axis=-1).astype(np.uint8)
    assert image.shape[0] * image.shape[1] > PRESHRINK_PIXELS
    got, _ = prepare(VLMRequest(prompt="x", pixels=torch.from_numpy(image)))
    floats = torch.from_numpy(image).float().permute(2, 0, 1).unsqueeze(0) / 255.0
    size = (TINY_VLM.image_size, TINY_VLM.image_size)
    want = F.interpolate(floats, size=size, mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(got, (want[0] - 0.5) / 0.5, rtol=0, atol=0.02)


def test_a_large_image_is_preprocessed_in_little_memory() -> None:
    """A 4096x4096 image took over 400 MiB in float32 to resize (one request; a stage runs up
    to max_concurrency at once); shrunk in uint8 first it takes a tenth of that."""
    script = (
        "import resource, torch\n"
        "from stages.payloads import VLMRequest\n"
        "from stages.preprocess import prepare\n"
        "torch.set_num_threads(1)\n"
        "pixels = torch.randint(0, 256, (4096, 4096, 3), dtype=torch.uint8)\n"
        "prepare(VLMRequest(prompt='x', pixels=torch.zeros(8, 8, 3, dtype=torch.uint8)))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "prepare(VLMRequest(prompt='x', pixels=pixels))\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(done.stdout) < 100, f"{done.stdout.strip()} MiB more at the peak"


def test_a_white_image_is_all_ones() -> None:
    """Full-intensity pixels map to 1.0 after resizing: antialiasing keeps a flat image flat."""
    white = torch.full((50, 60, 3), 255, dtype=torch.uint8)
    pixels, _ = prepare(VLMRequest(prompt="x", pixels=white))
    torch.testing.assert_close(pixels, torch.ones_like(pixels))


def test_the_longest_prompt_that_fits_is_accepted() -> None:
    """A prompt of exactly max_prompt_bytes bytes is accepted; one more byte is refused."""
    n = TINY_VLM.max_prompt_bytes
    pixels = torch.zeros(8, 8, 3, dtype=torch.uint8)
    _, ids = prepare(VLMRequest(prompt="a" * n, pixels=pixels))
    assert len(ids) == n + 1
    assert TINY_VLM.n_patches + len(ids) == TINY_VLM.max_context - 1
    with pytest.raises(InvalidRequest, match=f"prompt is {n + 1} bytes long"):
        prepare(VLMRequest(prompt="a" * (n + 1), pixels=pixels))


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (VLMRequest(prompt="", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)), "prompt is empty"),
        (
            VLMRequest(prompt=" \n", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)),
            r"prompt is blank \(only whitespace\)",
        ),
        (
            VLMRequest(prompt="é" * 60, pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)),
            "prompt is 120 bytes long but the model's context of 128 positions leaves room for "
            "at most 110 prompt bytes after the 16 image tokens",
        ),
        (VLMRequest(prompt="x"), "request has no image"),
        (
            VLMRequest(
                prompt="x", image=b"\x89PNG", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)
            ),
            "both image bytes and pixels",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(3, 32, 32, dtype=torch.uint8)),
            r"pixels must be a uint8 tensor of shape \(height, width, 3\); "
            r"got uint8 of shape \(3, 32, 32\)",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(32, 32, 3)),
            r"got float32 of shape \(32, 32, 3\)",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(32, 32, dtype=torch.uint8)),
            r"got uint8 of shape \(32, 32\)",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(0, 5, 3, dtype=torch.uint8)),
            "pixels are 5x0; each side must be 1 to 4096",
        ),
        (
            VLMRequest(prompt="x", image=b"hello world"),
            "image is 11 bytes starting b'hello wo', not a PNG or JPEG",
        ),
        (
            # Refused by its length in characters, before any token list is built for it.
            VLMRequest(prompt="a" * 10_000_000, pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)),
            "prompt is at least 10000000 bytes long",
        ),
        (
            VLMRequest(prompt="caf\udce9", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)),
            r"prompt is not valid text: surrogates not allowed at character 3",
        ),
    ],
    ids=[
        "empty-prompt",
        "blank-prompt",
        "long-prompt",
        "no-image",
        "two-images",
        "chw-pixels",
        "float-pixels",
        "grey-pixels",
        "zero-height",
        "not-an-image",
        "huge-prompt",
        "lone-surrogate",
    ],
)
def test_invalid_requests_say_what_is_wrong(request_: VLMRequest, message: str) -> None:
    """Each unusable request raises InvalidRequest whose message names the problem."""
    with pytest.raises(InvalidRequest, match=message):
        prepare(request_)


def _chunk(kind: bytes, body: bytes) -> bytes:
    """One PNG chunk: length, type, body and CRC."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header(width: int, height: int, pixel_data: bytes | None = None) -> bytes:
    """An RGB PNG whose header claims ``width`` x ``height``, with ``pixel_data`` (if any)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = b"" if pixel_data is None else _chunk(b"IDAT", zlib.compress(pixel_data))
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + idat + _chunk(b"IEND", b"")


def _garbled_idat(width: int, height: int) -> bytes:
    """An RGB PNG whose IDAT chunk has a right CRC over a compressed stream that is not."""
    return _raw_idat(width, height, b"\x78\x9c" + b"\x13" * 40)


def _raw_idat(width: int, height: int, body: bytes) -> bytes:
    """An RGB PNG whose one IDAT chunk holds ``body`` as it is (and its right CRC)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = _chunk(b"IDAT", body)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + idat + _chunk(b"IEND", b"")


def _jpeg_claiming(width: int, height: int) -> bytes:
    """A real 16x16 JPEG whose frame header is patched to claim ``width`` x ``height``."""
    data = encoded(_rgb(16, 16), "JPEG")
    # SOF0 marker, then a 2-byte length and a 1-byte precision, then height and width.
    at = data.index(b"\xff\xc0") + 5
    return data[:at] + struct.pack(">HH", height, width) + data[at + 4 :]


def _more_scans(jpeg: bytes, extra: int) -> bytes:
    """A progressive JPEG with its last scan (a refinement) repeated ``extra`` more times."""
    end = len(jpeg) - 2  # before the EOI marker
    last = jpeg.rindex(b"\xff\xda", 0, end)
    return jpeg[:end] + jpeg[last:end] * extra + jpeg[end:]


def test_a_jpeg_of_thousands_of_scans_is_refused_before_it_is_decoded() -> None:
    """Each scan is a pass of the decoder over the whole image: a 4096x4096 JPEG of 10,000
    tiny scans, a few hundred KB, took a minute to decode, holding the stage. Up to
    MAX_JPEG_SCANS scans still decode."""
    progressive = encoded(_rgb(48, 64), "JPEG", progressive=True)
    assert _decoded(_more_scans(progressive, MAX_JPEG_SCANS - 20)).shape == (48, 64, 3)
    with pytest.raises(InvalidRequest, match=f"JPEG has over {MAX_JPEG_SCANS} scans"):
        _decoded(_more_scans(progressive, 10_000))


def test_bytes_between_segments_hide_no_scan_from_the_count() -> None:
    """The decoder skips junk bytes between segments and decodes every scan after them,
    which the count stopped at: one zero byte before the first scan let any number through
    (7000 scans of a 4096x4096 image held the stage for 38 s)."""
    bomb = _more_scans(encoded(_rgb(48, 64), "JPEG", progressive=True), 200)
    first = bomb.index(b"\xff\xda")
    # Zeros, and a 0xFF 0x00 pair, which is no marker either (it was read as one, whose
    # "length" skipped the scans after it).
    for junk in (b"\x00\x00", b"\xff\x00\xff"):
        with pytest.raises(InvalidRequest, match=f"JPEG has over {MAX_JPEG_SCANS} scans"):
            _decoded(bomb[:first] + junk + bomb[first:])


def test_a_broken_exif_tag_does_not_cost_the_image_its_orientation() -> None:
    """A photo whose EXIF holds a tag of the wrong type (a text tag retagged as a rational):
    Pillow's exif_transpose, writing the EXIF back, raised a bare TypeError for it, failing
    an image whose pixels and orientation read fine."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turned 90 degrees
    exif[0x010F] = "cam"  # Make, an ASCII tag
    good = encoded(_rgb(40, 48), "JPEG", exif=exif)
    at = good.index(b"\x01\x0f\x00\x02")  # the Make entry (tag, then its type: ASCII)
    bad = good[:at] + b"\x01\x1a" + good[at + 2 :]  # now XResolution, which is RATIONAL
    assert _decoded(bad).shape == (48, 40, 3) == _decoded(good).shape
    assert np.array_equal(_decoded(bad), _decoded(good))


def test_a_sixteen_bit_transparent_grey_shows_white_and_a_sixteen_bit_rgb_key_is_refused() -> None:
    """A tRNS key is given in the image's own 16 bits: the transparent grey level is matched
    before scaling (it kept its grey); a 16-bit RGB key cannot be matched against the 8-bit
    pixels Pillow decodes, so such an image is refused rather than decoded wrongly."""

    def png(ctype: int, row: bytes, key: bytes) -> bytes:
        width = len(row) // (6 if ctype == 2 else 2)
        ihdr = struct.pack(">IIBBBBB", width, 1, 16, ctype, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"tRNS", key)
                + _chunk(b"IDAT", zlib.compress(b"\x00" + row)) + _chunk(b"IEND", b""))  # fmt: skip

    grey = png(0, struct.pack(">HH", 0x8000, 0x4000), struct.pack(">H", 0x8000))
    assert _decoded(grey).tolist() == [[[255, 255, 255], [64, 64, 64]]]
    key = struct.pack(">HHH", 0x1234, 0x5678, 0x9ABC)
    rgb = png(2, key + struct.pack(">HHH", 0x1200, 0x5600, 0x9A00), key)
    with pytest.raises(InvalidRequest, match="16-bit RGB PNGs with a transparent colour"):
        _decoded(rgb)
    # Also with a chunk before IHDR, which Pillow reads (it was told by fixed offsets).
    signature = b"\x89PNG\r\n\x1a\n"
    shifted = signature + _chunk(b"tEXt", b"k\x00v") + rgb[len(signature) :]
    with pytest.raises(InvalidRequest, match="16-bit RGB PNGs with a transparent colour"):
        _decoded(shifted)


@pytest.mark.parametrize("stray", [0, 1], ids=["", "stray-high-bits"])
@pytest.mark.parametrize("bits", [2, 4])
def test_a_low_bit_transparent_grey_shows_white(bits: int, stray: int) -> None:
    """A 2- or 4-bit grey PNG gives its transparent level in its own bits; Pillow scales
    the pixels to 8 bits but not that level, so the transparent pixels kept their grey
    (and a pixel whose 8-bit value equalled the unscaled level would have turned white).
    Bits of the level above the image's depth are ignored, as libpng ignores them."""
    top = (1 << bits) - 1
    levels = [0, 1, top, 2, 1]
    packed, acc, used = bytearray(), 0, 0
    for level in levels:
        acc, used = (acc << bits) | level, used + bits
        if used == 8:
            packed.append(acc)
            acc, used = 0, 0
    if used:
        packed.append(acc << (8 - used))
    ihdr = struct.pack(">IIBBBBB", len(levels), 1, bits, 0, 0, 0, 0)
    pixels = zlib.compress(b"\x00" + bytes(packed))
    key = struct.pack(">H", 1 | stray << bits)
    data = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"tRNS", key)
            + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b""))  # fmt: skip
    scale = 255 // top
    expected = [255 if level == 1 else level * scale for level in levels]
    assert _decoded(data)[0, :, 0].tolist() == expected
    assert (_decoded(data)[0] == _decoded(data)[0, :, :1]).all()  # grey: equal channels


def test_a_large_pixel_stream_is_checked_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking that a PNG's pixel data covers its rows inflates it in bounded pieces. Fed
    one large IDAT chunk whole, each bounded call copied what it left unread, the rest of
    the chunk: work quadratic in its size (minutes for a 48 MiB photo). Counted here as the
    compressed bytes handed to zlib, which must stay within twice the chunk's size."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)  # does not compress
    rows = b"".join(b"\x00" + image[r].tobytes() for r in range(512))
    data = _raw_idat(512, 512, zlib.compress(rows))
    fed = [0]
    real = zlib.decompressobj

    class Counting:
        def __init__(self) -> None:
            self._inner = real()

        def decompress(self, piece: bytes, max_length: int = 0) -> bytes:
            fed[0] += len(piece)
            return self._inner.decompress(piece, max_length)

        def __getattr__(self, name: str) -> object:
            return getattr(self._inner, name)

    monkeypatch.setattr(zlib, "decompressobj", Counting)
    assert _decoded(data).shape == (512, 512, 3)
    assert fed[0] <= 2 * len(data), f"{fed[0]} bytes fed for a {len(data)}-byte file"


def _decoded(data: bytes) -> np.ndarray:
    """What preprocess decodes ``data`` to, as a numpy array."""
    return to_rgb(VLMRequest(prompt="x", image=data)).numpy()


def test_to_rgb_decodes_png_to_hwc_uint8() -> None:
    """PNG bytes become a (height, width, 3) uint8 tensor of exactly the same pixels."""
    image = _rgb(5, 9)
    rgb = to_rgb(VLMRequest(prompt="x", image=encode_png(image)))
    assert rgb.dtype == torch.uint8
    assert np.array_equal(rgb.numpy(), image)


@pytest.mark.parametrize("options", [{}, {"quality": 60, "progressive": True}])
def test_jpeg_decodes_close_to_the_original(options: dict[str, object]) -> None:
    """A JPEG of a smooth image decodes to nearly its pixels, and preprocesses nearly alike."""
    y, x = np.mgrid[0:40, 0:56]
    image = np.stack((x * 4, y * 6, 255 - x * 4), axis=-1).astype(np.uint8)
    data = encoded(image, "JPEG", **options)
    assert data.startswith(b"\xff\xd8\xff")
    decoded = _decoded(data)
    assert decoded.shape == image.shape and decoded.dtype == np.uint8
    # Lossy, so close rather than equal; a wrong channel order or orientation is far off.
    assert np.abs(decoded.astype(int) - image).mean() < 3
    from_jpeg, _ = prepare(VLMRequest(prompt="x", image=data))
    from_raw, _ = prepare(VLMRequest(prompt="x", pixels=torch.from_numpy(image)))
    torch.testing.assert_close(from_jpeg, from_raw, rtol=0, atol=0.1)


def _palette(transparent: bool) -> tuple[bytes, np.ndarray]:
    """A 2x3 palette PNG of three colours, index 2 transparent if asked, and its RGB."""
    colours = np.array([[255, 0, 0], [0, 128, 255], [10, 20, 30]], np.uint8)
    index = np.array([[0, 1, 2], [2, 1, 0]], np.uint8)
    image = Image.new("P", (3, 2))
    image.putpalette(colours.flatten().tolist())
    image.putdata(index.flatten().tolist())
    expected = colours[index]
    if transparent:
        expected[index == 2] = 255
        return encoded(image, "PNG", transparency=2), expected
    return encoded(image, "PNG"), expected


def _grey_alpha(mode: str) -> tuple[bytes, np.ndarray]:
    """A 2x2 image with alpha 255 on the left and 0 on the right, in ``mode``, and its RGB."""
    rgb = np.array([[[10, 20, 30], [40, 50, 60]], [[70, 80, 90], [1, 2, 3]]], np.uint8)
    if mode == "LA":
        rgb = np.repeat(rgb[..., :1], 3, axis=2)
    alpha = np.array([[[255], [0]], [[255], [0]]], np.uint8)
    channels = rgb[..., :1] if mode == "LA" else rgb
    data = encoded(Image.fromarray(np.concatenate((channels, alpha), axis=2)), "PNG")
    expected = rgb.copy()
    expected[:, 1] = 255
    return data, expected


def _sixteen_bit() -> tuple[bytes, np.ndarray]:
    """A 16-bit greyscale PNG and its RGB: the high byte of each sample, repeated."""
    grey = np.array([[0, 255, 256], [4660, 40000, 65535]], np.uint16)
    expected = np.repeat((grey >> 8).astype(np.uint8)[..., None], 3, axis=2)
    return encoded(Image.fromarray(grey), "PNG"), expected


def _grey_and_bilevel(mode: str) -> tuple[bytes, np.ndarray]:
    """A greyscale ("L") or one-bit ("1") PNG and its RGB, grey repeated in three channels."""
    grey = np.array([[0, 255, 255], [255, 0, 255]], np.uint8)
    if mode == "L":
        grey[0, 1] = 77
    image = Image.fromarray(grey).convert(mode)
    return encoded(image, "PNG"), np.repeat(grey[..., None], 3, axis=2)


@pytest.mark.parametrize(
    "case",
    [
        lambda: _grey_and_bilevel("L"),
        lambda: _grey_and_bilevel("1"),
        lambda: _grey_alpha("LA"),
        lambda: _grey_alpha("RGBA"),
        lambda: _palette(transparent=False),
        lambda: _palette(transparent=True),
        _sixteen_bit,
    ],
    ids=["grey", "bilevel", "grey-alpha", "rgba", "palette", "palette-transparent", "16-bit"],
)
def test_every_png_mode_becomes_rgb(case) -> None:
    """Grey repeats, palettes expand, 16-bit keeps its high byte, transparency shows white."""
    data, expected = case()
    assert np.array_equal(_decoded(data), expected)


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grey_and_cmyk_jpegs_become_rgb(mode: str) -> None:
    """JPEGs in other colour spaces decode to RGB near the image they were saved from."""
    image = np.full((16, 24, 3), (200, 120, 40), np.uint8)
    if mode == "L":
        image[:] = 128
    data = encoded(Image.fromarray(image).convert(mode), "JPEG", quality=95)
    decoded = _decoded(data)
    assert decoded.shape == image.shape
    assert np.abs(decoded.astype(int) - image).max() <= 12


def test_exif_orientation_turns_the_image_upright() -> None:
    """An image tagged "rotate 90 clockwise to display" (EXIF orientation 6) arrives turned."""
    image = _rgb(3, 5)
    exif = Image.Exif()
    exif[0x0112] = 6
    decoded = _decoded(encoded(image, "PNG", exif=exif))
    assert np.array_equal(decoded, np.rot90(image, k=-1))


def _flip_idat_byte(png: bytes) -> bytes:
    """Flip a byte inside the IDAT chunk's body, so its CRC no longer matches."""
    at = png.index(b"IDAT") + 8
    return png[:at] + bytes([png[at] ^ 0x55]) + png[at + 1 :]


GOOD_PNG = encode_png(_rgb(30, 30))
GOOD_JPEG = encoded(_rgb(64, 64), "JPEG", quality=95)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (encoded(_rgb(4, 4), "GIF"), "image is a GIF, not a PNG or JPEG; send PNG or JPEG bytes"),
        (encoded(_rgb(4, 4), "BMP"), "image is a BMP, not a PNG or JPEG"),
        (encoded(_rgb(4, 4), "WEBP"), "image is a WebP, not a PNG or JPEG"),
        (encoded(_rgb(4, 4), "TIFF"), "image is a TIFF, not a PNG or JPEG"),
        (b"\x00" * 40, r"image is 40 bytes starting b'\\x00.*', not a PNG or JPEG"),
        (GOOD_PNG[:-30], "corrupt or truncated PNG image: Truncated File Read"),
        (GOOD_PNG[:20], "corrupt or truncated PNG image"),
        (
            _flip_idat_byte(GOOD_PNG),
            r"corrupt or truncated PNG image: broken PNG file \(bad header checksum in b'IDAT'\)",
        ),
        (
            _png_header(2, 2, b""),
            "corrupt or truncated PNG image: its pixel data ends after 0 of the 14 bytes",
        ),
        (
            # A pixel stream that ends cleanly after half the rows: the rest were black.
            _png_header(2, 4, b"\x00" + bytes(6) + b"\x00" + bytes(6)),
            "corrupt or truncated PNG image: its pixel data ends after 14 of the 28 bytes",
        ),
        (
            _raw_idat(2, 2, b"\x78\x9c\xff\xff\xff\xff"),
            "corrupt or truncated PNG image: its pixel data does not inflate "
            r"\(Error -3 while decompressing data: invalid block type\)",
        ),
        (
            # Every chunk's CRC right, its compressed pixels not: served half made before.
            _garbled_idat(8, 8),
            "corrupt or truncated PNG image: its pixel data ends after 39 of the 200 bytes",
        ),
        (b"\xff\xd8\xff\xe0" + bytes(100), "corrupt or truncated JPEG image: unreadable header"),
        (
            GOOD_JPEG[: len(GOOD_JPEG) * 2 // 3],
            "corrupt or truncated JPEG image: image file is truncated",
        ),
    ],
    ids=[
        "gif",
        "bmp",
        "webp",
        "tiff",
        "zeros",
        "png-truncated",
        "png-header-cut",
        "png-bad-crc",
        "png-no-pixels",
        "png-short-stream",
        "png-not-deflate",
        "png-garbled-pixels",
        "jpeg-garbage",
        "jpeg-truncated",
    ],
)
def test_bad_image_bytes_are_refused_saying_why(data: bytes, message: str) -> None:
    """Other formats, corrupt and truncated files each raise InvalidRequest naming the problem."""
    with pytest.raises(InvalidRequest, match=message):
        _decoded(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_png_header(4097, 1), "image is 4097x1; each side must be 1 to 4096"),
        (_png_header(1, 4097), "image is 1x4097; each side must be 1 to 4096"),
        (_png_header(5000, 5000), "image is 5000x5000"),
        # Pillow warns about this size; the warning must not escape, nor change the message.
        (_png_header(10000, 10000), "image is 10000x10000"),
        # Pillow refuses this size itself, in open(), before our check can.
        (_png_header(30000, 30000), "image is too large to decode; each side must be 1 to 4096"),
        (_jpeg_claiming(5000, 4000), "image is 5000x4000"),
        (_jpeg_claiming(60000, 60000), "image is too large to decode"),
    ],
    ids=["wide", "tall", "5k", "10k-pillow-warns", "30k-pillow-refuses", "jpeg-5k", "jpeg-60k"],
)
def test_a_huge_image_is_refused_from_its_header(data: bytes, message: str) -> None:
    """An image past 4096 a side is refused by size from its header, before any pixels.

    The files hold no pixel data for the size they claim, so had decoding begun, the error
    would have been a truncation instead.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InvalidRequest, match=message):
            _decoded(data)
    assert [str(w.message) for w in caught] == []


def test_the_largest_allowed_side_is_accepted() -> None:
    """A 4096x1 PNG decodes; the limit is inclusive, as for raw pixels."""
    assert _decoded(encode_png(np.zeros((1, 4096, 3), np.uint8))).shape == (1, 4096, 3)


async def test_the_stage_routes_pixels_to_encode_and_ids_to_prefill() -> None:
    """Preprocess.process returns pixels for 'encode' and token ids for 'prefill'."""
    stage = Preprocess(params=None, name="preprocess", replica=0, device="cpu")
    request = VLMRequest(prompt="ok", pixels=torch.from_numpy(_rgb(20, 20)))
    out = await stage.process(request, Context("r1", "preprocess", 0))
    pixels, ids = prepare(request)
    assert out.encode is not None and out.prefill is not None
    assert torch.equal(out.encode.values, pixels)
    assert out.prefill.ids == ids
