"""The ``preprocess`` stage: a request's image to encoder pixels, its prompt to token ids.

The image arrives as PNG or JPEG bytes, decoded with Pillow, or as raw ``uint8`` pixels
``(height, width, 3)``. Decoded images are turned upright by their EXIF orientation and
converted to RGB (grey is repeated, a palette is expanded, and transparency is composited
onto white). Either way the pixels are resized with ``torch.nn.functional.interpolate``
(bilinear, antialiased) to the encoder's square input and normalised to ``[-1, 1]``; an
image over a megapixel is first shrunk in ``uint8``, which takes a tenth of the memory.

Everything that can be wrong with a request is found here, before any model runs, and
raised as :class:`InvalidRequest` with a message that says what was wrong; the runtime turns
it into a ``StageError`` for that request only. That includes bytes in another format,
corrupt or truncated files, images larger than :data:`MAX_PIXELS_SIDE` a side, which
are refused from their header, before any pixel memory is allocated, and JPEGs of more than
:data:`MAX_JPEG_SCANS` scans, refused before decoding (each scan costs a pass over the
whole image). A 16-bit RGB PNG with a transparent colour is refused: Pillow decodes it to
8 bits, where that colour can no longer be told.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError

from pipeline import Context, Stage
from stages import tokenizer
from stages.model import TINY_VLM, VLMConfig
from stages.payloads import Pixels, PreprocessOut, PromptTokens, VLMRequest

__all__ = (
    "IMAGE_FORMATS",
    "MAX_JPEG_SCANS",
    "MAX_PIXELS_SIDE",
    "InvalidRequest",
    "Preprocess",
    "prepare",
    "to_rgb",
)

#: Largest side of an image accepted, decoded or raw; larger images should be resized by
#: the client. It also bounds a decoded image to 16 Mpx, 48 MiB of RGB.
MAX_PIXELS_SIDE = 4096
#: The most scans a JPEG may have. A progressive JPEG has about ten; the decoder passes over
#: the whole image once per scan, so thousands of tiny scans in a small file would hold the
#: stage for minutes.
MAX_JPEG_SCANS = 100
#: Up to this many characters, a prompt too long is measured in bytes exactly for its
#: error; a longer one is refused by its length alone, before it is encoded.
EXACT_PROMPT_CHARS = 1 << 16
#: The encoded formats accepted; Pillow is told to try no others.
IMAGE_FORMATS = ("PNG", "JPEG")
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)
#: What Pillow raises on malformed data, besides its own UnidentifiedImageError and
#: DecompressionBombError: plugins raise SyntaxError and struct.error on bad headers,
#: OSError on truncated or undecodable pixel data, and ValueError or EOFError on the rest.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)


class InvalidRequest(ValueError):
    """A request cannot be processed; the message says why."""


def _kind(data: bytes) -> str | None:
    """The format ``data`` claims by its first bytes, if it is one we can name."""
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WebP"
    return next((name for magic, name in _SIGNATURES if data.startswith(magic)), None)


def _check_side(width: int, height: int, what: str) -> None:
    if not (0 < width <= MAX_PIXELS_SIDE and 0 < height <= MAX_PIXELS_SIDE):
        raise InvalidRequest(f"{what} {width}x{height}; each side must be 1 to {MAX_PIXELS_SIDE}")


@contextmanager
def _decoding(data: bytes) -> Iterator[None]:
    """Translate Pillow's errors on ``data`` into :class:`InvalidRequest`."""
    kind = _kind(data)
    try:
        with warnings.catch_warnings():
            # Pillow warns in open() about images over MAX_IMAGE_PIXELS (89 Mpx); each of
            # them is far past MAX_PIXELS_SIDE, so the size check right after open() refuses
            # it, with our message, before anything is allocated. The warning adds nothing.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except InvalidRequest:
        raise
    except UnidentifiedImageError as e:
        if kind in IMAGE_FORMATS:
            raise InvalidRequest(f"corrupt or truncated {kind} image: unreadable header") from e
        what = f"a {kind}" if kind else f"{len(data)} bytes starting {data[:8]!r}"
        raise InvalidRequest(
            f"image is {what}, not a PNG or JPEG; send PNG or JPEG bytes, or raw pixels"
        ) from e
    except Image.DecompressionBombError as e:
        # Over twice MAX_IMAGE_PIXELS Pillow refuses in open(), before our size check.
        raise InvalidRequest(
            f"image is too large to decode; each side must be 1 to {MAX_PIXELS_SIDE} ({e})"
        ) from e
    except _DECODE_ERRORS as e:
        raise InvalidRequest(f"corrupt or truncated {kind} image: {e}") from e


