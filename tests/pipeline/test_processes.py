"""Process lifecycle: clean shutdown, Ctrl-C, kill -9, and garbage on sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq

from pipeline import Pipeline, PipelineError, PipelineSpec, StageUnavailable
from pipeline._config import MasterSpec
from pipeline._cpu_idle import PM_QOS_PATH, hold_cpu_idle
from pipeline._orchestrator import Orchestrator
from stages.text import Text
from tests.pipeline.conftest import spec, told, wait_for
from tests.procs import alive, children, wait_exited
from transports._shm_segment import PREFIX, list_segments


async def _gone(pids: list[int], timeout: float = 10.0) -> None:
    async def probe() -> bool:
        return not any(alive(p) for p in pids)

    await wait_for(probe, timeout=timeout)


def _lingering(
    tmp_path: Path, sink_impl: str = ":Lingers", **defaults: Any
) -> tuple[Path, PipelineSpec]:
    """src (Tokens) -> sink (Lingers, until told through the FIFO returned), and its spec."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    sink = {"impl": sink_impl, "env": {"LINGER_FIFO": str(fifo)}}
    return fifo, spec({"src": ":Tokens", "sink": sink}, [("src", "sink")], **defaults)


def _write_config(tmp_path: Path, stage: str = "Echo", replicas: int = 1) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(
        "defaults: {heartbeat_interval: 200ms, heartbeat_timeout: 2s}\n"
        "stages:\n"
        f"  echo: {{impl: 'tests.pipeline.sample_stages:{stage}', replicas: {replicas},"
        " max_concurrency: 64}\n"
    )
    return path


async def test_no_process_left_after_exit() -> None:
    """Leaving the async-with stops every worker process."""
    async with Pipeline(spec({"a": ":Echo", "b": ":Echo"}, [("a", "b")])) as pipe:
        pids = list(pipe.worker_pids.values())
        assert len(pids) == 2
        assert await pipe.submit(Text("x")) == Text("x")
    assert not any(alive(p) for p in pids)
    assert not children(os.getpid())


async def test_setup_failure_fails_start_and_leaves_nothing() -> None:
    """A stage whose setup raises makes start fail with its message; no process remains."""
    with pytest.raises(PipelineError, match="weights file is missing"):
        async with Pipeline(spec({"a": ":Echo", "b": ":BrokenSetup"}, [("a", "b")])):
            pytest.fail("started despite a broken stage")
    await _gone(children(os.getpid()))


async def test_a_setup_error_heard_after_its_worker_exited_still_fails_start_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker whose setup raised exits right after it says so, and the master may see
    the exit first. Start-up must still fail with the setup's message, not an exit code.
    (The setup error of a replica already declared dead was ignored.) The race is forced:
    the exit is declared just before the master reads the setup error."""
    from pipeline import _master
    from pipeline._messages import SetupFailed

    on_control = _master.Master._on_control

    def exit_seen_first(self: _master.Master, frames: list[bytes]) -> None:
        msg = _master._decode(frames[1]) if len(frames) == 2 else None
        if isinstance(msg, SetupFailed):
            self.replica_lost(msg.stage, msg.replica, "exited with code 1")
        on_control(self, frames)

    monkeypatch.setattr(_master.Master, "_on_control", exit_seen_first)
    with pytest.raises(PipelineError, match="weights file is missing"):
        async with Pipeline(spec({"a": ":Echo", "b": ":BrokenSetup"}, [("a", "b")])):
            pytest.fail("started despite a broken stage")
    await _gone(children(os.getpid()))


async def test_a_worker_dead_before_registering_fails_start_at_once() -> None:
    """A worker that exits before it registers (here its interpreter cannot start) fails
    start-up as soon as it exits, naming the replica, instead of at startup_timeout."""
    s = spec(
        {"a": ":Echo", "b": {"impl": ":Echo", "env": {"PYTHONHASHSEED": "not-a-seed"}}},
        [("a", "b")],
        startup_timeout="60s",
    )
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage .b. replica 0 .* during start-up"):
        async with Pipeline(s):
            pytest.fail("started despite a worker that cannot start")
    assert time.monotonic() - t0 < 30
    await _gone(children(os.getpid()))


async def test_kill_9_worker_fails_only_its_requests() -> None:
    """kill -9 of one replica fails its in-flight requests; the other replica's complete."""
    s = spec({"echo": {"impl": ":Echo", "replicas": 2}}, [])
    async with Pipeline(s) as pipe:
        tasks = [asyncio.ensure_future(pipe.submit(Text("sleep 1.5"))) for _ in range(10)]

        async def admitted() -> bool:
            return (await pipe.statistics())["client"]["active"] == 10

        await wait_for(admitted)
        victim = pipe.worker_pids[("echo", 0)]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        lost = [r for r in results if isinstance(r, StageUnavailable)]
        ok = [r for r in results if r == Text("sleep 1.5")]
        assert len(lost) + len(ok) == 10, results
        assert len(lost) == 5 and len(ok) == 5
        assert all(r.stage == "echo" and "replica 0" in str(r) for r in lost)
        assert time.monotonic() - t0 < 5
        # New requests go to the surviving replica.
        outs = await asyncio.gather(*(pipe.submit(Text(f"n{i}")) for i in range(10)))
        assert [o.value for o in outs] == [f"n{i}" for i in range(10)]


@pytest.mark.parametrize("transport", ["inline", "shm", "network"])
async def test_a_replica_killed_after_its_part_fails_only_the_requests_still_needing_it(
    tmp_path: Path, transport: str
) -> None:
    """kill -9 of a source replica fails the request it still serves, but not one whose part
    it finished (its handler ended, and the sink said it had every payload: inline, inside
    its envelope; by shm or network, got from the transport) while the sink still works on
    it: that one completes, its shm segment unlinked under the sink's mapping."""
    fifo, s = _lingering(
        tmp_path,
        # What workers report of their requests goes within 0.1 s, beats or not.
        heartbeat_interval="10s",
        heartbeat_timeout="30s",
        transport=transport,
    )
    async with Pipeline(s) as pipe:
        finished = asyncio.ensure_future(pipe.submit(Text("a b c")))
        stalled = asyncio.ensure_future(pipe.submit(Text("x stall")))  # src never ends it
        src = pipe._master_or_fail().orch.replicas["src"][0]

        async def released() -> bool:
            active = (await pipe.statistics())["client"]["active"]
            return active == 2 and len(src.requests) == 1

        try:
            await wait_for(released, timeout=10)
            os.kill(pipe.worker_pids[("src", 0)], signal.SIGKILL)
            with pytest.raises(StageUnavailable, match="src"):
                await stalled
            assert not finished.done()  # the sink holds it until told through the FIFO
        finally:
            told(fifo)
        assert await finished == Text("a b c")


def _reader_at(fifo: Path) -> int | None:
    """A writing end of ``fifo`` if a stage is waiting on it (LINGER_FIFO), else None. The
    stage then waits for a line through it, or its closing."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader yet
        return None


class _Writers:
    """The writing ends of FIFOs that stages wait on (LINGER_FIFO), each kept open from the
    moment its stage waits until closed: the stage then waits for a line."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def waiting(self, fifo: Path) -> bool:
        """Whether a stage waits on ``fifo``."""
        if fifo not in self._fds:
            fd = _reader_at(fifo)
            if fd is not None:
                self._fds[fifo] = fd
        return fifo in self._fds

    def write(self, fifo: Path, line: bytes) -> None:
        os.write(self._fds[fifo], line)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


PLUGIN = "tests.transports.plugin_transport:EchoTransport"
#: Heartbeats and reports due far past a test's end: the master knows of a request's
#: progress only what it asks when a replica dies.
UNREPORTED = {"heartbeat_interval": "60s", "heartbeat_timeout": "120s", "report_interval": "3600s"}


