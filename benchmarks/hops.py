"""1 KiB hops: stagewire's 4-stage chain against raw wake-ups and raw pyzmq, in one run.

Run from the repository root (worker processes import ``benchmarks.bench_stages``)::

    .venv/bin/python benchmarks/hops.py [--quick] [--json OUT] [--wide-window W]

The markdown report goes to stdout, progress (and the workers' logs) to stderr. A full run
takes about a minute, ``--quick`` about 25 s.

Everything is reported as a ratio against baselines measured in the same run, as medians
over repeated trials, because absolute timings on a small, shared VM are noisy. What it
measures (DESIGN section 11):

A. raw cross-process wake-up: an ``os.pipe`` ping-pong with a child process, 1 B and
   1 KiB; one-way latency is RTT/2. A2 is the same with both ends reading through an
   asyncio loop (``loop.add_reader``): the floor for any asyncio actor.
B. raw pyzmq over TCP loopback, blocking sockets: PUSH/PULL ping-pong (one-way = RTT/2)
   and streaming throughput of 1 KiB messages to one child. B2 is the same topology as
   the stagewire chain built from four bare Python relay processes: it shows what this
   machine can do with five processes sharing its cores, before any framework is added.
   B3 is the ping-pong with both ends on asyncio, each socket's FD watched with
   ``loop.add_reader`` and drained until EAGAIN: the mechanism of ``pipeline._sockets``.
C. stagewire: source -> relay -> relay -> sink, every edge inline, 1 KiB payloads.
   a. hop latency: sequential requests (concurrency 1). A request crosses 5 hops:
      client->source, three stage->stage edges and sink->client, so the hop figure is the
      end-to-end p50 divided by 5 (it includes admission, the handler and decoding). The
      envelope hop p50 from ``statistics()`` (envelope sent -> envelope received) is also
      given.
   b. streaming: the source yields N 1 KiB chunks for one request; each relay streams
      them through; the sink counts them. chunks/s per edge = N / elapsed (every internal
      edge carries all N chunks). Also with several concurrent requests. The CPU time of
      every process is sampled to show where the per-chunk cost goes.
   c. ordering: the runtime always orders, so ordering's cost is measured in process: a
      ReorderBuffer against a plain asyncio.Queue (what an unordered receiver would still
      need), per chunk, and set against the per-chunk pipeline cost of (b).
D. worker start-up: the time ``async with Pipeline(...)`` takes to be ready, against one
   bare interpreter importing the worker's entry point.
E. diagnostic: streaming again with a credit window of W chunks (1024 by default in a full
   run) instead of the default (256), to show how much the window alone limits throughput.
F. diagnostic: the wake-up of A with the receiver idle, first, for as long as a stage of
   the latency chain idles between two of its hops (one request's end-to-end time), as
   ``benchmarks/wake_cost.py`` measures it: the floor a real hop stands on here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # Workers inherit the parent's sys.path, so they find ``benchmarks.bench_stages`` too.
    sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from benchmarks._measure import (  # noqa: E402
    PhaseLog,
    add_cpu_idle_option,
    cpu_seconds,
    hold_cpu_idle_for_run,
    hop_p50s,
    median,
)
from benchmarks.bench_stages import Blob, Counted, Start  # noqa: E402
from benchmarks.wake_cost import measure as wake_cost  # noqa: E402
from pipeline import Pipeline  # noqa: E402
from pipeline._cpu_idle import CpuIdle  # noqa: E402
from pipeline._reorder import ReorderBuffer  # noqa: E402

KIB = 1024
#: Hops a request crosses in the 4-stage chain: client->source, 3 internal, sink->client.
CHAIN_HOPS = 5
#: The three stage->stage edges of the chain, which carry every streamed chunk.
INTERNAL_EDGES = ("source->relay1", "relay1->relay2", "relay2->sink")

# DESIGN section 11.
TARGET_HOP_RATIO = 1.5
TARGET_CHUNKS_PER_S = 50_000
TARGET_ORDERING_FRACTION = 0.10

_log = PhaseLog("hops")


@dataclass(frozen=True)
class Config:
    """Counts and time bounds of every phase; ``--quick`` scales them down."""

    trials: int = 5
    pipe_iters: int = 2000
    zmq_iters: int = 2000
    zmq_stream_n: int = 100_000
    chain_iters: int = 1000
    chain_stream_n: int = 50_000
    sw_latency_iters: int = 300
    sw_stream_n: int = 20_000
    sw_stream_min_n: int = 5_000
    #: Aimed-for length of one streaming trial, in seconds (sizes N, within the bounds).
    stream_trial_s: float = 2.5
    sw_stream_trials: int = 3
    sw_concurrency: int = 4
    reorder_n: int = 50_000
    startup_probes: int = 3
    #: Wall-clock cap of one trial's loop, in seconds (the counts above usually end it).
    trial_budget_s: float = 4.0
    #: Deadline of any single blocking step (a request, a reply), in seconds.
    step_timeout_s: float = 30.0
    #: The pipelines' ``defaults.cpu_idle``; ``poll`` is held by this process too, for the
    #: whole run, so that every baseline is measured in the same state.
    cpu_idle: CpuIdle = "default"


FULL = Config()
QUICK = Config(
    trials=3,
    pipe_iters=1000,
    zmq_iters=1000,
    zmq_stream_n=30_000,
    chain_iters=400,
    chain_stream_n=10_000,
    sw_latency_iters=150,
    sw_stream_n=5_000,
    sw_stream_min_n=2_000,
    stream_trial_s=1.0,
    reorder_n=20_000,
    startup_probes=1,
    trial_budget_s=2.0,
)


# ---- child processes ------------------------------------------------------------------------


@contextlib.contextmanager
def _children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to append started children to; every one is terminated and reaped on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=3)
            if p.stdout is not None:
                p.stdout.close()


def _spawn(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``python -c CODE ARGS...``; a few ms, so fine to call from a coroutine too."""
    return subprocess.Popen([sys.executable, "-c", *args], **kwargs)


