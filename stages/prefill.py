"""The ``prefill`` stage: joins a request's token ids and image embeddings, runs the decoder
over ``[image; prompt]``, and streams the KV cache to ``decode`` one layer per chunk.

Layer ``i`` is yielded as soon as it is computed, so its bytes travel while layer ``i + 1``
computes. The greedy first token needs every layer, so it rides on the last chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from pipeline import Context
from stages.decoder_stage import DecoderStage
from stages.model import BOS, TINY_VLM
from stages.payloads import ImageEmbeddings, KVChunk, PromptTokens

__all__ = ("Prefill",)


class Prefill(DecoderStage):
    """Prefills the decoder for one request; loads only the decoder's weights."""

    async def process(
        self, preprocess: PromptTokens, encode: ImageEmbeddings, ctx: Context
    ) -> AsyncIterator[KVChunk]:
        """Stream one KV chunk per decoder layer, in layer order.

        Raises:
            ValueError: the embeddings or token ids do not fit the model.
        """
        config = TINY_VLM
        expected = (config.n_patches, config.d_model)
        image = encode.values
        if image.dtype != torch.float32 or tuple(image.shape) != expected:
            raise ValueError(
                f"image embeddings must be float32 of shape {expected}; "
                f"got {image.dtype} of shape {tuple(image.shape)}"
            )
        ids = preprocess.ids
        if not ids or ids[0] != BOS or not all(0 <= i < config.vocab_size for i in ids):
            raise ValueError("token ids must start with BOS and lie within the vocabulary")
        for layer in self.decoder.prefill(image.to(self.device), ids):
            keys, values = layer.kv
            yield KVChunk(
                layer=layer.index, keys=keys, values=values, first_token=layer.first_token
            )