def _jpeg_scans(data: bytes) -> int:
    """How many scans (SOS segments) the JPEG ``data`` has, counting up to one past
    :data:`MAX_JPEG_SCANS`, as the decoder finds them. Malformed data counts what it can:
    the decoder reports it."""
    scans, at, end = 0, 2, len(data)
    while at + 4 <= end and scans <= MAX_JPEG_SCANS:
        if data[at] != 0xFF:
            # Bytes between segments: the decoder skips them to the next 0xFF and reads on,
            # so counting must too (one junk byte hid every scan after it).
            at = data.find(b"\xff", at)
            if at == -1:
                return scans
            continue
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker == 0x00:  # no marker: the decoder drops the pair as junk and reads on
            at += 2
            continue
        if marker == 0xD9:  # end of image
            return scans
        if marker in _STANDALONE_MARKERS:
            at += 2
            continue
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
        if marker != 0xDA:
            continue
        scans += 1
        # Entropy-coded data follows: a 0xFF in it is followed by 0x00 (a stuffed byte) or
        # a restart marker (0xD0-0xD7); any other byte after a 0xFF is the next marker.
        while (at := data.find(b"\xff", at)) != -1 and at + 1 < end:
            if data[at + 1] == 0 or 0xD0 <= data[at + 1] <= 0xD7:
                at += 2
                continue
            break
        else:
            return scans
    return scans


#: JPEG markers without a length: TEM, the restart markers and SOI.
_STANDALONE_MARKERS = frozenset((0x01, *range(0xD0, 0xD9)))

#: How to turn an image of each EXIF orientation upright.
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _upright(image: Image.Image) -> Image.Image:
    """``image`` turned as its EXIF orientation says. Other EXIF tags are not read: a broken
    one, common in photos, made ``ImageOps.exif_transpose`` (which writes the EXIF back)
    fail the image with a TypeError. Unreadable EXIF counts as upright."""
    try:
        orientation = image.getexif().get(_ORIENTATION)
    except Exception:  # any fault of a malformed EXIF block
        return image
    method = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    return image.transpose(method) if method is not None else image


_ORIENTATION = 0x0112


def _rgb_array(image: Image.Image, data: bytes) -> NDArray[np.uint8]:
    """``image`` (decoded from ``data``) upright, as ``uint8`` RGB ``(height, width, 3)``."""
    # How the file stores its pixels, which decoding forgets (it empties the tiles).
    tiles = getattr(image, "tile", None)  # an ImageFile's (what Image.open gives)
    raw = tiles[0].args if tiles else None
    # Decoded here, where a corrupt stream is an error: reading the EXIF of a PNG decodes
    # it too, and a failure there (taken for a bad EXIF block) left the pixels half made.
    image.load()
    image = _upright(image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grey PNGs: convert() would clip every value above 255, so scale them.
        wide = np.asarray(image).astype(np.uint32)
        grey = (wide >> 8).astype(np.uint8)
        key = image.info.get("transparency")
        if isinstance(key, int):
            # The transparent grey level is given in 16 bits: compare before scaling.
            grey[wide == key] = 255
        return np.repeat(grey[..., None], 3, axis=2)
    if raw in ("RGB;16B", "RGB;16L") and "transparency" in image.info:
        # A 16-bit RGB PNG whose transparent colour is given in 16 bits: Pillow decodes its
        # pixels to 8 bits, so which of them are that colour can no longer be told.
        raise InvalidRequest(
            "16-bit RGB PNGs with a transparent colour (tRNS) are not supported; "
            "send 8-bit RGB, or an alpha channel"
        )
    low_bits = _LOW_GREY_BITS.get(raw) if isinstance(raw, str) else None
    key = image.info.get("transparency")
    if low_bits is not None and isinstance(key, int) and image.mode == "L":
        # A 2- or 4-bit grey PNG: Pillow scales its levels to 8 bits (1 of 4 bits is 17)
        # but keeps the transparent level unscaled, so no pixel, or the wrong ones, would
        # match it. Compare in 8 bits.
        top = (1 << low_bits) - 1
        image.info["transparency"] = (key & top) * 255 // top  # (stray high bits: as libpng)
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        # Transparent pixels show the background, not whatever colour they happen to hold.
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba)
    # np.array copies into a writable array, which torch.from_numpy needs.
    return np.array(image.convert("RGB"))


#: Channels of each PNG colour type: grey, RGB, palette, grey and alpha, RGBA.
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: The Adam7 passes of an interlaced PNG: (first row, row step, first column, column step).
_ADAM7 = ((0, 8, 0, 8), (0, 8, 4, 8), (4, 8, 0, 4), (0, 4, 2, 4), (2, 4, 0, 2), (0, 2, 1, 2),
          (1, 2, 0, 1))  # fmt: skip


