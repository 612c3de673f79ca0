"""The runtime's own CPU per streamed chunk, in one process: no sockets, no wake-ups.

Run from the repository root::

    .venv/bin/python benchmarks/inproc_chain.py [--chunks N] [--trials T] [--concurrency C]
    .venv/bin/python benchmarks/inproc_chain.py --requests N [--evict MIB]

With ``--requests`` it measures the other shape instead: one-chunk requests, one at a
time, through the chain of ``hops.py``'s latency test (four relays), which is what a
request pays per hop before any model runs. ``--evict`` walks a buffer of that many MiB
between requests, so each request's Python runs with cold caches, as it does in a stage
that idled for a whole request while another process computed; the per-request cost
then grows several-fold, and that is the figure a leaner per-message path has to cut.

The 4-stage chain of ``benchmarks/hops.py`` (source -> relay -> relay -> sink, every edge
inline, 1 KiB chunks) runs as four real stage actors and the real orchestrator in one
event loop. Their batches go through the real ``Outbox``, whose transmit hands each frame
to the receiving actor on the next loop turn instead of to a socket. What remains is the
Python the runtime runs per chunk: encoding, envelopes, batching, decoding, ordering,
credit and the handlers' iteration. It is steady from run to run, unlike the multi-process
figures on a small VM, so it is the figure to compare before and after a change to the data
path. ``hops.py`` remains the figure that counts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_stages import Blob, Counted, Start  # noqa: E402
from benchmarks.hops import LATENCY_CHAIN, STREAM_CHAIN, chain_spec  # noqa: E402
from pipeline._actor import StageActor  # noqa: E402
from pipeline._config import PipelineSpec  # noqa: E402
from pipeline._errors import EndOfChannel  # noqa: E402
from pipeline._messages import Admit, Peer  # noqa: E402
from pipeline._orchestrator import Orchestrator, ReplicaView  # noqa: E402
from pipeline._signature import build_plan  # noqa: E402
from pipeline._sockets import Outbox  # noqa: E402

HOST = "inproc-host"
CLIENT_ENDPOINT = "inproc://client"


class LoopbackOutbox(Outbox):
    """The real batching, with each frame handed to its receiver on the next loop turn."""

    def __init__(self, routes: dict[str, Any]) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # no ZMQ context: nothing to connect
        self._routes = routes

    def _transmit(self, endpoint: str, frame: bytes) -> None:
        asyncio.get_running_loop().call_soon(self._routes[endpoint], [frame])


async def build(
    impls: tuple[str, str, str, str] = STREAM_CHAIN,
) -> tuple[Orchestrator, list[StageActor]]:
    """The chain's actors and orchestrator, wired through one loopback outbox."""
    spec = PipelineSpec.from_dict(chain_spec("inproc", impls), source="<inproc>")
    plan = build_plan(spec)
    routes: dict[str, Any] = {}
    outbox = LoopbackOutbox(routes)
    actors: dict[str, StageActor] = {}
    token = os.urandom(16)
    for name, stage_plan in plan.stages.items():
        instance = stage_plan.signature.cls(
            params=stage_plan.params, name=name, replica=0, device=stage_plan.spec.device
        )
        await instance.setup()
        actors[name] = StageActor(
            stage_plan,
            instance,
            replica=0,
            host=HOST,
            endpoint=f"inproc://{name}",
            send=outbox.send,
            report_failure=lambda info: print("failed:", info, file=sys.stderr),
            # No pacing (it flushes a handler's chunks when it computes slowly): under
            # valgrind every chunk would look slow, and the count would not compare.
            outbox=None,
            token=token,
        )

    def control(stage: str, replica: int, msg: Any) -> None:
        if isinstance(msg, Admit):
            actors[stage].admit(msg.request_id, msg.route)
        else:
            actors[stage].forget(msg.request_id)

    orch = Orchestrator(
        plan,
        host=HOST,
        endpoint=CLIENT_ENDPOINT,
        send_data=outbox.send,
        send_control=control,
        token=token,
    )
    peers = {name: {0: Peer(f"inproc://{name}", HOST)} for name in actors}
    for name, actor in actors.items():
        actor.set_peers(peers, Peer(CLIENT_ENDPOINT, HOST))
        # As a worker reads them: each message's handling ends with the outbox's flush.
        routes[f"inproc://{name}"] = outbox.flushing_after(actor.on_data)
        view = orch.replicas[name][0] = ReplicaView(name, 0, f"inproc://{name}", HOST)
        view.ready = True
    routes[CLIENT_ENDPOINT] = outbox.flushing_after(orch.on_data)
    return orch, list(actors.values())


