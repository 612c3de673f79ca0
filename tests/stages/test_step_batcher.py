"""Batched decode steps: bit-for-bit the tokens and caches of single steps, whatever the batch."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest
import torch

from stages.model import TINY_VLM, GreedyDecoding, LayerKV, TinyVLM
from stages.step_batcher import StepBatcher
from tests.stages.conftest import single_thread

SEED = 4321


def _cache(gen: torch.Generator, length: int) -> list[LayerKV]:
    """A random cache of ``length`` positions for every decoder layer."""
    shape = (TINY_VLM.n_heads, length, TINY_VLM.head_dim)
    return [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(TINY_VLM.decoder_layers)
    ]


def _copy(cache: list[LayerKV]) -> list[LayerKV]:
    return [(k.clone(), v.clone()) for k, v in cache]


def test_step_many_equals_single_steps_bit_for_bit(model: TinyVLM) -> None:
    """Every request of every batch gets exactly the token and cache that step() gives it."""
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    with single_thread():
        for _ in range(60):
            n = rng.randint(2, 12)
            tokens = [rng.randrange(TINY_VLM.vocab_size) for _ in range(n)]
            lengths = [rng.randint(1, TINY_VLM.max_context - 1) for _ in range(n)]
            caches = [_cache(gen, length) for length in lengths]
            alone = [_copy(c) for c in caches]
            expected = [decoder.step(t, c) for t, c in zip(tokens, alone, strict=True)]
            assert decoder.step_many(tokens, caches) == expected, (tokens, lengths)
            for got, want in zip(caches, alone, strict=True):
                for (gk, gv), (wk, wv) in zip(got, want, strict=True):
                    assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_step_many_refuses_a_full_cache(model: TinyVLM) -> None:
    gen = torch.Generator().manual_seed(SEED)
    caches = [_cache(gen, 3), _cache(gen, TINY_VLM.max_context)]
    with single_thread(), pytest.raises(ValueError, match="fills the context"):
        model.decoder.step_many([1, 2], caches)


async def _decode(
    batcher: StepBatcher,
    decoding: GreedyDecoding,
    sizes: list[int],
    stepped: asyncio.Event | None = None,
) -> list[int]:
    """Drive ``decoding`` through ``batcher`` as the decode stage does; its tokens.

    Each step's batch size goes to ``sizes``; ``stepped`` is set after every step.
    """
    out: list[int] = []
    with batcher.decoding():
        while decoding.has_token():
            out.append(decoding.token)
            if not decoding.wants_step():
                break
            step = await batcher.step(decoding.token, decoding.cache)
            decoding.token, size = step.token, step.batch
            assert step.seconds > 0
            sizes.append(size)
            if stepped is not None:
                stepped.set()
    return out


async def test_concurrent_requests_share_steps_and_keep_their_tokens(model: TinyVLM) -> None:
    """12 requests decoding at once, 4 per batch at most: each gets generate()'s tokens."""
    gen = torch.Generator().manual_seed(SEED)
    rng = random.Random(SEED)
    decoder = model.decoder
    with single_thread():
        starts = [
            (rng.randrange(256), _cache(gen, rng.randint(5, 60)), rng.randint(1, 40))
            for _ in range(12)
        ]
        expected = [
            list(GreedyDecoding(decoder, first, _copy(cache), n)) for first, cache, n in starts
        ]
        batcher = StepBatcher(decoder, max_batch=4)
        sizes: list[int] = []
        got = await asyncio.gather(
            *(
                _decode(batcher, GreedyDecoding(decoder, first, _copy(cache), n), sizes)
                for first, cache, n in starts
            )
        )
    assert got == expected
    assert batcher.batches > 0 and max(sizes) == 4, sizes
    assert batcher.batched_steps <= 4 * batcher.batches
    assert batcher.request_steps == len(sizes) and batcher.steps < len(sizes)


async def test_a_request_alone_steps_in_place(model: TinyVLM) -> None:
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    with single_thread():
        cache = _cache(gen, 20)
        expected = list(GreedyDecoding(decoder, 7, _copy(cache), 10))
        batcher = StepBatcher(decoder, max_batch=8)
        sizes: list[int] = []
        assert await _decode(batcher, GreedyDecoding(decoder, 7, cache, 10), sizes) == expected
    assert batcher.batches == 0 and set(sizes) <= {1}


async def test_a_cancelled_request_leaves_the_others_decoding(model: TinyVLM) -> None:
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    with single_thread():
        caches = [_cache(gen, 10 + i) for i in range(3)]
        expected = [list(GreedyDecoding(decoder, 9, _copy(c), 30)) for c in caches]
        batcher = StepBatcher(decoder, max_batch=8)
        sizes: list[int] = []
        stepped = asyncio.Event()
        tasks = [
            asyncio.ensure_future(
                _decode(batcher, GreedyDecoding(decoder, 9, c, 30), sizes, stepped)
            )
            for c in caches
        ]
        while len(sizes) < 6:  # a few shared steps first
            stepped.clear()
            await stepped.wait()
        assert batcher.batches > 0
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    assert [done[0], done[2]] == [expected[0], expected[2]]


