"""Tests for the reorder buffer: order, duplicates, gaps, abort and cancellation."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline._errors import ChunkGap, EndOfChannel, RequestAborted
from pipeline._reorder import HELD_LIMIT, ReorderBuffer

Item = tuple[int, int]  # (seq, index of the offer that carried it)


def make(timeout: float = 5.0) -> tuple[ReorderBuffer[Item], list[Item]]:
    """A buffer for request r1 on edge a->b, and the list its discards land in."""
    discarded: list[Item] = []
    return ReorderBuffer(
        "r1", "a->b", chunk_timeout=timeout, on_discard=discarded.append
    ), discarded


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until ``predicate`` holds, failing after 100 turns."""
    for _ in range(100):
        if predicate():
            return
        await asyncio.sleep(0)  # A scheduling point that lets the other task run.
    pytest.fail("the condition never held")


@st.composite
def offer_plans(draw: st.DrawFn) -> tuple[int, list[int], list[bool]]:
    """n, a permutation of 0..n-1 with duplicates inserted anywhere, and a schedule."""
    n = draw(st.integers(1, 60))
    order = draw(st.permutations(range(n)))
    offers = list(order)
    for dup in draw(st.lists(st.integers(0, n - 1), max_size=30)):
        offers.insert(draw(st.integers(0, len(offers))), dup)
    # True offers the next chunk; False lets the consumer run first.
    schedule = draw(st.lists(st.booleans(), min_size=len(offers), max_size=3 * len(offers)))
    return n, offers, schedule


@settings(max_examples=300, deadline=None)
@given(offer_plans())
def test_any_interleaving_delivers_each_seq_once_in_order(
    plan: tuple[int, list[int], list[bool]],
) -> None:
    """For any arrival order with duplicates and any interleaving, the consumer sees 0..n-1."""
    n, offers, schedule = plan

    async def scenario() -> None:
        buf, discarded = make()
        received: list[Item] = []

        async def consume() -> None:
            while True:
                try:
                    item, final = await buf.get()
                except EndOfChannel:
                    return
                assert final == (item[0] == n - 1)
                received.append(item)

        consumer = asyncio.create_task(consume())
        pending = iter(enumerate(offers))
        for offer_next in [*schedule, *([True] * len(offers))]:
            if not offer_next:
                await asyncio.sleep(0)  # A scheduling point chosen by Hypothesis.
            elif (step := next(pending, None)) is not None:
                index, seq = step
                buf.offer(seq, (seq, index), seq == n - 1)
        async with asyncio.timeout(5):
            await consumer

        first_offer = {seq: index for index, seq in reversed(list(enumerate(offers)))}
        assert received == [(seq, first_offer[seq]) for seq in range(n)]
        extra = [(seq, i) for i, seq in enumerate(offers) if first_offer[seq] != i]
        assert sorted(discarded) == sorted(extra)
        assert buf.duplicates == len(offers) - n
        assert (buf.delivered, buf.buffered, buf.finished, buf.final_seq) == (n, 0, True, n - 1)
        with pytest.raises(EndOfChannel):
            buf.get_nowait()

    asyncio.run(scenario())