@pytest.mark.parametrize(
    ("transport", "sink"),
    [
        ("inline", ":Lingers"),
        ("shm", ":Lingers"),
        ("network", ":Lingers"),
        ("plugin", ":Lingers"),
        ("shm", ":HoldsLoop"),
    ],
)
async def test_a_replica_killed_before_its_consumer_reported_fails_only_what_it_lacks(
    tmp_path: Path, transport: str, sink: str
) -> None:
    """kill -9 of a source replica just after its sink got every payload of a request, and
    before either could report it (reports and heartbeats due far past the test's end): the
    master asks the sink before failing anything, so that request goes on, and only the
    one the source still serves fails. A sink whose loop its handler holds answers too
    (from its heartbeat thread). Unless the payloads came by a transport that does not
    declare ``survives_producer`` (the plug-in): then both fail."""
    edge: Any = transport
    if transport == "plugin":
        edge = {"kind": PLUGIN, "options": {"directory": str(tmp_path), "capacity": 2**20}}
    fifo, s = _lingering(
        tmp_path,
        sink,
        **UNREPORTED,
        transport=edge,
    )
    writers = _Writers()
    async with Pipeline(s) as pipe:
        finished = asyncio.ensure_future(pipe.submit(Text("a b c")))
        stalled = asyncio.ensure_future(pipe.submit(Text("x stall")))  # src never ends it
        src = pipe._master_or_fail().orch.replicas["src"][0]
        try:
            await wait_for(lambda: writers.waiting(fifo), timeout=10)  # the sink has all
            # Nothing was reported: src is still bound to both requests.
            assert len(src.requests) == 2
            os.kill(pipe.worker_pids[("src", 0)], signal.SIGKILL)
            with pytest.raises(StageUnavailable, match="src"):
                await stalled
            if transport == "plugin":
                with pytest.raises(StageUnavailable, match="src"):
                    await finished
                return
            assert not finished.done()  # the sink holds it until told through the FIFO
            writers.write(fifo, b"go\n")
        finally:
            writers.close()
        assert await finished == Text("a b c")


def _join(tmp_path: Path, **defaults: Any) -> tuple[Path, PipelineSpec]:
    """pre -> encode (GatedEncode, until told through the FIFO returned), pre -> prefill,
    encode -> prefill (a join), and its spec."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    s = spec(
        {
            "pre": ":Pre",
            "encode": {"impl": ":GatedEncode", "env": {"LINGER_FIFO": str(fifo)}},
            "prefill": ":Prefill",
        },
        [("pre", "encode"), ("pre", "prefill"), ("encode", "prefill")],
        **defaults,
    )
    return fifo, s


async def test_a_replica_feeding_a_join_is_done_once_each_consumer_has_its_part(
    tmp_path: Path,
) -> None:
    """pre feeds encode and, beside it, prefill, which joins both. Once encode and prefill
    each have pre's payload, pre is done with the request, though prefill still waits for
    encode's: kill -9 of pre then fails nothing (counted per stage, prefill would not have
    been drained until encode's part came)."""
    fifo, s = _join(tmp_path, heartbeat_interval="10s", heartbeat_timeout="30s")
    async with Pipeline(s) as pipe:
        request = asyncio.ensure_future(pipe.submit(Text("abc")))
        orch = pipe._master_or_fail().orch
        pre = orch.replicas["pre"][0]

        def pre_done() -> bool:
            return len(orch.requests) == 1 and not pre.requests

        try:
            await wait_for(pre_done, timeout=10)
            os.kill(pipe.worker_pids[("pre", 0)], signal.SIGKILL)
            await wait_for(lambda: not orch.replicas["pre"][0].ready, timeout=40)
            assert not request.done()
        finally:
            told(fifo)
        assert await asyncio.wait_for(request, 20) == Text("abc|3")


async def test_a_replica_feeding_a_join_killed_before_any_report_fails_nothing(
    tmp_path: Path,
) -> None:
    """The join of the test above, with reports and heartbeats due far past the test's end:
    pre is killed once encode and prefill each have its payload, before either could say
    so. The master asks both before failing anything, and the request completes."""
    fifo, s = _join(tmp_path, **UNREPORTED)
    writers = _Writers()
    async with Pipeline(s) as pipe:
        request = asyncio.ensure_future(pipe.submit(Text("abc")))
        orch = pipe._master_or_fail().orch

        async def both_have_it() -> bool:
            # encode waits on the FIFO: it has pre's part
            encode_has_it = writers.waiting(fifo)
            stats = await pipe.statistics()
            (prefill,) = (r for r in stats["replicas"] if r["stage"] == "prefill")
            chunks = {i["edge"]: i["chunks"] for i in prefill["inputs"]}
            return encode_has_it and chunks["pre->prefill"] == 1

        try:
            await wait_for(both_have_it, timeout=10)
            assert orch.replicas["pre"][0].requests  # nothing was reported
            os.kill(pipe.worker_pids[("pre", 0)], signal.SIGKILL)
            await wait_for(lambda: not orch.replicas["pre"][0].ready, timeout=10)
            assert not request.done()
            writers.write(fifo, b"go\n")
        finally:
            writers.close()
        assert await asyncio.wait_for(request, 20) == Text("abc|3")


async def test_a_replica_killed_after_its_consumer_stopped_reading_frees_its_producer(
    tmp_path: Path,
) -> None:
    """src streams 300 tokens to 'first' (a window of 4), then one to 'count'. 'first'
    relays one token to s1 and holds its loop; s1 then returns, reading no more, and its
    word that it reads no more sits unread in the held process; src waits for credit
    from 'first'. kill -9 of 'first' (before any report): the request needs nothing more
    from it (s1 has all it reads), and src, told that 'first' is gone, stops sending to it
    and feeds 'count'. The request completes; it used to hang, src waiting for credit from
    the dead process for good."""
    relay_fifo, s1_fifo, mark = tmp_path / "relay", tmp_path / "s1", tmp_path / "holding"
    os.mkfifo(relay_fifo)
    os.mkfifo(s1_fifo)
    relay_env = {"LINGER_FIFO": str(relay_fifo), "HOLD_MARK": str(mark)}
    s = spec(
        {
            "src": ":ToFirstThenCount",
            "first": {"impl": ":RelaysOneThenHolds", "env": relay_env},
            "s1": {"impl": ":FirstWhenTold", "env": {"LINGER_FIFO": str(s1_fifo)}},
            "count": ":Count",
        },
        [("src", "first"), ("src", "count"), ("first", "s1")],
        window=4,
        **UNREPORTED,
    )
    writers = _Writers()

    async with Pipeline(s) as pipe:
        request = asyncio.ensure_future(pipe.submit(Text("300")))
        orch = pipe._master_or_fail().orch
        try:
            await wait_for(lambda: writers.waiting(s1_fifo), timeout=10)  # s1 has the token
            await wait_for(lambda: writers.waiting(relay_fifo), timeout=10)
            writers.write(relay_fifo, b"hold\n")
            await wait_for(mark.exists, timeout=10)  # 'first' holds its loop
            writers.write(s1_fifo, b"go\n")  # s1 returns: it reads no more
            (req,) = orch.requests.values()
            await wait_for(lambda: req.inflows["s1"].buffer.complete, timeout=10)
            os.kill(pipe.worker_pids[("first", 0)], signal.SIGKILL)
            out = await asyncio.wait_for(request, 10)
        finally:
            writers.close()
        assert out == {"s1": Text("t0"), "count": Text("1")}


def _fifo(tmp_path: Path, name: str) -> Path:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    return fifo


def _skipping_join(
    tmp_path: Path, feeding_p: dict[str, Any], edges_to_p: list[tuple[str, str]]
) -> tuple[Path, PipelineSpec]:
    """src -> d, p -> d, d -> c: d (TakesSrcOnly) joins src's text and p's stream and
    returns without reading p; c (EchoWhenTold) holds the result until told through the
    FIFO returned. ``feeding_p`` and ``edges_to_p`` bring p (and what feeds it) from src.
    Reports and heartbeats are due past the test's end."""
    c_fifo = _fifo(tmp_path, "c")
    c = {"impl": ":EchoWhenTold", "env": {"LINGER_FIFO": str(c_fifo)}}
    stages = {"src": ":Echo", **feeding_p, "d": ":TakesSrcOnly", "c": c}
    edges = [("src", "d"), *edges_to_p, ("p", "d"), ("d", "c")]
    return c_fifo, spec(stages, edges, **UNREPORTED)


