"""What readers that stop cost the requests still read, on an edge pinned to shm.

Run from the repository root::

    .venv/bin/python benchmarks/stopped_readers.py [--stopped N] [--rounds R] [--quick]

``SizedSource`` streams frames to ``FramesOn``, which passes them on to the client; the edge
between them is pinned to shm, with an arena smaller than one stream's window. A request is
timed read to its end alone, then while ``--stopped`` other clients have read one frame of
their own streams and stopped: ``FramesOn`` waits to send them on, and their windows of
frames wait unread in its buffers, holding extents of the arena (more than it holds: the
timing starts once the consumer has had to copy some out). The figure is the ratio of
the two medians, measured in the same run, and how many payloads the consumer copied out
of the arena (``spilled``) to keep the room for the request being read. Without that, the
request waited for room until its ``full_timeout`` (the edge's ``chunk_timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.transport_stages import Go  # noqa: E402
from pipeline import Pipeline, PipelineSpec  # noqa: E402


def _spec(size: int, capacity: str, chunk_timeout: str) -> PipelineSpec:
    return PipelineSpec.from_dict(
        {
            "name": "stopped-readers",
            "defaults": {"chunk_timeout": chunk_timeout},
            "stages": {
                "source": {"impl": "benchmarks.transport_stages:SizedSource"},
                "on": {"impl": "benchmarks.transport_stages:FramesOn"},
            },
            "edges": [
                {
                    "from": "source",
                    "to": "on",
                    "transport": {"kind": "shm", "options": {"capacity": capacity}},
                }
            ],
        }
    )


async def _timed(pipe: Pipeline, go: Go) -> float:
    """Seconds to read one request's stream to its end."""
    started = time.perf_counter()
    n = 0
    async for _ in pipe.stream(go):
        n += 1
    assert n == go.n, f"got {n} of {go.n} frames"
    return time.perf_counter() - started


async def _copied_out(pipe: Pipeline) -> None:
    """Wait until the consumer copied out frames of the stopped streams: what it holds of
    them unread (a window at least) is more than the arena, so their own producer runs
    short first. Measured before, the request could run while the arena still had room.

    Raises:
        TimeoutError: none was within 30 s (their windows fit in the arena: give a
            smaller ``--capacity``).
    """
    async with asyncio.timeout(30):
        while True:
            stats = await pipe.statistics()
            inputs = [i for r in stats["replicas"] if r["stage"] == "on" for i in r["inputs"]]
            if any(i["spilled"] for i in inputs):
                return
            await asyncio.sleep(0.05)


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    go = Go(args.size, args.frames)
    spec = _spec(args.size, args.capacity, args.chunk_timeout)
    async with Pipeline(spec) as pipe:
        await _timed(pipe, go)  # warm: segments made and mapped, modules loaded
        alone = [await _timed(pipe, go) for _ in range(args.rounds)]
        stopped = []
        for _ in range(args.stopped):
            stream = pipe.stream(go).__aiter__()
            await stream.__anext__()
            stopped.append(stream)
        try:
            await _copied_out(pipe)
            with_stopped = [await _timed(pipe, go) for _ in range(args.rounds)]
        finally:
            for stream in stopped:
                await stream.aclose()
        stats = await pipe.statistics()
    spilled = sum(
        i.get("spilled", 0) for r in stats["replicas"] if r["stage"] == "on" for i in r["inputs"]
    )
    alone_s, with_s = statistics.median(alone), statistics.median(with_stopped)
    return {
        "frame_bytes": args.size,
        "frames": args.frames,
        "capacity": args.capacity,
        "stopped": args.stopped,
        "alone_ms": alone_s * 1e3,
        "with_stopped_ms": with_s * 1e3,
        "ratio": with_s / alone_s,
        "spilled": spilled,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stopped", type=int, default=2, help="clients that stop reading")
    ap.add_argument("--rounds", type=int, default=5, help="timed requests each way")
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes per frame")
    ap.add_argument("--frames", type=int, default=200, help="frames per request")
    ap.add_argument("--capacity", default="16MiB", help="the shm arena's size")
    ap.add_argument("--chunk-timeout", default="10s", help="the edge's chunk_timeout")
    ap.add_argument("--quick", action="store_true", help="a short run (the smoke test's)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.frames, args.rounds = 100, 2
    figures = asyncio.run(_measure(args))
    print(
        f"| frames | arena | stopped readers | alone p50 | with them p50 | ratio | spilled |\n"
        f"|---|---|---|---|---|---|---|\n"
        f"| {args.frames} x {args.size // 1024} KiB | {args.capacity} | {args.stopped} "
        f"| {figures['alone_ms']:.0f} ms | {figures['with_stopped_ms']:.0f} ms "
        f"| {figures['ratio']:.2f}x | {figures['spilled']} |"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
