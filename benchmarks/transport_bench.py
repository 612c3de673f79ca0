"""Transports by payload size: every stagewire transport against raw baselines, in one run.

Run from the repository root (worker processes import ``benchmarks.transport_stages``)::

    .venv/bin/python benchmarks/transport_bench.py [--quick] [--json OUT] [--plot OUT.png]
        [--sizes 1KiB,16MiB] [--transports inline,shm] [--no-ray]

The markdown report goes to stdout, progress (and the workers' logs) to stderr. A full run
takes about 3 minutes on a 2-core machine, ``--quick`` about 75 s. ``--smoke`` is a tiny
run (2 sizes, 1 trial, no Ray) for the test suite. The Ray baseline and the plot need the
``bench`` extra (``pip install -e .[bench]``); without it they are skipped with a note.

Sizes are 1 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB. Absolute timings on a small shared VM
are noisy, so everything is a median over trials and the targets of DESIGN section 11 are
ratios against baselines measured in the same run. Latencies are one-way; "p50" is the
median of the trials' medians, "p99" the 99th percentile of every sample of every trial.

Baselines (one child process each, started and reaped here):

* memcpy: ``numpy.copyto`` into a preallocated, pre-faulted buffer (warm: both buffers
  were touched before timing), in batches for the small sizes.
* pipe wake-up: ``os.pipe`` ping-pong with a child, 1 B and 1 KiB, one-way = RTT/2
  (``benchmarks.hops.pipe_wakeup``).
* raw pyzmq PUSH/PULL, over ipc and over tcp loopback, ``copy=False`` both ways: one-way
  latency = RTT/2 of an echo of the full payload; throughput = N payloads streamed to the
  child until it answers the count.
* ``multiprocessing.Queue`` (spawn context, pickle): the same echo and stream.
* Ray (if installed): two actors on this host, A -> B with numpy payloads. Hop = from A
  just before ``B.take.remote(x)`` to B's method running (monotonic clock, one host);
  throughput = N calls from A, until the last has run in B. Ray's start-up is not timed.

stagewire, per transport (inline, shm, network, cuda_ipc on a CUDA device, auto): a 2-stage
pipeline ``source -> sink`` whose edge is pinned to the transport, payload a Struct with one
uint8 array of the size (``benchmarks.transport_stages.Frame``).

* hop p50/p99: sequential requests of one chunk. The source stamps ``time.monotonic_ns()``
  just before the runtime encodes and puts the chunk; the sink notes the clock when its
  handler has the decoded payload. So the hop is timed from put-start to get-complete
  (plus decode, release, reorder and the handler's wake-up), in the pipeline itself. The
  envelope hop of ``statistics()`` starts after ``put`` returns and ends before ``get``,
  so it is not used for this; it is kept in the JSON. As a cross-check the end-to-end p50
  minus that of an empty payload on the same pipeline is in the JSON too.
* streaming: one request whose source yields N chunks; bytes/s = N * size / (first chunk's
  put-start -> last chunk in the sink's handler). N is sized from a warm-up trial to last
  about ``stream_trial_s``, and capped so a 64 MiB run moves about 2 GiB in all.

Transport alone (no pipeline, no runtime), for each concrete transport:

* in process: one ``put -> descriptor through msgpack -> decode_descriptor -> get ->
  release`` cycle per payload, same sender and receiver, one event loop.
* two processes: the producer is a child process with the sending end. On request it
  stamps the clock, puts, and sends the descriptor over a pipe (asyncio streams); this
  process decodes it, ``get``s and releases. Hop = put-start -> get-complete. Streaming:
  the child puts N chunks under a credit window while this process gets and releases.

Every child process is stopped by pid in a ``finally`` block, pipelines are closed, and
``/dev/shm`` is listed before and after the run: the report names what was left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import platform
import queue
import re
import secrets
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This module is not named transports.py: run as a script, its folder leads sys.path, and a
# benchmarks/transports.py would shadow the transports package for every import below.
if str(ROOT) not in sys.path:
    # Workers inherit the parent's sys.path, so they find ``benchmarks.transport_stages``.
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from benchmarks import hops  # noqa: E402
from benchmarks._measure import PhaseLog, median  # noqa: E402
from benchmarks.transport_stages import Frame, Go, Tally, mp_echo, prefaulted  # noqa: E402
from pipeline import ConfigError, Pipeline  # noqa: E402
from pipeline._codec import codec_for  # noqa: E402
from pipeline._encoded import Encoded  # noqa: E402
from pipeline._host import host_identity  # noqa: E402
from pipeline._keys import ChunkKey  # noqa: E402
from pipeline._units import parse_byte_size  # noqa: E402
from transports import (  # noqa: E402
    EdgeContext,
    TransportReceiver,
    create_transport,
    resolve_transport,
)
from transports._cuda_files import cuda_files_of  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
SIZES = (KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB)
TRANSPORTS = ("inline", "shm", "network", "cuda_ipc", "auto")
#: The policy: it picks among the others per payload, so it is measured in the pipeline only.
AUTO = "auto"
EDGE = "source->sink"
#: Options per transport for the pipeline's edge and the transport-level runs (none yet:
#: every transport must work at these sizes with its defaults).
TRANSPORT_OPTIONS: dict[str, dict[str, Any]] = {}

# DESIGN section 11.
TARGET_SHM_HOP_X_MEMCPY = 2.0
TARGET_SHM_STREAM_OF_MEMCPY = 0.70
TARGET_NETWORK_OF_ZMQ = 0.80
TARGET_HOP_X_WAKEUP = 1.5
#: cuda_ipc: "hop latency flat in size (1 GiB at most 200 µs)". Flat is read as the largest
#: size's hop at most 1.5x the smallest's; the bound is checked on the transport alone.
TARGET_CUDA_FLAT = 1.5
TARGET_CUDA_HOP_US = 200.0

_log = PhaseLog("transports")
#: Every process this run started (and this one): /dev/shm names carrying one are ours.
_PIDS: set[int] = {os.getpid()}

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class Config:
    """Counts and time bounds of every phase; ``--quick`` and ``--smoke`` scale them down."""

    sizes: tuple[int, ...] = SIZES
    transports: tuple[str, ...] = TRANSPORTS
    trials: int = 3
    #: Copies timed per memcpy trial (in batches of up to 16 MiB for the small sizes).
    memcpy_iters: int = 30
    pipe_iters: int = 2000
    #: Sequential samples of one size per trial: at most, at least, and the time budget.
    lat_iters: int = 300
    lat_min_iters: int = 3
    lat_budget_s: float = 0.4
    #: Aimed-for length of one streaming trial (N is sized from a warm-up run).
    stream_trial_s: float = 0.4
    stream_min_n: int = 3
    stream_max_n: int = 5000
    #: Bytes one streaming trial moves at most: 3 trials of 64 MiB chunks move ~2 GiB.
    stream_trial_bytes: int = 640 * MIB
    #: Chunks in flight in the two-process transport stream (also bounded by 256 MiB).
    window: int = 64
    ray: bool = True
    ray_object_store: int = 2 * GIB
    #: Deadline of any single blocking step (a request, a reply), in seconds.
    step_timeout_s: float = 30.0
    #: Baselines skip sizes above this (0: none): a 1 GiB cuda_ipc hop needs no 1 GiB
    #: pickle through a multiprocessing.Queue beside it.
    baseline_max: int = 0

    @property
    def baseline_sizes(self) -> tuple[int, ...]:
        """The sizes the baselines measure."""
        return tuple(s for s in self.sizes if not self.baseline_max or s <= self.baseline_max)


FULL = Config()
QUICK = Config(
    trials=2,
    memcpy_iters=20,
    pipe_iters=1000,
    lat_iters=150,
    lat_min_iters=2,
    lat_budget_s=0.2,
    stream_trial_s=0.2,
    stream_min_n=2,
    stream_max_n=2000,
    stream_trial_bytes=192 * MIB,
)
#: For the smoke test: two sizes, one short trial, no Ray.
SMOKE = Config(
    sizes=(KIB, 64 * KIB),
    trials=1,
    memcpy_iters=5,
    pipe_iters=200,
    lat_iters=20,
    lat_min_iters=2,
    lat_budget_s=0.05,
    stream_trial_s=0.05,
    stream_min_n=2,
    stream_max_n=200,
    stream_trial_bytes=16 * MIB,
    ray=False,
    step_timeout_s=20.0,
)


def size_label(size: int) -> str:
    """``1 KiB``, ``64 MiB``, ..."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


