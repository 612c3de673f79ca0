"""The tiny-VLM pipeline, staged across 4 processes, against the monolithic reference, in one run.

Run from the repository root::

    .venv/bin/python benchmarks/vlm.py [--quick] [--json OUT] [--decode-replicas N]
        [--max-batch N] [--chunk-tokens N]

The markdown report goes to stdout, progress (and the workers' logs) to stderr. A full run
takes about 45 s on a 2-core machine, ``--quick`` about 25 s; ``--decode-replicas 2`` adds
about 25 s (``--quick``: 20 s). ``--max-batch 1`` runs the decode stage without batched
steps, to see what batching alone brings.

Both sides process the same inputs: the shipped sample requests (``sample_requests(12)``,
PNG bytes and a prompt each), cycled in the same order from index 0 in every trial. The
two sides are interleaved, so drift in the machine's speed hits both alike: latency request
by request (input k on one side, then at once on the other, the order alternating), and
throughput trial by trial. Everything is reported as medians over trials and as ratios
against the monolithic baseline measured in the same run. The concurrency-1 overhead is
the median of the paired requests' relative differences: this VM's speed swings by up to
1.6x within seconds, and a pair is measured in one state.

Monolithic (the baseline). A child process (so that it owns its interpreter and never
shares an event loop or a GIL with the client) loads the whole model and, on command,
runs ``prepare(request)`` (the preprocess stage's body: PNG decode, resize, tokenise) and
the reference generation, with ``torch.set_num_threads(1)`` as every stage sets it (so the
numerics are bit-for-bit those of the stages, and the baseline gets the one thread a stage
gets). It runs while the pipeline's workers sit idle, and the other way round.

* latency and TTFT (concurrency 1): ``generate()``'s body inlined (vision encoder, prefill
  layer by layer, then ``GreedyDecoding``, under ``torch.inference_mode()`` as
  ``generate()`` runs) with timestamps between the steps, so the time to first token is
  when the first greedy token exists and e2e is when the last one does.
* throughput (concurrency 8): ``prepare`` + ``generate()`` itself, back to back. A
  single-process server running a synchronous ``generate()`` cannot overlap requests: with
  8 requests outstanding it works them off one after another, whatever the interleaving
  of its event loop, and the model has no batched path. So its throughput at any
  concurrency is requests completed / busy time of the back-to-back loop. The loop's own
  clock is used (no request transport at all), which makes this baseline as strong as a
  monolithic server on one thread can be: the staged pipeline must beat pure compute.

Staged. ``Pipeline.from_yaml("configs/tiny-vlm.yaml")``: 4 worker processes (preprocess,
encode, prefill, decode), the master in this process.

* latency and TTFT (concurrency 1): sequential ``pipe.stream(request)``; TTFT is the first
  chunk with tokens, e2e is when the stream ends (the request is complete for the client).
* throughput (concurrency 8): 8 client tasks submitting ``pipe.submit`` back to back,
  sharing a fixed count of requests and a deadline; requests/s = completed / wall time.
* start-up: the time ``async with Pipeline.from_yaml(...)`` takes to be ready, against the
  monolithic child's start-up (interpreter, imports, model load).

Every request measured on either side (and every warm-up request) is checked against the
tokens ``generate()`` produced for that input in the monolithic child: the staged stream's
tokens and the final chunk's ``generated_ids`` must both equal them. A mismatch aborts the
run with exit status 1, after every process it started is stopped.

Diagnostics (no targets), to say where the staged overhead comes from:

* inference_mode A/B (off by default, ``Config.ab_n``): the child runs each input with and
  without ``torch.inference_mode()`` in alternating order. It found the stages 1.2x slower
  when they ran the model without it; the model's entry points now enter it themselves.
* the decode stage's own timings (from the final chunk), the envelope hop p50 of every
  edge at concurrency 1 (``pipe.statistics()``), the CPU time of every process per request
  (from /proc), and how busy the whole machine was (other tenants included).
* two monolithic processes at once (full runs): the obvious alternative to staging on a
  2-core box.
* the concurrency-1 pairs again with every stage worker, not only decode, pinned to the
  monolithic child's vCPU (the client still free): the stages before decode then run on
  the vCPU the monolithic process runs them on. The headline keeps them free, as a
  deployment would; the difference says how much of the overhead is where they land
  (this VM's vCPUs run at different speeds, and each has its own caches).
* ``--decode-replicas N``: throughput again with N replicas of the decode stage (the
  bottleneck), paired with monolithic trials taken in the same minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._measure import (  # noqa: E402
    PhaseLog,
    add_cpu_idle_option,
    cpu_seconds,
    hold_cpu_idle_for_run,
    hop_p50s,
    median,
)
from pipeline import Pipeline, PipelineSpec  # noqa: E402
from pipeline._cpu_idle import CpuIdle  # noqa: E402
from stages.payloads import DecodeChunk, VLMRequest  # noqa: E402
from stages.samples import sample_requests  # noqa: E402

CONFIG = ROOT / "configs" / "tiny-vlm.yaml"
#: This file: the monolithic child runs it with ``--mono-child``.
SELF = Path(__file__).resolve()
#: How many distinct inputs are cycled (the shipped requests.jsonl holds this many).
N_INPUTS = 12
CONCURRENCY = 8

# Targets (the brief for this benchmark).
TARGET_OVERHEAD = 0.10
TARGET_THROUGHPUT_RATIO = 1.0

_log = PhaseLog("vlm")


@dataclass(frozen=True)
class Config:
    """Counts and time bounds of every phase; ``--quick`` scales them down."""

    trials: int = 5
    #: Sequential requests per latency trial (each side).
    latency_n: int = 24
    #: Requests per throughput trial (each side; the staged side spreads them over 8 tasks).
    throughput_n: int = 48
    #: Inputs per trial of the inference_mode A/B diagnostic (each runs twice). Off: the
    #: model's entry points now run under inference_mode themselves, stages included.
    ab_n: int = 0
    #: Whether to run the two-process monolithic diagnostic.
    mono2: bool = True
    #: Whether to run each latency trial again with every stage on the child's vCPU.
    pin_all_diag: bool = True
    #: Trials of each diagnostic (two monolithic processes; decode replicas).
    diag_trials: int = 3
    #: Warm-up requests on each side before the trials.
    warmup_n: int = 24
    #: Wall-clock cap of one trial's loop, in seconds (the counts above usually end it).
    trial_budget_s: float = 6.0
    #: Deadline of any single blocking step (a request, a reply, a start-up), in seconds.
    step_timeout_s: float = 60.0
    #: The pipeline's ``defaults.cpu_idle``; ``poll`` is held by this process too, for the
    #: whole run, so that the monolithic side runs in the same state.
    cpu_idle: CpuIdle = "default"


FULL = Config()
QUICK = Config(
    trials=3, latency_n=12, throughput_n=24, ab_n=0, mono2=False, diag_trials=1, warmup_n=12
)


class OutputMismatch(RuntimeError):
    """The staged pipeline (or a monolithic run) produced other tokens than the reference."""


# ---- the monolithic child -------------------------------------------------------------------


def mono_child() -> int:
    """The monolithic reference server: JSON commands on stdin, JSON replies on stdout.

    Exits when stdin closes (so also when the parent dies).
    """
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    from stages.model import GreedyDecoding, generate
    from stages.preprocess import prepare
    from stages.weights import load_model

    t_import = time.perf_counter()
    model = load_model()
    requests = sample_requests(N_INPUTS)
    params = Pipeline.from_yaml(CONFIG).spec.stages["decode"].params
    max_new = int(params["max_new_tokens"])
    t_ready = time.perf_counter()
    out = sys.stdout

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, "stage_imports_s": t_import - t0, "load_s": t_ready - t_import})

    def timed(request: VLMRequest, inference_mode: bool) -> dict[str, Any]:
        """``prepare`` + ``generate()``'s body with timestamps between the steps.

        ``generate()`` runs under ``torch.inference_mode()``; the stages do not (they only
        turn gradients off), so ``inference_mode=False`` runs the same code as they do.
        """
        with torch.inference_mode(inference_mode):
            return _timed(request)

    def _timed(request: VLMRequest) -> dict[str, Any]:
        t0 = time.perf_counter()
        pixels, ids = prepare(request)
        t_prep = time.perf_counter()
        image = model.vision(pixels)
        t_enc = time.perf_counter()
        layers = list(model.decoder.prefill(image, ids))
        t_pre = time.perf_counter()
        first = layers[-1].first_token
        assert first is not None
        tokens: list[int] = []
        t_first = t_pre
        for token in GreedyDecoding(model.decoder, first, [x.kv for x in layers], max_new):
            if not tokens:
                t_first = time.perf_counter()
            tokens.append(token)
        t_end = time.perf_counter()
        return {
            "ttft_ms": (t_first - t0) * 1e3,
            "e2e_ms": (t_end - t0) * 1e3,
            "prepare_ms": (t_prep - t0) * 1e3,
            "encode_ms": (t_enc - t_prep) * 1e3,
            "prefill_ms": (t_pre - t_enc) * 1e3,
            "decode_ms": (t_end - t_pre) * 1e3,
            "tokens": tokens,
        }

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        n, budget = int(cmd.get("n", 0)), float(cmd.get("budget_s", 0.0))
        cpu0 = time.process_time()
        if op == "ref":
            tokens = []
            for r in requests:
                pixels, ids = prepare(r)
                tokens.append(generate(model, pixels, ids, max_new))
            reply({"tokens": tokens})
        elif op == "latency":
            samples = []
            deadline = time.monotonic() + budget
            start = int(cmd.get("start", 0))
            for i in range(start, start + n):
                samples.append({"i": i % N_INPUTS, **timed(requests[i % N_INPUTS], True)})
                if time.monotonic() > deadline:
                    break
            reply({"samples": samples, "cpu_s": time.process_time() - cpu0})
        elif op == "inference_mode_ab":
            # Each input twice, with and without inference_mode, in alternating order:
            # paired ratios are robust to the machine's drift.
            pairs = []
            deadline = time.monotonic() + budget
            for i in range(n):
                r = requests[i % N_INPUTS]
                first = i % 2 == 0
                a = timed(r, first)
                b = timed(r, not first)
                on, off = (a, b) if first else (b, a)
                pairs.append({"i": i % N_INPUTS, "on": on, "off": off})
                if time.monotonic() > deadline:
                    break
            reply({"pairs": pairs})
        elif op == "throughput":
            outs = []
            deadline = time.monotonic() + budget
            t0 = time.perf_counter()
            for i in range(n):
                pixels, ids = prepare(requests[i % N_INPUTS])
                outs.append(generate(model, pixels, ids, max_new))
                if time.monotonic() > deadline:
                    break
            elapsed = time.perf_counter() - t0
            reply({"tokens": outs, "elapsed_s": elapsed, "cpu_s": time.process_time() - cpu0})
        else:
            reply({"error": f"unknown op {op!r}"})
    return 0


class Mono:
    """A handle on one monolithic child process."""

    def __init__(self, proc: asyncio.subprocess.Process, startup_s: float, hello: dict[str, Any]):
        self.proc = proc
        self.startup_s = startup_s
        self.hello = hello

    @classmethod
    async def start(cls, timeout: float) -> Mono:
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SELF),
            "--mono-child",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        self = cls(proc, 0.0, {})
        try:
            self.hello = await self.read(timeout)
        except BaseException:
            await self.close()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    async def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"the monolithic child exited (code {await self.proc.wait()})")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"the monolithic child: {msg['error']}")
        return msg

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def call(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        await self.send(**cmd)
        return await self.read(timeout)

    async def close(self) -> None:
        """Ask it to quit (EOF on stdin), then terminate, then kill; reaps it."""
        proc = self.proc
        if proc.returncode is None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for sig, wait in ((None, 3.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            if proc.returncode is not None:
                break
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), wait)


# ---- checks ---------------------------------------------------------------------------------


class Checker:
    """Compares every measured request's tokens with the reference; raises on a mismatch."""

    def __init__(self, reference: list[list[int]]) -> None:
        self.reference = reference
        self.checked = {"staged": 0, "mono": 0}

    def check(
        self, side: str, i: int, tokens: list[int], what: str = "tokens", *, count: bool = True
    ) -> None:
        want = self.reference[i % N_INPUTS]
        if tokens != want:
            raise OutputMismatch(
                f"{side} {what} for input {i % N_INPUTS} differ from the reference:\n"
                f"  got  {tokens}\n  want {want}"
            )
        if count:
            self.checked[side] += 1


