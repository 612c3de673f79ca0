"""The ``encode`` stage: normalised pixels to image embeddings, with the vision encoder."""

from __future__ import annotations

import torch

from pipeline import Context, Stage
from stages.model import TINY_VLM, VisionEncoder
from stages.payloads import ImageEmbeddings, Pixels
from stages.weights import load_vision

__all__ = ("Encode",)


class Encode(Stage):
    """Runs the vision encoder over one image; loads only the encoder's weights."""

    vision: VisionEncoder

    async def setup(self) -> None:
        """Load the encoder's weights (generating the cached file on first use).

        One torch thread per stage keeps numerics identical to the single-process
        reference and stops the stages' processes from oversubscribing the cores.

        Raises:
            WeightsError: the weights file is malformed or fails verification.
        """
        torch.set_num_threads(1)
        self.vision = load_vision(device=self.device)

    async def process(self, pixels: Pixels, ctx: Context) -> ImageEmbeddings:
        """Embed one image.

        Raises:
            ValueError: the pixels are not ``float32 (3, size, size)``.
        """
        size = TINY_VLM.image_size
        expected = (TINY_VLM.channels, size, size)
        values = pixels.values
        if values.dtype != torch.float32 or tuple(values.shape) != expected:
            raise ValueError(
                f"pixels must be float32 of shape {expected}; "
                f"got {values.dtype} of shape {tuple(values.shape)}"
            )
        return ImageEmbeddings(self.vision(values.to(self.device)))
