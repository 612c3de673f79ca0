"""Per-request state is released in every stage after completion, failure and abort."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from pipeline import Pipeline, PipelineError, RequestAborted, StageError
from pipeline import _orchestrator as orchestrator_module
from pipeline._messages import Drop
from stages.text import Text
from tests.pipeline.conftest import settled, spec, wait_for


async def _one(pipe: Pipeline, i: int, rng: random.Random) -> str:
    kind = rng.choice(["ok", "ok", "ok", "fail", "abort"])
    words = [f"w{k}" for k in range(rng.randint(1, 12))]
    if kind == "fail":
        words.insert(rng.randint(0, len(words)), "boom")
    if kind == "abort":
        words.append("stall")
    text = " ".join(words)
    if kind == "abort":
        stream = pipe.stream(Text(text))
        await stream.start()
        await asyncio.sleep(rng.random() * 0.01)
        await stream.aclose()
        return "abort"
    try:
        out = await pipe.submit(Text(text))
    except PipelineError as exc:
        if kind == "ok":
            return f"unexpected {exc!r}"
        return "fail"
    assert out == Text(text), (out, text)
    return "ok"


async def test_nothing_is_left_in_any_stage_after_1000_requests() -> None:
    """1000 mixed requests (ok, failed, aborted) leave no request state, window or slot."""
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = spec(
        {"tokens": ":Tokens", "relay": {"impl": ":Relay", "replicas": 2}, "collect": ":Collect"},
        [("tokens", "relay"), ("relay", "collect")],
        chunk_timeout="5s",
    )
    async with Pipeline(s) as pipe:
        sem = asyncio.Semaphore(32)

        async def bounded(i: int) -> str:
            async with sem:
                return await _one(pipe, i, rng)

        kinds = await asyncio.gather(*(bounded(i) for i in range(1000)))
        unexpected = [k for k in kinds if k.startswith("unexpected")]
        assert not unexpected, (len(unexpected), unexpected[:5])
        assert {"ok", "fail", "abort"} <= set(kinds)
        assert kinds.count("fail") + kinds.count("ok") + kinds.count("abort") == 1000
        await wait_for(lambda: settled(pipe), timeout=20)
        stats = await pipe.statistics()
        client = stats["client"]
        assert client["submitted"] == 1000
        assert client["completed"] == kinds.count("ok")
        assert client["failed"] == kinds.count("fail")
        assert client["aborted"] == kinds.count("abort")
        for r in stats["replicas"]:
            assert r["active"] == 0, r
            assert r["open_windows"] == 0, r
            assert all(i["open"] == 0 for i in r["inputs"]), r
        assert all(i["open"] == 0 for i in client["inputs"]), client
        # The admission slots all came back: a full window of new requests still runs.
        outs = await asyncio.gather(*(pipe.submit(Text(f"a{i} b")) for i in range(64)))
        assert [o.value for o in outs] == [f"a{i} b" for i in range(64)]


@pytest.mark.parametrize("max_inflight", [4])
async def test_admission_is_bounded_by_max_inflight(max_inflight: int) -> None:
    """No more than max_inflight requests are admitted at once; the rest wait their turn."""
    s = spec({"echo": ":Echo"}, [], max_inflight=max_inflight)
    async with Pipeline(s) as pipe:
        outs = await asyncio.gather(*(pipe.submit(Text("sleep 0.05")) for _ in range(16)))
        assert all(o == Text("sleep 0.05") for o in outs)
        assert (await pipe.statistics())["client"]["peak_active"] == max_inflight


async def test_completed_requests_drops_leave_together_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A completed request's Drops wait for the wave: none leaves as a request completes,
    one wave carries every request completed meanwhile, and a full wave leaves at once.
    Stages forget a request themselves when its handler ends, so the wave only backs that
    up and must not wake every worker after every request."""
    monkeypatch.setattr(orchestrator_module, "DROP_BATCH", 8)
    s = spec({"tokens": ":Tokens", "collect": ":Collect"}, [("tokens", "collect")])
    async with Pipeline(s) as pipe:
        orch = pipe._master_or_fail().orch
        sent: list[tuple[float, str, str]] = []
        send_control = orch._send_control

        def recording(stage: str, replica: int, msg: Any) -> None:
            if isinstance(msg, Drop):
                sent.append((time.monotonic(), stage, msg.request_id))
            send_control(stage, replica, msg)

        monkeypatch.setattr(orch, "_send_control", recording)
        t0 = time.monotonic()
        for i in range(3):
            assert await pipe.submit(Text(f"a{i} b")) == Text(f"a{i} b")
        assert sent == []  # nothing leaves with the completions
        await wait_for(lambda: len(sent) == 6, timeout=5)
        # One wave, a delay after the first completion: both stages, all three requests.
        assert sent[-1][0] - sent[0][0] < 0.05
        assert sent[0][0] - t0 >= 0.9  # about a second: not one wave per request
        assert sorted(stage for _, stage, _ in sent) == ["collect"] * 3 + ["tokens"] * 3
        # Eight due: the wave leaves with the eighth completion, its timer not awaited.
        sent.clear()
        for i in range(8):
            await pipe.submit(Text(f"c{i}"))
        assert len(sent) == 16
        assert orch._drop_timer is None
        assert len({rid for _, _, rid in sent}) == 8


