"""Soak: the reference pipeline under sustained load, with cancellations, failures, kill -9
of replicas, and requests past their deadline.

The tests marked ``soak`` run with ``make soak`` (``make test`` leaves them out), each
for ``STAGEWIRE_SOAK_SECONDS`` (90 by default) at a concurrency of 12; ``make test`` runs
the mixed load for 10 seconds. In the mixed load every request is one of:

- a whole response, whose tokens must equal the single-process reference's;
- a stream left after its first chunk (``aclose``), which aborts it in every stage;
- a stream closed after a random few milliseconds, wherever the request then is (in
  preprocessing, mid-KV-stream, decoding);
- a corrupt image, which must fail alone with a ``StageError``.

The edges go over shm, inline, network and shm, so payloads are put, fetched, released
and reclaimed on three transports the whole time; a second run puts every edge on an shm
arena too small for the load, whose payloads wait for room and fall back to network.
At the end nothing may be held anywhere: no request state in any stage or the client, no
payload held by any transport, no worker's memory grown past a bound after warm-up, and
after close no process and no shm segment.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import Pipeline, PipelineSpec, RequestTimeout, StageError, StageUnavailable
from stages.model import TinyVLM
from stages.payloads import DecodeChunk, VLMRequest
from stages.samples import encode_png, sample_requests
from tests.pipeline.conftest import settled, wait_for
from tests.procs import alive
from tests.stages.conftest import reference
from transports._shm_segment import PREFIX, SHM_DIR

#: How long each soak test loads the pipeline, in seconds.
SECONDS = float(os.environ.get("STAGEWIRE_SOAK_SECONDS", "90"))
#: How long the brief run of the mixed load in ``make test`` lasts.
BRIEF_SECONDS = 10.0
# Beyond the load: starting pipelines, the reference outputs, restarts, the final checks.
pytestmark = pytest.mark.timeout(2 * SECONDS + 180)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-vlm.yaml"
EDGE_TRANSPORTS = {
    ("preprocess", "encode"): "shm",
    ("preprocess", "prefill"): "inline",
    ("encode", "prefill"): "network",
    ("prefill", "decode"): "shm",
}
CONCURRENCY = 12
#: The most a worker's resident memory may grow from warm-up to the end (bytes).
RSS_GROWTH_LIMIT = 64 << 20


#: Every edge on shm with an arena for two KV layers, falling back to network when it
#: stays full for 2 ms: under load most payloads wait for room, and many fall back.
TIGHT_SHM = {
    "kind": "shm",
    "options": {"capacity": "64KiB"},
    "fallback": "network",
    "full_timeout": "2ms",
}


def _spec(cache: Path, replicas: int = 1, *, tight: bool = False, **defaults: Any) -> PipelineSpec:
    data: dict[str, Any] = PipelineSpec.from_yaml(CONFIG).to_dict()
    data["defaults"].update(defaults)
    data["stages"]["prefill"]["replicas"] = data["stages"]["decode"]["replicas"] = replicas
    for edge in data["edges"]:
        pinned = {"kind": EDGE_TRANSPORTS[(edge["from"], edge["to"])]}
        edge["transport"] = TIGHT_SHM if tight else pinned
    for stage in data["stages"].values():
        stage["env"] = {"STAGEWIRE_CACHE_DIR": str(cache)}
    return PipelineSpec.from_dict(data)


def _inputs(seed: int) -> list[VLMRequest]:
    """The 12 shipped samples and 12 random raw images of assorted sizes."""
    rng = np.random.default_rng(seed)
    raw = [
        VLMRequest(
            prompt=f"soak {i}: what is this?",
            pixels=torch.from_numpy(rng.integers(0, 256, (8 + 5 * i, 60 - 2 * i, 3), np.uint8)),
        )
        for i in range(12)
    ]
    return sample_requests(12) + raw


def _corrupt_png(rng: random.Random) -> bytes:
    png = encode_png(np.full((16 + rng.randrange(16), 20, 3), rng.randrange(256), np.uint8))
    at = png.index(b"IDAT") + 8
    return png[:at] + bytes([png[at] ^ 0x55]) + png[at + 1 :]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _segments_of(pids: set[int]) -> list[str]:
    """shm segments whose names say one of ``pids`` created them."""
    found = []
    for entry in Path(SHM_DIR).iterdir():
        name = entry.name
        if name.startswith(PREFIX):
            owner = name.removeprefix(PREFIX).split("-", 1)[0]
            if owner.isdigit() and int(owner) in pids:
                found.append(name)
    return found


async def _held(pipe: Pipeline) -> dict[str, int]:
    """Payloads each producer-side transport still holds, by replica, edge and transport."""
    held = {}
    for r in (await pipe.statistics())["replicas"]:
        for out in r["outputs"]:
            for name, t in out["transports"].items():
                held[f"{r['stage']}#{r['replica']} {out['edge']} {name}"] = t["held"]
    return held


class _Run:
    """One soak run's duration, seeded randomness, inputs and their reference tokens."""

    def __init__(self, model: TinyVLM, seconds: float = SECONDS) -> None:
        self.seconds = seconds
        seed = random.randrange(1 << 30)
        print(f"seed={seed} seconds={self.seconds}")
        self.rng = random.Random(seed)
        self.inputs = _inputs(seed)
        max_new = PipelineSpec.from_yaml(CONFIG).stages["decode"].params["max_new_tokens"]
        self.expected = [reference(model, r, max_new) for r in self.inputs]
        self.errors: list[str] = []

    async def exact_or(
        self, pipe: Pipeline, allowed: type[Exception], counts: dict[str, int], name: str
    ) -> None:
        """One client until the end of the run: whole responses, each exact or ``allowed``."""
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and len(self.errors) < 5:
            i = self.rng.randrange(len(self.inputs))
            try:
                final = await asyncio.wait_for(pipe.submit(self.inputs[i]), 60)
            except allowed:
                counts[name] += 1
                continue
            except Exception as exc:
                self.errors.append(f"input {i} failed with {exc!r}")
                continue
            if not isinstance(final, DecodeChunk) or final.generated_ids != self.expected[i]:
                self.errors.append(f"input {i}: tokens differ from the reference")
            counts["exact"] += 1