@pytest.mark.parametrize("then_kill", [(), ("p", "src")], ids=["", "then-its-producers"])
async def test_a_producer_that_first_sends_after_its_consumer_died_sends_it_nothing(
    tmp_path: Path, then_kill: tuple[str, ...]
) -> None:
    """d joins src's text and p's stream, and returns without reading p; c works on what
    d returned. d is killed (and not restarted) before p sends anything: the request needs
    nothing more of d, so it goes on; p, which learns that d is gone before it first sends
    to it, ends its handler (its only consumer is gone) instead of failing the request for
    want of d. Nor does it then need p or src: killing both fails nothing (what they sent
    to d, and p to d, counted as got once d went)."""
    p_fifo = _fifo(tmp_path, "p")
    c_fifo, s = _skipping_join(
        tmp_path,
        {"p": {"impl": ":TokensWhenTold", "env": {"LINGER_FIFO": str(p_fifo)}}},
        [("src", "p")],
    )
    writers = _Writers()

    async with Pipeline(s) as pipe:
        assert pipe._launcher is not None
        pipe._launcher._max_restarts = 0
        request = asyncio.ensure_future(pipe.submit(Text("a b c")))
        orch = pipe._master_or_fail().orch
        try:
            await wait_for(lambda: writers.waiting(c_fifo) and writers.waiting(p_fifo), timeout=10)
            for victim in ("d", *then_kill):
                os.kill(pipe.worker_pids[(victim, 0)], signal.SIGKILL)
                await wait_for(lambda v=victim: not orch.replicas[v][0].requests, timeout=10)
                assert not request.done()
                # Every live worker has the peer table without it (sent to each before this).
                await pipe.statistics()
            if not then_kill:
                writers.write(p_fifo, b"go\n")
            writers.write(c_fifo, b"go\n")
            out = await asyncio.wait_for(request, 10)
        finally:
            writers.close()
        assert out == Text("a b c")
        if not then_kill:
            stats = await pipe.statistics()
            (p,) = (r for r in stats["replicas"] if r["stage"] == "p")
            (to_d,) = p["outputs"]
            # p's handler ended as soon as it learned that d, its only consumer, was gone.
            assert (p["unread_ended"], p["failed"], to_d["chunks"]) == (1, 0, 0), p


@pytest.mark.parametrize("restart", [False, True], ids=["gone", "restarted"])
async def test_a_producer_that_gets_a_request_after_its_consumer_died_sends_it_nothing(
    tmp_path: Path, restart: bool
) -> None:
    """As above, but p gets the request (through q, held) only after d died and the master
    kept the request: told by the master that the request goes on without d, p sends d
    nothing: no failure for want of d, and no Admit to a restarted d, which would start a
    handler there waiting for an input that never comes."""
    q_fifo = _fifo(tmp_path, "q")
    c_fifo, s = _skipping_join(
        tmp_path,
        {"q": {"impl": ":EchoWhenTold", "env": {"LINGER_FIFO": str(q_fifo)}}, "p": ":Tokens"},
        [("src", "q"), ("q", "p")],
    )
    writers = _Writers()
    async with Pipeline(s) as pipe:
        assert pipe._launcher is not None
        if not restart:
            pipe._launcher._max_restarts = 0
        request = asyncio.ensure_future(pipe.submit(Text("a b c")))
        orch = pipe._master_or_fail().orch
        try:
            await wait_for(lambda: writers.waiting(c_fifo) and writers.waiting(q_fifo), timeout=10)
            os.kill(pipe.worker_pids[("d", 0)], signal.SIGKILL)
            await wait_for(lambda: not orch.replicas["d"][0].requests, timeout=10)
            if restart:
                await wait_for(lambda: orch.replicas["d"][0].ready, timeout=30)
            await pipe.statistics()  # p has the latest peer table, and the master's word
            writers.write(q_fifo, b"go\n")

            async def p_done() -> bool:
                stats = await pipe.statistics()
                p = next(r for r in stats["replicas"] if r["stage"] == "p")
                return bool(p["started"] == 1 and p["active"] == 0)

            await wait_for(p_done, timeout=10)
            writers.write(c_fifo, b"go\n")
            out = await asyncio.wait_for(request, 10)
        finally:
            writers.close()
        assert out == Text("a b c")
        stats = await pipe.statistics()
        (to_d,) = next(r for r in stats["replicas"] if r["stage"] == "p")["outputs"]
        assert to_d["chunks"] == 0, to_d
        if restart:
            successor = next(r for r in stats["replicas"] if r["stage"] == "d")
            assert successor["started"] == 0, successor


async def test_a_replica_whose_output_its_consumer_has_not_had_is_not_done_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer's handler ended, but its consumer (stopped here, as a congested host would
    be) has not had the request's input arrive: the chunk may still be in the producer's own
    socket queue (ZMQ, as between hosts), so the producer is not done with the request, and
    its death fails it. (Releasing it at the producer's flush left it hanging for ever: the
    frame died with the process, and no stage knew of the request.)"""
    monkeypatch.setenv("STAGEWIRE_LOCAL_LINKS", "0")  # every hop over ZMQ, as across hosts
    s = spec({"src": ":Echo", "sink": ":Echo"}, [("src", "sink")], heartbeat_interval="50ms",
             heartbeat_timeout="30s", transport="inline")  # fmt: skip
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("warm")) == Text("warm")
        orch = pipe._master_or_fail().orch
        sink = pipe.worker_pids[("sink", 0)]
        os.kill(sink, signal.SIGSTOP)
        try:
            request = asyncio.ensure_future(pipe.submit(Text("x" * (8 << 20))))

            def src_ended() -> bool:
                return any("src" in req.ended for req in orch.requests.values())

            await wait_for(src_ended, 20)
            (rid,) = orch.requests
            assert rid in orch.replicas["src"][0].requests  # not done with it
            os.kill(pipe.worker_pids[("src", 0)], signal.SIGKILL)
            with pytest.raises(StageUnavailable, match="src"):
                await asyncio.wait_for(request, 20)
        finally:
            os.kill(sink, signal.SIGCONT)


async def test_outputs_that_cannot_be_read_fail_their_request_at_once(tmp_path: Path) -> None:
    """A run of a live request's outputs whose descriptors cannot be read reaches the
    client: the request fails with a TransportError naming the edge and the sender, not
    with a ChunkGap after the chunk timeout (an hour here)."""
    import msgspec

    from pipeline import TransportError
    from pipeline._messages import Chunks, encode_batch

    fifo, s = _lingering(tmp_path, chunk_timeout="1h")
    async with Pipeline(s) as pipe:
        request = asyncio.ensure_future(pipe.submit(Text("a b")))
        orch = pipe._master_or_fail().orch
        await wait_for(lambda: len(orch.requests) == 1, 10)
        (rid,) = orch.requests
        spoilt = msgspec.Raw(msgspec.msgpack.encode([{"t": "inline", "header": 7}]))
        run = Chunks(rid, "sink->@client", 0, True, "inline", spoilt, "tcp://x:1", "h", 0)
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(pipe._master_or_fail().data_endpoint)
            push.send(encode_batch([msgspec.msgpack.encode(run)]))
            push.close()
            with pytest.raises(TransportError, match=r"sink->@client.*tcp://x:1"):
                await asyncio.wait_for(request, 10)
        finally:
            ctx.term()
            told(fifo)


async def test_garbage_on_sockets_is_dropped_and_counted() -> None:
    """Garbage on a worker's data port and the master's control port is counted, not fatal:
    messages that are not the runtime's, and connections that are not ZMQ at all (which ZMQ
    refuses at the handshake, and which used to go uncounted)."""
    async with Pipeline(spec({"echo": ":Echo"}, [])) as pipe:
        endpoint = pipe.data_endpoints[("echo", 0)]
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(endpoint)
            for frames in ([b"\x00\xff garbage"], [b"a", b"b", b"c"], [b"\x93\xa1c\x01\x02"]):
                push.send_multipart(frames)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 1000)
            dealer.connect(pipe.master_endpoint)
            dealer.send(b"\xc1 not msgpack")
            push.close()
            dealer.close()
        finally:
            ctx.term()
        ports = [e.removeprefix("tcp://").rsplit(":", 1) for e in (endpoint, pipe.master_endpoint)]
        for host, port in ports:
            # ZMQ's signature byte, then no ZMQ: refused at the handshake, no message made.
            with socket.create_connection((host, int(port)), timeout=2) as raw:
                raw.sendall(b"\xff" + b"not a ZMQ greeting " * 8)

        async def counted() -> bool:
            stats = await pipe.statistics()
            return stats["replicas"][0]["garbage"] >= 4 and stats["garbage"] >= 2

        await wait_for(counted)
        for host, port in ports:
            # Taken for an old ZMQ peer's frames: its messages are garbage.
            with socket.create_connection((host, int(port)), timeout=2) as raw:
                raw.sendall(os.urandom(4096))
        assert await pipe.submit(Text("still serving")) == Text("still serving")


def _stagewire(tmp_path: Path, *args: str, sigint_ignored: bool = False) -> subprocess.Popen[bytes]:
    """Start ``stagewire`` in its own session, its stderr (with info logs) to ``tmp_path/err``;
    with ``sigint_ignored``, as a script's background job starts (SIGINT ignored, which
    ``exec`` keeps)."""
    command = [sys.executable, "-m", "pipeline", *args]
    if sigint_ignored:
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    with (tmp_path / "err").open("wb") as err:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env={**os.environ, "STAGEWIRE_LOG_LEVEL": "info"},
        )


def _stop(proc: subprocess.Popen[bytes], workers: list[int]) -> None:
    """Kill the run and its workers if the test left them running: none may outlive it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in workers:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


