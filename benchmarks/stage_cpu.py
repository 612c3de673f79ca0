"""Where the reference pipeline's CPU goes at concurrency 1: each process's CPU per request,
against the same steps run back to back in one process.

Run from the repository root::

    .venv/bin/python benchmarks/stage_cpu.py [--requests N] [--json OUT]

This process loads the whole model (one torch thread, as every stage sets) and runs the
shipped sample requests' steps back to back, before and after the staged requests (their
mean is the baseline, since this VM's speed drifts within a minute): ``prepare`` (the
preprocess stage's body), the vision encoder, prefill and the greedy decode loop, timing
each. In between it starts ``configs/tiny-vlm.yaml`` (four worker processes, the master
in this process), warms it up, and streams ``N`` requests one after another. Each
process's CPU over those requests comes from its threads' scheduler statistics
(``/proc/PID/task/*/schedstat``, nanosecond resolution, unlike the 10 ms ticks of
``/proc/PID/stat``), and each stage's handler time from the pipeline's statistics. Linux
only.

What the table shows: how much more CPU each stage spends per request than its step costs
in one process, and how much of that is inside the stage's handler (its model code, run
cold after the process idled through the rest of the request) and how much outside it
(the runtime: receiving, decoding, starting the handler, encoding, sending, and waking).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline import Pipeline  # noqa: E402
from stages.model import GreedyDecoding  # noqa: E402
from stages.preprocess import prepare  # noqa: E402
from stages.samples import sample_requests  # noqa: E402
from stages.weights import load_model  # noqa: E402

CONFIG = ROOT / "configs" / "tiny-vlm.yaml"
MAX_NEW_TOKENS = 32  # as configs/tiny-vlm.yaml sets it
WARM_UP = 24
STAGES = ("preprocess", "encode", "prefill", "decode")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in nanoseconds (threads gone excluded)."""
    total = 0
    for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(task, encoding="ascii") as f:
                total += int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return total


def one_process_steps(rounds: int) -> dict[str, float]:
    """Median milliseconds of each step per request, the steps run back to back here."""
    torch.set_num_threads(1)
    model = load_model()
    requests = sample_requests()
    times: dict[str, list[float]] = {"prepare": [], "encode": [], "prefill": [], "decode": []}

    def timed(step: str, t0: float) -> float:
        now = time.perf_counter()
        times[step].append((now - t0) * 1e3)
        return now

    with torch.inference_mode():
        for i in range(rounds + WARM_UP):
            t = time.perf_counter()
            pixels, ids = prepare(requests[i % len(requests)])
            t = timed("prepare", t)
            image = model.vision(pixels)
            t = timed("encode", t)
            layers = list(model.decoder.prefill(image, ids))
            t = timed("prefill", t)
            first = layers[-1].first_token
            assert first is not None
            list(GreedyDecoding(model.decoder, first, [x.kv for x in layers], MAX_NEW_TOKENS))
            timed("decode", t)
    return {k: statistics.median(v[WARM_UP:]) for k, v in times.items()}


async def staged(n: int) -> tuple[dict[str, float], dict[str, float], float]:
    """CPU ms per request of each worker and of this process, each stage's handler p50
    (ms), and the mean end-to-end latency (ms), over ``n`` sequential requests."""
    requests = sample_requests()
    async with Pipeline.from_yaml(CONFIG) as pipe:
        pids = {stage: pid for (stage, _replica), pid in pipe.worker_pids.items()}
        pids["master and client"] = os.getpid()
        for i in range(WARM_UP):
            async for _ in pipe.stream(requests[i % len(requests)]):
                pass
        before = {name: cpu_ns(pid) for name, pid in pids.items()}
        t0 = time.perf_counter()
        for i in range(n):
            async for _ in pipe.stream(requests[i % len(requests)]):
                pass
        elapsed = time.perf_counter() - t0
        after = {name: cpu_ns(pid) for name, pid in pids.items()}
        stats = await pipe.statistics()
    cpu = {name: (after[name] - before[name]) / n / 1e6 for name in pids}
    handler = {r["stage"]: r["process_p50_us"] / 1e3 for r in stats["replicas"]}
    return cpu, handler, elapsed / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured requests")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not os.path.isdir("/proc/self/task"):
        sys.exit("stage_cpu.py reads /proc/PID/task/*/schedstat: Linux only")
    # The one-process steps run before and after the staged requests, and their mean is
    # the baseline: this VM's speed drifts within a minute.
    print("steps back to back in one process ...", file=sys.stderr)
    first = one_process_steps(args.requests // 2)
    print(f"staged, {args.requests} sequential requests ...", file=sys.stderr)
    cpu, handler, e2e = asyncio.run(staged(args.requests))
    print("steps back to back in one process, again ...", file=sys.stderr)
    second = one_process_steps(args.requests // 2)
    mono = {k: (first[k] + second[k]) / 2 for k in first}
    same = {"preprocess": "prepare", "encode": "encode", "prefill": "prefill", "decode": "decode"}
    print(
        "| process | CPU per request, staged | the same step in one process | ratio |"
        " stage's handler p50 |"
    )
    print("|---|---|---|---|---|")
    for name, ms in cpu.items():
        step = same.get(name)
        if step is None:
            print(f"| {name} | {ms:.2f} ms | — | — | — |")
            continue
        one = mono[step]
        print(
            f"| {name} | {ms:.2f} ms | {step} {one:.2f} ms | {ms / one:.2f}x |"
            f" {handler.get(name, float('nan')):.2f} ms |"
        )
    staged_total, mono_total = sum(cpu.values()), sum(mono.values())
    ratio = staged_total / mono_total
    print(f"| all | {staged_total:.2f} ms | {mono_total:.2f} ms | {ratio:.2f}x | |")
    print(
        f"\nmean end-to-end latency, staged: {e2e:.2f} ms; the steps in one process: "
        f"{mono_total:.2f} ms ({e2e / mono_total:.2f}x; {sum(first.values()):.2f} ms before "
        f"the staged requests, {sum(second.values()):.2f} ms after). "
        f"machine: {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}"
    )

    if args.json is not None:
        figures = {
            "cpu_ms_per_request": cpu,
            "handler_p50_ms": handler,
            "one_process_ms": mono,
            "e2e_mean_ms": e2e,
        }
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