# ---- sampling -------------------------------------------------------------------------------


def _pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _warmup(size: int) -> int:
    return 10 if size <= MIB else 1


def _summary(trials: list[list[float]]) -> dict[str, Any]:
    """p50 = median of the trials' medians; p99 over every sample (µs)."""
    p50s = [median(t) for t in trials]
    pooled = [x for t in trials for x in t]
    return {"p50_us": median(p50s), "p99_us": _pct(pooled, 99), "trial_p50_us": p50s,
            "samples": len(pooled)}  # fmt: skip


def _budgeted(cfg: Config) -> Iterator[None]:
    """Yield once per sample of one trial: at least ``lat_min_iters``, then until the budget."""
    deadline = time.monotonic() + cfg.lat_budget_s
    for i in range(cfg.lat_iters):
        if i >= cfg.lat_min_iters and time.monotonic() > deadline:
            return
        yield None


def sample(cfg: Config, size: int, once: Callable[[], float]) -> dict[str, Any]:
    """Trials of ``once()`` (ns per sample) after a warm-up; see :func:`_summary`."""
    for _ in range(_warmup(size)):
        once()
    return _summary([[once() / 1000 for _ in _budgeted(cfg)] for _ in range(cfg.trials)])


async def asample(
    cfg: Config, size: int, once: Callable[[], Awaitable[tuple[float, ...]]], names: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """:func:`sample` for a coroutine returning one ns figure per name."""
    for _ in range(_warmup(size)):
        await once()
    trials: dict[str, list[list[float]]] = {n: [] for n in names}
    for _ in range(cfg.trials):
        per: dict[str, list[float]] = {n: [] for n in names}
        for _ in _budgeted(cfg):
            for n, v in zip(names, await once(), strict=True):
                per[n].append(v / 1000)
        for n in names:
            trials[n].append(per[n])
    return {n: _summary(t) for n, t in trials.items()}


def _stream_bounds(cfg: Config, size: int) -> tuple[int, int]:
    """(warm-up N, largest N) of a streaming trial of ``size``-byte chunks."""
    cap = max(cfg.stream_min_n, min(cfg.stream_max_n, cfg.stream_trial_bytes // max(size, 1)))
    return max(cfg.stream_min_n, min(cap // 8, 200)), cap


def _stream_result(size: int, n: int, seconds: list[float]) -> dict[str, Any]:
    rates = [n / s for s in seconds]
    return {
        "n": n,
        "chunks_per_s": median(rates),
        "bytes_per_s": median(rates) * size,
        "trial_chunks_per_s": rates,
    }


def stream(cfg: Config, size: int, run: Callable[[int], float]) -> dict[str, Any]:
    """Streaming trials: ``run(n)`` moves n chunks and returns the seconds it took."""
    warm_n, cap = _stream_bounds(cfg, size)
    rate = warm_n / run(warm_n)
    n = max(cfg.stream_min_n, min(cap, int(rate * cfg.stream_trial_s)))
    return _stream_result(size, n, [run(n) for _ in range(cfg.trials)])


async def astream(cfg: Config, size: int, run: Callable[[int], Awaitable[float]]) -> dict[str, Any]:
    """:func:`stream` for a coroutine."""
    warm_n, cap = _stream_bounds(cfg, size)
    rate = warm_n / await run(warm_n)
    n = max(cfg.stream_min_n, min(cap, int(rate * cfg.stream_trial_s)))
    return _stream_result(size, n, [await run(n) for _ in range(cfg.trials)])


def _error(exc: BaseException) -> dict[str, Any]:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return {"error": text[:300]}


# ---- baselines ------------------------------------------------------------------------------


def memcpy(cfg: Config) -> dict[str, Any]:
    """One warm ``numpy.copyto`` per size, into a preallocated, pre-faulted buffer."""
    out: dict[str, Any] = {}
    for size in cfg.baseline_sizes:
        src = prefaulted(size)
        dst = np.zeros(size, np.uint8)  # np.zeros is lazy: touch every page before timing
        dst.fill(1)
        batch = max(1, min(1000, (16 * MIB) // size))

        def once(src: Any = src, dst: Any = dst, batch: int = batch) -> float:
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                np.copyto(dst, src)
            return (time.perf_counter_ns() - t0) / batch

        for _ in range(3):
            once()
        trials = [[once() / 1000 for _ in range(cfg.memcpy_iters)] for _ in range(cfg.trials)]
        res = _summary(trials)
        res["bytes_per_s"] = size / (res["p50_us"] / 1e6)
        out[str(size)] = res
    return out


def pipe_wakeup(cfg: Config) -> dict[str, Any]:
    """The raw cross-process wake-ups of ``benchmarks.hops``: blocking reads, 1 B and 1 KiB,
    and 1 KiB with both ends reading through an asyncio loop (the floor of any asyncio actor).
    """
    hcfg = hops.Config(
        trials=cfg.trials,
        pipe_iters=cfg.pipe_iters,
        trial_budget_s=2.0,
        step_timeout_s=cfg.step_timeout_s,
    )
    return {
        "1": hops.pipe_wakeup(hcfg, 1),
        str(KIB): hops.pipe_wakeup(hcfg, KIB),
        "asyncio_1024": asyncio.run(hops._aio_pipe(hcfg, KIB)),
    }


# An echo of whole payloads with copy=False both ways. One-byte frames are commands: b"S"
# starts a count of payloads that ends at b"E" (answered with the count), b"Q" quits. An
# idle recv times out every second to check whether the parent is still there.
_ZMQ_SIZED_ECHO = """
import os, sys, zmq
parent = os.getppid()
ctx = zmq.Context()
rx = ctx.socket(zmq.PULL); rx.setsockopt(zmq.LINGER, 0); rx.setsockopt(zmq.RCVTIMEO, 1000)
rx.connect(sys.argv[1])
tx = ctx.socket(zmq.PUSH); tx.setsockopt(zmq.LINGER, 0); tx.connect(sys.argv[2])
def recv():
    while True:
        try:
            return rx.recv(copy=False)
        except zmq.Again:
            if os.getppid() != parent:
                sys.exit(0)
while True:
    m = recv()
    if len(m) == 1:
        if m.bytes == b"Q":
            break
        if m.bytes == b"S":
            n = 0
            while len(recv()) != 1:
                n += 1
            tx.send(str(n).encode())
        continue
    tx.send(m, copy=False)
tx.close(); rx.close(); ctx.term()
"""


def zmq_raw(cfg: Config, kind: str) -> dict[str, Any]:
    """Raw pyzmq PUSH/PULL with one child, over ``ipc`` or ``tcp`` loopback, per size."""
    ctx: zmq.Context[Any] = zmq.Context()
    timeout_ms = int(cfg.step_timeout_s * 1000)
    tx = hops._zmq_socket(ctx, zmq.PUSH, timeout_ms)
    rx = hops._zmq_socket(ctx, zmq.PULL, timeout_ms)
    paths: list[str] = []
    try:
        if kind == "ipc":
            base = f"/tmp/stagewire-bench-{os.getpid()}-{secrets.token_hex(4)}"
            paths = [base + "-tx", base + "-rx"]
            tx.bind(f"ipc://{paths[0]}")
            rx.bind(f"ipc://{paths[1]}")
            endpoints = [f"ipc://{p}" for p in paths]
        else:
            endpoints = [
                f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
                for sock in (tx, rx)
            ]
        out: dict[str, Any] = {}
        with hops._children() as procs:
            procs.append(hops._spawn([_ZMQ_SIZED_ECHO, *endpoints]))
            _PIDS.add(procs[-1].pid)
            for size in cfg.baseline_sizes:
                buf = prefaulted(size)

                def once(buf: Any = buf) -> float:
                    t0 = time.perf_counter_ns()
                    tx.send(buf, copy=False)
                    rx.recv(copy=False)
                    return (time.perf_counter_ns() - t0) / 2

                def run(n: int, buf: Any = buf) -> float:
                    t0 = time.perf_counter()
                    tx.send(b"S")
                    for _ in range(n):
                        tx.send(buf, copy=False)
                    tx.send(b"E")
                    got = int(rx.recv())
                    if got != n:
                        raise RuntimeError(f"zmq {kind} stream lost messages: {got} of {n}")
                    return time.perf_counter() - t0

                try:
                    out[str(size)] = {
                        "latency": sample(cfg, size, once),
                        "stream": stream(cfg, size, run),
                    }
                except zmq.ZMQError as exc:
                    out[str(size)] = _error(exc)
                    break
            tx.send(b"Q")
        return out
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def mp_queue(cfg: Config) -> dict[str, Any]:
    """``multiprocessing.Queue`` (spawn, pickle): echo latency and streaming, per size."""
    mp = multiprocessing.get_context("spawn")
    q_in: Any = mp.Queue()
    q_out: Any = mp.Queue()
    proc = mp.Process(target=mp_echo, args=(q_in, q_out), daemon=True)
    proc.start()
    assert proc.pid is not None
    _PIDS.add(proc.pid)
    timeout = cfg.step_timeout_s
    out: dict[str, Any] = {}
    try:
        for size in cfg.baseline_sizes:
            buf = prefaulted(size)

            def once(buf: Any = buf) -> float:
                t0 = time.perf_counter_ns()
                q_in.put(("echo", buf))
                q_out.get(timeout=timeout)
                return (time.perf_counter_ns() - t0) / 2

            def run(n: int, buf: Any = buf) -> float:
                t0 = time.perf_counter()
                q_in.put(("count", n))
                for _ in range(n):
                    q_in.put(buf)
                got = q_out.get(timeout=timeout)
                if got != n * buf.nbytes:
                    raise RuntimeError(f"mp.Queue stream lost data: {got} of {n * buf.nbytes}")
                return time.perf_counter() - t0

            try:
                out[str(size)] = {
                    "latency": sample(cfg, size, once),
                    "stream": stream(cfg, size, run),
                }
            except queue.Empty as exc:
                out[str(size)] = _error(exc)
                break
        q_in.put(None)
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join(3)
        for q in (q_in, q_out):
            q.cancel_join_thread()  # never block exit on data the child will not read
            q.close()
    return out


def ray_chain(cfg: Config) -> dict[str, Any]:
    """Two Ray actors on this host, A -> B, numpy payloads: hop latency and throughput."""
    if not cfg.ray:
        return {"skipped": "disabled (--no-ray)"}
    if importlib.util.find_spec("ray") is None:
        return {"skipped": "ray not installed: pip install -e .[bench]"}
    import ray  # type: ignore[import-not-found,unused-ignore]  # the optional bench extra

    t0 = time.perf_counter()
    ray.init(
        num_cpus=max(2, os.cpu_count() or 2),
        object_store_memory=cfg.ray_object_store,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    out: dict[str, Any] = {}
    try:
        # Defined here so that cloudpickle ships them by value: workers need no sys.path.
        @ray.remote
        class Sink:
            def take(self, x: Any) -> int:
                return time.monotonic_ns()

        @ray.remote
        class Sender:
            def __init__(self, sink: Any) -> None:
                self.sink = sink
                self.buffers: dict[int, Any] = {}

            def _buf(self, size: int) -> Any:
                if size not in self.buffers:
                    self.buffers[size] = np.full(size, 0x5A, np.uint8)
                return self.buffers[size]

            def hop(self, size: int) -> int:
                buf = self._buf(size)
                t = time.monotonic_ns()
                return int(ray.get(self.sink.take.remote(buf))) - t

            def stream(self, size: int, n: int) -> int:
                buf = self._buf(size)
                t = time.monotonic_ns()
                last = max(ray.get([self.sink.take.remote(buf) for _ in range(n)]))
                return int(last) - t

        sender = Sender.remote(Sink.remote())  # type: ignore[attr-defined]
        ray.get(sender.hop.remote(1))
        out["startup_s"] = time.perf_counter() - t0
        timeout = cfg.step_timeout_s
        for size in cfg.baseline_sizes:

            def once(size: int = size) -> float:
                return float(ray.get(sender.hop.remote(size), timeout=timeout))

            def run(n: int, size: int = size) -> float:
                return float(ray.get(sender.stream.remote(size, n), timeout=timeout)) / 1e9

            try:
                out[str(size)] = {
                    "latency": sample(cfg, size, once),
                    "stream": stream(cfg, size, run),
                }
            except Exception as exc:  # a Ray error of any kind ends the Ray baseline only
                out[str(size)] = _error(exc)
                break
    finally:
        ray.shutdown()
    return out


# ---- stagewire through the pipeline ---------------------------------------------------------


def _cuda_available() -> bool:
    if not os.path.exists("/proc/driver/nvidia/gpus"):
        return False  # no NVIDIA driver: do not pay for importing torch
    import torch

    return bool(torch.cuda.is_available())


def availability(name: str) -> str | None:
    """None if transport ``name`` can be measured here, else why not."""
    if name == AUTO:
        return None
    try:
        create_transport(name, TRANSPORT_OPTIONS.get(name))
    except ConfigError as exc:
        if "unknown transport" in str(exc):
            return "not installed"
        return f"not importable: {_error(exc)['error']}"
    except Exception as exc:  # a transport that fails to construct is reported, not fatal
        return str(_error(exc)["error"])
    if name == "cuda_ipc" and not _cuda_available():
        return "no GPU"
    return None


def pipeline_spec(name: str) -> dict[str, Any]:
    """``source -> sink``, the edge pinned to transport ``name``."""
    device = "cuda" if name == "cuda_ipc" else "cpu"
    opts = TRANSPORT_OPTIONS.get(name)
    transport: Any = {"kind": name, "options": opts} if opts else name
    impl = "benchmarks.transport_stages:"
    return {
        "name": "transports-" + re.sub(r"[^A-Za-z0-9]+", "-", name),
        "defaults": {"chunk_timeout": "30s"},
        "stages": {
            "source": {"impl": impl + "SizedSource", "device": device},
            "sink": {"impl": impl + "SizedSink", "device": device},
        },
        "edges": [{"from": "source", "to": "sink", "transport": transport}],
    }


async def _submit(pipe: Pipeline, go: Go, timeout: float) -> Tally:
    tally = await asyncio.wait_for(pipe.submit(go), timeout)
    if not isinstance(tally, Tally) or tally.chunks != go.n or tally.nbytes != go.n * go.size:
        raise RuntimeError(f"the sink counted {tally!r} for {go!r}")
    return tally


async def stagewire_transport(cfg: Config, name: str) -> dict[str, Any]:
    """Hop latency and streaming through a 2-stage pipeline on transport ``name``."""
    pipe = Pipeline(pipeline_spec(name))
    t0 = time.perf_counter()
    await pipe.start()
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
    _PIDS.update(pipe.worker_pids.values())
    timeout = cfg.step_timeout_s
    try:

        async def lat(size: int) -> dict[str, dict[str, Any]]:
            async def once() -> tuple[float, float]:
                t = time.perf_counter_ns()
                tally = await _submit(pipe, Go(size, 1), timeout)
                return tally.first_got_ns - tally.first_put_ns, time.perf_counter_ns() - t

            return await asample(cfg, size, once, ("hop", "e2e"))

        try:
            out["empty"] = await lat(0)
        except Exception as exc:
            out["empty"] = _error(exc)
        for size in cfg.sizes:
            _log(f"stagewire {name}: {size_label(size)}")

            async def run(n: int, size: int = size) -> float:
                tally = await _submit(pipe, Go(size, n), timeout)
                return (tally.last_got_ns - tally.first_put_ns) / 1e9

            try:
                res: dict[str, Any] = await lat(size)
                if "e2e" in out["empty"]:
                    res["e2e_minus_empty_us"] = res["e2e"]["p50_us"] - out["empty"]["e2e"]["p50_us"]
                res["stream"] = await astream(cfg, size, run)
                out[str(size)] = res
            except Exception as exc:  # reported in the table; later sizes are skipped
                out[str(size)] = _error(exc)
                break
        stats = await pipe.statistics()
        for rep in stats["replicas"]:
            for o in rep["outputs"]:
                if o["edge"] == EDGE:
                    out["used"] = o["used"]
            for i in rep["inputs"]:
                if i["edge"] == EDGE:
                    out["envelope_hop_p50_us"] = i["hop_p50_us"]
    finally:
        await pipe.aclose()
    return out


# ---- the transport alone --------------------------------------------------------------------


def _edge_context(name: str) -> EdgeContext:
    return EdgeContext(EDGE, host_identity(), dict(TRANSPORT_OPTIONS.get(name) or {}))


def _payload(size: int, device: str = "cpu") -> Encoded:
    return codec_for(Frame).encode(Frame(0, prefaulted(size, device)))


async def transport_inproc(cfg: Config, name: str) -> dict[str, Any]:
    """put -> descriptor through msgpack -> get -> release, in this process, per size."""
    transport = create_transport(name, TRANSPORT_OPTIONS.get(name))
    ctx = _edge_context(name)
    sender = transport.open_sender(ctx)
    receiver = transport.open_receiver(ctx)
    seqs = itertools.count()
    device = "cuda" if name == "cuda_ipc" else "cpu"
    timeout = cfg.step_timeout_s
    out: dict[str, Any] = {}
    try:
        for size in cfg.sizes:
            encoded = _payload(size, device)

            async def once(encoded: Encoded = encoded) -> tuple[float, float]:
                key = ChunkKey("bench", EDGE, next(seqs))
                t0 = time.perf_counter_ns()
                desc = await sender.put(key, encoded, timeout=timeout)
                parsed = receiver.decode_descriptor(_enc.encode(desc))
                got = await receiver.get(parsed)
                t1 = time.perf_counter_ns()
                del got
                await receiver.release(parsed)
                return t1 - t0, time.perf_counter_ns() - t0

            try:
                res = await asample(cfg, size, once, ("put_get", "cycle"))
                res["bytes_per_s"] = size / (res["cycle"]["p50_us"] / 1e6)
                out[str(size)] = res
            except Exception as exc:
                out[str(size)] = _error(exc)
                break
    finally:
        await receiver.aclose()
        await sender.aclose()
    return out


def _send_msg(writer: asyncio.StreamWriter, msg: Any) -> None:
    """Write one length-prefixed msgpack message (two writes: no copy of a large body)."""
    body = _enc.encode(msg)
    writer.write(struct.pack("<I", len(body)))
    writer.write(body)


async def _read_msg(reader: asyncio.StreamReader) -> Any:
    """The next length-prefixed msgpack message; None at end of file."""
    try:
        (n,) = struct.unpack("<I", await reader.readexactly(4))
        return _dec.decode(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        return None


async def _pipe_streams(
    rfd: int, wfd: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.BaseTransport]:
    """asyncio streams over a pipe pair: (reader, writer, the reader's transport)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * MIB)
    rt, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", buffering=0)
    )
    wt, wp = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin,  # what asyncio's own stream writers use
        os.fdopen(wfd, "wb", buffering=0),
    )
    return reader, asyncio.StreamWriter(wt, wp, None, loop), rt


def producer_main() -> None:
    """Entry of the two-process producer child: ``NAME OPTIONS_JSON READ_FD WRITE_FD``."""
    name, options, rfd, wfd = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    asyncio.run(_producer(name, options, int(rfd), int(wfd)))


async def _producer(name: str, options: dict[str, Any], rfd: int, wfd: int) -> None:
    """Put payloads on command and send their descriptors; see :func:`transport_two_process`.

    Commands: ``["one", size]`` (one put), ``["stream", size, n, window]`` (n puts, at most
    ``window`` ahead of the credit), ``["credit", upto]``, ``["quit"]``. Each put answers
    ``["d", put_ns, descriptor]``; a failure answers ``["error", text]``. End of file on the
    command pipe (the parent died) and SIGTERM end it too, closing the sender.
    """
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    reader, writer, rt = await _pipe_streams(rfd, wfd)
    sender = create_transport(name, options or None).open_sender(
        EdgeContext(EDGE, host_identity(), options)
    )
    device = "cuda" if name == "cuda_ipc" else "cpu"
    payloads: dict[int, Encoded] = {}
    seqs = itertools.count()
    allowed = [0]
    credit = asyncio.Event()
    streaming: asyncio.Task[None] | None = None

    async def put_one(size: int) -> None:
        encoded = payloads.get(size)
        if encoded is None:
            encoded = payloads[size] = _payload(size, device)
        key = ChunkKey("bench", EDGE, next(seqs))
        t = time.monotonic_ns()
        desc = await sender.put(key, encoded, timeout=60.0)
        _send_msg(writer, ["d", t, _enc.encode(desc)])
        await writer.drain()

    async def stream_out(size: int, n: int, window: int) -> None:
        allowed[0] = window
        try:
            for i in range(n):
                while i >= allowed[0]:
                    credit.clear()
                    await credit.wait()
                await put_one(size)
        except Exception as exc:
            _send_msg(writer, ["error", _error(exc)["error"]])

    try:
        while (msg := await _read_msg(reader)) is not None and msg[0] != "quit":
            try:
                if msg[0] == "one":
                    await put_one(msg[1])
                elif msg[0] == "stream":
                    streaming = asyncio.create_task(stream_out(*msg[1:4]))
                elif msg[0] == "credit":
                    allowed[0] = msg[1]
                    credit.set()
            except Exception as exc:
                _send_msg(writer, ["error", _error(exc)["error"]])
    except asyncio.CancelledError:
        pass  # SIGTERM: close down below
    finally:
        if streaming is not None:
            streaming.cancel()
            with contextlib.suppress(BaseException):
                await streaming
        await sender.aclose()
        writer.close()
        rt.close()


def _descriptor(msg: Any, receiver: TransportReceiver) -> tuple[int, Any]:
    if msg is None:
        raise RuntimeError("the producer child exited")
    if msg[0] == "error":
        raise RuntimeError(f"producer: {msg[1]}")
    return msg[1], receiver.decode_descriptor(msg[2])


async def transport_two_process(cfg: Config, name: str) -> dict[str, Any]:
    """A child process puts, this one gets: hop (put-start -> get-complete) and streaming."""
    options = TRANSPORT_OPTIONS.get(name) or {}
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    code = "from benchmarks.transport_bench import producer_main; producer_main()"
    out: dict[str, Any] = {}
    with hops._children() as procs:
        try:
            procs.append(
                hops._spawn(
                    [code, name, json.dumps(options), str(p2c_r), str(c2p_w)],
                    pass_fds=(p2c_r, c2p_w),
                    cwd=ROOT,
                )
            )
            _PIDS.add(procs[-1].pid)
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        reader, writer, rt = await _pipe_streams(c2p_r, p2c_w)
        receiver = create_transport(name, options or None).open_receiver(_edge_context(name))
        timeout = cfg.step_timeout_s
        try:
            for size in cfg.sizes:

                async def once(size: int = size) -> tuple[float]:
                    _send_msg(writer, ["one", size])
                    put_ns, desc = _descriptor(
                        await asyncio.wait_for(_read_msg(reader), timeout), receiver
                    )
                    got = await receiver.get(desc)
                    hop = time.monotonic_ns() - put_ns
                    del got
                    await receiver.release(desc)
                    return (hop,)

                window = max(2, min(cfg.window, (256 * MIB) // size))
                step = max(1, window // 2)

                async def run(
                    n: int, size: int = size, window: int = window, step: int = step
                ) -> float:
                    _send_msg(writer, ["stream", size, n, window])
                    first = 0
                    for i in range(n):
                        put_ns, desc = _descriptor(
                            await asyncio.wait_for(_read_msg(reader), timeout), receiver
                        )
                        first = first or put_ns
                        got = await receiver.get(desc)
                        del got
                        await receiver.release(desc)
                        if (i + 1) % step == 0:
                            _send_msg(writer, ["credit", i + 1 + window])
                    return (time.monotonic_ns() - first) / 1e9

                try:
                    res: dict[str, Any] = await asample(cfg, size, once, ("hop",))
                    res["stream"] = await astream(cfg, size, run)
                    out[str(size)] = res
                except Exception as exc:
                    out[str(size)] = _error(exc)
                    break
            _send_msg(writer, ["quit"])
            with contextlib.suppress(Exception):
                await writer.drain()
            # Let it close its sender (and free what it holds) before the finally's SIGTERM.
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(procs[0].wait, 5)
        finally:
            await receiver.aclose()
            writer.close()
            rt.close()
    return out


async def run_async(cfg: Config, avail: dict[str, str | None]) -> dict[str, Any]:
    """The stagewire phases: every pipeline, then every transport alone (one event loop)."""
    sw: dict[str, Any] = {}
    alone: dict[str, Any] = {"inproc": {}, "two_process": {}}
    for name in cfg.transports:
        if avail[name] is not None:
            continue
        _log(f"stagewire pipeline, transport {name}")
        try:
            sw[name] = await stagewire_transport(cfg, name)
        except Exception as exc:  # start-up failure: reported, the run goes on
            sw[name] = _error(exc)
    for name in cfg.transports:
        if name == AUTO or avail[name] is not None:
            continue
        _log(f"transport {name} alone: in process, then two processes")
        for kind, fn in (("inproc", transport_inproc), ("two_process", transport_two_process)):
            try:
                alone[kind][name] = await fn(cfg, name)
            except Exception as exc:
                alone[kind][name] = _error(exc)
    return {"stagewire": sw, "alone": alone}


# ---- /dev/shm -------------------------------------------------------------------------------


def shm_entries() -> dict[str, int]:
    """Names and sizes in /dev/shm."""
    try:
        with os.scandir("/dev/shm") as it:
            return {e.name: e.stat(follow_symlinks=False).st_size for e in it}
    except OSError:
        return {}


def shm_report(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """What appeared in /dev/shm during the run, split into ours (a pid of ours in the name)
    and others' (other tenants of this machine may create segments at the same time).

    This process's own CUDA IPC files (it ran cuda_ipc in process) are still in use while
    it reports; they go when it exits, so they are listed apart, not as left behind."""
    new = sorted(set(after) - set(before))
    pids = {str(p) for p in _PIDS}
    own_cuda = set(cuda_files_of([os.getpid()]))
    cuda = set(cuda_files_of(_PIDS)) - own_cuda
    ours = [n for n in new if n not in own_cuda and (n in cuda or _names_pid(n, pids))]
    return {
        "left_ours": ours,
        "left_other": [n for n in new if n not in ours and n not in own_cuda],
        "own_cuda_files_removed_at_exit": sorted(own_cuda & set(new)),
    }


def _names_pid(name: str, pids: set[str]) -> bool:
    """Whether a stagewire segment name holds one of ``pids`` as a whole field."""
    return any(part in pids for part in re.split(r"[-_.]", name))


# ---- report ---------------------------------------------------------------------------------


def _us(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    if v < 100:
        return f"{v:.1f} µs"
    if v < 1000:
        return f"{v:.0f} µs"
    if v < 1e6:
        return f"{v / 1000:.2f} ms"
    return f"{v / 1e6:.2f} s"


def _bw(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v / 1e9:.2f} GB/s" if v >= 1e8 else f"{v / 1e6:.1f} MB/s"


def _cps(v: float) -> str:
    return f"{v / 1000:.1f}k/s" if v >= 1000 else f"{v:.0f}/s"


def _get(d: Any, *path: Any) -> Any:
    for key in path:
        if not isinstance(d, dict) or str(key) not in d:
            return None
        d = d[str(key)]
    return d


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell(entry: Any, fmt: Callable[[dict[str, Any]], str], missing: str = "-") -> str:
    if isinstance(entry, dict) and "error" in entry:
        return f"error: {_short(entry['error'])} (see notes)"
    if entry is None:
        return missing
    return fmt(entry)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _transport_status(r: dict[str, Any], name: str, where: dict[str, Any]) -> str | None:
    reason = r["availability"].get(name)
    if reason is not None:
        return _short(reason)
    entry = where.get(name)
    if isinstance(entry, dict) and "error" in entry:
        return f"error: {_short(entry['error'])} (see notes)"
    return None


def _errors(r: dict[str, Any]) -> list[str]:
    """Every error recorded in the results, as ``where: message``."""
    found: list[str] = []

    def walk(d: Any, path: str) -> None:
        if not isinstance(d, dict):
            return
        if isinstance(d.get("error"), str):
            found.append(f"{path}: {d['error']}")
            return
        for k, v in d.items():
            label = size_label(int(k)) if k.isdigit() else k
            walk(v, f"{path} {label}".strip())

    for key in ("baselines", "stagewire", "alone"):
        walk(r.get(key), key)
    return found


def _lat(e: dict[str, Any]) -> str:
    return f"{_us(e['p50_us'])} / {_us(e['p99_us'])}"


def _thr(e: dict[str, Any]) -> str:
    return f"{_bw(e['bytes_per_s'])} ({_cps(e['chunks_per_s'])})"


def baseline_rows(r: dict[str, Any]) -> list[list[str]]:
    b = r["baselines"]
    rows = []
    ray_missing = b["ray"].get("skipped", "-")
    for size in r["config"]["sizes"]:
        row = [size_label(size)]
        mc = _get(b["memcpy"], size)
        row.append(_cell(mc, lambda e: f"{_us(e['p50_us'])} ({_bw(e['bytes_per_s'])})"))
        for key in ("zmq_ipc", "zmq_tcp", "mp_queue", "ray"):
            miss = ray_missing if key == "ray" else "-"
            entry = _get(b[key], size)
            row.append(_cell(entry, lambda e: _lat(e["latency"]), miss))
            row.append(_cell(entry, lambda e: _thr(e["stream"]), miss))
        rows.append(row)
    return rows


def transport_rows(
    r: dict[str, Any], where: dict[str, Any], names: Sequence[str], fmt: Callable[[Any], str]
) -> list[list[str]]:
    rows = []
    for size in r["config"]["sizes"]:
        row = [size_label(size)]
        for name in names:
            status = _transport_status(r, name, where)
            if status is not None:
                row.append(status)
                continue
            row.append(_cell(_get(where, name, size), fmt, "skipped after an error"))
        rows.append(row)
    return rows


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """DESIGN section 11's targets as measured/baseline ratios, with met/missed."""
    b, sw, two = r["baselines"], r["stagewire"], r["alone"]["two_process"]
    out: list[dict[str, Any]] = []
    s16 = 16 * MIB

    def add(
        what: str,
        transport: str,
        where: dict[str, Any],
        value: float | None,
        base: float | None,
        base_label: str,
        limit: float,
        higher_is_better: bool,
        fmt: Callable[[float | None], str],
        target: bool = True,
    ) -> None:
        status = _transport_status(r, transport, where)
        ratio = None
        if status is None:
            if value is None or base is None or math.isnan(value) or math.isnan(base):
                status = "not measured"
            else:
                ratio = value / base
                ok = ratio >= limit if higher_is_better else ratio <= limit
                status = ("met" if ok else "**missed**") if target else "info"
        out.append({
            "what": what, "measured": fmt(value), "baseline": f"{base_label} {fmt(base)}",
            "ratio": ratio, "target": f"{'≥' if higher_is_better else '≤'} {limit:g}x",
            "status": status,
        })  # fmt: skip

    # A transport given by import path or entry point counts under its class's own name.
    given = {r["canonical"].get(n, n): n for n in r["config"]["transports"]}
    shm, net, inline, auto = (given.get(n, n) for n in ("shm", "network", "inline", AUTO))
    memcpy16 = _get(b["memcpy"], s16, "p50_us")
    memcpy16_bw = _get(b["memcpy"], s16, "bytes_per_s")
    for where, label, is_target in (
        (sw, "pipeline", True),
        (two, "transport alone, 2 procs", False),
    ):
        add(f"shm 16 MiB hop p50 ({label})", shm, where, _get(where, shm, s16, "hop", "p50_us"),
            memcpy16, "memcpy 16 MiB", TARGET_SHM_HOP_X_MEMCPY, False, _us, is_target)  # fmt: skip
        add(f"shm 16 MiB streaming ({label})", shm, where,
            _get(where, shm, s16, "stream", "bytes_per_s"), memcpy16_bw, "memcpy",
            TARGET_SHM_STREAM_OF_MEMCPY, True, _bw, is_target)  # fmt: skip
        add(f"network 16 MiB streaming ({label})", net, where,
            _get(where, net, s16, "stream", "bytes_per_s"),
            _get(b["zmq_tcp"], s16, "stream", "bytes_per_s"), "raw pyzmq tcp",
            TARGET_NETWORK_OF_ZMQ, True, _bw, is_target)  # fmt: skip
    wake = _get(b["pipe"], KIB, "one_way_p50_us")
    for label, name in (("inline", inline), ("auto", auto), ("shm", shm), ("network", net)):
        add(f"1 KiB hop p50, {label} (pipeline)", name, sw, _get(sw, name, KIB, "hop", "p50_us"),
            wake, "pipe wake-up 1 KiB", TARGET_HOP_X_WAKEUP, False, _us,
            label in ("inline", "auto"))  # fmt: skip
    cuda = given.get("cuda_ipc", "cuda_ipc")
    sizes = sorted(r["config"]["sizes"])
    for where, label in ((two, "transport alone, 2 procs"), (sw, "pipeline")):
        # Flat in size: the largest payload's hop against the smallest's, and the bound.
        big = _get(where, cuda, sizes[-1], "hop", "p50_us")
        add(f"cuda_ipc {size_label(sizes[-1])} hop p50 ({label})", cuda, where, big,
            _get(where, cuda, sizes[0], "hop", "p50_us"),
            f"cuda_ipc {size_label(sizes[0])} hop", TARGET_CUDA_FLAT, False, _us,
            len(sizes) > 1)  # fmt: skip
        if where is two:
            add(f"cuda_ipc {size_label(sizes[-1])} hop p50 ({label}), bound", cuda, where, big,
                TARGET_CUDA_HOP_US, "the bound", 1.0, False, _us)  # fmt: skip
    aio = _get(b["pipe"], "asyncio_1024", "one_way_p50_us")
    add("1 KiB hop p50, inline (pipeline), vs the asyncio floor", inline, sw,
        _get(sw, inline, KIB, "hop", "p50_us"), aio, "asyncio pipe wake-up 1 KiB",
        TARGET_HOP_X_WAKEUP, False, _us, False)  # fmt: skip
    return out


def render(r: dict[str, Any]) -> str:
    """The markdown report: five tables and the notes a reader needs to judge them."""
    names = list(r["config"]["transports"])
    concrete = [n for n in names if n != AUTO]
    pipe = r["baselines"]["pipe"]
    lines = ["### Baselines (same run): one-way latency p50 / p99, and streaming throughput", ""]
    hdr = ["size", "memcpy (bandwidth)"]
    for label in ("pyzmq ipc", "pyzmq tcp", "mp.Queue pickle", "Ray 2 actors"):
        hdr += [f"{label} latency", f"{label} stream"]
    lines += _table(hdr, baseline_rows(r))
    lines += [
        "",
        f"Raw pipe wake-up, one-way (RTT/2): 1 B {_us(pipe['1']['one_way_p50_us'])}, "
        f"1 KiB {_us(pipe[str(KIB)]['one_way_p50_us'])}; 1 KiB with both ends on asyncio "
        f"(loop.add_reader) {_us(pipe['asyncio_1024']['one_way_p50_us'])}.",
        "",
        "### stagewire pipeline (source -> sink): hop latency p50 / p99, put-start -> "
        "payload in the sink's handler",
        "",
    ]
    sw = r["stagewire"]
    lines += _table(["size", *names], transport_rows(r, sw, names, lambda e: _lat(e["hop"])))
    lines += ["", "### stagewire pipeline: streaming throughput (one request, N chunks)", ""]
    lines += _table(["size", *names], transport_rows(r, sw, names, lambda e: _thr(e["stream"])))
    alone = r["alone"]
    lines += ["", "### Transport alone, one process: put -> get -> release cycle p50 / p99", ""]
    lines += _table(
        ["size", *concrete],
        transport_rows(r, alone["inproc"], concrete, lambda e: _lat(e["cycle"])),
    )
    lines += [
        "",
        "### Transport alone, producer in a child process: hop p50 / p99 "
        "(put-start -> get-complete), and streaming",
        "",
    ]
    rows = transport_rows(r, alone["two_process"], concrete, lambda e: _lat(e["hop"]))
    srows = transport_rows(r, alone["two_process"], concrete, lambda e: _thr(e["stream"]))
    lines += _table(
        ["size", *(f"{n} hop" for n in concrete), *(f"{n} stream" for n in concrete)],
        [a + b[1:] for a, b in zip(rows, srows, strict=True)],
    )
    lines += ["", "### Targets (DESIGN section 11)", ""]
    lines += _table(
        ["target", "measured", "baseline", "ratio", "target", "status"],
        [
            [t["what"], t["measured"], t["baseline"],
             "-" if t["ratio"] is None else f"{t['ratio']:.2f}x", t["target"], t["status"]]
            for t in r["targets"]
        ],
    )  # fmt: skip
    m = r["machine"]
    avail = ", ".join(f"{n}: {v or 'measured'}" for n, v in r["availability"].items())
    startup = ", ".join(
        f"{n} {e['startup_s']:.1f} s"
        for n, e in sw.items()
        if isinstance(e, dict) and "startup_s" in e
    )
    used = "; ".join(
        f"{n}: {e['used']}" for n, e in sw.items() if isinstance(e, dict) and e.get("used")
    )
    shm = r["shm"]
    left = shm["left_ours"]
    errors = _errors(r)
    lines += [
        "",
        f"- machine: {m['cpus']} CPUs, Python {m['python']}, pyzmq {m['pyzmq']}, numpy "
        f"{m['numpy']}; medians of {r['config']['trials']} trials; p99 pools every sample "
        "(so it is the slowest sample where there are few, as at 64 MiB). GB = 1e9 bytes.",
        f"- transports: {avail}",
        "- hop = source stamps the clock before the runtime encodes and puts, sink reads it "
        "when its handler has the decoded payload (CLOCK_MONOTONIC, one host); it includes "
        "the envelope over ZMQ, the reorder buffer and the handler's wake-up for a new request. "
        "Baselines' latency is RTT/2 of a full-size echo (Ray: A -> B, stamped as above).",
        "- transport alone, 2 processes: descriptors cross a pipe (asyncio streams), so an "
        "inline payload crosses it too; streaming keeps a credit window of chunks in flight.",
        "- the 1 KiB target is set for a 4-stage chain (benchmarks/hops.py measures it "
        "there); this pipeline has 2 stages and one measured hop.",
        f"- pipeline start-up: {startup or '-'}; what carried the edge's chunks: {used or '-'}",
        "- /dev/shm after the run: "
        + (f"**left behind: {', '.join(left)}**" if left else "nothing of ours left behind")
        + (f" (others' new entries: {', '.join(shm['left_other'])})" if shm["left_other"] else ""),
        *(f"- error, {e}" for e in errors),
    ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> str | None:
    """p50 latency against size, log-log; returns why not when matplotlib is missing."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return "matplotlib not installed: pip install -e .[bench]"
    sizes = r["config"]["sizes"]
    fig, ax = plt.subplots(figsize=(9, 6))

    def series(label: str, ys: list[float | None], style: str, **kw: Any) -> None:
        pts = [(s, y) for s, y in zip(sizes, ys, strict=True) if y is not None and y > 0]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, **kw)

    # One colour per transport (its pipeline line solid, the transport alone dashed); the
    # baselines in greys and muted colours, dotted.
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for i, name in enumerate(r["config"]["transports"]):
        colour = palette[i % len(palette)]
        ys = [_get(r["stagewire"], name, s, "hop", "p50_us") for s in sizes]
        series(f"stagewire {name}", ys, "-o", lw=2, color=colour)
        if name != AUTO:
            ys = [_get(r["alone"]["two_process"], name, s, "hop", "p50_us") for s in sizes]
            series(f"{name} alone, 2 procs", ys, "--^", lw=1, alpha=0.7, color=colour)
    b = r["baselines"]
    series("memcpy", [_get(b["memcpy"], s, "p50_us") for s in sizes], ":s", color="black")
    for key, label, colour in (
        ("zmq_ipc", "pyzmq ipc", "dimgrey"),
        ("zmq_tcp", "pyzmq tcp", "darkgrey"),
        ("mp_queue", "mp.Queue pickle", "tab:olive"),
        ("ray", "Ray 2 actors", "tab:cyan"),
    ):
        series(label, [_get(b[key], s, "latency", "p50_us") for s in sizes], ":x", color=colour)
    wake = _get(b["pipe"], KIB, "one_way_p50_us")
    if wake:
        ax.axhline(wake, color="grey", ls="--", lw=0.8, label="pipe wake-up (1 KiB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("payload size")
    ax.set_ylabel("one-way latency p50 (µs)")
    ax.set_title("stagewire transports vs baselines (same run)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    """Run every phase, print the markdown report, optionally write JSON and a plot."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter trials (~75 s)")
    p.add_argument("--smoke", action="store_true", help="2 sizes, 1 short trial, no Ray (tests)")
    p.add_argument("--json", metavar="OUT", help="write the raw numbers to this file")
    p.add_argument("--plot", metavar="OUT.png", help="plot p50 latency against size")
    p.add_argument("--sizes", help="comma-separated sizes, e.g. 1KiB,16MiB")
    p.add_argument(
        "--transports",
        help=f"comma-separated (default {','.join(TRANSPORTS)}); a plug-in may be named by "
        "entry point or import path (mypkg.rdma:RdmaTransport)",
    )
    p.add_argument("--no-ray", action="store_true", help="skip the Ray baseline")
    p.add_argument(
        "--baseline-max",
        metavar="SIZE",
        help="measure the baselines only up to this size (e.g. 64MiB beside a 1GiB cuda_ipc run)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="TRANSPORT.KEY=JSON",
        help="a transport option, e.g. network.copy_on_put=false (repeatable)",
    )
    args = p.parse_args(argv)
    for item in args.option:
        target, _, value = item.partition("=")
        name, _, key = target.partition(".")
        if not (name and key and value):
            p.error(f"--option {item!r}: expected TRANSPORT.KEY=JSON")
        TRANSPORT_OPTIONS.setdefault(name, {})[key] = json.loads(value)
    # SIGTERM unwinds like Ctrl-C, so every finally block stops what this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.sizes:
        cfg = replace(cfg, sizes=tuple(int(parse_byte_size(s)) for s in args.sizes.split(",")))
    if args.transports:
        cfg = replace(cfg, transports=tuple(args.transports.split(",")))
    if args.no_ray:
        cfg = replace(cfg, ray=False)
    if args.baseline_max:
        cfg = replace(cfg, baseline_max=int(parse_byte_size(args.baseline_max)))
    json_out = os.path.abspath(args.json) if args.json else None
    plot_out = os.path.abspath(args.plot) if args.plot else None
    os.chdir(ROOT)  # workers resolve "benchmarks.transport_stages" from the working directory
    t_start = time.perf_counter()
    shm_before = shm_entries()
    results: dict[str, Any] = {
        "config": {**asdict(cfg), "quick": args.quick, "smoke": args.smoke},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pyzmq": zmq.__version__,
            "numpy": np.__version__,
            "platform": platform.platform(),
        },
    }
    b: dict[str, Any] = {}
    results["baselines"] = b
    _log("baseline: memcpy")
    b["memcpy"] = memcpy(cfg)
    _log("baseline: pipe wake-up")
    b["pipe"] = pipe_wakeup(cfg)
    for kind in ("ipc", "tcp"):
        _log(f"baseline: raw pyzmq {kind}")
        b[f"zmq_{kind}"] = zmq_raw(cfg, kind)
    _log("baseline: multiprocessing.Queue")
    b["mp_queue"] = mp_queue(cfg)
    avail = {name: availability(name) for name in cfg.transports}
    results["availability"] = avail
    results["canonical"] = {
        name: str(getattr(resolve_transport(name), "name", name))
        for name, why in avail.items()
        if why is None and name != AUTO
    }
    results.update(asyncio.run(run_async(cfg, avail)))
    # Ray last: its daemons must not share the machine with anything else measured.
    _log("baseline: Ray actor chain")
    try:
        b["ray"] = ray_chain(cfg)
    except Exception as exc:  # Ray failing to start is reported, not fatal
        b["ray"] = {"skipped": f"Ray failed: {_error(exc)['error']}"}
    results["shm"] = shm_report(shm_before, shm_entries())
    results["targets"] = targets(results)
    results["elapsed_s"] = time.perf_counter() - t_start
    results["phase_start_s"] = _log.phases
    print(render(results))
    if plot_out:
        why = plot(results, plot_out)
        print(f"\nplot: {why or plot_out}")
    print(f"\n(total {results['elapsed_s']:.0f} s)")
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
