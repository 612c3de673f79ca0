"""The base of the stages that run the decoder (prefill and decode)."""

from __future__ import annotations

import torch

from pipeline import Stage
from stages.model import Decoder
from stages.weights import load_decoder

__all__ = ("DecoderStage",)


class DecoderStage(Stage):
    """A stage holding the decoder; it loads only the decoder's weights."""

    decoder: Decoder

    async def setup(self) -> None:
        """Load the decoder's weights, with one torch thread (see ``Encode.setup``).

        Raises:
            WeightsError: the weights file is malformed or fails verification.
        """
        torch.set_num_threads(1)
        self.decoder = load_decoder(device=self.device)