async def test_a_client_that_stops_reading_after_the_last_output_frees_the_request() -> None:
    """Leaving ``async for`` on the final output completes the request at once: its
    admission slot comes back although the stream was never read to its end."""
    s = spec({"echo": ":Echo"}, [], max_inflight=2)
    async with Pipeline(s) as pipe:
        streams = [pipe.stream(Text(f"hi {i}")) for i in range(2)]
        for i, stream in enumerate(streams):  # kept alive: no finalizer can help
            async for chunk in stream:
                assert chunk == Text(f"hi {i}")
                break
        client = (await pipe.statistics())["client"]
        assert (client["completed"], client["active"]) == (2, 0), client
        async with asyncio.timeout(10):
            assert await pipe.submit(Text("third")) == Text("third")


async def test_a_stream_dropped_right_after_its_last_output_completes_its_request() -> None:
    """A stage that computes between chunks sends each at once, and the end of its stream
    in a message of its own just after: a client leaving on the last output dropped the
    stream before that end came, and its request counted as aborted, not completed."""
    async with Pipeline(spec({"crunch": ":Crunch"}, [])) as pipe:
        async for token in pipe.stream(Text("a b")):
            if token.value == "b":
                break
        await wait_for(lambda: settled(pipe))
        client = (await pipe.statistics())["client"]
        assert (client["completed"], client["aborted"]) == (1, 0), client


async def test_a_stream_dropped_unfinished_aborts_its_request() -> None:
    """A ``break`` out of a stream still producing aborts the request in every stage once
    the stream object is gone, as ``aclose()`` would."""
    s = spec({"tokens": ":Tokens"}, [], max_inflight=1)
    async with Pipeline(s) as pipe:
        async for token in pipe.stream(Text("a stall never ends")):
            assert token.value == "a"
            break
        await wait_for(lambda: settled(pipe))
        assert (await pipe.statistics())["client"]["aborted"] == 1
        async with asyncio.timeout(10):
            out = [t.value async for t in pipe.stream(Text("b c"))]
        assert out == ["b", "c"]


async def test_requests_waiting_for_admission_when_the_pipeline_closes_are_aborted() -> None:
    """Requests still waiting for an admission slot when the pipeline closes end with
    RequestAborted ("pipeline closing"), like the admitted ones, not with an error about
    a closed channel."""
    s = spec({"echo": ":Echo"}, [], max_inflight=1)
    async with Pipeline(s) as pipe:
        running = asyncio.ensure_future(pipe.submit(Text("sleep 10")))

        async def admitted() -> bool:
            return (await pipe.statistics())["client"]["active"] == 1

        await wait_for(admitted)
        waiting = [asyncio.ensure_future(pipe.submit(Text(f"w{i}"))) for i in range(3)]
        slots = pipe._master_or_fail().orch._slots  # private: what the three wait on

        async def queued() -> bool:
            return len(slots._waiters or ()) == 3

        await wait_for(queued)
    done, pending = await asyncio.wait([running, *waiting], timeout=10)
    assert not pending
    for task in done:
        exc = task.exception()
        assert isinstance(exc, RequestAborted) and "pipeline closing" in str(exc), repr(exc)


async def test_a_failure_handed_over_by_a_running_task_leaves_that_task_running() -> None:
    """A handler fails with an error that a background task caught and handed over, so the
    task's own frame, still running, is in the error's traceback. The runtime lets go of
    the failed handler's frames without touching that one: the task serves the next
    request too. (Clearing the traceback's frames would have closed the suspended task.)"""
    async with Pipeline(spec({"relay": ":RelayedError"}, [])) as pipe:
        for i in range(3):
            with pytest.raises(StageError, match="relayed from the background task"):
                async with asyncio.timeout(10):
                    await pipe.submit(Text(f"r{i}"))


async def test_statistics_say_where_a_stuck_request_stands() -> None:
    """A stream whose producer stalls after its first token: each replica's and the client's
    ``oldest`` names it and where it waits (the relay's handler runs, reading the token
    edge past seq 0; the client has taken the relayed first chunk); once it is aborted,
    no replica holds anything, and ``oldest`` is None everywhere."""
    async with Pipeline(spec({"tok": ":Tokens", "relay": ":Relay"}, [("tok", "relay")])) as pipe:
        stream = pipe.stream(Text("first stall"))
        async for _ in stream:
            break
        stats = await pipe.statistics()
        by_stage = {r["stage"]: r["oldest"] for r in stats["replicas"]}
        rid = by_stage["tok"]["request_id"]
        relay, client = by_stage["relay"], stats["client"]["oldest"]
        assert relay["request_id"] == client["request_id"] == rid
        assert relay["running"] and relay["slot"] and relay["age_s"] >= 0
        waiting = relay["inputs"]["tok->relay"]
        assert waiting["next_seq"] == 1 and waiting["waiting"] and waiting["final_seq"] is None
        sent = by_stage["tok"]["outputs"]["tok->relay"]
        assert sent["next_seq"] == 1 and not sent["waiting_credit"], sent
        assert not sent["waiting_queued"], sent
        assert client["sinks"]["relay"]["taken"] == 1 and client["ended"] == []
        await stream.aclose()
        await wait_for(lambda: settled(pipe), timeout=10)
        stats = await pipe.statistics()
        assert [r["oldest"] for r in stats["replicas"]] == [None, None]
        assert stats["client"]["oldest"] is None
