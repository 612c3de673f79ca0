"""How much the monolithic model slows when another process keeps the other CPU busy, and
how much its pre-decode work slows after the process idled.

Run from the repository root::

    .venv/bin/python benchmarks/sibling_load.py [--rounds N] [--idle-ms MS]

1. The reference ``generate()`` (one torch thread) runs over the 12 shipped sample
   requests alone, then while a second process spins on a CPU, alternately, ``--rounds``
   times. On a small VM whose vCPUs share a physical core, or a busy host, the same model
   code runs measurably slower when the other vCPU works. A staged pipeline always has that
   other CPU working (other stages, the client), while ``benchmarks/vlm.py``'s monolithic
   baseline runs with the workers idle.
2. The work before decoding (vision encoder, then prefill of every layer) runs back to back,
   then each time after sleeping ``--idle-ms`` (60 ms by default: about one request's
   decode, which is how long the front stages of the staged pipeline sleep between
   requests at concurrency 1). A process that slept runs its next few milliseconds of
   model code slower (cold caches and predictors, a vCPU woken from halt); the monolithic
   process never sleeps between requests, its front stages' code runs right after the
   previous request's decode.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stages.model import generate  # noqa: E402
from stages.preprocess import prepare  # noqa: E402
from stages.samples import sample_requests  # noqa: E402
from stages.weights import load_model  # noqa: E402


def _front_ms(model: Any, inputs: list[Any], idle_s: float) -> float:
    """Median ms of encode + prefill per request, each after sleeping ``idle_s``."""
    times = []
    for pixels, ids in inputs * 3:
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        for _ in model.decoder.prefill(model.vision(pixels), ids):
            pass
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle-ms", type=float, default=60.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model()
    inputs = [prepare(r) for r in sample_requests(12)]

    def ms_per_request() -> float:
        t0 = time.perf_counter()
        for pixels, ids in inputs:
            generate(model, pixels, ids, 32)
        return (time.perf_counter() - t0) / len(inputs) * 1e3

    ms_per_request()  # warm-up
    ratios = []
    for _ in range(args.rounds):
        alone = ms_per_request()
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)  # let the spinner get its CPU before timing
            loaded = ms_per_request()
        finally:
            spinner.kill()
            spinner.wait()
        ratios.append(loaded / alone)
        print(f"generate(): {alone:.1f} ms/request alone, {loaded:.1f} with the other CPU busy")
    print(
        f"slowdown with the other CPU busy: median {statistics.median(ratios):.2f}x"
        f" (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    idle = []
    for _ in range(args.rounds):
        hot = _front_ms(model, inputs, 0.0)
        cold = _front_ms(model, inputs, args.idle_ms / 1e3)
        idle.append(cold / hot)
        print(
            f"encode + prefill: {hot:.2f} ms back to back,"
            f" {cold:.2f} after {args.idle_ms:g} ms idle"
        )
    print(
        f"slowdown after idling: median {statistics.median(idle):.2f}x"
        f" (rounds: {', '.join(f'{r:.2f}' for r in idle)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