_PIPE_ECHO = """
import os, sys
r, w, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
while True:
    buf = os.read(r, n)
    if not buf:
        break
    while len(buf) < n:
        more = os.read(r, n - len(buf))
        if not more:
            sys.exit(0)
        buf += more
    os.write(w, buf)
"""

# An echo whose reads are driven by an asyncio loop (loop.add_reader), as stagewire's are:
# "pipe R W N" echoes N-byte messages on a pipe; "zmq RX TX" drains a PULL socket until
# EAGAIN on every wake-up, exactly like pipeline._sockets.SocketReader, and echoes on a PUSH.
_AIO_ECHO = """
import asyncio, os, sys
async def main():
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    parent = os.getppid()
    def finish():
        if not done.done():
            done.set_result(None)
    def watch():
        if os.getppid() != parent:
            finish()
        else:
            loop.call_later(1.0, watch)
    watch()
    if sys.argv[1] == "pipe":
        r, w, n = map(int, sys.argv[2:5])
        buf = bytearray()
        def on_read():
            data = os.read(r, 65536)
            if not data:
                loop.remove_reader(r)
                finish()
                return
            buf.extend(data)
            while len(buf) >= n:
                os.write(w, bytes(buf[:n]))
                del buf[:n]
        loop.add_reader(r, on_read)
    else:
        import zmq
        ctx = zmq.Context()
        rx = ctx.socket(zmq.PULL); rx.setsockopt(zmq.LINGER, 0); rx.connect(sys.argv[2])
        tx = ctx.socket(zmq.PUSH); tx.setsockopt(zmq.LINGER, 0); tx.connect(sys.argv[3])
        def on_read():
            while not done.done():
                try:
                    m = rx.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                if m == b"Q":
                    finish()
                    return
                tx.send(m, zmq.NOBLOCK)
        loop.add_reader(rx.getsockopt(zmq.FD), on_read)
        on_read()
    await done
asyncio.run(main())
"""

# Children exit on their own if this process dies: an idle recv times out every second and
# checks whether the parent is still there (this costs nothing while messages flow).
_ZMQ_ECHO = """
import os, sys, zmq
parent = os.getppid()
ctx = zmq.Context()
rx = ctx.socket(zmq.PULL); rx.setsockopt(zmq.LINGER, 0); rx.setsockopt(zmq.RCVTIMEO, 1000)
rx.connect(sys.argv[1])
tx = ctx.socket(zmq.PUSH); tx.setsockopt(zmq.LINGER, 0); tx.connect(sys.argv[2])
def recv():
    while True:
        try:
            return rx.recv()
        except zmq.Again:
            if os.getppid() != parent:
                sys.exit(0)
while True:
    m = recv()
    if m == b"Q":
        break
    if m == b"S":  # streaming: count messages until b"E", then report the count
        n = 0
        while recv() != b"E":
            n += 1
        tx.send(str(n).encode())
        continue
    tx.send(m)
"""

# One process of a bare 4-process relay chain. It binds its PULL, prints the endpoint,
# pushes to argv[2]. "first" turns b"S<n>" into n 1 KiB messages and b"E"; "last" counts
# the b"D..." messages and answers b"E" with the count; ping messages pass straight through.
_ZMQ_RELAY = """
import os, sys, zmq
role, downstream = sys.argv[1], sys.argv[2]
parent = os.getppid()
ctx = zmq.Context()
rx = ctx.socket(zmq.PULL); rx.setsockopt(zmq.LINGER, 0); rx.setsockopt(zmq.RCVTIMEO, 1000)
port = rx.bind_to_random_port("tcp://127.0.0.1")
tx = ctx.socket(zmq.PUSH); tx.setsockopt(zmq.LINGER, 0); tx.connect(downstream)
print(f"tcp://127.0.0.1:{port}", flush=True)
blob = b"D" * 1024
n = 0
while True:
    try:
        m = rx.recv()
    except zmq.Again:
        if os.getppid() != parent:
            break
        continue
    if m == b"Q":
        tx.send(m)
        break
    if role == "first" and m[:1] == b"S":
        for _ in range(int(m[1:])):
            tx.send(blob)
        tx.send(b"E")
    elif role == "last" and m[:1] == b"D":
        n += 1
    elif role == "last" and m == b"E":
        tx.send(str(n).encode())
        n = 0
    else:
        tx.send(m)
"""


def _trials(
    cfg: Config, iters: int, once: Callable[[], float], warmup: int = 100
) -> tuple[float, list[float]]:
    """Run ``once`` (returns ns) in ``cfg.trials`` trials; median of the trials' p50s (µs)."""
    for _ in range(warmup):
        once()
    p50s = []
    for _ in range(cfg.trials):
        samples: list[float] = []
        deadline = time.monotonic() + cfg.trial_budget_s
        for _ in range(iters):
            samples.append(once() / 1000)
            if time.monotonic() > deadline:
                break
        p50s.append(median(samples))
    return median(p50s), p50s


def pipe_wakeup(cfg: Config, size: int) -> dict[str, Any]:
    """Baseline A: one-way latency (RTT/2) of an os.pipe ping-pong with a child process."""
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    with _children() as procs:
        try:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _PIPE_ECHO, str(p2c_r), str(c2p_w), str(size)],
                    pass_fds=(p2c_r, c2p_w),
                )
            )
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        msg = b"x" * size
        try:

            def once() -> float:
                t0 = time.perf_counter_ns()
                os.write(p2c_w, msg)
                got = 0
                while got < size:
                    b = os.read(c2p_r, size - got)
                    if not b:
                        raise RuntimeError("pipe echo child exited")
                    got += len(b)
                return time.perf_counter_ns() - t0

            rtt, p50s = _trials(cfg, cfg.pipe_iters, once)
        finally:
            os.close(p2c_w)  # EOF: the child leaves its loop
            os.close(c2p_r)
    return {"size": size, "rtt_p50_us": rtt, "one_way_p50_us": rtt / 2, "trial_rtt_p50_us": p50s}