async def _nothing_held(pipe: Pipeline) -> None:
    """Wait until no request state and no payload is held anywhere; fail saying what is."""
    await wait_for(lambda: settled(pipe), timeout=30)

    async def none() -> bool:
        return not any((await _held(pipe)).values())

    try:
        await wait_for(none, timeout=30)
    except TimeoutError:
        held = {k: v for k, v in (await _held(pipe)).items() if v}
        raise AssertionError(f"payloads still held: {held}") from None


async def test_a_brief_mixed_load_leaves_nothing_behind(cache_dir: Path, model: TinyVLM) -> None:
    """The mixed load over the pinned transports for a few seconds, in ``make test`` too:
    enough requests of each kind to catch a leak like the views that aborted handlers held."""
    await _mixed_load(_Run(model, BRIEF_SECONDS), cache_dir, tight=False)


@pytest.mark.soak
@pytest.mark.parametrize("tight", [False, True], ids=["pinned-transports", "tight-shm"])
async def test_mixed_load_leaves_nothing_behind(
    cache_dir: Path, model: TinyVLM, tight: bool
) -> None:
    """The mixed load over the pinned transports, or over a tight shm arena on every edge
    whose payloads wait for room and fall back to network."""
    await _mixed_load(_Run(model), cache_dir, tight=tight)


async def _state(pipe: Pipeline) -> str:
    """What each replica and the client hold now, in one line (for a failure's report)."""
    stats = await pipe.statistics()
    keys = ("active", "cancelling", "open_windows", "peak_buffered", "held")
    parts = [
        f"{r['stage']}[{r['replica']}] " + " ".join(f"{k}={r.get(k)}" for k in keys)
        for r in stats["replicas"]
    ]
    client = stats["client"]
    parts.append(f"client active={client['active']} peak_active={client['peak_active']}")
    # Where the longest-held request of each replica and of the client stands, whole: the
    # report a hang is diagnosed from (printed, as an assertion's text is cut short).
    oldest = {f"{r['stage']}[{r['replica']}]": r["oldest"] for r in stats["replicas"]}
    oldest["client"] = client["oldest"]
    print("oldest requests:", json.dumps(oldest, indent=1))
    return "; ".join(parts)


