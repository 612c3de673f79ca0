"""The heartbeat thread: its beats, and its answers to the master's ReportAsk."""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import threading
import time
import types
from collections import deque
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from pipeline import _master
from pipeline._master import Master, _Replica
from pipeline._messages import Heartbeat, ReportAsk, encode_message
from pipeline._orchestrator import InDoubt
from pipeline._pulse import Pulse
from pipeline._signature import build_plan
from tests.pipeline.conftest import spec, wait_for
from tests.procs import free_port

_beat = msgspec.msgpack.Decoder(Heartbeat).decode


class Reports:
    """A replica's report queue, as the actor keeps it: the loop appends, the heartbeat
    thread takes at most ``per_beat`` at a time."""

    def __init__(self, per_beat: int) -> None:
        self.queue: deque[str] = deque()
        self.per_beat = per_beat
        self.lock = threading.Lock()
        #: Cleared: the next take waits for it, setting ``held`` (the thread is held there).
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()

    def inflight(self) -> int:
        return 0

    def take_reports(self) -> tuple[list[str], list[tuple[str, str]]]:
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait()
        with self.lock:
            n = min(len(self.queue), self.per_beat)
            return [self.queue.popleft() for _ in range(n)], []

    def reports_left(self) -> int:
        return len(self.queue)

    def stalled(self) -> float:
        return 0.0


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(0)
        ctx.term()


def _beats(sock: zmq.Socket[bytes], until: float) -> Iterator[Heartbeat]:
    while time.monotonic() < until:
        if sock.poll(50):
            yield _beat(sock.recv_multipart()[1])


def test_an_ask_is_answered_at_once_with_every_report_queued(
    router: tuple[zmq.Socket[bytes], str],
) -> None:
    """With beats and reports due a minute and an hour away, an ask is answered at once:
    every report queued when it came goes, over as many beats as the per-beat bound takes,
    the last one carrying the ask's token; asks sent back to back are answered by the
    latest's token, which covers the earlier ones."""
    sock, endpoint = router
    reports = Reports(per_beat=3)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pulse = Pulse(ctx, endpoint, b"w", "c", 0, 60.0, reports, 3600.0)
    pulse.start()
    try:
        identity, first = sock.recv_multipart()  # the first beat, due at once
        assert identity == b"w/hb" and _beat(first).answers == 0
        reports.queue.extend(f"r{i}" for i in range(7))
        sock.send_multipart([identity, encode_message(ReportAsk(4))])
        told: list[str] = []
        for beat in _beats(sock, time.monotonic() + 10):
            told += beat.ended
            if beat.answers:
                assert beat.answers == 4
                break
        assert told == [f"r{i}" for i in range(7)]
        sock.send_multipart([identity, encode_message(ReportAsk(5))])
        sock.send_multipart([identity, encode_message(ReportAsk(6))])
        answered = next(b.answers for b in _beats(sock, time.monotonic() + 10) if b.answers)
        assert answered in (5, 6)
        if answered == 5:  # the thread woke between the two asks: the next beat answers 6
            assert next(b.answers for b in _beats(sock, time.monotonic() + 10) if b.answers) == 6
        # Anything but an ask is dropped and counted; the asks after it are answered.
        sock.send_multipart([identity, b"\x93garbage"])
        sock.send_multipart([identity, encode_message(ReportAsk(7))])
        assert next(b.answers for b in _beats(sock, time.monotonic() + 10) if b.answers) == 7
        assert pulse.garbage == 1
    finally:
        pulse.stop()
        pulse.stop()  # idempotent
        ctx.term()