# ---- the monolithic side --------------------------------------------------------------------


def _mono_summary(samples: list[dict[str, Any]], cpu_s: float) -> dict[str, Any]:
    """One latency trial of the monolithic side: TTFT, e2e and the time of each model step."""
    return {
        "n": len(samples),
        "ttft_p50_ms": median([s["ttft_ms"] for s in samples]),
        "e2e_p50_ms": median([s["e2e_ms"] for s in samples]),
        "e2e_ms": [s["e2e_ms"] for s in samples],
        "steps_p50_ms": {
            k: median([s[k] for s in samples])
            for k in ("prepare_ms", "encode_ms", "prefill_ms", "decode_ms")
        },
        "cpu_ms_per_request": cpu_s / len(samples) * 1e3,
    }


async def _mono_requests(
    cfg: Config, mono: Mono, checker: Checker, n: int, start: int = 0
) -> tuple[list[dict[str, Any]], float]:
    """``n`` sequential requests in the child from input ``start`` on: samples, CPU seconds."""
    r = await mono.call(
        cfg.step_timeout_s, op="latency", n=n, start=start, budget_s=cfg.trial_budget_s
    )
    for s in r["samples"]:
        checker.check("mono", s["i"], s.pop("tokens"))
    return r["samples"], r["cpu_s"]