async def test_a_step_that_fails_in_a_batch_fails_only_its_own_request(model: TinyVLM) -> None:
    """A request whose cache breaks the model step (a layer of another dtype, in its last
    layer, so that the batch has extended the others' first layers already) fails alone:
    its batch-mates get the tokens they get alone, their caches extended once. Every
    request of the batch used to fail with its error."""
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    with single_thread():
        good = [_cache(gen, 12), _cache(gen, 17)]
        expected = [list(GreedyDecoding(decoder, 5, _copy(c), 6)) for c in good]
        bad = _cache(gen, 9)
        bad[-1] = (bad[-1][0].double(), bad[-1][1].double())
        batcher = StepBatcher(decoder, max_batch=8)
        sizes: list[int] = []
        results = await asyncio.gather(
            _decode(batcher, GreedyDecoding(decoder, 5, good[0], 6), sizes),
            _decode(batcher, GreedyDecoding(decoder, 5, bad, 6), sizes),
            _decode(batcher, GreedyDecoding(decoder, 5, good[1], 6), sizes),
            return_exceptions=True,
        )
    assert [results[0], results[2]] == expected
    assert isinstance(results[1], RuntimeError), results[1]
    assert [c[0][0].shape[1] for c in good] == [12 + 5, 17 + 5]  # five steps each, once


async def _ticking(turns: list[int]) -> None:
    """Count loop turns: one per pass of the event loop that runs ready tasks."""
    while True:
        turns[0] += 1
        await asyncio.sleep(0)


@pytest.mark.parametrize(("budget", "most_turns", "least_turns"), [(3600.0, 2, 0), (0.0, 99, 9)])
async def test_a_request_alone_yields_to_the_loop_once_per_budget(
    model: TinyVLM, budget: float, most_turns: int, least_turns: int
) -> None:
    """Alone, a request lets the loop run once per ``yield_alone_s``; 0 means every step."""
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    turns = [0]
    with single_thread():
        cache = _cache(gen, 20)
        expected = list(GreedyDecoding(decoder, 7, _copy(cache), 11))
        batcher = StepBatcher(decoder, max_batch=8, yield_alone_s=budget)
        ticker = asyncio.ensure_future(_ticking(turns))
        await asyncio.sleep(0)  # the ticker is running
        before = turns[0]
        sizes: list[int] = []
        got = await _decode(batcher, GreedyDecoding(decoder, 7, cache, 11), sizes)
        during = turns[0] - before
        ticker.cancel()
    assert got == expected and len(sizes) == 10
    assert least_turns <= during <= most_turns, during


async def test_a_request_alone_skips_loop_turns_with_nothing_to_run(model: TinyVLM) -> None:
    """Alone, with nothing else for the loop to do, no step takes a loop turn; data that
    arrives on a socket, or a timer that falls due, gets one within the next step."""
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    loop = asyncio.get_running_loop()
    with single_thread():
        cache = _cache(gen, 20)
        expected = list(GreedyDecoding(decoder, 7, _copy(cache), 11))
        batcher = StepBatcher(decoder, max_batch=8, yield_alone_s=0.0)
        sizes: list[int] = []
        got = await _decode(batcher, GreedyDecoding(decoder, 7, _copy(cache), 11), sizes)
        assert got == expected and len(sizes) == 10
        assert batcher.yields == 0  # without the check: a turn after each of the 10 steps

        # Data on a watched socket: its reader runs within two steps (the turn the first
        # takes runs the resumed request before the reader's callback).
        at_step: list[int] = []
        a, b = socket.socketpair()
        with a, b:
            loop.add_reader(b.fileno(), lambda: at_step.append(len(sizes)) or b.recv(16))
            try:
                sizes.clear()
                a.send(b"x")
                got = await _decode(batcher, GreedyDecoding(decoder, 7, _copy(cache), 11), sizes)
            finally:
                loop.remove_reader(b.fileno())
        assert got == expected and len(at_step) == 1 and at_step[0] <= 2, at_step
        assert 1 <= batcher.yields <= 2
        before = batcher.yields

        # A timer due during decoding: it runs after the step during which it fell due.
        fired: list[float] = []
        sizes.clear()
        t0 = time.perf_counter()
        loop.call_later(0.002, lambda: fired.append(time.perf_counter() - t0))
        got = await _decode(batcher, GreedyDecoding(decoder, 7, _copy(cache), 11), sizes)
        took = time.perf_counter() - t0
    assert got == expected and len(fired) == 1 and fired[0] < took, (fired, took)
    assert batcher.yields > before


async def test_requests_that_cannot_batch_take_turns_step_by_step(model: TinyVLM) -> None:
    """With batching off, two requests decoding at once alternate, whatever the budget."""
    gen = torch.Generator().manual_seed(SEED)
    decoder = model.decoder
    order: list[int] = []

    async def run(who: int, cache: list[LayerKV]) -> list[int]:
        decoding = GreedyDecoding(decoder, 5, cache, 12)
        out: list[int] = []
        with batcher.decoding():
            await asyncio.sleep(0)  # both are decoding before either steps
            while decoding.has_token():
                out.append(decoding.token)
                if not decoding.wants_step():
                    break
                decoding.token, size, _ = await batcher.step(decoding.token, decoding.cache)
                assert size == 1
                order.append(who)
        return out

    with single_thread():
        caches = [_cache(gen, 8), _cache(gen, 9)]
        expected = [list(GreedyDecoding(decoder, 5, _copy(c), 12)) for c in caches]
        batcher = StepBatcher(decoder, max_batch=1, yield_alone_s=3600.0)
        got = await asyncio.gather(run(0, caches[0]), run(1, caches[1]))
    assert got == expected
    both = 2 * min(order.count(0), order.count(1))
    assert both >= 10 and order[:both] == [0, 1] * (both // 2), order