async def test_missing_seq_raises_chunk_gap_after_the_timeout() -> None:
    """A missing seq makes get() raise ChunkGap naming it once chunk_timeout has passed."""
    buf, _ = make(timeout=0.05)
    for seq in (0, 1, 3):
        assert buf.offer(seq, (seq, seq), seq == 3)
    assert [await buf.get() for _ in range(2)] == [((0, 0), False), ((1, 1), False)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(2):
        with pytest.raises(ChunkGap) as info:
            await buf.get()
    assert loop.time() - started >= 0.04
    assert (info.value.request_id, info.value.edge, info.value.seq) == ("r1", "a->b", 2)
    assert info.value.timeout == 0.05
    assert not buf.waiting


async def test_nothing_offered_raises_chunk_gap_for_seq_zero() -> None:
    """With no chunk at all, get() raises ChunkGap for seq 0 instead of hanging."""
    buf, _ = make(timeout=0.05)
    async with asyncio.timeout(2):
        with pytest.raises(ChunkGap) as info:
            await buf.get()
    assert (info.value.request_id, info.value.edge, info.value.seq) == ("r1", "a->b", 0)


async def test_an_untimed_first_wait_is_timed_once_a_later_seq_shows_a_gap() -> None:
    """With ``time_first`` off, waiting for seq 0 before anything came is not a gap (its
    producer may not have begun); a later seq arriving first makes it one, timed from then."""
    buf = ReorderBuffer[Item]("r1", "a->b", chunk_timeout=0.05, time_first=False)
    loop = asyncio.get_running_loop()
    getter = asyncio.create_task(buf.get())
    # Five timeouts: a timed wait would have ended (with ChunkGap) by now.
    done, _ = await asyncio.wait({getter}, timeout=0.25)
    assert not done and buf.waiting
    arrived = loop.time()
    assert buf.offer(1, (1, 0), True)
    async with asyncio.timeout(2):
        with pytest.raises(ChunkGap) as info:
            await getter
    assert loop.time() - arrived >= 0.04
    assert info.value.seq == 0
    assert buf.offer(0, (0, 1), False)  # the buffer stays usable
    assert [await buf.get(), await buf.get()] == [((0, 1), False), ((1, 0), True)]


async def test_an_untimed_first_wait_ends_with_its_first_chunk_or_the_request() -> None:
    """Untimed, the first wait ends when seq 0 comes, or when the request ends (abort)."""
    first = ReorderBuffer[Item]("r1", "a->b", chunk_timeout=0.02, time_first=False)
    getter = asyncio.create_task(first.get())
    done, _ = await asyncio.wait({getter}, timeout=0.1)  # past the timeout: still waiting
    assert not done
    assert first.offer(0, (0, 0), False)
    async with asyncio.timeout(1):
        assert await getter == ((0, 0), False)
    # From the second chunk on, every wait is timed.
    with pytest.raises(ChunkGap):
        await first.get()
    aborted = ReorderBuffer[Item]("r2", "a->b", chunk_timeout=0.02, time_first=False)
    getter = asyncio.create_task(aborted.get())
    done, _ = await asyncio.wait({getter}, timeout=0.1)
    assert not done
    aborted.abort(RequestAborted("r2", "deadline"))
    async with asyncio.timeout(1):
        with pytest.raises(RequestAborted):
            await getter


async def test_chunk_arriving_within_the_timeout_is_delivered() -> None:
    """A chunk offered while get() waits wakes it before the deadline."""
    buf, _ = make(timeout=5.0)
    getter = asyncio.create_task(buf.get())
    await until(lambda: buf.waiting)
    assert buf.offer(1, (1, 0), True)
    assert not getter.done()
    assert buf.offer(0, (0, 1), False)
    async with asyncio.timeout(1):
        assert await getter == ((0, 1), False)
    assert await buf.get() == ((1, 0), True)


async def test_gap_leaves_the_buffer_usable() -> None:
    """After a ChunkGap, a chunk that arrives late is still delivered in order."""
    buf, _ = make(timeout=0.02)
    with pytest.raises(ChunkGap):
        await buf.get()
    buf.offer(0, (0, 0), True)
    assert await buf.get() == ((0, 0), True)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 40), max_size=25), st.randoms(use_true_random=False))
def test_abort_releases_every_buffered_item(seqs: set[int], rnd: random.Random) -> None:
    """Abort discards exactly the undelivered items, wakes the getter and refuses later offers."""
    order = sorted(seqs)
    rnd.shuffle(order)

    async def scenario() -> None:
        buf, discarded = make()
        for seq in order:
            assert buf.offer(seq, (seq, 0), False)
        delivered = []
        while (entry := buf.get_nowait()) is not None:
            delivered.append(entry[0])
        assert delivered == [(s, 0) for s in range(buf.expected)]
        held = {(s, 0) for s in seqs} - set(delivered)
        assert buf.buffered == len(held)

        getter = asyncio.create_task(buf.get())
        await until(lambda: buf.waiting)
        assert buf.abort() == len(held)
        async with asyncio.timeout(1):
            with pytest.raises(RequestAborted) as info:
                await getter
        assert info.value.request_id == "r1"
        assert sorted(discarded) == sorted(held)
        assert buf.buffered == 0
        assert buf.abort() == 0

        assert not buf.offer(buf.expected, (buf.expected, 1), False)
        assert not buf.offer(41, (41, 1), True)
        assert buf.late == 2
        assert sorted(discarded) == sorted(held | {(buf.expected, 1), (41, 1)})
        with pytest.raises(RequestAborted):
            buf.get_nowait()

    asyncio.run(scenario())