async def _workers_of(proc: subprocess.Popen[bytes], count: int) -> list[int]:
    async def up() -> bool:
        return len(children(proc.pid)) >= count

    await wait_for(up, timeout=30)
    return children(proc.pid)


@pytest.mark.parametrize(
    ("sig", "code", "said", "sigint_ignored"),
    [
        (signal.SIGINT, 130, "interrupted", False),
        (signal.SIGTERM, 143, "terminated", False),
        (signal.SIGTERM, 143, "terminated", True),
    ],
    ids=["ctrl-c", "sigterm", "sigterm-with-sigint-ignored"],
)
async def test_ctrl_c_stops_run_and_every_worker(
    tmp_path: Path, sig: signal.Signals, code: int, said: str, sigint_ignored: bool
) -> None:
    """SIGINT to the run's process group exits 130 and leaves no worker behind; so does
    SIGTERM to the run's process alone (as a service manager stops it), exiting 143, also
    when SIGINT came ignored (a script's background job), where a first fix of it let
    SIGTERM do nothing at all. (SIGTERM used to kill the run outright, leaving its workers
    to the kernel's parent-death signal and, now and then, a worker's shm segment.)"""
    cfg = _write_config(tmp_path)
    proc = _stagewire(
        tmp_path, "run", str(cfg), "--input", '{"value": "sleep 5"}', "--requests", "50",
        sigint_ignored=sigint_ignored,
    )  # fmt: skip
    try:
        workers = await _workers_of(proc, 1)

        async def running() -> bool:
            return "run_started" in (tmp_path / "err").read_text()

        await wait_for(running, timeout=30)  # Ctrl-C lands mid-run, not during start-up
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        got = await asyncio.to_thread(proc.wait, 30)
        err = (tmp_path / "err").read_text()
        assert got == code, err
        assert err.rstrip().endswith(said) and "Traceback" not in err, err
        await _gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("moment", ["importing", "in-setup"])
async def test_ctrl_c_during_start_up_is_quiet_and_leaves_no_worker(
    tmp_path: Path, moment: str
) -> None:
    """SIGINT to the run's process group while its workers still import, or sit in a setup
    that never returns, exits 130 with one line and no traceback, and no worker remains.
    (Workers shared the run's process group, so the Ctrl-C reached them mid-import and each
    printed a KeyboardInterrupt traceback.)"""
    cfg = _write_config(tmp_path, stage="HangingSetup", replicas=2)
    proc = _stagewire(tmp_path, "run", str(cfg), "--input", '{"value": "x"}', "--requests", "1")
    workers: list[int] = []
    try:
        workers = await _workers_of(proc, 2)
        if moment == "in-setup":

            async def registered() -> bool:
                return (tmp_path / "err").read_text().count("replica_registered") >= 2

            await wait_for(registered, timeout=30)
        os.killpg(proc.pid, signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, 30)
        err = (tmp_path / "err").read_text()
        assert code == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert "interrupted" in err
        await _gone(workers, timeout=15)
    finally:
        _stop(proc, workers)


async def test_an_embedding_loop_held_past_the_heartbeat_timeout_keeps_its_workers() -> None:
    """An embedded master beats from its service's event loop. A loop held for several times
    the heartbeat timeout (a blocking call, a debugger's breakpoint) keeps its workers:
    launched ones wait while the master's process lives, and requests go on being served by
    the same processes afterwards. (They used to exit 4, taking their stages' setup with
    them.)"""
    s = spec({"a": ":Echo", "b": ":Echo"}, [("a", "b")],
             heartbeat_interval="100ms", heartbeat_timeout="600ms")  # fmt: skip
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("before")) == Text("before")
        pids = dict(pipe.worker_pids)
        # The loop held, on purpose, for 2.5x a worker's patience: the master is silent,
        # and no worker may exit meanwhile (they used to, with code 4).
        assert not wait_exited(list(pids.values()), 3.0)
        assert await asyncio.wait_for(pipe.submit(Text("after")), 30) == Text("after")
        assert dict(pipe.worker_pids) == pids
        assert all(alive(p) for p in pids.values()), pids
    assert not any(alive(p) for p in pids.values())


_ABANDONS = """
import asyncio, sys
from pipeline import Pipeline
from tests.pipeline.conftest import spec

async def main():
    pipe = Pipeline(spec({"a": ":Echo"}, [], heartbeat_interval="100ms",
                         heartbeat_timeout="500ms"))
    await pipe.start()
    print(*pipe.worker_pids.values(), flush=True)

asyncio.run(main())  # returns with the pipeline open
sys.stdin.read()  # the process lives on until the test is done
"""


def _abandoning() -> subprocess.Popen[bytes]:
    """A process running _ABANDONS from the repository's root, its three streams piped."""
    return subprocess.Popen(
        [sys.executable, "-c", _ABANDONS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )


async def test_a_pipeline_whose_loop_closes_unclosed_stops_its_workers() -> None:
    """``asyncio.run`` returning with a pipeline never closed, in a process that lives on:
    nothing on that loop will ever stop its workers, which wait for a silent master while
    its process lives, so the pipeline's watch stops them within a heartbeat interval."""
    proc = _abandoning()
    workers: list[int] = []
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        workers = [int(pid) for pid in line.split()]
        assert len(workers) == 1, line
        await _gone(workers, timeout=10)
        assert proc.poll() is None  # the process still lives
    finally:
        _stop(proc, workers)
        _, err = proc.communicate()  # closes the pipes
    assert b"pipeline_abandoned" in err, err


@pytest.mark.parametrize(
    ("stage", "replicas"), [("Echo", 2), ("HangingSetup", 1)], ids=["serving", "in-setup"]
)
async def test_kill_9_master_takes_its_workers_down(
    tmp_path: Path, stage: str, replicas: int
) -> None:
    """kill -9 of the run process makes every one of its workers exit by itself, also one
    still in a setup that never returns. (That one's SIGTERM at the parent's death used to
    wait for the setup.)"""
    cfg = _write_config(tmp_path, stage=stage, replicas=replicas)
    proc = _stagewire(
        tmp_path, "run", str(cfg), "--input", '{"value": "sleep 5"}', "--requests", "50"
    )
    workers: list[int] = []
    try:
        workers = await _workers_of(proc, replicas)

        async def registered() -> bool:
            return "replica_registered" in (tmp_path / "err").read_text()

        await wait_for(registered, timeout=30)  # serving, or in setup now
        proc.kill()
        proc.wait()
        await _gone(workers, timeout=15)
    finally:
        _stop(proc, workers)


async def test_kill_9_master_ends_a_worker_whose_handler_never_gives_the_loop_back(
    tmp_path: Path,
) -> None:
    """A worker whose handler holds its event loop for good took the SIGTERM that comes at
    its parent's death on that loop, which never ran it: killed with ``kill -9``, the master
    left it spinning for ever, its shm segment with it. The signal now arms a watchdog that
    ends it (exit 143) once twice the heartbeat timeout has passed, removing its segment."""
    mark = tmp_path / "spinning"
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "defaults: {heartbeat_interval: 200ms, heartbeat_timeout: 1s}\n"
        "stages:\n"
        "  spin: {impl: 'tests.pipeline.sample_stages:SpinsForever',"
        f" env: {{HOLD_MARK: '{mark}'}}}}\n"
        "  sink: {impl: 'tests.pipeline.sample_stages:Echo'}\n"
        "edges:\n"
        "  - {from: spin, to: sink, transport: {kind: shm, options: {capacity: 1MiB}}}\n"
    )
    proc = _stagewire(tmp_path, "run", str(cfg), "--input", '{"value": "x"}')
    workers: list[int] = []
    try:
        workers = await _workers_of(proc, 2)

        async def spinning() -> bool:
            return mark.exists()

        await wait_for(spinning, timeout=60)
        owned = [n for n in list_segments() if int(n[len(PREFIX) :].split("-")[0]) in workers]
        assert owned, list_segments()  # the pinned shm edge reserved the spinner's arena
        proc.kill()
        proc.wait()
        await _gone(workers, timeout=20)
        assert not set(owned) & set(list_segments())
        assert "stop_overdue" in (tmp_path / "err").read_text()
    finally:
        _stop(proc, workers)