def test_an_idle_replica_beats_once_per_interval(router: tuple[zmq.Socket[bytes], str]) -> None:
    """With reports due an hour away, an idle replica still beats every interval, even one
    that is not a whole number of milliseconds. (The thread polled for the interval cut to
    whole milliseconds, woke just before the beat was due, sent nothing, and polled a whole
    interval more: it beat every other interval, which a heartbeat timeout under twice the
    interval took for death.)"""
    sock, endpoint = router
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    interval = 0.1015
    pulse = Pulse(ctx, endpoint, b"w", "c", 0, interval, Reports(per_beat=8), 3600.0)
    pulse.start()
    try:
        arrivals = []
        for _ in _beats(sock, time.monotonic() + 30):
            arrivals.append(time.monotonic())
            if len(arrivals) == 11:
                break
        gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
        assert len(gaps) == 10 and gaps[len(gaps) // 2] < 1.5 * interval, gaps
    finally:
        pulse.stop()
        ctx.term()


async def test_one_answer_settles_every_earlier_ask_of_that_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two producers of one consumer die at once: the master asks that consumer twice, and
    its heartbeat thread answers the later ask once. That answer settles both asks, so
    neither waits for its timer (an hour here)."""
    monkeypatch.setattr(_master, "ASK_WAIT_S", 3600.0)
    plan = build_plan(
        spec(
            {"pre": ":Pre", "encode": ":Encode", "prefill": ":Prefill"},
            [("pre", "encode"), ("pre", "prefill"), ("encode", "prefill")],
            heartbeat_interval="60s",
            heartbeat_timeout="120s",
        )
    )
    master = Master(plan)
    await master.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rep = _Replica("prefill", 0, b"w", "h", 1, "tcp://127.0.0.1:9", 0.0, ready=True)
    master.replicas[("prefill", 0)] = rep
    reports = Reports(per_beat=8)
    pulse = Pulse(ctx, master.endpoint, b"w", "prefill", 0, 60.0, reports, 3600.0)
    pulse.start()
    try:
        await wait_for(lambda: rep.last_seen > 0, timeout=10)  # its first beat came
        # Hold the thread while both asks come, so that it reads them together (as it may
        # when two deaths are declared at once): an ask of no death wakes it into the hold.
        reports.gate.clear()
        assert master._send(b"w/hb", ReportAsk(next(master._tokens)))
        await asyncio.to_thread(reports.held.wait, 10)
        assert reports.held.is_set()
        for stage in ("pre", "encode"):
            doubt = InDoubt(stage, 0, "exited with code -9")
            doubt.asks.add(("prefill", 0))
            master._ask_consumers(doubt)
        assert len(master._asks) == 2
        reports.gate.set()
        await wait_for(lambda: not master._asks, timeout=10)
    finally:
        reports.gate.set()
        pulse.stop()
        await master.aclose()
        ctx.term()


async def test_a_worker_whose_loop_is_held_again_and_again_still_finds_its_master_gone() -> None:
    """Held by a handler for over a second at a time, again and again, a worker's loop
    comes late to every round of its watch on the master. It took each late round for a
    process pause and timed the master's silence afresh: a master gone for good went
    unnoticed. A pause is what the heartbeat thread finds (the process spent no CPU
    meanwhile); here there is none, so the master is lost within a few holds."""
    from pipeline._worker import EXIT_MASTER_LOST, _Worker

    read, write = os.pipe()
    try:
        worker = types.SimpleNamespace(
            actor=types.SimpleNamespace(sweep=lambda now: None),
            last_seen=time.monotonic(),  # heard now, then never again
            stop=asyncio.Event(),
            control_reader=types.SimpleNamespace(drain_now=lambda: None),
            parent=0,  # started by hand: a silent master is lost
            stage="s",
            replica=0,
            pulse=None,
        )

        async def hold_again_and_again() -> None:
            while True:
                await asyncio.sleep(0)
                select.select([read], [], [], 1.3)  # holds the loop: nothing is written

        holder = asyncio.ensure_future(hold_again_and_again())
        try:
            watch = _Worker._watch_master(worker, 0.1, 1.5)  # type: ignore[arg-type]
            assert await asyncio.wait_for(watch, 30) == EXIT_MASTER_LOST
        finally:
            holder.cancel()
    finally:
        os.close(read)
        os.close(write)


async def test_reports_whose_beats_could_not_leave_go_with_the_next_beat_that_does() -> None:
    """While the master is unreachable, a few beats queue and the next ones cannot leave.
    The reports they carried were lost, and a request a consumer had had every payload of
    could fail when its producer died; they now go with the first beat that leaves."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    reports = Reports(per_beat=1)
    reports.queue.extend(f"r{i}" for i in range(12))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pulse = Pulse(ctx, endpoint, b"w", "c", 0, 0.05, reports, 0.05)
    pulse.start()
    master = ctx.socket(zmq.ROUTER)
    master.setsockopt(zmq.LINGER, 0)
    try:
        # Nothing listens: four beats queue (its high-water mark), the rest cannot leave.
        await wait_for(lambda: not reports.queue, 10)
        master.bind(endpoint)
        told: list[str] = []
        for beat in _beats(master, time.monotonic() + 10):
            told += beat.ended
            if len(told) >= 12:
                break
        assert sorted(told, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(12)]
    finally:
        pulse.stop()
        master.close(0)
        ctx.term()
