"""Failure semantics: one request fails, the pipeline goes on; nothing hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import pytest_asyncio

from pipeline import (
    ChunkGap,
    PayloadError,
    Pipeline,
    PipelineError,
    RequestAborted,
    RequestTimeout,
    ResponseStream,
    StageError,
    TransportError,
)
from pipeline import _orchestrator as orchestrator_module
from stages.text import Text, Token
from tests.pipeline.conftest import settled, spec, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chain():
    """tokens -> relay -> collect, with a 1 s chunk timeout."""
    s = spec(
        {"tokens": ":Tokens", "relay": ":Relay", "collect": ":Collect"},
        [("tokens", "relay"), ("relay", "collect")],
        chunk_timeout="1s",
    )
    async with Pipeline(s) as pipe:
        yield pipe


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def echo():
    """A single Echo stage with a 1.5 s request timeout."""
    async with Pipeline(spec({"echo": ":Echo"}, [], request_timeout="1.5s")) as pipe:
        yield pipe


async def test_stage_exception_fails_only_that_request(chain: Pipeline) -> None:
    """A request whose stage raises gets StageError naming the stage; the others complete."""
    texts = [("a boom c" if i % 4 == 0 else f"a b{i} c") for i in range(40)]
    results = await asyncio.gather(*(chain.submit(Text(t)) for t in texts), return_exceptions=True)
    for text, result in zip(texts, results, strict=True):
        if "boom" in text:
            assert isinstance(result, StageError)
            assert result.stage == "relay"
            assert "relay refused 'boom'" in str(result)
        else:
            assert result == Text(text)
    assert await chain.submit(Text("still fine")) == Text("still fine")


@pytest.mark.parametrize(
    ("value", "said", "batch"),
    [
        ("sys.exit", "SystemExit: 3", 1),
        ("keyboard interrupt", "KeyboardInterrupt", 1),
        ("no message", "_NoMessage: <the message of this _NoMessage could not be made", 1),
        ("huge message", "ValueError: xxx", 1),
        ("another pipeline's gap", "ChunkGap: request a-request-of-another-pipeline", 1),
        ("another pipeline's stage", "StageUnavailable: stage 'inner' unavailable", 1),
        ("another pipeline's stage, no id", "StageUnavailable: stage 'inner' unavailable", 1),
        ("sys.exit", "SystemExit: 3", 4),  # from process_batch
        ("base exception", "_LibraryAbort: aborted by the library", 1),
        ("base exception", "_LibraryAbort: aborted by the library", 4),
        ("file name not utf-8", "FileNotFoundError: no file caf\\udce9", 1),
    ],
    ids=[
        "exit",
        "interrupt",
        "no message",
        "huge message",
        "gap",
        "unavailable",
        "no id",
        "batch exit",
        "base exception",
        "batch base exception",
        "not utf-8",
    ],
)
async def test_whatever_a_handler_raises_fails_that_request_alone(
    value: str, said: str, batch: int
) -> None:
    """Each of these ended worse: sys.exit() in a handler (or in process_batch) ended its
    worker, failing every request of the replica (and, after three restarts, the stage
    for good); an exception whose message cannot be made (or cannot be encoded: a lone
    surrogate, as a file name that is not UTF-8 gives), or a ChunkGap from a pipeline
    the handler calls, or a library's own BaseException, killed the handler's task (or the
    batcher's) unreported, and the request hung; another
    pipeline's StageUnavailable blamed a stage of that pipeline; a message of tens of MB
    passed the control messages' size cap, and the worker's link to its master dropped."""
    async with Pipeline(spec({"n": {"impl": ":Misbehaves", "max_batch_size": batch}}, [])) as pipe:
        pid = pipe.worker_pids["n", 0]
        # Requests at once with it, but for a batch's (which fails whole, as documented).
        others = [
            asyncio.ensure_future(pipe.submit(Text(f"ok {i}")))
            for i in range(5 if batch == 1 else 0)
        ]
        with pytest.raises(StageError) as info:
            await asyncio.wait_for(pipe.submit(Text(value)), 30)
        assert info.value.stage == "n" and said in str(info.value), str(info.value)[:500]
        assert len(str(info.value)) < 9000  # the first 8192 characters of a huge message
        assert [o.value for o in await asyncio.gather(*others)] == [
            f"ok {i}" for i in range(len(others))
        ]
        assert await pipe.submit(Text("after")) == Text("after")
        assert pipe.worker_pids["n", 0] == pid  # served on, never restarted


async def test_a_huge_message_of_any_kind_is_cut_and_its_request_fails_at_once() -> None:
    """A TransportError a handler raises, or a setup's error, with a message of tens of MB:
    the first hung its request (its report passed the control messages' size cap), the
    second lost its reason (start-up said only that the worker exited)."""
    async with Pipeline(spec({"n": ":Misbehaves"}, [])) as pipe:
        with pytest.raises(TransportError, match=r"more characters\)$") as info:
            await asyncio.wait_for(pipe.submit(Text("huge transport error")), 30)
        assert len(str(info.value)) < 9000
        assert await pipe.submit(Text("after")) == Text("after")
    with pytest.raises(PipelineError, match=r"ValueError: xxxx.*more characters\)") as failed:
        async with Pipeline(spec({"n": ":HugeSetupError"}, [])):
            pass
    assert len(str(failed.value)) < 9000


@pytest.mark.parametrize(
    ("stage", "said"),
    [
        (":ExitsInSetup", "SystemExit: model file weights.bin not found"),
        (":SetupErrorNotUtf8", "OSError: cannot load caf\\udce9"),
    ],
    ids=["sys.exit", "not utf-8"],
)
async def test_a_setup_that_fails_oddly_says_why(stage: str, said: str) -> None:
    """sys.exit() in a setup is its failure, said with its reason; so is an error naming a
    file whose name is not UTF-8. (The first ended the worker with code 1, start-up saying
    only that; the second crashed the worker as it reported the error, its reason lost.)"""
    with pytest.raises(PipelineError) as failed:
        async with Pipeline(spec({"n": stage}, [])):
            pass
    assert said in str(failed.value), str(failed.value)


async def test_an_abort_whose_reason_is_not_utf8_aborts_the_request_everywhere() -> None:
    """A reason with a lone surrogate (a client's name decoded from bytes) aborts the
    request in its stage too. (abort() raised UnicodeEncodeError, the client having
    dropped the request already, and the stage ran it on to its end.)"""
    async with Pipeline(spec({"tok": ":Tokens", "relay": ":Relay"}, [("tok", "relay")])) as pipe:
        stream = pipe.stream(Text("one stall"))
        await stream.start()
        reason = f"client {os.fsdecode(b'caf' + bytes([0xE9]))} went away"
        assert await pipe.abort(stream.request_id, reason) is True

        async def nothing_active() -> bool:
            stats = await pipe.statistics()
            return all(r["active"] == 0 for r in stats["replicas"])

        await wait_for(nothing_active, timeout=10)
        with pytest.raises(RequestAborted, match="went away"):
            async for _ in stream:
                pass


async def test_a_stage_error_carries_the_handlers_traceback(chain: Pipeline) -> None:
    """The StageError holds the traceback the worker formatted before it let the error go:
    the handler's own frame and the error, as text."""
    with pytest.raises(StageError) as info:
        await chain.submit(Text("a boom c"))
    text = info.value.traceback
    assert "sample_stages.py" in text and ", in process" in text, text
    assert text.rstrip().endswith("RuntimeError: relay refused 'boom'"), text


async def test_wrong_output_type_fails_only_that_request(echo: Pipeline) -> None:
    """A stage returning the wrong payload type fails that request with PayloadError."""
    bad, good = await asyncio.gather(
        echo.submit(Text("badtype")), echo.submit(Text("good")), return_exceptions=True
    )
    assert isinstance(bad, PayloadError)
    assert "Text" in str(bad) and "Token" in str(bad)
    assert good == Text("good")


async def test_wrong_input_type_is_refused_before_admission(echo: Pipeline) -> None:
    """An input of the wrong type raises PayloadError at submit and admits nothing."""
    with pytest.raises(PayloadError, match="must be Text, got Token"):
        await echo.submit(Token(0, "x"))
    assert (await echo.statistics())["client"]["submitted"] >= 0
    assert await echo.submit(Text("ok")) == Text("ok")


async def test_missing_chunk_fails_with_chunk_gap_not_a_hang(chain: Pipeline) -> None:
    """A producer that stops mid-stream yields ChunkGap naming edge and seq after the timeout."""
    t0 = time.monotonic()
    with pytest.raises(ChunkGap) as info:
        await chain.submit(Text("first stall"))
    elapsed = time.monotonic() - t0
    # Both relay and collect wait on seq 1 with the same timeout; whichever reports first
    # fails the request, and either names a real gap.
    assert info.value.edge in ("tokens->relay", "relay->collect")
    assert info.value.seq == 1
    assert info.value.request_id in str(info.value)
    assert 0.9 <= elapsed < 5.0
    assert await chain.submit(Text("after gap")) == Text("after gap")
    await wait_for(lambda: settled(chain))


async def test_request_deadline_fails_with_request_timeout(echo: Pipeline) -> None:
    """A request running past request_timeout fails with RequestTimeout, and is aborted."""
    with pytest.raises(RequestTimeout):
        await echo.submit(Text("sleep 30"))
    await wait_for(lambda: settled(echo))


async def test_cancelling_stream_aborts_the_request_in_every_stage(chain: Pipeline) -> None:
    """Closing a stream early aborts the request at every stage, which then holds nothing."""
    before = {r["stage"]: r["aborted"] for r in (await chain.statistics())["replicas"]}
    stream = chain.stream(Text("x stall"))
    rid = await stream.start()

    async def held_everywhere() -> bool:
        stats = await chain.statistics()
        return all(r["active"] == 1 for r in stats["replicas"])

    await wait_for(held_everywhere)
    await stream.aclose()
    await wait_for(lambda: settled(chain))
    after = {r["stage"]: r["aborted"] for r in (await chain.statistics())["replicas"]}
    assert all(after[s] == before[s] + 1 for s in before), (before, after)
    assert not await chain.abort(rid)


async def test_cancelling_the_client_task_aborts(chain: Pipeline) -> None:
    """Cancelling the task awaiting submit() aborts the request everywhere."""
    task = asyncio.ensure_future(chain.submit(Text("y stall")))

    async def admitted() -> bool:
        return (await chain.statistics())["client"]["active"] == 1

    await wait_for(admitted)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: settled(chain))


async def test_abort_by_request_id(chain: Pipeline) -> None:
    """Pipeline.abort(request_id) fails the stream with RequestAborted."""
    async with chain.stream(Text("z stall")) as stream:
        assert stream.request_id is not None
        assert await chain.abort(stream.request_id)
        with pytest.raises(RequestAborted):
            await anext(stream)
    await wait_for(lambda: settled(chain))


async def test_a_handler_that_answers_its_cancellation_is_counted_aborted_only() -> None:
    """A handler that catches the cancellation of its aborted request and then returns, or
    raises, was counted failed too: ``completed + failed + aborted`` came out above
    ``started``."""
    s = spec({"hold": ":AnswersItsCancellation"}, [])
    async with Pipeline(s) as pipe:
        for value in ("return", "raise"):
            async with pipe.stream(Text(value)) as stream:
                assert stream.request_id is not None
                assert await pipe.abort(stream.request_id)

        async def ended() -> bool:
            (rep,) = (await pipe.statistics())["replicas"]
            return rep["cancelling"] == 0 and rep["active"] == 0

        await wait_for(ended)
        (rep,) = (await pipe.statistics())["replicas"]
    assert (rep["started"], rep["aborted"], rep["failed"], rep["completed"]) == (2, 2, 0, 0), rep


@pytest.mark.parametrize(
    ("source", "words"),
    [(":Tokens", " ".join(f"w{i}" for i in range(50))), (":ToFirstThenCount", "50")],
    ids=["fan-out", "per-destination"],
)
async def test_a_handler_that_stops_reading_early_holds_up_no_producer(
    source: str, words: str
) -> None:
    """A stage that returns after the first chunk of a long stream tells its producer to
    send no more: the producer's other output still gets all it sends, with no chunk
    timeout and no hang, and what went unread is counted. (A producer used to wait for
    that stage's credit for good, starving its other output.)"""
    s = spec(
        {"src": source, "first": ":First", "count": ":Count"},
        [("src", "first"), ("src", "count")],
        window=4,
        chunk_timeout="30s",
    )
    async with Pipeline(s) as pipe:
        for _ in range(3):
            async with asyncio.timeout(20):
                out = await pipe.submit(Text(words))
            first = "w0" if source == ":Tokens" else "t0"
            assert out == {"first": Text(first), "count": Text("50" if first == "w0" else "1")}
        await wait_for(lambda: settled(pipe))
        stats = await pipe.statistics()
        src = next(r for r in stats["replicas"] if r["stage"] == "src")
        to_first = next(o for o in src["outputs"] if o["edge"] == "src->first")
        assert to_first["unread"] > 0, to_first


async def test_a_producer_nobody_reads_any_more_stops_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streaming handler whose only consumer returned after its first chunk ends as soon
    as that consumer says it reads no more, not at the request's Drop: here the producer
    would otherwise wait forever (it stalls after its first token), and the Drop is held
    back for a minute."""
    monkeypatch.setattr(orchestrator_module, "DROP_DELAY_S", 60.0)
    s = spec({"src": ":Tokens", "first": ":First"}, [("src", "first")])
    async with Pipeline(s) as pipe:
        async with asyncio.timeout(20):
            assert await pipe.submit(Text("a stall b")) == Text("a")
        await wait_for(lambda: settled(pipe))
        stats = await pipe.statistics()
        src = next(r for r in stats["replicas"] if r["stage"] == "src")
        assert (src["unread_ended"], src["completed"], src["failed"]) == (1, 0, 0), src
        # The replica serves on.
        async with asyncio.timeout(20):
            assert await pipe.submit(Text("c d")) == Text("c")


@pytest.mark.parametrize("batched", [False, True], ids=["process", "process_batch"])
async def test_a_cancelled_await_inside_a_handler_fails_only_that_request(batched: bool) -> None:
    """A CancelledError from something the handler awaited (not an abort of the request)
    fails that request with a StageError saying so; the requests after it still run. (It
    used to end the handler silently, leaving the request pending for good, and a batched
    replica's batching loop dead.)"""
    stage: dict[str, object] = {"impl": ":CancelledInside"}
    if batched:
        stage |= {"max_batch_size": 4, "max_wait_ms": 5}
    async with Pipeline(spec({"s": stage}, [])) as pipe:
        async with asyncio.timeout(20):
            assert await pipe.submit(Text("ok")) == Text("ok")
            with pytest.raises(StageError, match="was cancelled"):
                await pipe.submit(Text("cancel"))
            outs = await asyncio.gather(*(pipe.submit(Text(f"ok {i}")) for i in range(8)))
        assert outs == [Text(f"ok {i}") for i in range(8)]
        await wait_for(lambda: settled(pipe))


async def test_a_join_waits_for_an_input_whose_producer_is_busy_without_a_gap() -> None:
    """A join's handler starts with its first input; the other's producer may be busy with
    other requests (one at a time here) for longer than chunk_timeout. That is no gap in its
    stream: every request is served."""
    s = spec(
        {
            "pre": ":Pre",
            "encode": {"impl": ":SlowEncode", "max_concurrency": 1},
            "prefill": ":Prefill",
        },
        [("pre", "encode"), ("pre", "prefill"), ("encode", "prefill")],
        chunk_timeout="500ms",
    )
    async with Pipeline(s) as pipe:
        # Five queue at encode: the last one's pixels reach prefill 1.5 s after its ids.
        results = await asyncio.gather(*(pipe.submit(Text(f"r{i}")) for i in range(5)))
        assert results == [Text(f"r{i}|2") for i in range(5)]
        await wait_for(lambda: settled(pipe))


async def test_outputs_all_here_are_read_after_the_deadline(echo: Pipeline) -> None:
    """A request whose every output has reached the client is done: a client that reads
    them after ``request_timeout`` still gets them all. (The deadline failed the request
    and threw away the outputs it held, a slow reader forwarding them getting part.)"""
    async with echo.stream(Text("after the deadline")) as stream:

        async def all_here() -> bool:
            oldest = (await echo.statistics())["client"]["oldest"]
            return oldest is not None and oldest["sinks"]["echo"]["final_seq"] is not None

        await wait_for(all_here, timeout=10)
        # A request begun after it, still running at its own deadline: once that fails,
        # the held request's deadline has passed too.
        with pytest.raises(RequestTimeout):
            await echo.submit(Text("sleep 3"))
        assert [out async for out in stream] == [Text("after the deadline")]


async def test_the_deadline_counts_the_wait_for_admission() -> None:
    """``request_timeout`` bounds the whole request, the wait for an admission slot
    (``max_inflight``) included: requests queued behind a slow one fail at their deadline,
    not at their deadline after admission."""
    s = spec({"echo": ":Echo"}, [], max_inflight=1, request_timeout="1s")
    async with Pipeline(s) as pipe:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def outcome() -> tuple[str, float]:
            try:
                await pipe.submit(Text("sleep 0.7"))
            except RequestTimeout as exc:
                return str(exc), loop.time() - t0
            return "served", loop.time() - t0

        results = await asyncio.gather(*(outcome() for _ in range(4)))
        assert results[0][0] == "served"
        # The second is admitted at 0.7 s and times out at its deadline of 1 s while it
        # runs; the other two wait for a slot until theirs.
        for what, at in results[1:]:
            assert "did not complete within 1s" in what and at < 1.6, results
        assert sum("(not admitted)" in what for what, _ in results) >= 1, results
        await wait_for(lambda: settled(pipe))


async def test_start_while_the_stream_is_read_submits_one_request() -> None:
    """start() (to learn the id early) while iterating began, the request waiting for a
    slot: each submitted a request of its own, and the one nobody read held its slot and
    its state in every stage for ever."""
    async with Pipeline(spec({"echo": ":Echo"}, [], max_inflight=1)) as pipe:
        busy, stream, starting = await _starting_behind_another(pipe, "sleep 0.3")

        async def read() -> list[object]:
            return [chunk async for chunk in stream]

        # (Two requests, one slot: the second waited for the first, which nobody read.)
        assert await asyncio.wait_for(read(), 10) == [Text("x")]
        assert await starting == stream.request_id
        assert await busy == Text("sleep 0.3")
        assert not pipe._master_here().orch.requests
        assert (await pipe.statistics())["client"]["submitted"] == 2


async def test_a_deadline_that_passes_while_no_replica_is_ready_is_a_request_timeout() -> None:
    """request_timeout shorter than replica_wait, the only replica restarting: the request
    failed with StageUnavailable, "no replica is ready after waiting 0.3s", though it had
    waited its own timeout, not replica_wait (10 s)."""
    s = spec({"echo": ":Echo"}, [], request_timeout="300ms", replica_wait="10s")
    async with Pipeline(s) as pipe:
        os.kill(pipe.worker_pids["echo", 0], signal.SIGKILL)
        views = pipe._master_here().orch.replicas["echo"]
        await wait_for(lambda: not views[0].ready, 30)
        # Its figures are missing, and statistics() says whose (they were left out).
        assert (await pipe.statistics())["unanswered"] == ["echo[0]"]
        with pytest.raises(RequestTimeout, match=r"within 0.3s, its request_timeout .*'echo'"):
            await pipe.submit(Text("x"))
        await wait_for(lambda: views[0].ready, 60)  # restarted: served again
        assert await pipe.submit(Text("y")) == Text("y")
        assert (await pipe.statistics())["unanswered"] == []


async def test_a_stream_read_after_its_pipeline_closed_says_it_was_aborted() -> None:
    """It raised RuntimeError("the pipeline is closed"), as for a call made after the close,
    where the request was in flight and aborted by the close."""
    async with Pipeline(spec({"tokens": ":Tokens"}, [])) as pipe:
        stream = pipe.stream(Text("a stall"))
        assert await anext(stream) == Token(0, "a")
    with pytest.raises(RequestAborted, match="the pipeline was closed"):
        await anext(stream)


async def test_a_handler_that_ignores_its_cancellation_shows_in_the_statistics() -> None:
    """It holds its max_concurrency slot, and every later request timed out while the
    statistics showed the replica idle: now they count it as cancelling (and the worker
    logs it after CANCEL_GRACE_S)."""
    s = spec({"s": {"impl": ":HoldsOnCancelled", "max_concurrency": 1}}, [], request_timeout="1s")
    async with Pipeline(s) as pipe:
        with pytest.raises(RequestTimeout):
            await pipe.submit(Text("swallow"))

        async def cancelling() -> bool:
            (replica,) = (await pipe.statistics())["replicas"]
            return bool(replica["active"] == 0 and replica["cancelling"] == 1)

        await wait_for(cancelling, 10)


async def test_a_start_cancelled_as_its_request_is_admitted_leaves_no_request() -> None:
    """A caller of start() cancelled in the very turn its request was admitted: the stream
    never recorded the request, so nothing ended it, and it held its admission slot and
    its state in every stage for ever (four such locked a pipeline of max_inflight 4)."""
    async with Pipeline(spec({"echo": ":Echo"}, [], max_inflight=4)) as pipe:
        for _ in range(8):
            stream = pipe.stream(Text("x"))
            starting = asyncio.ensure_future(stream.start())
            # Turn by turn, to cancel the caller in the turn its request is admitted (it is
            # woken in the next one).
            for _ in range(10_000):
                await asyncio.sleep(0)
                if stream._starting is not None and stream._starting.done():
                    break
            starting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await starting
            await stream.aclose()
        await wait_for(lambda: not pipe._master_here().orch.requests, 10)
        assert await asyncio.wait_for(pipe.submit(Text("y")), 10) == Text("y")


async def test_a_stream_closed_while_another_task_starts_it_starts_nothing() -> None:
    """aclose() while start() waited for a slot: the start went on, admitted a request
    that nothing would end, and the reader got it."""
    async with Pipeline(spec({"echo": ":Echo"}, [], max_inflight=1)) as pipe:
        busy, stream, starting = await _starting_behind_another(pipe, "sleep 0.5")
        await stream.aclose()
        with pytest.raises(RequestAborted, match="the stream was closed"):
            await starting
        # Nor does a start() after the close (it admitted a request nothing ended).
        with pytest.raises(RequestAborted, match="the stream was closed"):
            await stream.start()
        assert await busy == Text("sleep 0.5")
        assert not pipe._master_here().orch.requests


async def test_a_start_withdrawn_by_another_callers_cancellation_says_so() -> None:
    """Two tasks wait in start() on one stream; the one cancelled withdraws the request, and
    the other, never cancelled, gets a RequestAborted saying why. (It got a bare
    CancelledError, which ended its task as if cancelled: silently, in a TaskGroup.)"""
    async with Pipeline(spec({"echo": ":Echo"}, [], max_inflight=1)) as pipe:
        busy, stream, starting = await _starting_behind_another(pipe, "sleep 0.5")
        other = asyncio.ensure_future(stream.start())
        await asyncio.sleep(0)  # both wait for the slot now
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        with pytest.raises(RequestAborted, match="another caller of start"):
            await other
        assert not other.cancelled()
        assert await busy == Text("sleep 0.5")
        assert await asyncio.wait_for(stream.start(), 10)  # a later start() tries again
        await stream.aclose()


async def _starting_behind_another(
    pipe: Pipeline, busy: str
) -> tuple[asyncio.Future[Any], ResponseStream, asyncio.Future[str]]:
    """In a pipeline of one admission slot: a request of ``busy`` holding it, a stream of
    "x", and that stream's start() in a task, waiting for the slot."""
    holding = asyncio.ensure_future(pipe.submit(Text(busy)))
    await wait_for(lambda: bool(pipe._master_here().orch.requests))
    stream = pipe.stream(Text("x"))
    starting = asyncio.ensure_future(stream.start())
    await asyncio.sleep(0)  # start() now waits for the slot
    return holding, stream, starting