async def test_kill_9_master_ends_a_worker_whose_exit_waits_on_a_stuck_thread(
    tmp_path: Path,
) -> None:
    """A worker whose handler awaits a thread that never returns stopped in order at its
    parent's death, and then waited for ever at its exit, which joins the loop's executor
    threads: the watchdog bounds the exit too."""
    mark = tmp_path / "waiting"
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "defaults: {heartbeat_interval: 200ms, heartbeat_timeout: 1s}\n"
        "stages:\n"
        "  stuck: {impl: 'tests.pipeline.sample_stages:AwaitsAStuckThread',"
        f" env: {{HOLD_MARK: '{mark}'}}}}\n"
    )
    proc = _stagewire(tmp_path, "run", str(cfg), "--input", '{"value": "x"}')
    workers: list[int] = []
    try:
        await wait_for(mark.exists, timeout=60)
        workers = children(proc.pid)  # the worker's, now that it serves
        proc.kill()
        proc.wait()
        await _gone(workers, timeout=20)
    finally:
        _stop(proc, workers)


async def test_closing_while_a_crashed_worker_is_respawned_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipeline closed while the launcher is re-spawning a worker killed -9 stops the new
    worker too. (Close used to list the processes to stop before that spawn had finished.)
    The spawn is slowed down so that close begins while it is under way."""
    pipe = Pipeline(spec({"echo": ":Echo"}, []))
    await pipe.start()
    real = asyncio.create_subprocess_exec
    closing: list[asyncio.Task[None]] = []

    async def slow_spawn(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        closing.append(asyncio.ensure_future(pipe.aclose()))  # the user's async with ends
        launcher = pipe._launcher
        assert launcher is not None
        # The spawn goes on only once the launcher has begun closing.
        await wait_for(lambda: asyncio.sleep(0, launcher._closing), timeout=10)
        return await real(*args, **kwargs)

    started: list[int] = []
    try:
        launcher = pipe._launcher
        assert launcher is not None
        started = [launcher.pids[("echo", 0)]]
        monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_spawn)
        os.kill(started[0], signal.SIGKILL)
        await wait_for(lambda: asyncio.sleep(0, bool(closing)), timeout=10)
        await asyncio.wait_for(closing[0], 30)
        started = sorted(launcher.started)
        assert len(started) == 2  # the respawn happened
        await _gone(started)
        assert not children(os.getpid())
    finally:
        monkeypatch.undo()
        for pid in started:  # started by this test: none may outlive it, even on failure
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _can_unshare_pids() -> bool:
    try:
        done = subprocess.run(["unshare", "-fp", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare_pids(), reason="needs unshare -p (a pid namespace)")
async def test_a_worker_restarted_with_the_same_pid_takes_its_slot_back() -> None:
    """A headless worker restarted in a fresh pid namespace (as in a container) has the
    same pid as the one that died: it still registers as new, and serves. (The master used
    to take its registration for a resend of the dead one's and route requests to a slot
    that was never revived.)"""

    def worker(master: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["unshare", "-fp", sys.executable, "-m", "pipeline", "worker", "--master", master,
             "--stage", "echo", "--connect-timeout", "20"],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    pipe = Pipeline(spec({"echo": ":Echo"}, [], startup_timeout="20s"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with asyncio.timeout(60):
            starting = asyncio.ensure_future(pipe.start(launch=False))

            async def bound() -> bool:
                return pipe._master is not None and bool(pipe._master.endpoint)

            await wait_for(bound)
            procs.append(worker(pipe.master_endpoint))
            await starting
            assert await pipe.submit(Text("one")) == Text("one")
            master = pipe._master
            assert master is not None
            first = master.replicas[("echo", 0)].identity
            (inner,) = children(procs[0].pid)  # the worker, pid 1 of its namespace
            os.kill(inner, signal.SIGKILL)

            async def dead() -> bool:
                return not master.replicas[("echo", 0)].alive

            await wait_for(dead)
            procs.append(worker(pipe.master_endpoint))

            async def back() -> bool:
                rep = master.replicas[("echo", 0)]
                return rep.alive and rep.ready

            await wait_for(back, timeout=20)
            assert master.replicas[("echo", 0)].identity != first
            assert await pipe.submit(Text("two")) == Text("two")
    finally:
        await pipe.aclose()
        for p in procs:  # started by this test
            if p.poll() is None:
                p.kill()
            p.wait()


async def test_start_failure_exits_3_with_one_line(tmp_path: Path) -> None:
    """A stage failing setup makes run exit 3 with a one-line error and no worker left."""
    cfg = _write_config(tmp_path, stage="BrokenSetup")
    proc = _stagewire(tmp_path, "run", str(cfg), "--input", '{"value": "x"}')
    assert await asyncio.to_thread(proc.wait, 60) == 3
    err = (tmp_path / "err").read_text()
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "weights file is missing" in lines[0], err
    assert "Traceback" not in err


async def _kill_and_wait_for_restart(pipe: Pipeline, stage: str, replicas: int) -> None:
    """Kill ``stage``'s replica 0 with -9 and wait until a new process holds its slot and
    ``replicas`` replicas (of every stage) are registered again."""
    victim = pipe.worker_pids[(stage, 0)]
    os.kill(victim, signal.SIGKILL)

    async def back() -> bool:
        pid = pipe.worker_pids.get((stage, 0))
        stats = await pipe.statistics()
        return pid not in (None, victim) and len(stats["replicas"]) == replicas

    await wait_for(back, timeout=20)


async def _served_after_40(pipe: Pipeline, stage: str) -> dict[int, int]:
    """Submit 40 requests (each must come back whole); requests completed by each of
    ``stage``'s replicas (a restarted one counts from 0)."""
    outs = await asyncio.gather(*(pipe.submit(Text(f"r{i}")) for i in range(40)))
    assert [o.value for o in outs] == [f"r{i}" for i in range(40)]
    return {
        r["replica"]: r["completed"]
        for r in (await pipe.statistics())["replicas"]
        if r["stage"] == stage
    }


async def test_killed_worker_is_restarted_and_takes_its_slot_back() -> None:
    """A replica killed with -9 is restarted, re-registers, and serves requests again."""
    s = spec({"echo": {"impl": ":Echo", "replicas": 2}}, [])
    async with Pipeline(s) as pipe:
        await _kill_and_wait_for_restart(pipe, "echo", 2)
        served = await _served_after_40(pipe, "echo")
        assert served[0] > 0, served
        assert served[1] > 0, served


@pytest.mark.parametrize("code", [0, 5])
async def test_a_worker_that_exits_unasked_with_a_stop_code_is_restarted(code: int) -> None:
    """A worker whose process ends with code 0 while the pipeline serves (a handler, or a
    library in it, called exit) was taken for one told to stop and never restarted: its
    stage stayed unavailable for good. So would one ending with 5, the code of a worker
    the master replaced, had the launcher not asked the master whether another worker holds
    the slot. Its request fails; the slot is restarted and serves."""
    s = spec({"echo": {"impl": ":Echo"}}, [])
    async with Pipeline(s) as pipe:
        victim = pipe.worker_pids[("echo", 0)]
        with pytest.raises(StageUnavailable, match=f"exited with code {code}"):
            await pipe.submit(Text(f"exit{code}"))

        async def back() -> bool:
            return pipe.worker_pids.get(("echo", 0)) not in (None, victim)

        await wait_for(back, timeout=20)
        assert await pipe.submit(Text("again")) == Text("again")
    assert not alive(victim)


def _hand_started_worker(
    master: str, stage: str, err: Path, *, own_pids: bool = False
) -> subprocess.Popen[bytes]:
    """``stagewire worker`` for replica 0 of ``stage``, as a user starts one, its log to
    ``err``; with ``own_pids``, in a pid namespace of its own (as in a container)."""
    prefix = ["unshare", "-fp"] if own_pids else []
    with err.open("wb") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "pipeline", "worker", "--master", master,
             "--stage", stage, "--connect-timeout", "30"],
            stdin=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip


