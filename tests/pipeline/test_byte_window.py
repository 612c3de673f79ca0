"""The byte window between two real channel ends, in one process: the producer's
OutputChannel and the consumer's InputChannel exchange real encoded runs and credits.

Edge cases a pipeline rarely hits on its own: a byte window filled by one large chunk
after many small ones, a credit ahead of a put still under way, a forged credit.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from pipeline import ConfigError
from pipeline import _channel as channel_module
from pipeline._channel import InputChannel, OutputChannel, SendTarget, file_run
from pipeline._errors import EndOfChannel, RequestAborted
from pipeline._messages import Chunks, Credit, decode_batch, encode_batch
from pipeline._signature import EdgePlan, build_plan
from pipeline._stage import NOT_READY, Stream
from tests.pipeline.conftest import spec, wait_for
from tests.pipeline.sample_stages import Blob


def _plan(window: int, window_bytes: int, transport: str = "inline") -> EdgePlan:
    s = spec(
        {"flood": ":Flood", "drain": ":Drain"},
        [("flood", "drain")],
        window=window,
        window_bytes=window_bytes,
        transport=transport,
    )
    return build_plan(s).stages["flood"].outputs["drain"]


class _Wire:
    """Both ends of one edge, and what travels between them, delivered on request."""

    def __init__(self, plan: EdgePlan) -> None:
        self.runs: list[Any] = []
        self.credits: list[bytes] = []
        self.out = OutputChannel(
            plan, host="h", endpoint="producer", send=lambda _, run: self.runs.append(run)
        )
        self.inp = InputChannel(plan, host="h", send=lambda _, msg: self.credits.append(msg))
        self.inflow = self.inp.open("r")
        self.target = SendTarget("consumer", "h")

    def deliver(self) -> None:
        """Runs to the consumer, credits to the producer, each through its encoding."""
        while self.runs:
            (run,) = decode_batch(encode_batch([self.runs.pop(0).seal()]))
            assert isinstance(run, Chunks)
            file_run(self.inflow, run, self.inp.admit(run))
        while self.credits:
            (credit,) = decode_batch(encode_batch([self.credits.pop(0)]))
            assert isinstance(credit, Credit)
            self.out.on_credit(credit)

    async def produce(self, sizes: list[int]) -> None:
        for i, n in enumerate(sizes):
            encoded = self.out.codec.encode(Blob(i, bytes(n)))
            if not self.out.try_send("r", encoded, False, self.target):
                await self.out.send("r", encoded, False, self.target)
            await asyncio.sleep(0)
        await self.out.send("r", None, True, self.target)

    async def consume(self) -> int:
        """Take every chunk as a handler would; how many came before the end.

        Fails when nothing can move: no chunk to take, and the producer waiting for credit.
        """
        taken = idle = 0
        while True:
            self.deliver()
            try:
                blob = self.inp.poll(self.inflow)
            except EndOfChannel:
                return taken
            if blob is NOT_READY:
                idle += 1
                win = self.out._windows["r"]
                assert idle < 1000, (
                    f"stuck after {taken} taken: producer at seq {win.next_seq}, "
                    f"{win.in_flight} bytes in flight; consumer credits at {self.inflow.credit_due}"
                )
                await asyncio.sleep(0)
                continue
            idle = 0
            assert blob.seq == taken
            taken += 1


async def test_a_large_chunk_after_small_ones_gets_its_credit() -> None:
    """A routine credit (every half window) before the chunk that filled the byte window
    must not cancel the credit the producer asked for at that chunk."""
    wire = _Wire(_plan(window=64, window_bytes=1_000_000))
    sizes = [100] * 40 + [2_000_000] + [100] * 5
    producer = asyncio.ensure_future(wire.produce(sizes))
    for _ in range(200):  # the producer runs ahead until the byte window is full
        await asyncio.sleep(0)
    assert await wire.consume() == len(sizes)
    await producer


async def test_a_credit_ahead_of_the_queued_chunks_is_clamped() -> None:
    """A credit past what the producer queued (a put still under way, or a forged one)
    neither raises nor breaks the window: the stream still completes."""
    wire = _Wire(_plan(window=4, window_bytes=10_000))
    wire.out.on_credit(Credit("r", wire.out.plan.name, 1000))  # before anything was sent
    wire.out.on_credit(Credit("nobody", wire.out.plan.name, 5))
    sizes = [3000] * 12
    producer = asyncio.ensure_future(wire.produce(sizes))
    await asyncio.sleep(0)
    wire.out.on_credit(Credit("r", wire.out.plan.name, 1000))  # forged, mid-stream
    assert await wire.consume() == len(sizes)
    await producer


async def test_a_request_alone_on_its_edge_gets_several_windows() -> None:
    """Alone on the edge, a request's producer may run LONE_WINDOWS windows ahead, and its
    consumer credits every half of that; once a second request is open there, each gets
    one window again. A forged credit cannot grant more than the lone windows."""
    assert channel_module.LONE_WINDOWS > 1
    window = 8
    wire = _Wire(_plan(window=window, window_bytes=1 << 30))
    producer = asyncio.ensure_future(wire.produce([10] * 200))

    async def settle() -> int:
        """Deliver until the producer waits for credit; how far ahead it ran."""
        for _ in range(100):
            wire.deliver()
            await asyncio.sleep(0)
        win = wire.out._windows["r"]
        return win.next_seq - win.acked

    assert await settle() == window  # before any credit: the edge's window
    for _ in range(window // 2):
        assert wire.inp.poll(wire.inflow) is not NOT_READY
    # The first credit (half a window taken) grants the lone request several windows.
    assert await settle() == channel_module.LONE_WINDOWS * window
    assert wire.inflow.credit_due == window // 2 + channel_module.LONE_WINDOWS * window // 2
    other = wire.inp.open("other")
    for _ in range(wire.inflow.credit_due - wire.inflow.taken):
        assert wire.inp.poll(wire.inflow) is not NOT_READY
    # With another request open on the edge, the next credit grants one window (what was
    # already sent under the wider grant stays sent).
    await settle()
    win = wire.out._windows["r"]
    assert (win.acked, win.allowed) == (wire.inflow.taken, wire.inflow.taken + window)
    assert wire.inflow.credit_due == wire.inflow.taken + window // 2
    wire.out.on_credit(Credit("r", wire.out.plan.name, wire.inflow.taken + 1, window=10**6))
    assert win.allowed == win.acked + channel_module.LONE_WINDOWS * window
    other.end()
    seqs = []
    while True:  # the rest arrives whole and in order
        wire.deliver()
        try:
            blob = wire.inp.poll(wire.inflow)
        except EndOfChannel:
            break
        if blob is NOT_READY:
            await asyncio.sleep(0)
        else:
            seqs.append(blob.seq)
    assert seqs == list(range(seqs[0], 200))
    await producer


def test_a_zero_byte_window_is_refused() -> None:
    with pytest.raises(ConfigError, match="window_bytes"):
        _plan(window=4, window_bytes=0)


async def test_a_credit_during_a_put_counts_only_queued_chunks() -> None:
    """A chunk whose put is still under way (shm: the segment is being made) has its seq
    but no size yet: a credit naming it is clamped, and the window stays whole."""
    s = spec({"flood": ":Flood", "drain": ":Drain"}, [("flood", "drain")], transport="shm")
    plan = build_plan(s).stages["flood"].outputs["drain"]
    runs: list[Any] = []
    out = OutputChannel(plan, host="h", endpoint="producer", send=lambda _, run: runs.append(run))
    try:
        encoded = out.codec.encode(Blob(0, bytes(1000)))
        put = asyncio.ensure_future(out.send("r", encoded, False, SendTarget("consumer", "h")))
        await asyncio.sleep(0)
        assert not put.done() and out._windows["r"].next_seq == 1
        out.on_credit(Credit("r", plan.name, 1))  # names the chunk being put
        await put
        win = out._windows["r"]
        assert (win.acked, len(win.sizes), win.in_flight) == (0, 1, encoded.nbytes)
        out.on_credit(Credit("r", plan.name, 1))  # now it counts
        assert (win.acked, len(win.sizes), win.in_flight) == (1, 0, 0)
    finally:
        await out.aclose()


async def test_a_consumer_gone_while_a_first_put_is_under_way_is_sent_nothing_more() -> None:
    """The consumer of a request dies while the producer's first put for it is still under
    way (shm waiting for room): its window closes all the same, so the next send drops its
    chunk as unread instead of waiting for the dead consumer's credit for good. (The window
    learned its consumer only once the put was done, too late.)"""
    s = spec(
        {"flood": ":Flood", "drain": ":Drain"}, [("flood", "drain")], transport="shm", window=1
    )
    plan = build_plan(s).stages["flood"].outputs["drain"]
    out = OutputChannel(plan, host="h", endpoint="producer", send=lambda _, run: None)
    room = asyncio.Event()
    shm = out._senders["shm"]

    class WaitsForRoom:
        """The shm sender, its put waiting until the test makes room."""

        async def put(self, *args: Any, **kwargs: Any) -> Any:
            await room.wait()
            return await shm.put(*args, **kwargs)

    out._senders["shm"] = WaitsForRoom()  # type: ignore[assignment]
    target = SendTarget("consumer", "h")
    try:
        first = asyncio.ensure_future(out.send("r", out.codec.encode(Blob(0, b"x")), False, target))
        await wait_for(lambda: out._windows.get("r") is not None, 5, interval=0)
        out.readers_gone({"consumer"})
        room.set()
        await asyncio.wait_for(first, 5)
        unread = out.unread
        await asyncio.wait_for(out.send("r", out.codec.encode(Blob(1, b"y")), False, target), 5)
        assert out.unread == unread + 1
    finally:
        room.set()
        out._senders["shm"] = shm
        await out.aclose()


async def test_a_read_cancelled_while_its_payload_is_fetched_loses_nothing() -> None:
    """A handler reading with its own timeout may be cancelled while a payload is fetched
    from a transport: the next read returns that very chunk, and the rest follow in order.
    (The chunk used to be dropped, and the stream went on with the one after it.)"""
    wire = _Wire(_plan(8, 1 << 20, transport="shm"))
    try:
        await wire.produce([100, 100, 100])
        wire.deliver()
        stream = Stream(
            functools.partial(wire.inp.next, wire.inflow),
            functools.partial(wire.inp.poll, wire.inflow),
        )
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert not reading.done()  # suspended in chunk 0's fetch (shm attaches in a thread)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert [blob.seq async for blob in stream] == [0, 1, 2]
    finally:
        await wire.out.aclose()
        await wire.inp.aclose()


async def test_an_envelope_delivered_twice_leaves_the_original_readable() -> None:
    """A run that arrives a second time while its chunks wait unread is refused, and the
    payloads the chunks name stay theirs: each chunk still reads whole, once, in order."""
    wire = _Wire(_plan(16, 1 << 30, transport="shm"))
    try:
        await wire.produce([1000, 1000, 1000])
        frames = [encode_batch([run.seal()]) for run in wire.runs]
        wire.runs.clear()
        for _ in range(2):
            for frame in frames:
                for run in decode_batch(frame):
                    assert isinstance(run, Chunks)
                    file_run(wire.inflow, run, wire.inp.admit(run))
        async with asyncio.timeout(5):
            # Releases run as background tasks: wait until any the repeat started is done.
            while channel_module._background:  # noqa: ASYNC110
                await asyncio.sleep(0)
        assert wire.inflow.buffer.duplicates == 4  # three chunks and the end, again
        assert [(await wire.inp.next(wire.inflow)).seq for _ in range(3)] == [0, 1, 2]
    finally:
        await wire.out.aclose()
        await wire.inp.aclose()


async def test_a_request_ending_mid_fetch_ends_the_read_and_frees_the_payload() -> None:
    """A request that ends (aborted, timed out) while its reader waits for a fetch from a
    transport: the reader gets the request's error, not a CancelledError nobody asked for,
    and the payload is released even though the fetch had not started."""
    wire = _Wire(_plan(8, 1 << 20, transport="shm"))
    try:
        await wire.produce([100])
        wire.deliver()
        reading = asyncio.ensure_future(wire.inp.next(wire.inflow))
        await asyncio.sleep(0)  # the read has queued the fetch, which has not run yet
        assert not reading.done()
        wire.inflow.end(RequestAborted("r", "the request failed elsewhere"))
        with pytest.raises(RequestAborted, match="failed elsewhere"):
            await reading
        shm = wire.out._senders["shm"]
        # The release travels through the segment's own words: poll for it.
        await wait_for(lambda: not shm.statistics().held, 5)
    finally:
        await wire.out.aclose()
        await wire.inp.aclose()


@pytest.mark.parametrize("transport", ["inline", "shm"])
async def test_an_edge_is_drained_once_every_payload_is_got_its_end_unread(
    transport: str,
) -> None:
    """What a consumer reports drained (see ``StageActor.take_reports``): inline, every
    chunk arrived; by shm, every payload got from the transport too, a repeat of one
    counting once. The stream's end marker carries none and need not be read: a handler
    that takes a known count of chunks and works on still lets its producer go."""
    wire = _Wire(_plan(16, 1 << 30, transport=transport))
    told: list[str] = []
    wire.inp.on_got_all = told.append
    try:
        await wire.produce([100, 100, 100])
        frames = [encode_batch([run.seal()]) for run in wire.runs]
        wire.runs.clear()
        for frame in [*frames, frames[0]]:  # the first run again, as a duplicate
            for run in decode_batch(frame):
                assert isinstance(run, Chunks)
                file_run(wire.inflow, run, wire.inp.admit(run))
        assert wire.inflow.buffer.complete
        assert wire.inflow.drained is (transport == "inline")
        for seq in range(3):
            assert not told
            assert (await wire.inp.next(wire.inflow)).seq == seq
        assert wire.inflow.drained
        assert told == ([] if transport == "inline" else ["r"])
        with pytest.raises(EndOfChannel):
            await wire.inp.next(wire.inflow)
        assert told == ([] if transport == "inline" else ["r"])
    finally:
        await wire.out.aclose()
        await wire.inp.aclose()


async def test_a_run_never_outgrows_a_data_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks queued for one batch join one run (one envelope) only while their payloads
    stay within MAX_INLINE: a run of large inline chunks made one envelope larger than a
    receiver takes, which dropped the link with every envelope queued on it."""
    monkeypatch.setattr(channel_module, "MAX_INLINE", 10_000)
    wire = _Wire(_plan(window=64, window_bytes=1 << 20))
    await wire.produce([4000, 4000, 4000])
    assert [len(run.descriptors) for run in wire.runs] == [2, 2]  # the end joins the second
    assert await wire.consume() == 3