async def mono_inference_mode_ab(cfg: Config, mono: Mono, checker: Checker) -> dict[str, Any]:
    """Diagnostic: how much slower the reference runs without inference_mode, as stages do."""
    r = await mono.call(
        cfg.step_timeout_s,
        op="inference_mode_ab",
        n=cfg.ab_n,
        budget_s=cfg.trial_budget_s,
    )
    out: dict[str, list[float]] = {"e2e_ratio": [], "decode_ratio": [], "front_ratio": []}
    for p in r["pairs"]:
        on, off = p["on"], p["off"]
        checker.check("mono", p["i"], on.pop("tokens"), count=False)
        checker.check("mono", p["i"], off.pop("tokens"), "tokens without inference_mode")
        out["e2e_ratio"].append(off["e2e_ms"] / on["e2e_ms"])
        out["decode_ratio"].append(off["decode_ms"] / on["decode_ms"])
        front_on = on["e2e_ms"] - on["decode_ms"]
        out["front_ratio"].append((off["e2e_ms"] - off["decode_ms"]) / front_on)
    return out


async def mono_throughput(cfg: Config, monos: list[Mono], checker: Checker) -> dict[str, Any]:
    """Every child runs the same back-to-back loop at once; rate = total done / longest loop."""
    for m in monos:
        await m.send(op="throughput", n=cfg.throughput_n, budget_s=cfg.trial_budget_s)
    replies = [await m.read(cfg.step_timeout_s) for m in monos]
    done = 0
    for r in replies:
        for i, tokens in enumerate(r["tokens"]):
            checker.check("mono", i, tokens)
        done += len(r["tokens"])
    elapsed = max(r["elapsed_s"] for r in replies)
    return {
        "processes": len(monos),
        "done": done,
        "elapsed_s": elapsed,
        "req_per_s": done / elapsed,
        "cpu_ms_per_request": sum(r["cpu_s"] for r in replies) / done * 1e3,
    }


# ---- the staged side ------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds of each worker (by stage) and of this (master + client) process."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pids = {
            stage if k == 0 else f"{stage}#{k}": pid for (stage, k), pid in pipe.worker_pids.items()
        }
        self._start = self._sample()

    def _sample(self) -> dict[str, float]:
        cpu = {stage: cpu_seconds(pid) for stage, pid in self.pids.items()}
        cpu["master+client"] = time.process_time()
        return cpu

    def per_request_ms(self, n: int) -> dict[str, float]:
        end = self._sample()
        return {k: (end[k] - self._start[k]) / max(n, 1) * 1e3 for k in end}


async def _one_stream(pipe: Pipeline, i: int, request: VLMRequest) -> dict[str, Any]:
    """One request through ``pipe.stream``: TTFT, e2e, and its tokens checked later."""
    t0 = time.perf_counter()
    t_first = t_final = None
    streamed: list[int] = []
    final: DecodeChunk | None = None
    async for chunk in pipe.stream(request):
        if not isinstance(chunk, DecodeChunk):
            raise RuntimeError(f"decode streamed {chunk!r}")
        if chunk.token_ids and t_first is None:
            t_first = time.perf_counter()
        streamed.extend(chunk.token_ids)
        if chunk.done:
            t_final = time.perf_counter()
            final = chunk
    t_end = time.perf_counter()
    if final is None or t_final is None:
        raise RuntimeError(f"the stream of input {i} ended without a final chunk")
    return {
        "i": i,
        # A request whose first greedy token is EOS has no tokens at all: TTFT = e2e then.
        "ttft_ms": ((t_first or t_final) - t0) * 1e3,
        "e2e_ms": (t_end - t0) * 1e3,
        "final_chunk_ms": (t_final - t0) * 1e3,
        "timings": final.timings,
        "streamed": streamed,
        "generated_ids": final.generated_ids,
    }


