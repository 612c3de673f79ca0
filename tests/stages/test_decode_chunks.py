"""How the decode stage groups tokens into streamed chunks: the first token alone, then at
most ``chunk_tokens`` a chunk, and no token held back past ``chunk_ms`` for company."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from pipeline import Context, Stream
from pipeline._errors import EndOfChannel
from stages.decode import Decode
from stages.model import TINY_VLM, LayerKV, TinyVLM
from stages.payloads import DecodeChunk, KVChunk
from stages.step_batcher import Step, StepBatcher
from tests.stages.conftest import single_thread

SEED = 77
MAX_NEW = 24


class _SlowSteps(StepBatcher):
    """Steps that take at least ``delay`` seconds each, as a larger model's would."""

    def __init__(self, batcher: StepBatcher, delay: float) -> None:
        super().__init__(batcher._decoder, max_batch=1)
        self._delay = delay

    async def step(self, token: int, cache: list[LayerKV]) -> Step:
        await asyncio.sleep(self._delay)
        return await super().step(token, cache)


def _kv_stream(gen: torch.Generator, length: int) -> Stream[KVChunk]:
    """A whole cache of ``length`` positions, as prefill streams it: a chunk per layer."""
    shape = (TINY_VLM.n_heads, length, TINY_VLM.head_dim)
    chunks = [
        KVChunk(
            layer=i,
            keys=torch.randn(shape, generator=gen),
            values=torch.randn(shape, generator=gen),
            first_token=65 if i == TINY_VLM.decoder_layers - 1 else None,
        )
        for i in range(TINY_VLM.decoder_layers)
    ]

    async def next_chunk() -> KVChunk:
        if not chunks:
            raise EndOfChannel
        return chunks.pop(0)

    return Stream(next_chunk)


async def _sizes(model: TinyVLM, delay: float = 0.0, **params: float) -> list[int]:
    """Tokens per streamed chunk of one request (the final summary left out)."""
    stage = Decode(
        params=Decode.Params(max_new_tokens=MAX_NEW, **params),  # type: ignore[arg-type]
        name="decode",
        replica=0,
        device="cpu",
    )
    stage.decoder = model.decoder
    stage.batcher = StepBatcher(model.decoder, max_batch=1)
    if delay:
        stage.batcher = _SlowSteps(stage.batcher, delay)
    gen = torch.Generator().manual_seed(SEED)
    out: AsyncIterator[DecodeChunk] = stage.process(_kv_stream(gen, 12), Context("r", "decode", 0))
    with single_thread():
        chunks = [c async for c in out]
    *progress, final = chunks
    assert final.done and not any(c.done for c in progress)
    sizes = [len(c.token_ids) for c in progress]
    assert sum(sizes) == len(final.generated_ids) > 0
    return sizes


def _by_count(n: int, cap: int) -> list[int]:
    """The first token alone, then full chunks of ``cap``, then the rest."""
    rest = [cap] * ((n - 1) // cap)
    return [1, *rest, *([(n - 1) % cap] if (n - 1) % cap else [])]


async def test_a_fast_model_fills_chunks_up_to_chunk_tokens(model: TinyVLM) -> None:
    """With time to spare, chunks are full: the first token alone, then ``chunk_tokens``."""
    sizes = await _sizes(model, chunk_tokens=5, chunk_ms=60_000.0)
    assert sizes == _by_count(sum(sizes), 5)


async def test_no_budget_sends_every_token_alone(model: TinyVLM) -> None:
    sizes = await _sizes(model, chunk_tokens=16, chunk_ms=0.0)
    assert sizes == [1] * len(sizes)


async def test_a_slow_model_sends_each_token_as_it_is_made(model: TinyVLM) -> None:
    """Steps slower than ``chunk_ms``: no token waits for the next one."""
    sizes = await _sizes(model, delay=0.03, chunk_tokens=16, chunk_ms=20.0)
    assert sizes == [1] * len(sizes)


@pytest.mark.parametrize("budget_ms", [20.0, 40.0])
async def test_chunks_hold_no_more_tokens_than_the_budget_allows(
    model: TinyVLM, budget_ms: float
) -> None:
    """Steps of at least 5 ms and a budget of ``budget_ms``: a chunk is sent once its next
    token would keep the oldest past the budget, so it holds at most budget / 5 tokens,
    however much longer the steps take on a loaded machine; never ``chunk_tokens``."""
    sizes = await _sizes(model, delay=0.005, chunk_tokens=64, chunk_ms=budget_ms)
    assert sizes[0] == 1
    assert max(sizes) <= budget_ms / 5, sizes