@pytest.mark.parametrize(
    "own_pids",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not _can_unshare_pids(), reason="needs unshare -p (a pid namespace)"
            ),
        ),
    ],
    ids=["same-pid-namespace", "own-pid-namespace"],
)
async def test_a_launched_worker_replaced_by_another_in_its_slot_is_not_restarted(
    tmp_path: Path, own_pids: bool
) -> None:
    """A launched worker gone quiet (stopped here) is replaced by a worker started by hand
    for its slot; running again, it is told so and exits 5. Its launcher, which the master
    tells that another worker holds the slot, does not start it again (a restart would only
    be refused as a duplicate, again and again, then give the slot up): the newcomer
    serves, and the launcher's slot keeps the exited process. The old worker's exit is no
    death of the newcomer's, even when the newcomer's pid means nothing here (its own pid
    namespace: the master used to declare it dead, failing what it served)."""
    s = spec({"echo": ":Echo"}, [], heartbeat_interval="100ms", heartbeat_timeout="30s")
    newcomer: subprocess.Popen[bytes] | None = None
    async with Pipeline(s) as pipe:
        launcher = pipe._launcher
        master = pipe._master
        assert launcher is not None and master is not None
        holder = pipe.worker_pids[("echo", 0)]
        first = master.replicas[("echo", 0)].identity
        os.kill(holder, signal.SIGSTOP)
        try:
            newcomer = _hand_started_worker(
                pipe.master_endpoint, "echo", tmp_path / "err", own_pids=own_pids
            )

            def replaced() -> bool:
                rep = master.replicas[("echo", 0)]
                return rep.alive and rep.ready and rep.identity != first

            await wait_for(replaced, timeout=30)
        finally:
            os.kill(holder, signal.SIGCONT)
        serving = master.replicas[("echo", 0)]
        proc = launcher.procs[("echo", 0)]
        assert await asyncio.wait_for(proc.wait(), 30) == 5
        # Its watcher is done with it, and began no restart (one would wait out a backoff).
        await wait_for(lambda: all(t.done() for t in launcher._watchers), timeout=10)
        assert launcher.procs[("echo", 0)] is proc and not launcher.restarts, launcher.restarts
        assert master.replicas[("echo", 0)] is serving and serving.alive, serving.why
        assert await pipe.submit(Text("served")) == Text("served")
    assert newcomer is not None
    try:
        assert await asyncio.to_thread(newcomer.wait, 30) == 0  # told to stop by the close
    finally:
        if newcomer.poll() is None:
            newcomer.kill()
        newcomer.wait()


async def test_workers_told_to_stop_by_a_close_are_not_taken_for_crashes(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a close the master tells every worker to stop, and they exit with 0: the launcher,
    which restarts a worker that exits with 0 unasked, knows the close began first, and
    reports no exit and restarts nothing, even when the workers are gone before the master
    has finished closing (held open here until they are)."""
    s = spec({"echo": {"impl": ":Echo", "replicas": 2}}, [])
    close_orchestrator = Orchestrator.aclose

    async def slow_close(orch: Orchestrator) -> None:
        await wait_for(lambda: all(p.returncode is not None for p in procs), timeout=20)
        # The launcher's watchers have seen the exits: done, with no restart's backoff.
        await wait_for(lambda: all(t.done() for t in launcher._watchers), timeout=10)
        await close_orchestrator(orch)

    monkeypatch.setattr(Orchestrator, "aclose", slow_close)
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("one")) == Text("one")
        launcher = pipe._launcher
        assert launcher is not None
        procs = list(launcher.procs.values())
    assert not any(p.returncode for p in launcher.procs.values()), launcher.procs
    err = capfd.readouterr().err
    assert "worker_exited" not in err and "worker_restarting" not in err, err


async def test_a_restart_whose_setup_hangs_is_restarted_then_given_up(tmp_path: Path) -> None:
    """A replica restarted while the pipeline serves, whose setup never returns, held its
    slot for good: registered, never ready, never timed (only start-up was), so it was
    neither restarted nor given up, and every request waited ``replica_wait`` for it. Past
    ``startup_timeout`` it is now declared dead and killed, restarted within the budget,
    then given up: requests fail at once, saying no replica is being restarted. However
    long each restart lived before it was killed (``stable_s`` is 0 here): the budget
    renews only for a worker that served that long, and one that never became ready did
    not (with the defaults, a restart killed ``startup_timeout`` after registering had
    always lived ``stable_s``, and the slot was restarted for ever)."""
    s = spec(
        {"echo": {"impl": ":HangsWhenRestarted", "env": {"HANG_MARKER": str(tmp_path / "m")}}},
        [],
        heartbeat_interval="200ms",
        startup_timeout="1s",
        replica_wait="60s",
    )
    async with Pipeline(s) as pipe:
        assert pipe._launcher is not None
        pipe._launcher._stable_s = 0.0
        assert await pipe.submit(Text("one")) == Text("one")
        os.kill(pipe.worker_pids[("echo", 0)], signal.SIGKILL)

        def given_up() -> bool:
            return pipe._master_here().orch.replicas["echo"][0].given_up

        await wait_for(given_up, timeout=40)
        assert ("echo", 0) not in pipe.worker_pids
        async with asyncio.timeout(20):  # not replica_wait's 60 s
            with pytest.raises(StageUnavailable, match="none is being restarted"):
                await pipe.submit(Text("two"))


#: An environment string longer than the kernel takes in one exec (E2BIG): what makes the
#: spawn of a restart fail here, as running out of processes or memory would.
_TOO_LONG = "x" * (1 << 18)


@pytest.mark.parametrize("spawns_again", [False, True], ids=["never", "at the second try"])
async def test_a_restart_that_cannot_be_spawned_is_tried_again_then_given_up(
    spawns_again: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart whose spawn raised (E2BIG here; EAGAIN or ENOMEM on a loaded host) ended
    its slot's watcher with an error nobody read: the slot was neither restarted nor given
    up, and every request waited ``replica_wait`` for it. A spawn that fails now uses an
    attempt of the restart budget: the slot comes back once a spawn succeeds, or is given
    up when none does."""
    s = spec({"echo": ":Echo"}, [], heartbeat_interval="200ms", replica_wait="60s")
    async with Pipeline(s) as pipe:
        launcher = pipe._launcher
        assert launcher is not None
        assert await pipe.submit(Text("one")) == Text("one")
        monkeypatch.setenv("STAGEWIRE_TEST_TOO_LONG", _TOO_LONG)
        victim = pipe.worker_pids[("echo", 0)]
        os.kill(victim, signal.SIGKILL)
        if spawns_again:
            # The budget's second attempt is counted once the first one's spawn failed.
            await wait_for(lambda: launcher.restarts.get(("echo", 0), 0) >= 2, timeout=20)
            monkeypatch.delenv("STAGEWIRE_TEST_TOO_LONG")
            await wait_for(lambda: pipe.worker_pids.get(("echo", 0), victim) != victim, 20)
            assert await asyncio.wait_for(pipe.submit(Text("two")), 30) == Text("two")
            return

        def given_up() -> bool:
            return pipe._master_here().orch.replicas["echo"][0].given_up

        await wait_for(given_up, timeout=20)
        async with asyncio.timeout(20):  # not replica_wait's 60 s
            with pytest.raises(StageUnavailable, match="none is being restarted"):
                await pipe.submit(Text("two"))


async def test_a_worker_that_cannot_be_started_fails_the_start_in_one_line() -> None:
    """A worker whose spawn fails (here its environment is past what exec takes; out of
    processes or memory likewise) fails the start with a PipelineError naming the stage,
    the workers already started stopped. The OSError escaped as is: ``stagewire run``
    printed a traceback and exited 1."""
    s = spec({"a": ":Echo", "b": {"impl": ":Echo", "env": {"BIG": _TOO_LONG}}}, [("a", "b")])
    pipe = Pipeline(s)
    with pytest.raises(PipelineError, match=r"cannot start a worker for stage 'b' replica 0"):
        await pipe.start()
    await pipe.aclose()
    assert not children(os.getpid())


async def test_a_close_ends_a_restarts_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A close while a crashed worker's restart waits out its backoff ends the wait at once
    and restarts nothing. It used to sleep the backoff through (up to 5 s) before the
    close could finish; here the backoff is a minute, which the close must not wait for."""
    monkeypatch.setattr("pipeline._launcher.RESTART_BACKOFF_S", 60.0)
    monkeypatch.setattr("pipeline._launcher.RESTART_BACKOFF_MAX_S", 60.0)
    s = spec({"echo": ":Echo"}, [], heartbeat_interval="200ms")
    pipe = Pipeline(s)
    await pipe.start()
    try:
        launcher = pipe._launcher
        assert launcher is not None
        assert await pipe.submit(Text("one")) == Text("one")
        victim = pipe.worker_pids[("echo", 0)]
        os.kill(victim, signal.SIGKILL)
        await wait_for(lambda: launcher.restarts.get(("echo", 0), 0) == 1, timeout=20)
        # Well inside the backoff: a close that waited for it would still be running.
        await asyncio.wait_for(pipe.aclose(), 30)
        assert ("echo", 0) not in launcher.pids
        assert launcher.started == {victim}
    finally:
        await pipe.aclose()


async def test_new_requests_avoid_a_replica_whose_loop_a_handler_holds(tmp_path: Path) -> None:
    """A replica whose handler holds its event loop still beats (from a thread of its own),
    so the master took it for a healthy one; its stuck request aborted, it looked the least
    loaded and took every other new request, which hung there. Its heartbeats now say how
    long its loop has been held: past ``heartbeat_timeout`` the others take the new
    requests, and it takes its share again once its loop runs."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    s = spec(
        {"s": {"impl": ":SaysItsReplica", "replicas": 2, "env": {"LINGER_FIFO": str(fifo)}}},
        [],
        heartbeat_interval="200ms",
        heartbeat_timeout="1s",
    )
    async with Pipeline(s) as pipe:
        views = pipe._master_here().orch.replicas["s"]
        async with pipe.stream(Text("hold")):

            def stalled() -> bool:
                return any(v.stalled for v in views.values())

            await wait_for(stalled, timeout=30)
        (held,) = [k for k, v in views.items() if v.stalled]
        async with asyncio.timeout(30):
            answers = [(await pipe.submit(Text("x"))).value for _ in range(6)]
        assert answers == [str(1 - held)] * 6
        told(fifo)

        def unstalled() -> bool:
            return not any(v.stalled for v in views.values())

        await wait_for(unstalled, timeout=30)
        answers = [(await pipe.submit(Text("x"))).value for _ in range(6)]
        assert sorted(answers) == ["0"] * 3 + ["1"] * 3