async def test_abort_with_a_custom_exception_raises_it() -> None:
    """get() raises the exception given to abort(), and close() afterwards changes nothing."""
    buf, _ = make()
    error = RuntimeError("stage died")
    assert buf.abort(error) == 0
    assert buf.close() == 0
    with pytest.raises(RuntimeError) as info:
        await buf.get()
    assert info.value is error


async def test_close_discards_and_ends_the_stream() -> None:
    """close() drops buffered items, wakes the getter with EndOfChannel and refuses offers."""
    buf, discarded = make()
    buf.offer(2, (2, 0), False)
    buf.offer(3, (3, 0), True)
    getter = asyncio.create_task(buf.get())
    await until(lambda: buf.waiting)
    assert buf.close() == 2
    with pytest.raises(EndOfChannel):
        await getter
    assert sorted(discarded) == [(2, 0), (3, 0)]
    assert buf.close() == 0
    assert buf.abort() == 0
    assert not buf.offer(0, (0, 0), False)
    assert (buf.late, len(discarded)) == (1, 3)
    with pytest.raises(EndOfChannel):
        await buf.get()


def test_conflicting_finals_and_seqs_past_final_are_refused() -> None:
    """A second final, a final below a held seq and a seq past the final are refused and counted."""
    buf, discarded = make()
    assert buf.offer(5, (5, 0), False)
    assert not buf.offer(3, (3, 0), True)  # Contradicts seq 5, already held.
    assert buf.offer(7, (7, 0), True)
    assert not buf.offer(8, (8, 0), False)
    assert not buf.offer(6, (6, 0), True)  # A second, different final.
    assert not buf.offer(7, (7, 1), True)  # The same final again is a duplicate.
    assert not buf.offer(-1, (-1, 0), False)
    assert (buf.invalid, buf.duplicates, buf.final_seq) == (4, 1, 7)
    assert discarded == [(3, 0), (8, 0), (6, 0), (7, 1), (-1, 0)]
    assert buf.buffered == 2


def test_get_nowait_returns_ready_items_only() -> None:
    """get_nowait() returns in-order items, None at a gap, then EndOfChannel after the final."""
    buf, discarded = make()
    assert buf.get_nowait() is None
    buf.offer(1, (1, 0), True)
    assert buf.get_nowait() is None
    buf.offer(0, (0, 0), False)
    assert buf.get_nowait() == ((0, 0), False)
    assert buf.get_nowait() == ((1, 0), True)
    assert buf.finished
    with pytest.raises(EndOfChannel):
        buf.get_nowait()
    assert not buf.offer(0, (0, 1), False)
    assert (buf.duplicates, discarded) == (1, [(0, 1)])


async def test_cancelled_get_loses_nothing() -> None:
    """Cancelling a waiting get() leaves the buffer intact for the next get()."""
    buf, _ = make()
    getter = asyncio.create_task(buf.get())
    await until(lambda: buf.waiting)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    assert not buf.waiting
    buf.offer(0, (0, 0), False)
    assert await buf.get() == ((0, 0), False)


async def test_get_cancelled_after_wakeup_keeps_the_chunk() -> None:
    """A get() cancelled between being woken and resuming leaves its chunk buffered."""
    buf, _ = make()
    getter = asyncio.create_task(buf.get())
    await until(lambda: buf.waiting)
    buf.offer(0, (0, 0), True)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    assert (buf.buffered, buf.delivered) == (1, 0)
    assert await buf.get() == ((0, 0), True)