def _staged_summary(samples: list[dict[str, Any]], cpu: dict[str, float]) -> dict[str, Any]:
    """One latency trial of the staged side: TTFT, e2e, the decode stage's own timings."""
    return {
        "n": len(samples),
        "ttft_p50_ms": median([s["ttft_ms"] for s in samples]),
        "e2e_p50_ms": median([s["e2e_ms"] for s in samples]),
        "final_chunk_p50_ms": median([s["final_chunk_ms"] for s in samples]),
        "e2e_ms": [s["e2e_ms"] for s in samples],
        "decode_timings_p50_ms": {
            k: median([s["timings"][k] for s in samples])
            for k in ("kv_receive_ms", "first_token_ms", "decode_ms", "model_ms")
        },
        "cpu_ms_per_request": cpu,
    }


def _decode_pids(pipe: Pipeline) -> list[int]:
    return [pid for (stage, _k), pid in pipe.worker_pids.items() if stage == "decode"]


@contextlib.contextmanager
def _same_cpu(pids: list[int]) -> Iterator[None]:
    """Pin ``pids`` (processes this run started) to one CPU for the block, then free them.

    This VM's two vCPUs often run at different speeds at the same moment (up to 1.6x
    apart, as the host's other load shifts), so a pair whose decode loops ran on different
    vCPUs would compare the vCPUs, not the two ways of serving. The monolithic child and
    the decode worker, where nearly all of each side's time goes, share one vCPU here; the
    other stages and the client stay free. Nothing is pinned on a single-CPU machine.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield
        return
    for pid in pids:
        os.sched_setaffinity(pid, {cpus[-1]})
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, cpus)


async def latency_pairs(
    cfg: Config,
    mono: Mono,
    pipe: Pipeline,
    requests: list[VLMRequest],
    checker: Checker,
    *,
    pin_all: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sequential requests (concurrency 1), the two sides interleaved request by request.

    Request k goes to both sides back to back, the monolithic child first for even k and
    the pipeline first for odd k. This machine's speed changes by up to 1.6x within
    seconds (its vCPUs' share of the host), so each pair is measured in one machine
    state and the paired ratios compare like with like.

    With ``pin_all`` every stage worker shares the child's vCPU, not only decode's.

    Returns:
        One latency trial of each side: (monolithic, staged).
    """
    mono_samples: list[dict[str, Any]] = []
    staged_samples: list[dict[str, Any]] = []
    mono_cpu = 0.0
    staged_pids = list(pipe.worker_pids.values()) if pin_all else _decode_pids(pipe)
    with _same_cpu([mono.proc.pid, *staged_pids]):
        meter = CpuMeter(pipe)
        deadline = time.monotonic() + 2 * cfg.trial_budget_s
        for k in range(cfg.latency_n):
            idx = k % N_INPUTS
            for side in ("mono", "staged") if k % 2 == 0 else ("staged", "mono"):
                if side == "mono":
                    samples, cpu_s = await _mono_requests(cfg, mono, checker, 1, idx)
                    mono_samples += samples
                    mono_cpu += cpu_s
                    continue
                s = await asyncio.wait_for(
                    _one_stream(pipe, idx, requests[idx]), cfg.step_timeout_s
                )
                checker.check("staged", idx, s.pop("streamed"), "streamed tokens", count=False)
                checker.check("staged", idx, s.pop("generated_ids"), "final generated_ids")
                staged_samples.append(s)
            if time.monotonic() > deadline:
                break
        # The workers idle while the child runs, so their CPU time is the staged requests'.
        cpu = meter.per_request_ms(len(staged_samples))
    return _mono_summary(mono_samples, mono_cpu), _staged_summary(staged_samples, cpu)


async def staged_throughput(
    cfg: Config, pipe: Pipeline, requests: list[VLMRequest], checker: Checker
) -> dict[str, Any]:
    """8 client tasks, each submitting back to back from a shared count until the deadline."""
    next_index = 0
    latencies: list[float] = []
    shared: list[float] = []
    deadline = time.monotonic() + cfg.trial_budget_s

    async def client() -> None:
        nonlocal next_index
        while next_index < cfg.throughput_n and time.monotonic() < deadline:
            i = next_index
            next_index += 1
            idx = i % N_INPUTS
            t0 = time.perf_counter()
            final = await asyncio.wait_for(pipe.submit(requests[idx]), cfg.step_timeout_s)
            latencies.append((time.perf_counter() - t0) * 1e3)
            if not isinstance(final, DecodeChunk) or not final.done:
                raise RuntimeError(f"input {idx}: the pipeline returned {final!r}")
            checker.check("staged", idx, final.generated_ids)
            shared.append(final.timings.get("mean_batch", 1.0))

    meter = CpuMeter(pipe)
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(client()) for _ in range(CONCURRENCY)]
    try:
        await asyncio.gather(*tasks)
    finally:
        # On a failure (a mismatch, a timeout), stop the other clients before unwinding.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    done = len(latencies)
    cpu = meter.per_request_ms(done)
    return {
        "done": done,
        "elapsed_s": elapsed,
        "req_per_s": done / elapsed,
        "latency_p50_ms": median(latencies),
        "cpu_ms_per_request": cpu,
        "mean_batch": sum(shared) / len(shared),
    }


# ---- the run --------------------------------------------------------------------------------


def _summarise_cpu(trials: list[dict[str, float]]) -> dict[str, float]:
    keys = trials[0].keys()
    out = {k: median([t[k] for t in trials]) for k in keys}
    out["total"] = sum(out.values())
    return out