async def test_a_restarted_replica_gets_its_upstream_stages_chunks_again() -> None:
    """After a downstream replica is killed and restarted (at a new endpoint), the stage
    upstream of it sends that replica's chunks to where it now listens, not where it was."""
    s = spec({"first": ":Echo", "relay": {"impl": ":Echo", "replicas": 2}}, [("first", "relay")])
    async with Pipeline(s) as pipe:
        # Both replicas served, so the upstream stage has sent to each.
        outs = await asyncio.gather(*(pipe.submit(Text(f"a{i}")) for i in range(8)))
        assert [o.value for o in outs] == [f"a{i}" for i in range(8)]
        await _kill_and_wait_for_restart(pipe, "relay", 3)
        served = await _served_after_40(pipe, "relay")
        assert served[0] > 0, served
        assert served[1] > 0, served


async def test_a_stage_holding_the_loop_is_not_declared_dead() -> None:
    """A handler that blocks its event loop past the heartbeat timeout still completes."""
    s = spec({"hog": ":Hog"}, [], heartbeat_timeout="1s", heartbeat_interval="200ms")
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("3")) == Text("3")
        assert await pipe.submit(Text("0")) == Text("0")
        stats = await pipe.statistics()
        assert stats["replicas"][0]["completed"] == 2
        assert stats["client"]["failed"] == 0


async def test_forged_chunks_cannot_grow_state_without_bound() -> None:
    """Chunks for never-admitted requests are held only up to twice max_inflight, and
    never at the expense of real requests."""
    import msgspec

    from pipeline._messages import Admit, Chunks, encode_batch
    from transports.inline import InlineDescriptor

    s = spec({"echo": ":Echo"}, [], max_inflight=4)
    async with Pipeline(s) as pipe:
        endpoint = pipe.data_endpoints[("echo", 0)]
        descriptors = msgspec.Raw(msgspec.msgpack.encode([InlineDescriptor(b"\x91\xa1x", [])]))
        frames = [
            msgspec.msgpack.encode(
                Chunks(
                    f"forged-{i}",
                    "@client->echo",
                    0,
                    True,
                    "inline",
                    descriptors,
                    "tcp://127.0.0.1:9",
                    "h",
                    0,
                )
            )
            for i in range(50)
        ]
        # Request messages are taken from a data socket only with the master's token.
        frames += [
            msgspec.msgpack.encode(Admit(f"forged-admit-{i}", {"echo": 0}, b"not the token"))
            for i in range(20)
        ]
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(endpoint)
            push.send(encode_batch(frames))
            push.close()
        finally:
            ctx.term()

        async def counted() -> bool:
            return (await pipe.statistics())["replicas"][0]["garbage"] >= 50 - 8 + 20

        await wait_for(counted)
        assert (await pipe.statistics())["replicas"][0]["active"] <= 8
        # The forged requests fill every slot for chunks that precede their Admit, and a real
        # request's input may well arrive before its Admit: it must take a forged one's slot.
        for i in range(5):
            got = await asyncio.wait_for(pipe.submit(Text(f"real {i}")), 10)
            assert got == Text(f"real {i}")


async def test_peers_that_register_during_a_slow_setup_are_known() -> None:
    """A replica still in setup when its downstream registers still learns where it is."""
    s = spec(
        {"tokens": ":Tokens", "relay": ":SlowSetupRelay", "collect": ":Collect"},
        [("tokens", "relay"), ("relay", "collect")],
    )
    async with Pipeline(s) as pipe:
        outs = await asyncio.gather(*(pipe.submit(Text(f"a{i} b{i}")) for i in range(10)))
        assert [o.value for o in outs] == [f"a{i} b{i}" for i in range(10)]


@pytest.mark.parametrize("transport", ["shm", "network"])
async def test_payloads_held_for_a_killed_consumer_are_taken_back(transport: str) -> None:
    """A consumer killed with payloads sent to it but never read leaves the producer's
    transport holding nothing: the producer knows where each payload went, and takes back
    what a dead process can no longer read (shm: its pid is gone; network: the master
    declared the replica dead)."""
    s = spec(
        {
            "flood": {"impl": ":Flood", "params": {"count": 4, "size": 128 * 1024}},
            # One handler at a time, asleep after its first chunk: every other payload
            # sent to it waits unread.
            "drain": {"impl": ":Drain", "params": {"delay": 60}, "max_concurrency": 1},
        },
        [("flood", "drain")],
        transport=transport,
        # Stopped (network below), the consumer must not be declared dead before it is
        # killed: that is what would drop its payloads, and it is the kill under test.
        heartbeat_timeout="60s",
    )

    async def counters() -> dict[str, int]:
        stats = await pipe.statistics()
        flood = next(r for r in stats["replicas"] if r["stage"] == "flood")
        return flood["outputs"][0]["transports"][transport]  # type: ignore[no-any-return]

    async def held() -> int:
        return (await counters())["held"]

    async with Pipeline(s) as pipe:
        victim = pipe.worker_pids[("drain", 0)]
        if transport == "network":
            # A network consumer fetches as soon as an envelope comes: stopped, it cannot.
            os.kill(victim, signal.SIGSTOP)
        tasks = [asyncio.ensure_future(pipe.submit(Text(f"go {i}"))) for i in range(2)]

        seen: dict[str, int] = {}

        async def all_put() -> bool:
            # While the consumer is stopped, each call waits out its silence (5 s).
            seen.update(await counters())
            return seen["chunks"] == 8  # 2 requests x 4 chunks

        await wait_for(all_put, timeout=30)
        # shm: the first chunk was read (its bytes copied out, released); the rest wait.
        assert seen["held"] >= 6, seen
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, StageUnavailable) for r in results), results

        async def taken_back() -> bool:
            return await held() == 0

        await wait_for(taken_back)


