"""Requests whose readers stopped must not starve the others of a shared shm arena.

A chunk waits in its consumer's reorder buffer, holding its extent of the producer's
arena, until the request's handler takes it. A handler that reads no more for a while (its
client stopped reading, it waits to send elsewhere) kept its whole window there, and a few
such requests could hold the whole arena: a request being read then waited for room for
its ``full_timeout`` and failed. Now a producer short of room asks its consumers to copy
out what they hold unread (``Spill``), and the room comes back at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline import Pipeline
from pipeline import _channel as channel_module
from pipeline._channel import COPIED, Inflow, file_run
from pipeline._errors import EndOfChannel
from pipeline._messages import Chunks, Credit, Spill, decode_batch, encode_batch
from pipeline._report import edge_rows
from pipeline._signature import EdgePlan, build_plan
from tests.pipeline.conftest import spec, wait_for
from tests.pipeline.sample_stages import Blob, Text, numbered
from tests.pipeline.test_byte_window import _Wire as _OneRequestWire

#: One chunk's payload: three fill most of a 1 MiB arena.
SIZE = 300_000


def _plan(**transport: Any) -> EdgePlan:
    s = spec(
        {"flood": ":Flood", "drain": ":Drain"},
        [("flood", "drain")],
        window=64,
        window_bytes=1 << 30,
        transport={"kind": "shm", "options": {"capacity": "1MiB"}, **transport},
    )
    return build_plan(s).stages["flood"].outputs["drain"]


class _Wire(_OneRequestWire):
    """Both ends of one edge in this process, and the messages between them, for several
    requests: runs and ``Spill`` to the consumer, credit to the producer, each through
    its encoding."""

    def __init__(self, plan: EdgePlan) -> None:
        super().__init__(plan)
        self.inflows: dict[str, Inflow] = {"r": self.inflow}

    def open(self, request_id: str) -> Inflow:
        if request_id not in self.inflows:
            self.inflows[request_id] = self.inp.open(request_id)
        return self.inflows[request_id]

    def deliver(self) -> None:
        while self.runs:
            message = self.runs.pop(0)
            frame = message if isinstance(message, bytes) else message.seal()
            (msg,) = decode_batch(encode_batch([frame]))
            if isinstance(msg, Spill):
                self.inp.spill(msg.transport)
            else:
                assert isinstance(msg, Chunks)
                file_run(self.inflows[msg.request_id], msg, self.inp.admit(msg))
        while self.credits:
            (credit,) = decode_batch(encode_batch([self.credits.pop(0)]))
            assert isinstance(credit, Credit)
            self.out.on_credit(credit)

    async def send(self, request_id: str, seq: int, final: bool = False) -> None:
        """Send chunk ``seq``, delivering what travels meanwhile (a put may wait for room)."""
        blob = Blob(seq, numbered(seq, SIZE))
        sending = asyncio.ensure_future(
            self.out.send(request_id, self.out.codec.encode(blob), final, self.target)
        )
        while not sending.done():
            self.deliver()
            # The put may wait for room, which the messages delivered here make.
            await asyncio.wait([sending], timeout=0.001)
        await sending
        self.deliver()

    async def read(self, request_id: str) -> int:
        """Read a request's next chunk (its first: its producer then knows it is read)."""
        blob = await self.inp.next(self.inflows[request_id])
        self.deliver()
        assert blob.data == numbered(blob.seq, SIZE), f"chunk {blob.seq} is corrupt"
        return int(blob.seq)

    async def read_all(self, request_id: str) -> list[int]:
        """Read a request's stream to its end, checking every payload's bytes."""
        seqs = []
        while True:
            try:
                blob = await self.inp.next(self.inflows[request_id])
            except EndOfChannel:
                return seqs
            assert blob.data == numbered(blob.seq, SIZE), f"chunk {blob.seq} is corrupt"
            seqs.append(blob.seq)
            self.deliver()

    async def aclose(self) -> None:
        await self.inp.aclose()
        await self.out.aclose()