async def _atrials(
    cfg: Config, iters: int, once: Callable[[], Any], warmup: int = 100
) -> tuple[float, list[float]]:
    """:func:`_trials` for a coroutine function ``once`` (returns ns)."""
    for _ in range(warmup):
        await once()
    p50s = []
    for _ in range(cfg.trials):
        samples: list[float] = []
        deadline = time.monotonic() + cfg.trial_budget_s
        for _ in range(iters):
            samples.append(await once() / 1000)
            if time.monotonic() > deadline:
                break
        p50s.append(median(samples))
    return median(p50s), p50s


async def _aio_pipe(cfg: Config, size: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    with _children() as procs:
        try:
            procs.append(
                _spawn(
                    [_AIO_ECHO, "pipe", str(p2c_r), str(c2p_w), str(size)],
                    pass_fds=(p2c_r, c2p_w),
                )
            )
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        msg = b"x" * size
        state: dict[str, Any] = {"got": 0, "fut": None}

        def on_read() -> None:
            data = os.read(c2p_r, 65536)
            state["got"] += len(data)
            fut = state["fut"]
            if (not data or state["got"] >= size) and fut is not None and not fut.done():
                fut.set_result(None)

        loop.add_reader(c2p_r, on_read)
        try:

            async def once() -> float:
                state["got"] = 0
                state["fut"] = fut = loop.create_future()
                t0 = time.perf_counter_ns()
                os.write(p2c_w, msg)
                await asyncio.wait_for(fut, cfg.step_timeout_s)
                return time.perf_counter_ns() - t0

            rtt, p50s = await _atrials(cfg, cfg.pipe_iters, once)
        finally:
            loop.remove_reader(c2p_r)
            os.close(p2c_w)
            os.close(c2p_r)
    return {"size": size, "rtt_p50_us": rtt, "one_way_p50_us": rtt / 2, "trial_rtt_p50_us": p50s}


async def _aio_zmq(cfg: Config, size: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    ctx: zmq.Context[Any] = zmq.Context()
    timeout_ms = int(cfg.step_timeout_s * 1000)
    tx = _zmq_socket(ctx, zmq.PUSH, timeout_ms)
    rx = _zmq_socket(ctx, zmq.PULL, timeout_ms)
    fd = rx.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    state: dict[str, Any] = {"fut": None}

    def drain() -> None:
        while True:
            try:
                rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            fut = state["fut"]
            if fut is not None and not fut.done():
                fut.set_result(None)

    try:
        tx_port = tx.bind_to_random_port("tcp://127.0.0.1")
        rx_port = rx.bind_to_random_port("tcp://127.0.0.1")
        with _children() as procs:
            procs.append(
                _spawn(
                    [
                        _AIO_ECHO,
                        "zmq",
                        f"tcp://127.0.0.1:{tx_port}",
                        f"tcp://127.0.0.1:{rx_port}",
                    ]
                )
            )
            loop.add_reader(fd, drain)
            try:
                msg = b"P" * size

                async def once() -> float:
                    state["fut"] = fut = loop.create_future()
                    t0 = time.perf_counter_ns()
                    tx.send(msg)  # blocks (to SNDTIMEO) only until the child connects
                    await asyncio.wait_for(fut, cfg.step_timeout_s)
                    return time.perf_counter_ns() - t0

                rtt, p50s = await _atrials(cfg, cfg.zmq_iters, once, warmup=300)
                tx.send(b"Q")
            finally:
                loop.remove_reader(fd)
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()
    return {"size": size, "rtt_p50_us": rtt, "one_way_p50_us": rtt / 2, "trial_rtt_p50_us": p50s}


def asyncio_wakeups(cfg: Config) -> dict[str, Any]:
    """Baselines A2 and B3: the same ping-pongs with both ends driven by an asyncio loop.

    A2 (a pipe read through ``loop.add_reader``) is the floor for any asyncio actor on this
    machine; B3 (pyzmq through ``loop.add_reader``, drained until EAGAIN) is the mechanism
    stagewire's sockets use, before any of stagewire's own code runs.
    """

    async def both() -> dict[str, Any]:
        return {"pipe_1KiB": await _aio_pipe(cfg, KIB), "zmq_1KiB": await _aio_zmq(cfg, KIB)}

    return asyncio.run(both())


def _zmq_socket(ctx: zmq.Context[Any], kind: int, timeout_ms: int) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    return sock


def zmq_raw(cfg: Config) -> dict[str, Any]:
    """Baseline B: raw pyzmq PUSH/PULL over TCP loopback with one child process."""
    ctx: zmq.Context[Any] = zmq.Context()
    timeout_ms = int(cfg.step_timeout_s * 1000)
    tx = _zmq_socket(ctx, zmq.PUSH, timeout_ms)
    rx = _zmq_socket(ctx, zmq.PULL, timeout_ms)
    try:
        tx_port = tx.bind_to_random_port("tcp://127.0.0.1")
        rx_port = rx.bind_to_random_port("tcp://127.0.0.1")
        with _children() as procs:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _ZMQ_ECHO,
                        f"tcp://127.0.0.1:{tx_port}",
                        f"tcp://127.0.0.1:{rx_port}",
                    ]
                )
            )
            out: dict[str, Any] = {}
            for size in (1, KIB):
                msg = b"P" * size

                def once(msg: bytes = msg) -> float:
                    t0 = time.perf_counter_ns()
                    tx.send(msg)
                    rx.recv()
                    return time.perf_counter_ns() - t0

                rtt, p50s = _trials(cfg, cfg.zmq_iters, once, warmup=300)
                out[f"pingpong_{size}B"] = {
                    "rtt_p50_us": rtt,
                    "one_way_p50_us": rtt / 2,
                    "trial_rtt_p50_us": p50s,
                }
            blob = b"D" * KIB
            rates = []
            for _ in range(cfg.trials):
                n = cfg.zmq_stream_n
                t0 = time.perf_counter()
                tx.send(b"S")
                for _ in range(n):
                    tx.send(blob)
                tx.send(b"E")
                got = int(rx.recv())
                dt = time.perf_counter() - t0
                if got != n:
                    raise RuntimeError(f"zmq stream lost messages: {got} of {n}")
                rates.append(n / dt)
            out["stream_1KiB"] = {"msgs_per_s": median(rates), "trial_msgs_per_s": rates}
            tx.send(b"Q")
            return out
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()