async def _last_output(orch: Orchestrator, value: Any) -> Any:
    """Send ``value`` to the chain's source and read the request to its end; its last output."""
    req = await orch.start({"source": value})
    out: Any = None
    try:
        while True:
            _, out = await orch.next_output(req)
    except EndOfChannel:
        pass
    return out


async def run_one(orch: Orchestrator, n: int) -> Counted:
    """Stream ``n`` chunks through the chain; the sink's count."""
    out = await _last_output(orch, Start(n, 1024))
    if not isinstance(out, Counted) or out.chunks != n:
        raise RuntimeError(f"the sink counted {out!r}, expected {n} chunks")
    return out


async def one_request(orch: Orchestrator, blob: Blob) -> None:
    """One one-chunk request through the latency chain, read to its end."""
    out = await _last_output(orch, blob)
    if out != blob:
        raise RuntimeError(f"the chain returned {out!r}")


async def per_request(requests: int, trials: int, evict_mib: int) -> list[float]:
    """CPU µs per one-chunk request through the four relays and the client, per trial;
    with ``evict_mib``, a buffer that size is walked (outside the timing) between requests."""
    orch, actors = await build(LATENCY_CHAIN)
    blob = Blob(b"\x5a" * 1024)
    for _ in range(200):  # warm-up
        await one_request(orch, blob)
    junk = bytearray(evict_mib * 2**20)
    per = []
    for _ in range(trials):
        spent = 0.0
        for _ in range(requests):
            if junk:
                junk[::64] = bytes(len(junk[::64]))  # touch every cache line
            t0 = time.process_time()
            await one_request(orch, blob)
            spent += time.process_time() - t0
        per.append(spent / requests * 1e6)
    await orch.aclose()
    for actor in actors:
        await actor.aclose()
    return per


async def main_async(chunks: int, trials: int, concurrency: int) -> list[float]:
    """CPU µs per chunk of each trial."""
    orch, actors = await build()
    await run_one(orch, 1000)  # warm-up
    per_chunk = []
    for _ in range(trials):
        t0 = time.process_time()
        await asyncio.gather(*(run_one(orch, chunks // concurrency) for _ in range(concurrency)))
        per_chunk.append((time.process_time() - t0) / chunks * 1e6)
    await orch.aclose()
    for actor in actors:
        await actor.aclose()
    return per_chunk


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=50_000)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument(
        "--requests",
        type=int,
        default=0,
        help="measure one-chunk requests through the latency chain instead, this many a trial",
    )
    ap.add_argument(
        "--evict",
        type=int,
        default=0,
        metavar="MIB",
        help="with --requests: walk a buffer this large between requests (cold caches)",
    )
    args = ap.parse_args(argv)
    if args.requests:
        per = asyncio.run(per_request(args.requests, args.trials, args.evict))
        trials = ", ".join(f"{x:.0f}" for x in per)
        cold = f", caches evicted ({args.evict} MiB walked) before each" if args.evict else ""
        print(
            f"runtime CPU per one-chunk request through 4 relays and the client{cold}: best"
            f" {min(per):.0f} µs, median {statistics.median(per):.0f} µs (trials: {trials})"
        )
        return 0
    per_chunk = asyncio.run(main_async(args.chunks, args.trials, args.concurrency))
    trials = ", ".join(f"{x:.1f}" for x in per_chunk)
    best, mid = min(per_chunk), statistics.median(per_chunk)
    # The best trial is the steadiest figure for CPU-bound code on a shared VM: slower
    # trials only add interference.
    print(
        f"runtime CPU per chunk across the 4-stage chain: best {best:.1f} µs, median"
        f" {mid:.1f} µs (trials: {trials}); at best a ceiling of {1e6 / best:,.0f} chunks/s"
        " on one core"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
