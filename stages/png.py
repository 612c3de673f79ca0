"""A small PNG codec for 8-bit, non-interlaced images, because no imaging library is installed.

:func:`decode_png` reads greyscale, greyscale+alpha, RGB and RGBA images of bit depth 8
(the common case) and returns ``uint8`` RGB of shape ``(height, width, 3)``, dropping alpha
and repeating grey. Palette, 16-bit and interlaced images are refused with a message that
says so. Every chunk's CRC is checked, and inflation is bounded by the size the header
implies, so a corrupt or hostile file fails fast instead of exhausting memory.

:func:`encode_png` writes RGB images, with a chosen row filter so tests can exercise each
of the decoder's five filters. Pillow should replace this module once it is a dependency,
and bring JPEG with it.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
from numpy.typing import NDArray

__all__ = ("MAX_SIDE", "PNG_SIGNATURE", "PngError", "decode_png", "encode_png")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Largest width or height accepted: unfiltering is a Python loop, so bound its cost.
MAX_SIDE = 1024
#: Channels per colour type (0 grey, 2 RGB, 4 grey+alpha, 6 RGBA).
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}


class PngError(ValueError):
    """The bytes are not a PNG this codec can read; the message says what is wrong."""


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Split ``data`` into ``(type, body)`` chunks, checking lengths and CRCs."""
    if not data.startswith(PNG_SIGNATURE):
        raise PngError("not a PNG (bad signature)")
    chunks: list[tuple[bytes, bytes]] = []
    pos = len(PNG_SIGNATURE)
    while pos < len(data):
        if pos + 12 > len(data):
            raise PngError(f"truncated chunk header at byte {pos}")
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        end = pos + 8 + length
        if end + 4 > len(data):
            raise PngError(f"chunk {kind!r} at byte {pos} is truncated")
        body = data[pos + 8 : end]
        (crc,) = struct.unpack(">I", data[end : end + 4])
        if zlib.crc32(kind + body) != crc:
            raise PngError(f"chunk {kind!r} at byte {pos} fails its CRC check")
        chunks.append((kind, body))
        pos = end + 4
        if kind == b"IEND":
            return chunks
    raise PngError("missing IEND chunk (truncated file)")


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> bytearray:
    """Undo the per-row filters (None, Sub, Up, Average, Paeth) of the PNG spec."""
    out = bytearray(height * stride)
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        row = bytearray(raw[start + 1 : start + 1 + stride])
        if kind == 1:
            for i in range(bpp, stride):
                row[i] = (row[i] + row[i - bpp]) & 0xFF
        elif kind == 2:
            row = bytearray((a + b) & 0xFF for a, b in zip(row, prev, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                row[i] = (row[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                row[i] = (row[i] + pred) & 0xFF
        elif kind != 0:
            raise PngError(f"row {y} has unknown filter type {kind}")
        out[y * stride : (y + 1) * stride] = row
        prev = row
    return out


def decode_png(data: bytes) -> NDArray[np.uint8]:
    """Decode an 8-bit non-interlaced PNG to ``uint8`` RGB of shape ``(height, width, 3)``.

    Raises:
        PngError: the data is not a PNG, is corrupt, or uses a feature not supported here.
    """
    chunks = _chunks(data)
    if chunks[0][0] != b"IHDR" or len(chunks[0][1]) != 13:
        raise PngError("first chunk is not a 13-byte IHDR")
    width, height, depth, colour, method, filters, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1]
    )
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        raise PngError(f"image is {width}x{height}; each side must be 1 to {MAX_SIDE} pixels")
    if colour not in _CHANNELS or depth != 8:
        raise PngError(
            f"colour type {colour} at bit depth {depth} is not supported "
            "(only 8-bit grey, grey+alpha, RGB and RGBA)"
        )
    if method != 0 or filters != 0 or interlace != 0:
        raise PngError("interlaced or non-standard PNGs are not supported")
    channels = _CHANNELS[colour]
    stride = width * channels
    expected = height * (stride + 1)
    inflater = zlib.decompressobj()
    try:
        # Bounded inflation: a zlib bomb stops at one byte past what the header allows.
        raw = inflater.decompress(b"".join(b for k, b in chunks if k == b"IDAT"), expected + 1)
    except zlib.error as e:
        raise PngError(f"image data does not inflate: {e}") from e
    if len(raw) != expected:
        raise PngError(
            f"image data holds {len(raw)} bytes; a {width}x{height} image needs {expected}"
        )
    pixels = np.frombuffer(_unfilter(raw, height, stride, channels), dtype=np.uint8)
    pixels = pixels.reshape(height, width, channels)
    if channels < 3:
        return np.repeat(pixels[..., :1], 3, axis=2)
    return np.ascontiguousarray(pixels[..., :3])


def _filter(rows: NDArray[np.int32], kind: int, bpp: int) -> NDArray[np.int32]:
    """Apply one PNG filter to every row; encoding needs only unfiltered neighbours."""
    left = np.zeros_like(rows)
    left[:, bpp:] = rows[:, :-bpp]
    up = np.zeros_like(rows)
    up[1:] = rows[:-1]
    upleft = np.zeros_like(rows)
    upleft[1:, bpp:] = rows[:-1, :-bpp]
    if kind == 0:
        pred = np.zeros_like(rows)
    elif kind == 1:
        pred = left
    elif kind == 2:
        pred = up
    elif kind == 3:
        pred = (left + up) >> 1
    else:
        p = left + up - upleft
        pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - upleft)
        pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
    return (rows - pred) & 0xFF


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def encode_png(pixels: NDArray[np.uint8], filter_type: int = 0) -> bytes:
    """Encode ``uint8`` RGB of shape ``(height, width, 3)`` as a PNG.

    Args:
        pixels: the image.
        filter_type: the row filter used for every row, 0 (None) to 4 (Paeth).

    Raises:
        ValueError: the array is not ``uint8`` RGB, or the filter type is unknown.
    """
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected uint8 (H, W, 3), got {pixels.dtype} {pixels.shape}")
    if filter_type not in range(5):
        raise ValueError(f"unknown PNG filter type {filter_type}")
    height, width, _ = pixels.shape
    rows = _filter(pixels.reshape(height, width * 3).astype(np.int32), filter_type, 3)
    lines = np.concatenate((np.full((height, 1), filter_type, dtype=np.int32), rows), axis=1)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(lines.astype(np.uint8).tobytes(), 9)
    return PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