async def test_a_stage_pythonpath_is_added_to_the_workers_path(tmp_path: Path) -> None:
    """A stage's ``env: {PYTHONPATH: ...}`` is put in front of the path the launcher gives
    its workers, so they still import the stage class. (It used to replace that path.)"""
    extra = tmp_path / "extra"
    extra.mkdir()
    s = spec({"echo": {"impl": ":Echo", "env": {"PYTHONPATH": str(extra)}}}, [])
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("x")) == Text("x")
        pid = pipe.worker_pids[("echo", 0)]
        environ = await asyncio.to_thread(Path(f"/proc/{pid}/environ").read_bytes)
        (path,) = [e for e in environ.split(b"\0") if e.startswith(b"PYTHONPATH=")]
        entries = path.decode().split("=", 1)[1].split(os.pathsep)
        assert entries[0] == str(extra)
        assert os.getcwd() in entries  # what the launcher gives every worker, kept


async def test_a_launched_worker_loads_only_what_it_serves_with() -> None:
    """A worker loads what it serves with, not the command line's modules (its progress
    bars, the master, the launcher), PyYAML (the master sends the spec as data), rich
    (which structlog would load for its tracebacks) or numpy (which the shm receiver every
    ``auto`` edge has needs only once a payload comes in place): each worker paid them at
    start-up, about 40% of its CPU until ready. The stage may still import them itself."""
    unwanted = [
        "numpy",
        "rich",
        "yaml",
        "pygments",
        "pipeline._cli",
        "pipeline._api",
        "pipeline._master",
        "pipeline._launcher",
        "pipeline._yaml",
    ]
    s = spec({"first": ":Echo", "loaded": ":SaysWhatItLoaded"}, [("first", "loaded")])
    assert s.edges[0].transport is None and s.defaults.transport.kind == "auto"
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text(",".join([*unwanted, "structlog", "zmq"]))) == Text(
            "structlog,zmq"
        )
        assert await pipe.submit(Text("import rich.console")) == Text("rich.console")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "kind", ["ipv6", "ipc", "ipc-abstract", "every-interface", "every-ipv6-interface"]
)
async def test_every_master_bind_the_config_accepts_works(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An IPv6 or an ipc:// master address, which the config accepts, serves requests and
    leaves no socket file behind. (Both used to fail at bind with a ZMQ traceback.) So does
    a master bound to every interface: its launched workers were given the wildcard as the
    address to reach it at, refused it, and start-up failed. An abstract ipc address
    (``ipc://@NAME``) has no file: the close used to remove a file named ``@NAME`` from
    the working directory."""
    if "ipv6" in kind and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    bind = {
        "ipv6": "tcp://[::1]:0",
        "ipc": f"ipc://{tmp_path}/master.sock",
        "ipc-abstract": f"ipc://@stagewire-test-{os.getpid()}-{tmp_path.name}",
        "every-interface": "tcp://0.0.0.0:0",
        "every-ipv6-interface": "tcp://[::]:0",
    }[kind]
    monkeypatch.chdir(tmp_path)
    s = spec({"echo": ":Echo"}, []).model_copy(update={"master": MasterSpec(bind=bind)})
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text(kind)) == Text(kind)
        kept = {f"@{bind.removeprefix('ipc://@')}", f"@{bind.removeprefix('ipc://@')}.data"}
        if kind == "ipc-abstract":
            for name in kept:  # a user's files, which happen to have the sockets' names
                (tmp_path / name).write_text("mine")
    left = set(await asyncio.to_thread(os.listdir, tmp_path))
    assert left == (kept if kind == "ipc-abstract" else set()), left


async def test_a_master_address_in_use_fails_start_with_one_line() -> None:
    """A master bind address already taken fails start with a PipelineError that names it,
    and leaves nothing running."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = spec({"echo": ":Echo"}, []).model_copy(
            update={"master": MasterSpec(bind=f"tcp://127.0.0.1:{port}")}
        )
        with pytest.raises(PipelineError, match=f"cannot bind 'tcp://127.0.0.1:{port}'"):
            async with Pipeline(s):
                pytest.fail("started on an address in use")
    assert not children(os.getpid())


def _collector_state(text: str) -> dict[str, str]:
    return dict(part.split(":") for part in text.split())


async def test_a_worker_sets_up_without_the_collector_and_serves_with_it_frozen() -> None:
    """The collector is off while a worker imports and sets its stage up, and on when it
    serves, with start-up's objects frozen out of later collections."""
    async with Pipeline(spec({"a": ":CollectorState"}, [])) as pipe:
        state = _collector_state((await pipe.submit(Text("x"))).value)
    assert state["setup"] == "False"
    assert state["serving"] == "True"
    # Everything the worker imported (torch included, through the sample stages' types).
    assert int(state["frozen"]) > 10_000


def test_stagewire_run_serves_with_the_collector_back_on(tmp_path: Path) -> None:
    """``stagewire run`` turns its own collector back on, frozen, once the pipeline is up;
    its workers serve with theirs on."""
    config = _write_config(tmp_path, "CollectorState")
    script = (
        "import gc, sys\n"
        "from pipeline._cli import main\n"
        f"code = main(['run', {str(config)!r}, '--input', '{{\"value\": \"x\"}}'])\n"
        "print('master', gc.isenabled(), gc.get_freeze_count() > 10_000)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "master True True" in done.stdout
    assert "setup:False serving:True" in done.stdout


def _policies(pid: int) -> set[int]:
    """The scheduling policies of every thread of ``pid``."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _pm_qos_fds(pid: int) -> int:
    """How many descriptors ``pid`` holds open on the PM QoS device."""
    fds = f"/proc/{pid}/fd"
    return sum(os.readlink(f"{fds}/{fd}") == PM_QOS_PATH for fd in os.listdir(fds))


def _cpu_latency_in_force() -> int:
    """The CPU wake-up latency (µs) this host is held to: the least of every request."""
    fd = os.open(PM_QOS_PATH, os.O_RDONLY)
    try:
        return int(struct.unpack("=i", os.read(fd, 4))[0])
    finally:
        os.close(fd)


@pytest.mark.skipif(
    not os.access(PM_QOS_PATH, os.R_OK | os.W_OK), reason="no writable PM QoS device here"
)
async def test_cpu_idle_poll_holds_a_zero_wake_up_latency_while_the_workers_run() -> None:
    """``cpu_idle: poll``: every worker holds the host's CPUs to a zero wake-up latency (one
    descriptor on the PM QoS device), restarted workers too, and the request ends with
    the workers, even one killed with -9. By default no worker holds one."""
    before = _cpu_latency_in_force()
    stages = {"a": ":Echo", "b": ":Echo"}
    async with Pipeline(spec(stages, [("a", "b")])) as pipe:
        assert await pipe.submit(Text("x")) == Text("x")
        assert [_pm_qos_fds(pid) for pid in pipe.worker_pids.values()] == [0, 0]
    async with Pipeline(spec(stages, [("a", "b")], cpu_idle="poll")) as pipe:
        assert await pipe.submit(Text("x")) == Text("x")
        assert [_pm_qos_fds(pid) for pid in pipe.worker_pids.values()] == [1, 1]
        assert _cpu_latency_in_force() == 0
        await _kill_and_wait_for_restart(pipe, "a", 2)
        assert [_pm_qos_fds(pid) for pid in pipe.worker_pids.values()] == [1, 1]
        assert await pipe.submit(Text("y")) == Text("y")
    assert _cpu_latency_in_force() == before


def test_cpu_idle_refused_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    """Where the device is missing or not writable, ``poll`` holds nothing, says why, and
    the worker serves on; ``default`` opens nothing."""
    absent = str(tmp_path / "absent")
    with structlog.testing.capture_logs() as logs:
        assert hold_cpu_idle("default", absent) is None
        assert hold_cpu_idle("poll", absent) is None
    assert [(e["event"], e["device"]) for e in logs] == [("cpu_idle_refused", absent)], logs


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this platform")
async def test_workers_run_under_their_stages_scheduling_policy() -> None:
    """Every thread of a worker runs SCHED_BATCH by default; ``scheduling: normal`` keeps the
    policy the worker started with."""
    stages = {"a": ":Echo", "b": {"impl": ":Echo", "scheduling": "normal"}}
    async with Pipeline(spec(stages, [("a", "b")])) as pipe:
        assert await pipe.submit(Text("x")) == Text("x")
        pids = {stage: pid for (stage, _), pid in pipe.worker_pids.items()}
        assert len(os.listdir(f"/proc/{pids['a']}/task")) > 1  # zmq's threads at least
        assert _policies(pids["a"]) == {os.SCHED_BATCH}
        assert _policies(pids["b"]) == {os.sched_getscheduler(0)}
