"""The ``preprocess`` stage: a request's image to encoder pixels, its prompt to token ids.

The image arrives as PNG bytes or as raw ``uint8`` pixels ``(height, width, 3)``. It is
resized with ``torch.nn.functional.interpolate`` (bilinear, antialiased) to the encoder's
square input and normalised to ``[-1, 1]``. Everything that can be wrong with a request is
found here, before any model runs, and raised as :class:`InvalidRequest` with a message
that says what was wrong; the runtime turns it into a ``StageError`` for that request only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline import Context, Stage
from stages import tokenizer
from stages.model import TINY_VLM, VLMConfig
from stages.payloads import Pixels, PreprocessOut, PromptTokens, VLMRequest
from stages.png import PNG_SIGNATURE, PngError, decode_png

__all__ = ("MAX_PIXELS_SIDE", "InvalidRequest", "Preprocess", "prepare", "to_rgb")

#: Largest side of raw pixels accepted; larger images should be resized by the client.
MAX_PIXELS_SIDE = 4096
_JPEG_SIGNATURE = b"\xff\xd8\xff"


class InvalidRequest(ValueError):
    """A request cannot be processed; the message says why."""


def _decode_image(data: bytes) -> torch.Tensor:
    if data.startswith(PNG_SIGNATURE):
        try:
            return torch.from_numpy(decode_png(data))
        except PngError as e:
            raise InvalidRequest(f"corrupt or unsupported PNG image: {e}") from e
    if data.startswith(_JPEG_SIGNATURE):
        raise InvalidRequest(
            "JPEG images are not supported (no JPEG decoder is installed); "
            "send PNG bytes or raw pixels"
        )
    raise InvalidRequest(f"image is not a PNG ({len(data)} bytes starting {data[:8]!r})")


def _check_pixels(pixels: torch.Tensor) -> torch.Tensor:
    shape = tuple(pixels.shape)
    if pixels.dtype != torch.uint8 or len(shape) != 3 or shape[2] != 3:
        raise InvalidRequest(
            "pixels must be a uint8 tensor of shape (height, width, 3); "
            f"got {str(pixels.dtype).removeprefix('torch.')} of shape {shape}"
        )
    if not (0 < shape[0] <= MAX_PIXELS_SIDE and 0 < shape[1] <= MAX_PIXELS_SIDE):
        raise InvalidRequest(
            f"pixels are {shape[1]}x{shape[0]}; each side must be 1 to {MAX_PIXELS_SIDE}"
        )
    return pixels


def to_rgb(request: VLMRequest) -> torch.Tensor:
    """The request's image as ``uint8`` RGB ``(height, width, 3)``.

    Raises:
        InvalidRequest: no image, two images, a corrupt image, or pixels of a wrong shape.
    """
    if request.pixels is not None and request.image:
        raise InvalidRequest("request has both image bytes and pixels; give one")
    if request.pixels is not None:
        return _check_pixels(request.pixels)
    if not request.image:
        raise InvalidRequest("request has no image: give PNG bytes in 'image' or 'pixels'")
    return _decode_image(request.image)


def _normalise(rgb: torch.Tensor, config: VLMConfig) -> torch.Tensor:
    """Resize ``uint8`` RGB to the encoder's input and scale it to ``[-1, 1]``."""
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
    ids = tokenizer.encode(prompt)
    n = len(ids) - 1
    if n > config.max_prompt_bytes:
        raise InvalidRequest(
            f"prompt is {n} bytes long but the model's context of {config.max_context} "
            f"positions leaves room for at most {config.max_prompt_bytes} prompt bytes "
            f"after the {config.n_patches} image tokens"
        )
    return ids


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