async def _mixed_load(run: _Run, cache_dir: Path, *, tight: bool) -> None:
    rng, inputs, expected, errors = run.rng, run.inputs, run.expected, run.errors
    counts = {"whole": 0, "left": 0, "cancelled": 0, "bad": 0}

    async with Pipeline(_spec(cache_dir, tight=tight)) as pipe:
        pids = dict(pipe.worker_pids)
        deadline = time.monotonic() + run.seconds
        warm_at = time.monotonic() + min(15.0, run.seconds / 4)
        warm_rss: dict[Any, int] = {}
        #: Each running request's stream, by the task reading it (for a hang's report).
        streams: weakref.WeakKeyDictionary[asyncio.Task[Any], Any] = weakref.WeakKeyDictionary()

        async def one(kind: str, i: int) -> None:
            if kind == "bad":
                try:
                    await pipe.submit(VLMRequest(prompt="hi", image=_corrupt_png(rng)))
                except StageError as exc:
                    if "corrupt or truncated PNG" not in str(exc):
                        errors.append(f"bad input failed with {exc!r}")
                else:
                    errors.append("a corrupt image did not fail")
                return
            stream = pipe.stream(inputs[i])
            this = asyncio.current_task()
            assert this is not None
            streams[this] = stream
            if kind == "cancelled":
                await stream.start()
                await asyncio.sleep(rng.random() * 0.03)
                await stream.aclose()
                return
            if kind == "left":
                async for chunk in stream:
                    assert isinstance(chunk, DecodeChunk)
                    break
                await stream.aclose()
                return
            tokens: list[int] = []
            final = None
            async for chunk in stream:
                tokens += chunk.token_ids
                final = chunk
            if not (isinstance(final, DecodeChunk) and final.done):
                errors.append(f"input {i}: the stream ended without its final chunk")
            elif tokens != expected[i] or final.generated_ids != expected[i]:
                errors.append(f"input {i}: tokens differ from the reference")

        async def client() -> None:
            while time.monotonic() < deadline and len(errors) < 5:
                if not warm_rss and time.monotonic() >= warm_at:
                    warm_rss.update({k: _rss(pid) for k, pid in pids.items()})
                kind = rng.choices(list(counts), weights=[16, 2, 2, 1])[0]
                i = rng.randrange(len(inputs))
                task = asyncio.ensure_future(one(kind, i))
                done, _ = await asyncio.wait({task}, timeout=60)
                if not done:
                    # What every stage held then, and where this client waits, for the report:
                    # a request that gets nothing for a minute is a hang somewhere.
                    where = io.StringIO()
                    task.print_stack(file=where)
                    stream = streams.get(task)
                    rid = stream.request_id if stream is not None else None
                    held = rid in pipe._master_here().orch.requests
                    print(f"stuck {kind!r} request {rid} (held by the client: {held}):")
                    print(where.getvalue())
                    errors.append(
                        f"a {kind!r} request of input {i} took over 60 s; {await _state(pipe)}"
                    )
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return
                task.result()
                counts[kind] += 1

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        print(counts)
        assert not errors, errors
        assert all(counts.values()), counts
        if tight:
            stats = await pipe.statistics()
            outputs = [out for r in stats["replicas"] for out in r["outputs"]]
            assert sum(out["fallbacks"] for out in outputs) > 0, outputs
        await _nothing_held(pipe)
        client_stats = (await pipe.statistics())["client"]
        total = sum(counts.values())
        assert client_stats["submitted"] == total, client_stats
        assert client_stats["active"] == 0, client_stats
        assert warm_rss, "the run ended before warm-up"
        grown = {f"{s}#{k}": _rss(pid) - warm_rss[(s, k)] for (s, k), pid in pids.items()}
        assert all(g < RSS_GROWTH_LIMIT for g in grown.values()), grown
        # Still serving: the admission slots and every window came back.
        assert (await pipe.submit(inputs[0])).generated_ids == expected[0]

    worker_pids = set(pids.values())
    assert not any(alive(p) for p in worker_pids)
    assert not _segments_of(worker_pids)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("replicas", "victims"),
    [
        pytest.param(
            2, [("prefill", 0), ("decode", 1), ("decode", 0), ("prefill", 1)], id="two-replicas"
        ),
        # Every kill leaves its stage with no replica until the restart: new requests wait
        # for it (replica_wait) rather than fail.
        pytest.param(
            1, [("prefill", 0), ("decode", 0), ("encode", 0), ("preprocess", 0)], id="one-replica"
        ),
    ],
)
async def test_kill_9_under_load_fails_only_the_victims_requests(
    cache_dir: Path, model: TinyVLM, replicas: int, victims: list[tuple[str, int]]
) -> None:
    """Under the same load, one replica is killed -9 every few seconds: with two replicas
    of prefill and of decode, producers and consumers of the shm edge between them in turn;
    with one replica of each stage, each stage in turn, so that requests made while it
    restarts wait for it. Only requests in flight on a victim may fail, each with
    StageUnavailable; every other response stays exact; each victim is restarted and serves
    again. At the end nothing is held, no dead worker's segment is left, and after close no
    segment at all."""
    run = _Run(model)
    counts = {"exact": 0, "unavailable": 0}
    started: set[int] = set()
    workers = 2 + 2 * replicas

    async with Pipeline(_spec(cache_dir, replicas=replicas)) as pipe:

        async def all_back() -> bool:
            stats = await pipe.statistics()
            return len(stats["replicas"]) == workers and len(pipe.worker_pids) == workers

        async def killer() -> None:
            pause = run.seconds / (len(victims) + 1)
            for key in victims:
                await asyncio.sleep(pause)
                # The previous victim serves again before the next kill.
                await wait_for(all_back, timeout=60)
                started.update(pipe.worker_pids.values())
                os.kill(pipe.worker_pids[key], signal.SIGKILL)

        clients = (
            run.exact_or(pipe, StageUnavailable, counts, "unavailable") for _ in range(CONCURRENCY)
        )
        await asyncio.gather(killer(), *clients)
        waited = (await pipe.statistics())["client"]["waited"]
        print(counts, f"waited={waited}")
        assert not run.errors, run.errors
        if replicas == 1:
            assert waited, "no request waited for a restarting replica"
        # Each kill fails at most the requests then in flight on its victim.
        assert counts["unavailable"] <= len(victims) * CONCURRENCY, counts
        assert counts["exact"] > 10 * counts["unavailable"], counts

        await wait_for(all_back, timeout=30)
        await _nothing_held(pipe)
        started.update(pipe.worker_pids.values())
        dead = {pid for pid in started if not alive(pid)}
        assert len(dead) == len(victims)
        assert not _segments_of(dead)
        # Every replica serves: a burst spread over all of them is exact.
        n = len(run.inputs)
        outs = await asyncio.gather(*(pipe.submit(run.inputs[k % n]) for k in range(24)))
        assert [o.generated_ids for o in outs] == [run.expected[k % n] for k in range(24)]

    assert not any(alive(p) for p in started)
    assert not _segments_of(started)