def _png_pixel_bytes(width: int, height: int, depth: int, colour: int, interlaced: bool) -> int:
    """How many bytes a PNG's pixel stream inflates to: each row's bytes and filter byte."""
    bits = depth * _PNG_CHANNELS.get(colour, 4)
    passes = _ADAM7 if interlaced else ((0, 1, 0, 1),)
    total = 0
    for row0, row_step, col0, col_step in passes:
        rows = max(0, (height - row0 + row_step - 1) // row_step)
        cols = max(0, (width - col0 + col_step - 1) // col_step)
        if rows and cols:
            total += rows * (1 + (cols * bits + 7) // 8)
    return total


#: Compressed bytes given to zlib at a time, and the most it may inflate them to in one call.
_INFLATE_IN = 1 << 16
_INFLATE_OUT = 1 << 20


def _check_png_rows(data: bytes) -> None:
    """Refuse a PNG whose pixel stream (its IDAT chunks, which ``verify`` read) inflates to
    fewer bytes than its rows need. Inflated in pieces and counted: nothing is kept.

    Raises:
        InvalidRequest: the pixel data ends early, or does not inflate.
    """
    view, at = memoryview(data), 8
    need = None
    inflate = zlib.decompressobj()
    got = 0
    while at + 8 <= len(data):
        length = int.from_bytes(view[at : at + 4], "big")
        kind = bytes(view[at + 4 : at + 8])
        body = view[at + 8 : at + 8 + length]
        at += 12 + length
        if kind == b"IHDR" and len(body) >= 13:
            width, height = int.from_bytes(body[0:4], "big"), int.from_bytes(body[4:8], "big")
            need = _png_pixel_bytes(width, height, body[8], body[9], body[12] == 1)
        elif kind == b"IDAT" and need is not None:
            try:
                # Fed in small pieces: what a bounded call leaves unread is copied each time.
                for start in range(0, len(body), _INFLATE_IN):
                    piece: bytes | memoryview = body[start : start + _INFLATE_IN]
                    while piece and got < need and not inflate.eof:
                        got += len(inflate.decompress(piece, _INFLATE_OUT))
                        piece = inflate.unconsumed_tail
            except zlib.error as e:
                raise InvalidRequest(
                    f"corrupt or truncated PNG image: its pixel data does not inflate ({e})"
                ) from e
            if got >= need:
                return
        elif kind == b"IEND":
            break
    if need is not None and got < need:
        raise InvalidRequest(
            f"corrupt or truncated PNG image: its pixel data ends after {got} of the {need} "
            "bytes its rows need"
        )


#: The raw modes of 2- and 4-bit grey PNGs, with their bit depths.
_LOW_GREY_BITS = {"L;2": 2, "L;4": 4}


def _decode_image(data: bytes) -> torch.Tensor:
    """Decode PNG or JPEG ``data`` to ``uint8`` RGB ``(height, width, 3)``."""
    with _decoding(data):
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            # open() reads only the header: refuse a huge image before it is allocated.
            _check_side(*image.size, what="image is")
            if image.format != "PNG":
                if _jpeg_scans(data) > MAX_JPEG_SCANS:
                    raise InvalidRequest(
                        f"JPEG has over {MAX_JPEG_SCANS} scans; at most {MAX_JPEG_SCANS} are "
                        "decoded (a progressive JPEG has about ten)"
                    )
                return torch.from_numpy(_rgb_array(image, data))
            # load() skips the CRCs of PNG chunks, so a flipped bit in the pixel data could
            # decode silently into other pixels; verify() checks every chunk's CRC.
            image.verify()
        # Nor does load() notice pixel data that ends, cleanly, before the last row: the
        # rows missing would be black.
        _check_png_rows(data)
        # verify() leaves the image unusable, so decode from a fresh parse.
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            return torch.from_numpy(_rgb_array(image, data))


def _check_pixels(pixels: torch.Tensor | NDArray[np.generic]) -> torch.Tensor:
    if isinstance(pixels, np.ndarray):
        # As the wire turns an array into a tensor (a request made in this process): any
        # layout (a flipped view, say) as its own contiguous copy, checked first.
        if pixels.dtype != np.uint8:
            raise InvalidRequest(
                "pixels must be a uint8 array of shape (height, width, 3); "
                f"got {pixels.dtype} of shape {pixels.shape}"
            )
        pixels = torch.from_numpy(np.array(pixels, order="C"))
    shape = tuple(pixels.shape)
    if pixels.dtype != torch.uint8 or len(shape) != 3 or shape[2] != 3:
        raise InvalidRequest(
            "pixels must be a uint8 tensor of shape (height, width, 3); "
            f"got {str(pixels.dtype).removeprefix('torch.')} of shape {shape}"
        )
    _check_side(shape[1], shape[0], what="pixels are")
    return pixels


def to_rgb(request: VLMRequest) -> torch.Tensor:
    """The request's image as ``uint8`` RGB ``(height, width, 3)``.

    Raises:
        InvalidRequest: no image, two images, an image in another format, a corrupt or
            truncated image, one too large, or pixels of a wrong shape.
    """
    if request.pixels is not None and request.image:
        raise InvalidRequest("request has both image bytes and pixels; give one")
    if request.pixels is not None:
        return _check_pixels(request.pixels)
    if not request.image:
        raise InvalidRequest("request has no image: give PNG or JPEG bytes in 'image', or 'pixels'")
    return _decode_image(request.image)


#: An image of more pixels than this is first shrunk as it is, in ``uint8``, each side to
#: at most :data:`PRESHRINK_FACTOR` times the encoder's side, then as floats. In float32 a
#: 4096x4096 image alone took 200 MiB, and resizing it 200 MiB more (per request, up to
#: ``max_concurrency`` at once); shrunk first it takes about 20 MiB, and a twentieth of the
#: time. Smaller images go the float way only, as before.
PRESHRINK_PIXELS = 1 << 20
PRESHRINK_FACTOR = 8


def _normalise(rgb: torch.Tensor, config: VLMConfig) -> torch.Tensor:
    """Resize ``uint8`` RGB to the encoder's input and scale it to ``[-1, 1]``."""
    height, width = rgb.shape[0], rgb.shape[1]
    if height * width > PRESHRINK_PIXELS and rgb.device.type == "cpu":
        # (CUDA has no uint8 resize: pixels sent there are resized as floats, there.)
        side = PRESHRINK_FACTOR * config.image_size
        rgb = F.interpolate(
            rgb.permute(2, 0, 1).unsqueeze(0),
            size=(min(height, side), min(width, side)),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )[0].permute(1, 2, 0)
    x = rgb.to(torch.float32).permute(2, 0, 1).unsqueeze(0) / 255.0
    size = (config.image_size, config.image_size)
    if tuple(x.shape[-2:]) != size:
        # Antialiasing matters when shrinking: without it a fine pattern aliases.
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return ((x[0] - 0.5) / 0.5).contiguous()


def _tokens(prompt: str, config: VLMConfig) -> list[int]:
    if not prompt:
        raise InvalidRequest("prompt is empty")
    if not prompt.strip():
        raise InvalidRequest("prompt is blank (only whitespace)")
    # Each character is a byte or more: a prompt of far too many characters is refused
    # before it is encoded, and its token list (8 bytes a byte) never built.
    if len(prompt) > max(config.max_prompt_bytes, EXACT_PROMPT_CHARS):
        raise _too_long(f"at least {len(prompt)}", config)
    try:
        ids = tokenizer.encode(prompt)
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"prompt is not valid text: {e.reason} at character {e.start} "
            f"({prompt[e.start : e.end]!r})"
        ) from None
    n = len(ids) - 1
    if n > config.max_prompt_bytes:
        raise _too_long(str(n), config)
    return ids


def _too_long(size: str, config: VLMConfig) -> InvalidRequest:
    return InvalidRequest(
        f"prompt is {size} bytes long but the model's context of {config.max_context} "
        f"positions leaves room for at most {config.max_prompt_bytes} prompt bytes "
        f"after the {config.n_patches} image tokens"
    )


def prepare(request: VLMRequest, config: VLMConfig = TINY_VLM) -> tuple[torch.Tensor, list[int]]:
    """The encoder's pixels and the prompt's token ids for ``request``.

    This is the whole stage minus transport, so the single-process reference calls it too.

    Raises:
        InvalidRequest: the prompt or image is unusable; the message says how.
    """
    ids = _tokens(request.prompt, config)
    return _normalise(to_rgb(request), config), ids


class Preprocess(Stage):
    """Sends normalised pixels to ``encode`` and prompt token ids to ``prefill``."""

    async def setup(self) -> None:
        """Pin torch to one thread: deterministic numerics and no oversubscription."""
        torch.set_num_threads(1)

    async def process(self, request: VLMRequest, ctx: Context) -> PreprocessOut:
        """Split one request into the encoder's and the decoder's inputs.

        Raises:
            InvalidRequest: the prompt or image is unusable.
        """
        pixels, ids = prepare(request)
        return PreprocessOut(encode=Pixels(pixels), prefill=PromptTokens(ids))