class MachineMeter:
    """How busy the whole machine was over a span, and how much of that was this run's.

    Other tenants' load matters on a 2-core box: a process of theirs that keeps one core
    busy leaves the 4 workers and the client one core between them.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        with open("/proc/stat", encoding="ascii") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)
        ours = time.process_time() + sum(cpu_seconds(p) for p in self.pids)
        return (sum(cpu) - idle) / tick, ours, time.monotonic()

    def stop(self) -> dict[str, float]:
        busy, ours, now = self._sample()
        wall = now - self._start[2]
        busy, ours = busy - self._start[0], ours - self._start[1]
        return {
            "wall_s": wall,
            "busy_cores": busy / wall,
            "this_run_cores": ours / wall,
            "other_cores": max(0.0, busy - ours) / wall,
            "loadavg_1m_end": os.getloadavg()[0],
        }


def _spec(
    decode_replicas: int = 1,
    decode_params: dict[str, int] | None = None,
    cpu_idle: CpuIdle = "default",
) -> PipelineSpec:
    """configs/tiny-vlm.yaml with ``decode_replicas`` replicas of the decode stage, the
    decode params given (``max_batch``: 1 makes every request step alone; ``chunk_tokens``)
    and ``defaults.cpu_idle``."""
    data: dict[str, Any] = PipelineSpec.from_yaml(CONFIG).to_dict()
    data.setdefault("defaults", {})["cpu_idle"] = cpu_idle
    decode = data["stages"]["decode"]
    decode["replicas"] = decode_replicas
    decode["params"].update(decode_params or {})
    return PipelineSpec.from_dict(data)


async def _staged_trials(
    cfg: Config, pipe: Pipeline, mono: Mono, requests: list[VLMRequest], checker: Checker
) -> dict[str, list[dict[str, Any]]]:
    """The interleaved trials: latency, the A/B diagnostic, then throughput, each round."""
    trials: dict[str, list[dict[str, Any]]] = {
        "mono_latency": [],
        "staged_latency": [],
        "mono_latency_pin_all": [],
        "staged_latency_pin_all": [],
        "mono_inference_mode_ab": [],
        "mono_throughput": [],
        "staged_throughput": [],
    }
    for t in range(cfg.trials):
        _log(f"trial {t + 1}/{cfg.trials}: latency (conc 1), the sides interleaved")
        mono_trial, staged_trial = await latency_pairs(cfg, mono, pipe, requests, checker)
        trials["mono_latency"].append(mono_trial)
        trials["staged_latency"].append(staged_trial)
        if cfg.pin_all_diag:
            _log(f"trial {t + 1}/{cfg.trials}: latency again, every stage on the child's vCPU")
            mono_trial, staged_trial = await latency_pairs(
                cfg, mono, pipe, requests, checker, pin_all=True
            )
            trials["mono_latency_pin_all"].append(mono_trial)
            trials["staged_latency_pin_all"].append(staged_trial)
        if cfg.ab_n:
            trials["mono_inference_mode_ab"].append(
                await mono_inference_mode_ab(cfg, mono, checker)
            )
        _log(f"trial {t + 1}/{cfg.trials}: throughput (conc {CONCURRENCY})")
        trials["mono_throughput"].append(await mono_throughput(cfg, [mono], checker))
        trials["staged_throughput"].append(await staged_throughput(cfg, pipe, requests, checker))
    return trials


async def run(
    cfg: Config, decode_replicas: int, decode_params: dict[str, int] | None = None
) -> dict[str, Any]:
    """Start the monolithic children and the pipeline, then interleave their trials."""
    requests = sample_requests(N_INPUTS)
    timeout = cfg.step_timeout_s
    out: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    async with contextlib.AsyncExitStack() as stack:
        _log("monolithic child: start-up")
        mono = await Mono.start(timeout)
        stack.push_async_callback(mono.close)
        out["mono_startup_s"] = mono.startup_s
        out["mono_startup_detail"] = mono.hello
        _log("monolithic child: reference tokens (generate)")
        reference = (await mono.call(timeout, op="ref"))["tokens"]
        checker = Checker(reference)
        out["reference_lengths"] = [len(t) for t in reference]

        _log("staged pipeline: start-up")
        t0 = time.perf_counter()
        async with Pipeline(_spec(decode_params=decode_params, cpu_idle=cfg.cpu_idle)) as pipe:
            out["staged_startup_s"] = time.perf_counter() - t0
            out["workers"] = {stage: pid for (stage, _k), pid in pipe.worker_pids.items()}
            # The second monolithic child (for the two-process diagnostic only) starts
            # during the warm-up, which measures nothing, and then idles on its stdin.
            _log("warm-up, both sides" + (" (and a second monolithic child)" if cfg.mono2 else ""))
            second_start = asyncio.ensure_future(Mono.start(timeout)) if cfg.mono2 else None

            async def _reap() -> None:
                assert second_start is not None
                if not second_start.done():
                    second_start.cancel()
                with contextlib.suppress(BaseException):
                    await (await second_start).close()

            if second_start is not None:
                stack.push_async_callback(_reap)
            for i in range(cfg.warmup_n):
                final = await asyncio.wait_for(pipe.submit(requests[i % N_INPUTS]), timeout)
                checker.check("staged", i, final.generated_ids, "warm-up tokens", count=False)
            await _mono_requests(cfg, mono, checker, cfg.warmup_n)
            second = None
            if second_start is not None:
                second = await asyncio.wait_for(second_start, timeout)
                await _mono_requests(cfg, second, checker, cfg.warmup_n)
            # Only sequential requests so far: the envelope hops of an unloaded pipeline.
            out["envelope_hop_p50_us_conc1"] = hop_p50s(await pipe.statistics())
            ours = [mono.proc.pid, *out["workers"].values()]
            machine = MachineMeter(ours + ([second.proc.pid] if second is not None else []))
            out["trials"] = await _staged_trials(cfg, pipe, mono, requests, checker)
            out["machine_during_trials"] = machine.stop()
            _log("staged pipeline: shutdown")
            t0 = time.perf_counter()
        out["staged_shutdown_s"] = time.perf_counter() - t0

        if second is not None:
            _log("diagnostic: two monolithic processes at once")
            out["mono2_throughput"] = [
                await mono_throughput(cfg, [mono, second], checker) for _ in range(cfg.diag_trials)
            ]
        if decode_replicas > 1:
            _log(f"diagnostic: staged with {decode_replicas} decode replicas: start-up")
            t0 = time.perf_counter()
            async with Pipeline(_spec(decode_replicas, decode_params, cfg.cpu_idle)) as pipe:
                rep: dict[str, Any] = {
                    "decode_replicas": decode_replicas,
                    "startup_s": time.perf_counter() - t0,
                    "mono": [],
                    "staged": [],
                }
                for i in range(cfg.warmup_n):
                    await asyncio.wait_for(pipe.submit(requests[i % N_INPUTS]), timeout)
                for t in range(cfg.diag_trials):
                    _log(f"diagnostic: decode replicas, throughput trial {t + 1}")
                    rep["mono"].append(await mono_throughput(cfg, [mono], checker))
                    rep["staged"].append(await staged_throughput(cfg, pipe, requests, checker))
                out["replicated"] = rep
    out["checked"] = checker.checked
    return out


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians over trials of everything the table and the notes need."""
    tr = raw["trials"]

    def med(name: str, key: str) -> float:
        return median([t[key] for t in tr[name]])

    mono_e2e = med("mono_latency", "e2e_p50_ms")
    staged_e2e = med("staged_latency", "e2e_p50_ms")

    # Request k of a latency trial ran on both sides back to back, on the same input: the
    # median of the paired relative differences.
    def paired_trials(mono_key: str, staged_key: str) -> list[list[float]]:
        return [
            [(b - a) / a for a, b in zip(mt["e2e_ms"], st["e2e_ms"], strict=True)]
            for mt, st in zip(tr[mono_key], tr[staged_key], strict=True)
        ]

    paired = paired_trials("mono_latency", "staged_latency")
    pinned = paired_trials("mono_latency_pin_all", "staged_latency_pin_all")
    s: dict[str, Any] = {
        "mono": {
            "ttft_p50_ms": med("mono_latency", "ttft_p50_ms"),
            "e2e_p50_ms": mono_e2e,
            "req_per_s": med("mono_throughput", "req_per_s"),
            "steps_p50_ms": {
                k: median([t["steps_p50_ms"][k] for t in tr["mono_latency"]])
                for k in tr["mono_latency"][0]["steps_p50_ms"]
            },
            "cpu_ms_per_request_conc1": med("mono_latency", "cpu_ms_per_request"),
            "cpu_ms_per_request_tput": med("mono_throughput", "cpu_ms_per_request"),
            "startup_s": raw["mono_startup_s"],
        },
        "staged": {
            "ttft_p50_ms": med("staged_latency", "ttft_p50_ms"),
            "e2e_p50_ms": staged_e2e,
            "final_chunk_p50_ms": med("staged_latency", "final_chunk_p50_ms"),
            "req_per_s": med("staged_throughput", "req_per_s"),
            "latency_p50_ms_conc8": med("staged_throughput", "latency_p50_ms"),
            "decode_timings_p50_ms": {
                k: median([t["decode_timings_p50_ms"][k] for t in tr["staged_latency"]])
                for k in tr["staged_latency"][0]["decode_timings_p50_ms"]
            },
            "cpu_ms_per_request_conc1": _summarise_cpu(
                [t["cpu_ms_per_request"] for t in tr["staged_latency"]]
            ),
            "mean_batch_conc8": median([t["mean_batch"] for t in tr["staged_throughput"]]),
            "cpu_ms_per_request_conc8": _summarise_cpu(
                [t["cpu_ms_per_request"] for t in tr["staged_throughput"]]
            ),
            "startup_s": raw["staged_startup_s"],
        },
        "overhead_conc1": median([x for trial in paired for x in trial]),
        "overhead_conc1_p50s": (staged_e2e - mono_e2e) / mono_e2e,
        "trial_overheads": [median(trial) for trial in paired],
        "overhead_conc1_pin_all": (
            median([x for trial in pinned for x in trial]) if pinned else None
        ),
        "trial_overheads_pin_all": [median(trial) for trial in pinned],
        "trial_throughput_ratios": [
            s["req_per_s"] / m["req_per_s"]
            for m, s in zip(tr["mono_throughput"], tr["staged_throughput"], strict=True)
        ],
    }
    ab = tr["mono_inference_mode_ab"]
    if ab:
        ratios = {k: median([x for t in ab for x in t[k]]) for k in ab[0]}
        noim = mono_e2e * ratios["e2e_ratio"]
        s["inference_mode_ab"] = {**ratios, "pairs": sum(len(t["e2e_ratio"]) for t in ab)}
        s["mono"]["e2e_p50_ms_no_inference_mode"] = noim
        s["overhead_conc1_vs_no_inference_mode"] = (staged_e2e - noim) / noim
    s["throughput_ratio"] = s["staged"]["req_per_s"] / s["mono"]["req_per_s"]
    s["ttft_ratio"] = s["staged"]["ttft_p50_ms"] / s["mono"]["ttft_p50_ms"]
    s["startup_ratio"] = s["staged"]["startup_s"] / s["mono"]["startup_s"]
    if raw.get("replicated"):
        rep = raw["replicated"]
        s["replicated"] = {
            "decode_replicas": rep["decode_replicas"],
            "startup_s": rep["startup_s"],
            "staged_req_per_s": median([t["req_per_s"] for t in rep["staged"]]),
            "mono_req_per_s": median([t["req_per_s"] for t in rep["mono"]]),
            "ratio": median(
                [
                    st["req_per_s"] / mo["req_per_s"]
                    for mo, st in zip(rep["mono"], rep["staged"], strict=True)
                ]
            ),
        }
    if raw.get("mono2_throughput"):
        s["mono2_req_per_s"] = median([t["req_per_s"] for t in raw["mono2_throughput"]])
    return s