@pytest.mark.soak
async def test_requests_past_their_deadline_leave_nothing_behind(
    cache_dir: Path, model: TinyVLM
) -> None:
    """Under the same load with a request timeout at the median latency, about half the
    requests pass their deadline wherever they then are, and the master aborts them. Each
    request is exact or a RequestTimeout, and at the end nothing is held anywhere."""
    run = _Run(model)
    counts = {"exact": 0, "timed_out": 0}
    # The deadline is the median latency under this load, measured first: about half the
    # requests pass it, whatever this machine's speed.
    async with Pipeline(_spec(cache_dir)) as pipe:
        latencies: list[float] = []

        async def timed() -> None:
            for _ in range(8):
                t0 = time.perf_counter()
                await pipe.submit(run.inputs[run.rng.randrange(len(run.inputs))])
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(timed() for _ in range(CONCURRENCY)))
    timeout_ms = max(20, round(sorted(latencies)[len(latencies) // 2] * 1e3))
    print(f"request_timeout={timeout_ms}ms")
    async with Pipeline(_spec(cache_dir, request_timeout=f"{timeout_ms}ms")) as pipe:
        clients = (
            run.exact_or(pipe, RequestTimeout, counts, "timed_out") for _ in range(CONCURRENCY)
        )
        await asyncio.gather(*clients)
        print(counts)
        assert not run.errors, run.errors
        assert counts["exact"] and counts["timed_out"], counts
        await _nothing_held(pipe)