def zmq_chain(cfg: Config) -> dict[str, Any]:
    """Baseline B2: the chain's topology built from four bare Python pyzmq relays."""
    ctx: zmq.Context[Any] = zmq.Context()
    timeout_ms = int(cfg.step_timeout_s * 1000)
    tx = _zmq_socket(ctx, zmq.PUSH, timeout_ms)
    rx = _zmq_socket(ctx, zmq.PULL, timeout_ms)
    try:
        downstream = f"tcp://127.0.0.1:{rx.bind_to_random_port('tcp://127.0.0.1')}"
        with _children() as procs:
            for role in ("last", "mid", "mid", "first"):
                p = subprocess.Popen(
                    [sys.executable, "-c", _ZMQ_RELAY, role, downstream], stdout=subprocess.PIPE
                )
                procs.append(p)
                assert p.stdout is not None
                downstream = p.stdout.readline().decode().strip()
                if not downstream.startswith("tcp://"):
                    raise RuntimeError(f"relay {role} did not start")
            tx.connect(downstream)
            msg = b"P" * KIB

            def once() -> float:
                t0 = time.perf_counter_ns()
                tx.send(msg)
                rx.recv()
                return time.perf_counter_ns() - t0

            rtt, p50s = _trials(cfg, cfg.chain_iters, once, warmup=300)
            rates = []
            for _ in range(cfg.trials):
                n = cfg.chain_stream_n
                t0 = time.perf_counter()
                tx.send(b"S%d" % n)
                got = int(rx.recv())
                dt = time.perf_counter() - t0
                if got != n:
                    raise RuntimeError(f"zmq chain lost messages: {got} of {n}")
                rates.append(n / dt)
            tx.send(b"Q")
            return {
                "rtt_p50_us": rtt,
                "hop_p50_us": rtt / CHAIN_HOPS,
                "trial_rtt_p50_us": p50s,
                "stream_msgs_per_s_per_edge": median(rates),
                "trial_stream_msgs_per_s": rates,
            }
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()


def import_startup(cfg: Config) -> dict[str, Any]:
    """A start-up floor: one fresh interpreter loading the worker's entry point as a
    launched worker does (``python -m pipeline worker``), asked only for its help."""
    times = []
    for _ in range(cfg.startup_probes):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pipeline", "worker", "--help"],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            timeout=cfg.step_timeout_s,
        )
        times.append(time.perf_counter() - t0)
    return {"import_worker_s": median(times), "trials_s": times}


# ---- ordering, in one process ---------------------------------------------------------------


async def _reorder_ready(n: int, item: bytes) -> float:
    """offer(i) then get(), item already there: the buffer's bookkeeping alone."""
    buf: ReorderBuffer[bytes] = ReorderBuffer("r", "e", chunk_timeout=30.0)
    t0 = time.perf_counter()
    for i in range(n):
        buf.offer(i, item, False)
        await buf.get()
    return time.perf_counter() - t0


async def _queue_ready(n: int, item: bytes) -> float:
    q: asyncio.Queue[bytes] = asyncio.Queue()
    t0 = time.perf_counter()
    for _ in range(n):
        q.put_nowait(item)
        await q.get()
    return time.perf_counter() - t0


async def _handoff(n: int, put: Callable[[int], None], get: Callable[[], Any]) -> float:
    """A consumer task that waits for every chunk, fed one chunk per loop turn.

    This is the pipeline's shape when the consumer keeps up: the socket callback files a
    chunk, and the handler blocked in ``get()`` wakes for it.
    """

    async def consume() -> None:
        for _ in range(n):
            await get()

    t0 = time.perf_counter()
    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)  # the consumer is now waiting
    for i in range(n):
        put(i)
        await asyncio.sleep(0)
    await task
    return time.perf_counter() - t0


async def _reorder_handoff(n: int, item: bytes) -> float:
    buf: ReorderBuffer[bytes] = ReorderBuffer("r", "e", chunk_timeout=30.0)

    def put(seq: int) -> None:
        buf.offer(seq, item, False)

    return await _handoff(n, put, buf.get)


async def _queue_handoff(n: int, item: bytes) -> float:
    q: asyncio.Queue[bytes] = asyncio.Queue()
    return await _handoff(n, lambda i: q.put_nowait(item), q.get)


async def _reorder_shuffled(n: int, item: bytes) -> float:
    """Chunks offered shuffled within blocks of 16 (a window), then drained in order."""
    buf: ReorderBuffer[bytes] = ReorderBuffer("r", "e", chunk_timeout=30.0)
    rng = random.Random(7)
    order: list[int] = []
    for base in range(0, n, 16):
        block = list(range(base, min(n, base + 16)))
        rng.shuffle(block)
        order.extend(block)
    t0 = time.perf_counter()
    for start in range(0, n, 16):
        block = order[start : start + 16]
        for seq in block:
            buf.offer(seq, item, False)
        for _ in block:
            await buf.get()
    return time.perf_counter() - t0