def build_rows(raw: dict[str, Any], s: dict[str, Any]) -> list[list[str]]:
    """The markdown table: metric, staged, monolithic, ratio, target, status."""
    rows: list[list[str]] = []
    mono, staged = s["mono"], s["staged"]

    def row(
        metric: str, sw: str, base: str, ratio: str, target: str, ok: bool | None = None
    ) -> None:
        status = "info" if ok is None else ("met" if ok else "**missed**")
        rows.append([metric, sw, base, ratio, target, status])

    row(
        "TTFT p50, conc 1",
        f"{staged['ttft_p50_ms']:.2f} ms",
        f"{mono['ttft_p50_ms']:.2f} ms",
        f"{s['ttft_ratio']:.2f}x",
        "report",
    )
    row(
        "e2e latency p50, conc 1",
        f"{staged['e2e_p50_ms']:.2f} ms",
        f"{mono['e2e_p50_ms']:.2f} ms",
        f"{staged['e2e_p50_ms'] / mono['e2e_p50_ms']:.3f}x",
        "report",
    )
    ov = s["overhead_conc1"]
    row(
        "staged overhead at conc 1, median of paired requests' (staged - mono) / mono",
        f"{ov * 100:+.1f}%",
        "0%",
        f"{1 + ov:.3f}x",
        f"< {TARGET_OVERHEAD:.0%}",
        ov < TARGET_OVERHEAD,
    )
    ov50 = s["overhead_conc1_p50s"]
    row(
        "staged overhead at conc 1, (staged - mono) / mono of the e2e p50s",
        f"{ov50 * 100:+.1f}%",
        "0%",
        f"{1 + ov50:.3f}x",
        "report",
    )
    ova = s["overhead_conc1_pin_all"]
    if ova is not None:
        row(
            "staged overhead at conc 1, every stage on the child's vCPU (diagnostic)",
            f"{ova * 100:+.1f}%",
            "0%",
            f"{1 + ova:.3f}x",
            "-",
        )
    tr = s["throughput_ratio"]
    row(
        f"throughput, conc {CONCURRENCY} (req/s)",
        f"{staged['req_per_s']:.1f}/s",
        f"{mono['req_per_s']:.1f}/s (1 process, back to back)",
        f"{tr:.2f}x",
        f"≥ {TARGET_THROUGHPUT_RATIO:.1f}x",
        tr >= TARGET_THROUGHPUT_RATIO,
    )
    if "inference_mode_ab" in s:
        noim = mono["e2e_p50_ms_no_inference_mode"]
        ov2 = s["overhead_conc1_vs_no_inference_mode"]
        row(
            "staged overhead at conc 1 vs mono run as the stages run it: no inference_mode "
            "(diagnostic)",
            f"{ov2 * 100:+.1f}%",
            f"e2e p50 {noim:.2f} ms (estimated)",
            f"{1 + ov2:.3f}x",
            "-",
        )
    if "mono2_req_per_s" in s:
        m2 = s["mono2_req_per_s"]
        row(
            f"throughput, conc {CONCURRENCY} (diagnostic)",
            f"{staged['req_per_s']:.1f}/s",
            f"{m2:.1f}/s (2 processes, one per core)",
            f"{staged['req_per_s'] / m2:.2f}x",
            "-",
        )
    if "replicated" in s:
        rp = s["replicated"]
        row(
            f"throughput, conc {CONCURRENCY}, {rp['decode_replicas']} decode replicas (diagnostic)",
            f"{rp['staged_req_per_s']:.1f}/s",
            f"{rp['mono_req_per_s']:.1f}/s (1 process, same minutes)",
            f"{rp['ratio']:.2f}x (median of paired trials)",
            "-",
        )
    row(
        "start-up to ready",
        f"{staged['startup_s']:.2f} s (4 workers)",
        f"{mono['startup_s']:.2f} s (1 process + model)",
        f"{s['startup_ratio']:.2f}x",
        "report",
    )
    checked = raw["checked"]
    row(
        "outputs identical to generate()",
        f"{checked['staged']} requests equal",
        f"{checked['mono']} requests equal",
        "-",
        "all equal",
        True,  # a mismatch ends the run before the table
    )
    return rows