async def test_requests_noted_as_queued_are_forgotten_once_released_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer notes whose consumer each queued payload in its shm arena waits for; the
    notes of requests aborted before their consumer read them stayed until a full queued
    share pruned them, however many there were."""
    monkeypatch.setattr(channel_module, "QUEUED_READERS_PRUNE", 3)
    wire = _Wire(_plan(window=8, window_bytes=1 << 20, transport="shm"))
    try:
        for i in range(10):
            rid = f"r{i}"
            wire.inflow = wire.inp.open(rid)
            await wire.out.send(rid, wire.out.codec.encode(Blob(0, b"x" * 1000)), True, wire.target)
            wire.deliver()
            # Aborted at its consumer before it was read: its payload is released unread.
            wire.inflow.end(RequestAborted(rid, "aborted"))
            wire.out.forget(rid)
            await wait_for(lambda: not wire.out.statistics()["transports"]["shm"]["held"])
        assert len(wire.out._queued_readers) <= 4, wire.out._queued_readers
    finally:
        await wire.inp.aclose()
        await wire.out.aclose()


async def test_a_chunk_taken_on_its_arrival_is_the_next_one_read() -> None:
    """A handler waiting for a stream's first chunk without its slot takes the chunk as it
    arrives (``arrival``) and reads it once it has a slot again; a read cancelled between
    the two leaves it taken. The next read, by ``poll`` as by ``next``, must return that
    chunk, not the one after it."""
    wire = _Wire(_plan(window=8, window_bytes=1_000_000))
    waiting = asyncio.ensure_future(wire.inp.arrival(wire.inflow))
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing came yet
    await wire.produce([10, 20, 30])
    wire.deliver()
    await waiting
    assert wire.inp.poll(wire.inflow) is NOT_READY
    assert (await wire.inp.next(wire.inflow)).seq == 0
    assert wire.inp.poll(wire.inflow).seq == 1
    await wire.inp.arrival(wire.inflow)
    assert wire.inp.poll(wire.inflow) is NOT_READY
    assert (await wire.inp.next(wire.inflow)).seq == 2
    with pytest.raises(EndOfChannel):
        await wire.inp.next(wire.inflow)


async def test_a_send_held_back_by_the_queued_share_goes_before_newcomers() -> None:
    """First chunks of requests whose consumer has not begun reading them wait while the
    queued share of the producer's shm arena is full. When it had room again, the first
    send to run took it: a newcomer that had not waited went ahead of one that had, and
    under a steady load one request waited a minute and more (the tight-arena soak). The
    sends that waited now go first, in the order they began waiting."""
    s = spec(
        {"flood": ":Flood", "drain": ":Drain"},
        [("flood", "drain")],
        window=8,
        window_bytes=1 << 20,
        transport={"kind": "shm", "options": {"capacity": "1MiB"}},
    )
    plan = build_plan(s).stages["flood"].outputs["drain"]
    out = OutputChannel(plan, host="h", endpoint="producer", send=lambda _, run: None)
    target = SendTarget("consumer", "h")
    encoded = out.codec.encode(Blob(0, bytes(300_000)))  # one fills the 256 KiB share

    async def settle() -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    try:
        await out.send("first", encoded, True, target)  # queued: the share is full now
        waiting = asyncio.ensure_future(out.send("waiting", encoded, True, target))
        await settle()
        assert not waiting.done() and out.queued_waits == 1
        where = out.describe("waiting")
        assert where is not None and where["waiting_queued"] and not where["waiting_credit"]
        # A newcomer's send runs first, then the consumer begins reading the queued
        # request, which frees the share, in the same turn of the loop.
        newcomer = asyncio.ensure_future(out.send("newcomer", encoded, True, target))
        out.on_credit(Credit("first", plan.name, 1))
        await settle()
        assert waiting.done(), "the send that waited lost its turn to a newcomer"
        await waiting
        assert not newcomer.done()  # its turn comes once the consumer reads the other
        out.on_credit(Credit("waiting", plan.name, 1))
        await asyncio.wait_for(newcomer, 5)
        assert out.queued_waits == 2
    finally:
        await out.aclose()