async def test_what_a_stopped_reader_holds_is_copied_out_when_the_producer_runs_short() -> None:
    """A request's reader takes its first chunk and stops; three more fill the arena. The
    next request's put found no room until the first request ended (here: its
    full_timeout, 5 s, then failed with TransportFull). Now the consumer copies the three
    out and releases them, the put goes on at once, and the stopped request still reads
    every chunk intact, in order."""
    wire = _Wire(_plan(full_timeout="5s"))
    try:
        wire.open("stopped")
        wire.open("read")
        await wire.send("stopped", 0)
        assert await wire.read("stopped") == 0
        for seq in range(1, 4):
            await wire.send("stopped", seq, final=seq == 3)
        shm = wire.out._senders["shm"]
        assert shm.statistics().held == 3
        await asyncio.wait_for(wire.send("read", 0, final=True), 4)
        assert wire.out.spill_asks >= 1
        await wait_for(lambda: wire.inp.spilled == 3)
        assert wire.inp.spilled_bytes > 3 * SIZE
        assert await wire.read_all("read") == [0]
        assert all(item[0] == COPIED for _, item in wire.inflows["stopped"].buffer.items())
        assert await wire.read_all("stopped") == [1, 2, 3]
        await wait_for(lambda: not shm.statistics().held)
    finally:
        await wire.aclose()


async def test_a_copied_out_request_is_drained_and_its_repeats_free_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copied out, a request's payloads need their producer no more: the consumer says it
    holds them all (what lets a producer go) before its handler reads them. A repeat of a
    copied chunk's envelope is refused, and releasing it frees no other payload."""
    monkeypatch.setattr(channel_module, "SPILL_STALL_S", 0.0)
    wire = _Wire(_plan())
    told: list[str] = []
    wire.inp.on_got_all = told.append
    try:
        inflow = wire.open("stopped")
        await wire.send("stopped", 0)
        assert await wire.read("stopped") == 0
        await wire.send("stopped", 1)
        repeat = wire.out._windows["stopped"].run
        await wire.send("stopped", 2, final=True)
        assert not inflow.drained
        wire.inp.spill("shm")
        await wait_for(lambda: wire.inp.spilled == 2)
        assert inflow.drained and told == ["stopped"]
        assert repeat is not None
        (again,) = decode_batch(encode_batch([repeat.seal()]))
        assert isinstance(again, Chunks)
        assert file_run(inflow, again, wire.inp.admit(again)) == 1
        wire.open("next")
        await wire.send("next", 0, final=True)
        assert await wire.read_all("next") == [0]
        assert await wire.read_all("stopped") == [1, 2]
    finally:
        await wire.aclose()


async def test_a_chunk_taken_while_it_is_copied_is_read_once_and_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copying out yields between payloads: a handler may take the very chunk
    meanwhile and fetch it itself. The copy is dropped, the chunk read once, and its
    extent released by the handler's fetch, not before it."""
    monkeypatch.setattr(channel_module, "SPILL_STALL_S", 0.0)
    wire = _Wire(_plan())
    try:
        inflow = wire.open("r")
        await wire.send("r", 0)
        assert await wire.read("r") == 0
        await wire.send("r", 1, final=True)
        wire.inp.spill("shm")
        await asyncio.sleep(0)  # the copy is made: the copying yields before it swaps
        assert wire.inp._spilling is not None and not wire.inp._spilling.done()
        assert await wire.read("r") == 1
        with pytest.raises(EndOfChannel):
            await wire.inp.next(inflow)
        await wire.inp._spilling
        assert wire.inp.spilled == 0
        shm = wire.out._senders["shm"]
        await wait_for(lambda: not shm.statistics().held)
    finally:
        await wire.aclose()