async def test_second_concurrent_get_is_refused() -> None:
    """Only one task may wait in get(); a second one raises RuntimeError."""
    buf, _ = make()
    getter = asyncio.create_task(buf.get())
    await until(lambda: buf.waiting)
    with pytest.raises(RuntimeError):
        await buf.get()
    buf.offer(0, (0, 0), True)
    assert await getter == ((0, 0), True)


async def test_infinite_timeout_waits_without_a_deadline() -> None:
    """With chunk_timeout=inf, get() waits until the chunk is offered."""
    buf = ReorderBuffer[Item]("r1", "a->b", chunk_timeout=math.inf)
    getter = asyncio.create_task(buf.get())
    await until(lambda: buf.waiting)
    buf.offer(0, (0, 0), True)
    async with asyncio.timeout(1):
        assert await getter == ((0, 0), True)


def test_failing_on_discard_still_releases_everything() -> None:
    """An on_discard that raises during abort still sees every item, then its error surfaces."""
    released: list[Item] = []

    def release(item: Item) -> None:
        released.append(item)
        if item[0] == 1:
            raise OSError("unmap failed")

    buf = ReorderBuffer[Item]("r1", "a->b", chunk_timeout=1.0, on_discard=release)
    for seq in (3, 1, 2):
        buf.offer(seq, (seq, 0), False)
    with pytest.raises(OSError, match="unmap failed"):
        buf.abort()
    assert sorted(released) == [(1, 0), (2, 0), (3, 0)]
    assert (buf.buffered, buf.abort()) == (0, 0)


def test_non_positive_timeout_is_rejected() -> None:
    """A chunk_timeout of zero, below zero or NaN is a ValueError."""
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="chunk_timeout"):
            ReorderBuffer[Item]("r1", "a->b", chunk_timeout=bad)


def test_a_repeat_of_a_buffered_chunk_is_not_released() -> None:
    """The same item offered again while the original waits is refused and counted, but not
    discarded: releasing it would free the payload the original still names. A repeat
    carrying a different item, or of a chunk already delivered, is discarded."""
    buf, discarded = make()
    assert buf.offer(1, (1, 0), False)
    assert not buf.offer(1, (1, 0), False)  # the same envelope again
    assert not buf.offer(1, (1, 1), False)  # a different item for the same seq
    assert buf.offer(0, (0, 0), False)
    assert buf.get_nowait() == ((0, 0), False)
    assert not buf.offer(0, (0, 0), False)  # already delivered
    assert buf.duplicates == 3
    assert discarded == [(1, 1), (0, 0)]


async def test_complete_once_every_chunk_up_to_the_final_one_arrived() -> None:
    """What a stage reports as drained: the final chunk and every one before it arrived,
    in any order, delivered or not."""
    buf, _ = make()
    buf.offer(0, (0, 0), False)
    assert not buf.complete
    buf.offer(2, (2, 0), True)  # the final one, before a gap is filled
    assert not buf.complete
    assert buf.get_nowait() == ((0, 0), False)
    buf.offer(1, (1, 0), False)
    assert buf.complete
    assert buf.get_nowait() == ((1, 0), False) and buf.complete


async def test_a_wait_its_producer_keeps_alive_still_ends_after_held_limit_timeouts() -> None:
    """A producer's Held notices restart the wait, but no wait lasts past HELD_LIMIT chunk
    timeouts: what holds the producer up may be this very consumer, and the request must
    end in a ChunkGap that says so, not hang."""
    timeout = 0.05
    buf: ReorderBuffer[str] = ReorderBuffer("r", "a->b", chunk_timeout=timeout)
    loop = asyncio.get_running_loop()
    began = loop.time()
    waiting = asyncio.ensure_future(buf.get())

    def keep_alive() -> None:  # a notice every fifth of a timeout, as long as it waits
        if not waiting.done():
            buf.alive()
            loop.call_later(timeout / 5, keep_alive)

    keep_alive()
    with pytest.raises(ChunkGap, match="held up sending elsewhere, for 10 chunk timeouts"):
        await asyncio.wait_for(waiting, 5)
    assert loop.time() - began >= HELD_LIMIT * timeout * 0.99  # extended, then ended
