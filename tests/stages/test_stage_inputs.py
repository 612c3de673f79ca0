"""What prefill and decode accept from the stage before them: inputs of the wrong dtype or
shape fail their request up front, with a message naming what was wrong, never inside the
model (where a batched decode step would fail its batch-mates too)."""

from __future__ import annotations

import pytest
import torch

from pipeline import Context, Stream
from pipeline._errors import EndOfChannel
from stages.decode import Decode
from stages.model import BOS, TINY_VLM, TinyVLM
from stages.payloads import ImageEmbeddings, KVChunk, PromptTokens
from stages.prefill import Prefill
from stages.step_batcher import StepBatcher

SEED = 77


def _broken(change: str) -> list[KVChunk]:
    """A cache of 12 positions, as prefill streams it, with one thing wrong."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (TINY_VLM.n_heads, 12, TINY_VLM.head_dim)
    chunks = []
    for i in range(TINY_VLM.decoder_layers):
        keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        if i == 1 and change == "dtype":
            values = values.double()
        elif i == 1 and change == "positions":
            keys, values = keys[:, :5].contiguous(), values[:, :5].contiguous()
        elif change == "head_dim":
            keys, values = keys[..., :8].contiguous(), values[..., :8].contiguous()
        first = 65 if i == TINY_VLM.decoder_layers - 1 else None
        chunks.append(KVChunk(layer=i, keys=keys, values=values, first_token=first))
    return chunks


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("dtype", "KV layer 1 values must be float32 of shape (4, 12, 16)"),
        ("positions", "KV layer 1 keys must be float32 of shape (4, 12, 16)"),
        ("head_dim", "KV layer 0 keys must be float32 of shape (4, 12, 16)"),
    ],
)
async def test_a_cache_of_the_wrong_dtype_or_shape_is_refused_before_any_token(
    model: TinyVLM, change: str, says: str
) -> None:
    """KV chunks of another dtype, head width, or length than the first layer's fail the
    request up front, naming the layer; they used to reach the model step (a raw torch
    error, after tokens had streamed, or none at all: a bfloat16 or a short layer decoded)."""
    stage = Decode(params=Decode.Params(), name="decode", replica=0, device="cpu")
    stage.decoder = model.decoder
    stage.batcher = StepBatcher(model.decoder, max_batch=8)
    chunks = _broken(change)

    async def next_chunk() -> KVChunk:
        if not chunks:
            raise EndOfChannel
        return chunks.pop(0)

    out = stage.process(Stream(next_chunk), Context("r", "decode", 0))
    with pytest.raises(ValueError) as refused:
        await anext(out)
    assert says in str(refused.value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
async def test_prefill_refuses_image_embeddings_of_another_dtype(
    model: TinyVLM, dtype: torch.dtype
) -> None:
    """Embeddings of the right shape but another dtype are refused, naming both; int64 and
    bfloat16 ones used to prefill silently, float64 ones to fail inside torch."""
    stage = Prefill(params=None, name="prefill", replica=0, device="cpu")
    stage.decoder = model.decoder
    shape = (TINY_VLM.n_patches, TINY_VLM.d_model)
    image = ImageEmbeddings(torch.zeros(shape, dtype=dtype))
    out = stage.process(PromptTokens([BOS, 65]), image, Context("r", "prefill", 0))
    with pytest.raises(ValueError, match=f"must be float32 of shape .*; got {dtype}"):
        await anext(out)