def _fmt_ms(d: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in d.items())


def render(raw: dict[str, Any], s: dict[str, Any]) -> str:
    """The markdown report: the table, then what a reader needs to judge it."""
    lines = [
        "| metric | staged | monolithic | ratio | target | status |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in build_rows(raw, s)]
    mono, staged = s["mono"], s["staged"]
    dt = staged["decode_timings_p50_ms"]
    front = staged["e2e_p50_ms"] - dt["kv_receive_ms"] - dt["decode_ms"]
    mono_front = sum(v for k, v in mono["steps_p50_ms"].items() if k != "decode_ms")
    cfg = raw["config"]
    m = raw["machine_during_trials"]
    lines += [
        "",
        f"- machine: {raw['machine']['cpus']} CPUs, Python {raw['machine']['python']}, "
        f"torch {raw['machine']['torch']}; cpu_idle: {cfg.get('cpu_idle', 'default')}; "
        f"medians of {cfg['trials']} trials; inputs: the "
        f"{N_INPUTS} shipped sample requests, cycled (reference lengths "
        f"{raw['reference_lengths']} tokens)",
        "- per-trial overhead at conc 1 (median of the trial's pairs): "
        + ", ".join(f"{x * 100:+.1f}%" for x in s["trial_overheads"])
        + (
            "; with every stage on the child's vCPU: "
            + ", ".join(f"{x * 100:+.1f}%" for x in s["trial_overheads_pin_all"])
            if s["trial_overheads_pin_all"]
            else ""
        )
        + "; per-trial throughput ratio: "
        + ", ".join(f"{x:.2f}x" for x in s["trial_throughput_ratios"]),
        f"- monolithic steps p50 (ms): {_fmt_ms(mono['steps_p50_ms'])}",
        f"- decode stage's own timings p50 (ms): {_fmt_ms(dt)}; so e2e minus decode's "
        f"time = {front:.2f} ms (client→preprocess→encode→prefill→decode, plus the tail "
        f"back to the client) against {mono_front:.2f} ms of prepare+encode+prefill in "
        f"one process; staged decode loop {dt['decode_ms']:.2f} ms (of it model steps "
        f"{dt['model_ms']:.2f} ms, the rest the runtime's) against mono "
        f"{mono['steps_p50_ms']['decode_ms']:.2f} ms",
        f"- staged shutdown {raw['staged_shutdown_s']:.2f} s; "
        f"staged final chunk p50 {staged['final_chunk_p50_ms']:.2f} ms, stream end p50 "
        f"{staged['e2e_p50_ms']:.2f} ms; staged request latency at conc {CONCURRENCY} p50 "
        f"{staged['latency_p50_ms_conc8']:.1f} ms",
        _fmt_ab(s),
        "- envelope hop p50 by edge, conc 1 (µs): "
        + ", ".join(f"{k} {v:.0f}" for k, v in raw["envelope_hop_p50_us_conc1"].items()),
        f"- machine during the trials: {m['busy_cores']:.2f} of {raw['machine']['cpus']} "
        f"cores busy on average, {m['this_run_cores']:.2f} of them this run's processes and "
        f"{m['other_cores']:.2f} other tenants'; load average {raw['loadavg_start'][0]:.2f} "
        f"at the start, {m['loadavg_1m_end']:.2f} at the end of the trials",
        "- CPU ms per request, staged conc 1: "
        + _fmt_cpu(staged["cpu_ms_per_request_conc1"])
        + f"; mono {mono['cpu_ms_per_request_conc1']:.1f}",
        f"- CPU ms per request, staged conc {CONCURRENCY}: "
        + _fmt_cpu(staged["cpu_ms_per_request_conc8"])
        + f"; mono {mono['cpu_ms_per_request_tput']:.1f}",
        f"- decode steps at conc {CONCURRENCY}: each request's steps were shared by "
        f"{staged['mean_batch_conc8']:.2f} requests on average (decode max_batch: "
        f"{cfg['max_batch'] if cfg['max_batch'] is not None else 'as configured'}; "
        f"chunk_tokens: {cfg.get('chunk_tokens') or 'as configured'})",
    ]
    return "\n".join(lines)


def _fmt_ab(s: dict[str, Any]) -> str:
    ab = s.get("inference_mode_ab")
    if not ab:
        return "- inference_mode A/B: not run"
    return (
        "- the reference without torch.inference_mode (the stages run without it), paired "
        f"with it over {ab['pairs']} inputs, median ratios: e2e {ab['e2e_ratio']:.3f}x, "
        f"decode loop {ab['decode_ratio']:.3f}x, prepare+encode+prefill "
        f"{ab['front_ratio']:.3f}x; the estimated reference e2e without it is mono e2e p50 x "
        "the e2e ratio"
    )


def _fmt_cpu(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items())


def main(argv: list[str] | None = None) -> int:
    """Run every phase, print the markdown table, optionally write the raw numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter trials (~30 s)")
    p.add_argument("--json", metavar="OUT", help="write the raw numbers to this file")
    p.add_argument(
        "--decode-replicas",
        type=int,
        default=0,
        metavar="N",
        help="also measure throughput with N decode replicas (a diagnostic; adds ~25 s)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="N",
        help="the decode stage's max_batch instead of the config's (1: no batched steps)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the decode stage's chunk_tokens instead of the config's (the most tokens per "
        "streamed chunk: fewer chunks, fewer wake-ups of the client)",
    )
    add_cpu_idle_option(p, "the monolithic side")
    p.add_argument("--mono-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mono_child:
        return mono_child()
    # SIGTERM unwinds like Ctrl-C, so every finally block stops what this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    cfg = replace(QUICK if args.quick else FULL, cpu_idle=args.cpu_idle)
    hold_cpu_idle_for_run(cfg.cpu_idle)
    json_out = os.path.abspath(args.json) if args.json else None
    os.chdir(ROOT)  # workers resolve "stages.*" from the working directory
    t_start = time.perf_counter()
    try:
        overrides = {
            k: v
            for k, v in (("max_batch", args.max_batch), ("chunk_tokens", args.chunk_tokens))
            if v is not None
        }
        raw = asyncio.run(run(cfg, args.decode_replicas, overrides))
    except OutputMismatch as e:
        print(f"OUTPUT MISMATCH: {e}", file=sys.stderr, flush=True)
        return 1
    raw["config"] = {
        **asdict(cfg),
        "quick": args.quick,
        "concurrency": CONCURRENCY,
        "max_batch": args.max_batch,
        "chunk_tokens": args.chunk_tokens,
    }
    raw["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    summary = summarise(raw)
    raw["summary"] = summary
    raw["elapsed_s"] = time.perf_counter() - t_start
    raw["phase_start_s"] = _log.phases
    print(render(raw, summary))
    print(f"\n(total {raw['elapsed_s']:.0f} s)")
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