async def ordering_micro(cfg: Config) -> dict[str, Any]:
    """ReorderBuffer against asyncio.Queue, per 1 KiB chunk, in this process."""
    item = b"x" * KIB
    n = cfg.reorder_n
    runs: dict[str, Callable[[int, bytes], Any]] = {
        "reorder_ready": _reorder_ready,
        "queue_ready": _queue_ready,
        "reorder_handoff": _reorder_handoff,
        "queue_handoff": _queue_handoff,
        "reorder_shuffled16": _reorder_shuffled,
    }
    # A handoff costs a loop turn (~10x the ready path), so it runs a fifth of the chunks.
    # Many short rounds rather than a few long ones, each variant next to its FIFO and the
    # pair's order alternating: the differences are then taken between moments close
    # together, and neither side always runs first (a slow spell of a few hundred
    # milliseconds once made a full run's handoff look 15% dearer than the Queue's).
    rounds = 4 * cfg.trials
    counts = {k: max(1, (n // 5 if "handoff" in k else n) // 4) for k in runs}
    per_chunk: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        await fn(min(n, 5000), item)  # warm-up
    pairs = [("reorder_ready", "queue_ready"), ("reorder_handoff", "queue_handoff")]
    for r in range(rounds):
        order: list[str] = []
        for ours, fifo in pairs:
            order += [ours, fifo] if r % 2 == 0 else [fifo, ours]
        order.append("reorder_shuffled16")
        for name in order:
            fn = runs[name]
            per_chunk[name].append(await fn(counts[name], item) / counts[name] * 1e6)
    us = {k: median(v) for k, v in per_chunk.items()}
    return {
        "per_chunk_us": us,
        "chunks_per_s": {k: 1e6 / v for k, v in us.items()},
        "trial_per_chunk_us": per_chunk,
        "ratio_ready": us["queue_ready"] / us["reorder_ready"],
        "ratio_handoff": us["queue_handoff"] / us["reorder_handoff"],
        # What ordering adds over the FIFO an unordered receiver would need anyway: the
        # median of each trial's difference, since the variants of a trial run back to back
        # and the machine drifts between trials (one full run's handoff trials ranged from
        # 7.5 to 14.8 µs), so a difference of the medians compares different moments.
        "extra_us_ready": _paired_extra(per_chunk, "reorder_ready", "queue_ready"),
        "extra_us_handoff": _paired_extra(per_chunk, "reorder_handoff", "queue_handoff"),
    }


def _paired_extra(per_chunk: dict[str, list[float]], ours: str, fifo: str) -> float:
    """The median over trials of ``ours - fifo``, per chunk."""
    return median([a - b for a, b in zip(per_chunk[ours], per_chunk[fifo], strict=True)])


# ---- stagewire ------------------------------------------------------------------------------


def chain_spec(
    name: str,
    impls: tuple[str, str, str, str],
    window: int | None = None,
    cpu_idle: CpuIdle = "default",
) -> dict[str, Any]:
    """A 4-stage chain, every edge inline."""
    names = ("source", "relay1", "relay2", "sink")
    defaults: dict[str, Any] = {"transport": "inline", "chunk_timeout": "30s"}
    if cpu_idle != "default":
        defaults["cpu_idle"] = cpu_idle
    if window is not None:
        defaults["window"] = window
    return {
        "name": name,
        "defaults": defaults,
        "stages": {n: {"impl": impl} for n, impl in zip(names, impls, strict=True)},
        "edges": [
            {"from": a, "to": b, "transport": "inline"} for a, b in itertools.pairwise(names)
        ],
    }


LATENCY_CHAIN = ("benchmarks.bench_stages:Relay",) * 4
STREAM_CHAIN = (
    "benchmarks.bench_stages:Burst",
    "benchmarks.bench_stages:StreamRelay",
    "benchmarks.bench_stages:StreamRelay",
    "benchmarks.bench_stages:Count",
)


def _worker_pids(pipe: Pipeline) -> dict[str, int]:
    launcher = pipe._launcher  # private, but the benchmark wants per-stage CPU
    if launcher is None:
        return {}
    return {stage: proc.pid for (stage, _k), proc in launcher.procs.items()}


class _CpuMeter:
    """CPU seconds of each worker and of this (master + client) process over a span."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start = self._sample()

    def _sample(self) -> dict[str, float]:
        cpu = {stage: cpu_seconds(pid) for stage, pid in self.pids.items()}
        cpu["master+client"] = time.process_time()
        return cpu

    def stop(self) -> dict[str, float]:
        end = self._sample()
        return {k: end[k] - self._start[k] for k in end}


async def _started(spec: dict[str, Any]) -> tuple[Pipeline, float]:
    pipe = Pipeline(spec)
    t0 = time.perf_counter()
    await pipe.start()  # aclose()s the workers itself when start-up fails
    return pipe, time.perf_counter() - t0


async def stagewire_latency(cfg: Config) -> dict[str, Any]:
    """C.a: sequential 1 KiB requests through the 4-stage chain."""
    pipe, startup = await _started(chain_spec("hops-latency", LATENCY_CHAIN, cpu_idle=cfg.cpu_idle))
    try:
        blob = Blob(b"\x5a" * KIB)
        timeout = cfg.step_timeout_s
        out = await asyncio.wait_for(pipe.submit(blob), timeout)
        if not isinstance(out, Blob) or out.data != blob.data:
            raise RuntimeError(f"the chain returned {out!r}")
        for _ in range(50):
            await asyncio.wait_for(pipe.submit(blob), timeout)
        p50s = []
        for _ in range(cfg.trials):
            samples = []
            deadline = time.monotonic() + cfg.trial_budget_s
            for _ in range(cfg.sw_latency_iters):
                t0 = time.perf_counter_ns()
                await asyncio.wait_for(pipe.submit(blob), timeout)
                samples.append((time.perf_counter_ns() - t0) / 1000)
                if time.monotonic() > deadline:
                    break
            p50s.append(median(samples))
        hops = hop_p50s(await pipe.statistics())
    finally:
        await pipe.aclose()
    e2e = median(p50s)
    return {
        "startup_s": startup,
        "e2e_p50_us": e2e,
        "hop_p50_us": e2e / CHAIN_HOPS,
        "trial_e2e_p50_us": p50s,
        "envelope_hop_p50_us": median(list(hops.values())),
        "envelope_hop_p50_us_by_edge": hops,
    }


async def _stream_trial(
    pipe: Pipeline, n: int, concurrency: int, timeout: float
) -> tuple[float, dict[str, float]]:
    per = n // concurrency
    meter = _CpuMeter(_worker_pids(pipe))
    t0 = time.perf_counter()
    outs = await asyncio.wait_for(
        asyncio.gather(*(pipe.submit(Start(per, KIB)) for _ in range(concurrency))), timeout
    )
    dt = time.perf_counter() - t0
    cpu = meter.stop()
    for out in outs:
        if not isinstance(out, Counted) or out.chunks != per:
            raise RuntimeError(f"the sink counted {out!r}, expected {per} chunks")
    return per * concurrency / dt, cpu


async def stagewire_stream(
    cfg: Config, window: int | None = None, *, concurrent: bool = True
) -> dict[str, Any]:
    """C.b: N 1 KiB chunks streamed through the chain, one request and several at once."""
    name = "hops-stream" if window is None else f"hops-stream-w{window}"
    pipe, startup = await _started(chain_spec(name, STREAM_CHAIN, window, cfg.cpu_idle))
    trials = cfg.sw_stream_trials
    labels = [("single", 1)] + ([("concurrent", cfg.sw_concurrency)] if concurrent else [])
    try:
        # The warm-up also sizes the trials: about cfg.stream_trial_s each at the rate seen,
        # between cfg.sw_stream_min_n and cfg.sw_stream_n chunks, so a slow runtime still
        # finishes in time and a fast one streams long enough to reach a steady state.
        warm, _ = await _stream_trial(pipe, 2000, 1, cfg.step_timeout_s)
        n = int(min(cfg.sw_stream_n, max(cfg.sw_stream_min_n, warm * cfg.stream_trial_s)))
        result: dict[str, Any] = {"startup_s": startup, "n": n, "window": window}
        for label, conc in labels:
            rates, cpus = [], []
            for _ in range(trials):
                rate, cpu = await _stream_trial(pipe, n, conc, cfg.step_timeout_s)
                rates.append(rate)
                cpus.append(cpu)
            # CPU µs per chunk for each process, from the trial with the median rate.
            mid = sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]
            chunks = (n // conc) * conc
            cpu_us = {k: v / chunks * 1e6 for k, v in cpus[mid].items()}
            result[label] = {
                "concurrency": conc,
                "chunks_per_s_per_edge": median(rates),
                "trial_chunks_per_s": rates,
                "cpu_us_per_chunk": cpu_us,
                "cpu_us_per_chunk_total": sum(cpu_us.values()),
            }
        stats = await pipe.statistics()
        result["envelope_hop_p50_us_by_edge"] = hop_p50s(stats)
    finally:
        await pipe.aclose()
    return result


# ---- report ---------------------------------------------------------------------------------


def _fmt(v: float, unit: str) -> str:
    if unit == "us":
        return f"{v:.1f} µs"
    if unit == "/s":
        return f"{v / 1000:.1f}k/s"
    if unit == "s":
        return f"{v:.2f} s"
    if unit == "%":
        return f"{v * 100:.1f}%"
    return f"{v:.3g}"


def build_rows(r: dict[str, Any]) -> list[list[str]]:
    """The markdown table: metric, stagewire, baseline, ratio, target, status."""
    pipe1k = r["pipe"]["1KiB"]["one_way_p50_us"]
    lat = r["stagewire"]["latency"]
    st = r["stagewire"]["stream"]
    zr = r["zmq"]
    ch = r["zmq_chain"]
    o = r["ordering"]
    rows: list[list[str]] = []

    def row(
        metric: str, sw: str, base: str, ratio: float | None, target: str, ok: bool | None
    ) -> None:
        status = "info" if ok is None else ("met" if ok else "**missed**")
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        rows.append([metric, sw, base, shown, target, status])

    ratio = lat["hop_p50_us"] / pipe1k
    row(
        "1 KiB hop p50, e2e/5 (conc 1)",
        _fmt(lat["hop_p50_us"], "us"),
        f"pipe wake-up 1 KiB {_fmt(pipe1k, 'us')}",
        ratio,
        f"≤ {TARGET_HOP_RATIO}x",
        ratio <= TARGET_HOP_RATIO,
    )
    ratio = lat["envelope_hop_p50_us"] / pipe1k
    row(
        "1 KiB envelope hop p50 (statistics)",
        _fmt(lat["envelope_hop_p50_us"], "us"),
        f"pipe wake-up 1 KiB {_fmt(pipe1k, 'us')}",
        ratio,
        f"≤ {TARGET_HOP_RATIO}x",
        ratio <= TARGET_HOP_RATIO,
    )
    aio = r["asyncio"]
    z1k = zr["pingpong_1024B"]["one_way_p50_us"]
    for sw_label, sw_value in (
        ("1 KiB hop p50, e2e/5", lat["hop_p50_us"]),
        ("1 KiB envelope hop p50", lat["envelope_hop_p50_us"]),
    ):
        for base_label, base in (
            ("asyncio pipe wake-up", aio["pipe_1KiB"]["one_way_p50_us"]),
            ("asyncio pyzmq (add_reader)", aio["zmq_1KiB"]["one_way_p50_us"]),
        ):
            row(
                sw_label,
                _fmt(sw_value, "us"),
                f"{base_label} {_fmt(base, 'us')}",
                sw_value / base,
                "-",
                None,
            )
    row(
        "1 KiB hop p50, e2e/5",
        _fmt(lat["hop_p50_us"], "us"),
        f"raw pyzmq tcp one-way {_fmt(z1k, 'us')}",
        lat["hop_p50_us"] / z1k,
        "-",
        None,
    )
    row(
        "1 KiB hop p50, e2e/5",
        _fmt(lat["hop_p50_us"], "us"),
        f"raw pyzmq 4-relay chain /5 {_fmt(ch['hop_p50_us'], 'us')}",
        lat["hop_p50_us"] / ch["hop_p50_us"],
        "-",
        None,
    )
    idle = r.get("idle_wakeup")
    if idle:
        hot, cold = idle[0], idle[-1]
        row(
            "1 KiB envelope hop p50",
            _fmt(lat["envelope_hop_p50_us"], "us"),
            f"unix-socket wake-up, receiver idle {cold['gap_ms']:.1f} ms first (as a chain "
            f"stage) {_fmt(cold['wake_us'], 'us')}; in ping-pong {_fmt(hot['wake_us'], 'us')}",
            lat["envelope_hop_p50_us"] / cold["wake_us"],
            "-",
            None,
        )
    zs = zr["stream_1KiB"]["msgs_per_s"]
    for label in ("single", "concurrent"):
        rate = st[label]["chunks_per_s_per_edge"]
        what = "1 request" if label == "single" else f"{st[label]['concurrency']} requests"
        row(
            f"streaming 1 KiB chunks/s per edge, {what}",
            _fmt(rate, "/s"),
            f"raw pyzmq 1 KiB stream {_fmt(zs, '/s')}",
            rate / zs,
            f"≥ {TARGET_CHUNKS_PER_S // 1000}k/s",
            rate >= TARGET_CHUNKS_PER_S,
        )
    rate = st["single"]["chunks_per_s_per_edge"]
    cs = ch["stream_msgs_per_s_per_edge"]
    row(
        "streaming 1 KiB chunks/s per edge, 1 request",
        _fmt(rate, "/s"),
        f"raw pyzmq 4-relay chain {_fmt(cs, '/s')}",
        rate / cs,
        "-",
        None,
    )
    if "stream_wide" in r["stagewire"]:
        w = r["stagewire"]["stream_wide"]
        wr = w["single"]["chunks_per_s_per_edge"]
        row(
            f"streaming, window {w['window']} (diagnostic), 1 request",
            _fmt(wr, "/s"),
            f"default window {_fmt(rate, '/s')}",
            wr / rate,
            "-",
            None,
        )
    cps = o["chunks_per_s"]
    row(
        "ReorderBuffer offer+get, ready (chunks/s)",
        _fmt(cps["reorder_ready"], "/s"),
        f"asyncio.Queue {_fmt(cps['queue_ready'], '/s')}",
        cps["reorder_ready"] / cps["queue_ready"],
        "-",
        None,
    )
    row(
        "ReorderBuffer handoff to waiting consumer",
        _fmt(cps["reorder_handoff"], "/s"),
        f"asyncio.Queue {_fmt(cps['queue_handoff'], '/s')}",
        cps["reorder_handoff"] / cps["queue_handoff"],
        "-",
        None,
    )
    oc = r["ordering_cost"]
    row(
        "ordering cost / per-chunk pipeline cost (worse of 2 views)",
        _fmt(oc["fraction"], "%"),
        f"+{oc['extra_us']:.1f} µs/chunk/edge vs a FIFO; per edge "
        f"{_fmt(oc['fraction_per_edge'], '%')} of {oc['pipeline_us_per_chunk']:.0f} µs, per CPU "
        f"{_fmt(oc['fraction_per_cpu'], '%')} of {oc['cpu_us_per_chunk']:.0f} µs",
        None,
        f"≤ {TARGET_ORDERING_FRACTION:.0%}",
        oc["fraction"] <= TARGET_ORDERING_FRACTION,
    )
    imp = r["startup"]["import_worker_s"]
    for label, key in (("latency chain", "latency"), ("streaming chain", "stream")):
        s = r["stagewire"][key]["startup_s"]
        row(
            f"worker start-up, 4 workers ({label})",
            _fmt(s, "s"),
            f"1 interpreter + import {_fmt(imp, 's')}",
            s / imp,
            "report",
            None,
        )
    return rows


def ordering_cost(o: dict[str, Any], stream: dict[str, Any]) -> dict[str, Any]:
    """How much of the pipeline's per-chunk cost ordering is.

    Without ordering a receiver would still need a FIFO between the socket callback and the
    handler, so ordering's cost is what a ReorderBuffer adds over an asyncio.Queue, taking
    the worse of the "chunk already there" and "consumer waiting" paths. Every stage->stage
    edge pays it once per chunk, in the receiving process, and nowhere else. Two views of
    the per-chunk pipeline cost are used and the larger fraction is reported:

    * per edge: each edge moves a chunk every 1/R seconds (R = chunks/s per edge from C.b),
      and its receiver spends ``extra`` of that on ordering: fraction = extra * R;
    * per CPU: the chunk costs the sum of every process's CPU time per chunk (measured in
      C.b) and ordering adds ``extra`` for each of the three ordered edges:
      fraction = 3 * extra / total CPU per chunk.

    If that fraction is at most 10%, removing ordering entirely (the best an unordered
    runtime could do) would raise throughput by at most ~10%: ordering costs at most 10%
    of throughput. A negative ``extra`` (ReorderBuffer faster than the Queue) counts as 0.
    """
    extra = max(0.0, o["extra_us_ready"], o["extra_us_handoff"])
    single = stream["single"]
    rate = single["chunks_per_s_per_edge"]
    per_edge = extra * rate / 1e6
    cpu_total = single["cpu_us_per_chunk_total"]
    per_cpu = len(INTERNAL_EDGES) * extra / cpu_total if cpu_total > 0 else 0.0
    upper = max(o["per_chunk_us"]["reorder_ready"], o["per_chunk_us"]["reorder_handoff"])
    return {
        "extra_us": extra,
        "pipeline_us_per_chunk": 1e6 / rate,
        "cpu_us_per_chunk": cpu_total,
        "fraction_per_edge": per_edge,
        "fraction_per_cpu": per_cpu,
        "fraction": max(per_edge, per_cpu),
        # As if the whole ReorderBuffer were overhead (no FIFO needed at all): a bound.
        "upper_bound_fraction": upper * rate / 1e6,
    }


def _spread(res: dict[str, Any]) -> str:
    trials = [t / 2 for t in res["trial_rtt_p50_us"]]
    return f"{res['one_way_p50_us']:.1f} µs [{min(trials):.1f}-{max(trials):.1f}]"


def render(r: dict[str, Any]) -> str:
    """The markdown report: the table, then the detail a reader needs to judge it."""
    lines = [
        "| metric | stagewire | baseline | ratio | target | status |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in build_rows(r)]
    lat = r["stagewire"]["latency"]
    st = r["stagewire"]["stream"]
    lines += [
        "",
        f"- machine: {r['machine']['cpus']} CPUs, Python {r['machine']['python']}, "
        f"pyzmq {r['machine']['pyzmq']}; medians of {r['config']['trials']} trials; "
        f"cpu_idle: {r['config'].get('cpu_idle', 'default')}",
        "- one-way p50 = RTT/2, median of trials [slowest and fastest trial]; a 2-vCPU VM "
        "flips between a fast regime (the peer vCPU still awake) and a slow one (woken from "
        "halt), so trials can differ several-fold: "
        + "; ".join(
            f"{label} {_spread(res)}"
            for label, res in (
                ("pipe 1 B", r["pipe"]["1B"]),
                ("pipe 1 KiB", r["pipe"]["1KiB"]),
                ("asyncio pipe 1 KiB", r["asyncio"]["pipe_1KiB"]),
                ("pyzmq tcp 1 B", r["zmq"]["pingpong_1B"]),
                ("pyzmq tcp 1 KiB", r["zmq"]["pingpong_1024B"]),
                ("asyncio pyzmq 1 KiB", r["asyncio"]["zmq_1KiB"]),
            )
        ),
        f"- stagewire e2e p50 {lat['e2e_p50_us']:.0f} µs over {CHAIN_HOPS} hops "
        "(client->source, source->relay1, relay1->relay2, relay2->sink, sink->client)",
        "- envelope hop p50 by edge (conc 1): "
        + ", ".join(f"{k} {v:.0f} µs" for k, v in lat["envelope_hop_p50_us_by_edge"].items()),
    ]
    for label in ("single", "concurrent"):
        cpu = st[label]["cpu_us_per_chunk"]
        lines.append(
            f"- CPU µs per chunk ({label}): "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            + f"; total {st[label]['cpu_us_per_chunk_total']:.1f}"
        )
    o = r["ordering"]["per_chunk_us"]
    lines.append(
        "- ordering µs per chunk: "
        + ", ".join(f"{k} {v:.2f}" for k, v in o.items())
        + f"; upper bound (whole buffer as overhead) "
        f"{r['ordering_cost']['upper_bound_fraction'] * 100:.1f}% of the per-edge chunk time"
    )
    return "\n".join(lines)


async def run_async(cfg: Config, wide_window: int | None) -> dict[str, Any]:
    """The stagewire and in-process phases (one event loop)."""
    out: dict[str, Any] = {}
    _log("ordering micro-benchmark")
    out["ordering"] = await ordering_micro(cfg)
    _log("stagewire latency chain")
    latency = await stagewire_latency(cfg)
    _log("stagewire streaming chain")
    stream = await stagewire_stream(cfg)
    out["stagewire"] = {"latency": latency, "stream": stream}
    if wide_window is not None:
        _log(f"stagewire streaming chain, window {wide_window}")
        out["stagewire"]["stream_wide"] = await stagewire_stream(cfg, wide_window, concurrent=False)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every phase, print the markdown table, optionally write the raw numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter trials (~40 s)")
    p.add_argument("--json", metavar="OUT", help="write the raw numbers to this file")
    p.add_argument(
        "--wide-window",
        type=int,
        default=None,
        metavar="W",
        help="also stream with credit window W, to see how much the window limits "
        "throughput (default: 1024 in full mode, off with --quick; 0 turns it off)",
    )
    add_cpu_idle_option(p, "every baseline")
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every finally block stops what this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = replace(QUICK if args.quick else FULL, cpu_idle=args.cpu_idle)
    hold_cpu_idle_for_run(cfg.cpu_idle)
    json_out = os.path.abspath(args.json) if args.json else None
    os.chdir(ROOT)  # workers resolve "benchmarks.bench_stages" from the working directory
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "config": {**asdict(cfg), "quick": args.quick},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pyzmq": zmq.__version__,
            "platform": platform.platform(),
        },
    }
    _log("baseline A: pipe wake-up")
    results["pipe"] = {"1B": pipe_wakeup(cfg, 1), "1KiB": pipe_wakeup(cfg, KIB)}
    _log("baseline A2/B3: asyncio-driven pipe and pyzmq wake-ups")
    results["asyncio"] = asyncio_wakeups(cfg)
    _log("baseline B: raw pyzmq")
    results["zmq"] = zmq_raw(cfg)
    _log("baseline B2: raw pyzmq 4-relay chain")
    results["zmq_chain"] = zmq_chain(cfg)
    results["startup"] = import_startup(cfg)
    wide = args.wide_window if args.wide_window is not None else (None if args.quick else 1024)
    results.update(asyncio.run(run_async(cfg, wide or None)))
    results["ordering_cost"] = ordering_cost(results["ordering"], results["stagewire"]["stream"])
    _log("diagnostic F: wake-up after the receiver idled as long as a chain stage does")
    idle_s = results["stagewire"]["latency"]["e2e_p50_us"] / 1e6
    results["idle_wakeup"] = wake_cost(cfg.pipe_iters // 10, (0.0, idle_s))
    results["elapsed_s"] = time.perf_counter() - t_start
    results["phase_start_s"] = _log.phases
    print(render(results))
    print(f"\n(total {results['elapsed_s']:.0f} s)")
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