@pytest.mark.parametrize("reader", ["queued", "reading on"])
async def test_requests_not_stopped_keep_their_extents(
    reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a request whose reader stopped is copied out. One not yet read (queued behind
    the consumer's max_concurrency) stays in the arena, where the queued share bounds it:
    copied out, it let more queued chunks in, each copied in turn, and the consumer's
    memory grew with the queue. One whose reader took a chunk within SPILL_STALL_S reads
    on and frees its extents itself: a single stream through an arena smaller than its
    window had most of its chunks copied. Payloads of another transport stay too."""
    if reader == "queued":
        monkeypatch.setattr(channel_module, "SPILL_STALL_S", 0.0)
    wire = _Wire(_plan())
    try:
        wire.open("r")
        if reader == "reading on":
            await wire.send("r", 0)
            assert await wire.read("r") == 0
        await wire.send("r", 1, final=True)
        for _ in range(3):  # asked again and again, within SPILL_STALL_S
            wire.inp.spill("shm")
            wire.inp.spill("network")  # not a transport of this edge: nothing to do
            assert wire.inp._spilling is not None
            await wire.inp._spilling
        assert wire.inp.spilled == 0
        assert wire.out._senders["shm"].statistics().held == 1
        assert await wire.read_all("r") == [1]
    finally:
        await wire.aclose()


async def test_a_reader_is_stopped_once_it_took_nothing_for_a_while() -> None:
    """A reader that took a chunk since the last look reads on, however slowly: copying
    its chunks would cost memory and time for room it frees itself."""
    wire = _Wire(_plan())
    try:
        inflow = wire.open("r")
        assert not inflow.stalled(10.0, 0.1)  # the first look starts the count
        assert not inflow.stalled(10.05, 0.1)
        assert inflow.stalled(10.25, 0.1)
        inflow.taken += 1
        assert not inflow.stalled(10.5, 0.1)
        assert inflow.stalled(10.75, 0.1)
    finally:
        await wire.aclose()


async def test_clients_that_stopped_reading_do_not_starve_a_request_being_read() -> None:
    """Real processes, the edge between the stages pinned to shm with a 2 MiB arena. Two
    clients read one chunk of their streams and stop: the stage between waits to send to
    them, and the window of a stream it holds unread is more than the arena. Their
    producer, then a third request, must still stream through (each waited for room until
    its full_timeout, then failed), and the two then read on to their ends, every chunk
    intact and in order."""
    s = spec(
        {"numbered": {"impl": ":Numbered", "params": {"size": SIZE}}, "pass": ":PassBlobs"},
        [("numbered", "pass")],
        window=16,
        chunk_timeout="5s",
        transport={"kind": "shm", "options": {"capacity": "2MiB"}},
    )
    async with Pipeline(s) as pipe:

        async def spilled() -> bool:
            stats = await pipe.statistics()
            (inp,) = (i for r in stats["replicas"] if r["stage"] == "pass" for i in r["inputs"])
            return bool(inp["spilled"])

        stopped = []
        for _ in range(2):
            stream = pipe.stream(Text("40")).__aiter__()
            assert (await stream.__anext__()).seq == 0
            stopped.append(stream)
        # What the stage between holds of them unread (a window of 16 chunks of 300 kB
        # each, at least for the second) is more than the arena: their own producer runs
        # short, and has it copied out. It waited for room until its full_timeout.
        await wait_for(spilled, 30)
        got = [blob.seq async for blob in pipe.stream(Text("30"))]
        assert got == list(range(30))
        for stream in stopped:
            rest = []
            async for blob in stream:
                assert blob.data == numbered(blob.seq, SIZE), f"chunk {blob.seq} is corrupt"
                rest.append(blob.seq)
            assert rest == list(range(1, 40))
        stats = await pipe.statistics()
    edge = "numbered->pass"
    (between,) = (r for r in stats["replicas"] if r["stage"] == "pass")
    # The stage between copied out what its stopped streams held, and the run's edge
    # table says so.
    spilled = sum(i["spilled"] for i in between["inputs"])
    assert spilled > 0, between["inputs"]
    (row,) = (r for r in edge_rows(stats["replicas"], stats["client"]) if r["edge"] == edge)
    assert row["used"].endswith(f"({spilled} spilled)"), row
