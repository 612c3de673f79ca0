"""End-to-end runs over real worker processes: ordering, fan-out, joins, batching."""

from __future__ import annotations

import asyncio
import functools
import gc
import os

import pytest
import pytest_asyncio

from pipeline import PayloadError, Pipeline, RequestAborted, SinkOutput
from stages.text import Text
from tests.pipeline.conftest import spec, told, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def demo():
    """The example pipeline of configs/demo.yaml, started once for the module."""
    async with Pipeline.from_yaml("configs/demo.yaml") as pipe:
        yield pipe


async def test_every_stage_runs_in_its_own_process(demo: Pipeline) -> None:
    """Each replica is a separate live process, none of them this one."""
    pids = demo.worker_pids
    assert set(pids) == {("split", 0), ("upper", 0), ("join", 0)}
    assert len(set(pids.values())) == 3
    assert os.getpid() not in pids.values()
    for pid in pids.values():
        os.kill(pid, 0)


async def test_200_concurrent_requests_are_correct_and_in_order(demo: Pipeline) -> None:
    """200 concurrent requests each get their own words back, upper-cased, in order."""
    texts = [" ".join(f"w{i}x{j}" for j in range(1 + i % 17)) for i in range(200)]
    outs = await asyncio.gather(*(demo.submit(Text(t)) for t in texts))
    assert [o.value for o in outs] == [t.upper() for t in texts]


async def test_stream_yields_the_sink_output(demo: Pipeline) -> None:
    """stream() yields every sink chunk and ends after the final one."""
    chunks = [c async for c in demo.stream(Text("one two three"))]
    assert chunks == [Text("ONE TWO THREE")]


@pytest.mark.parametrize("transport", ["inline", "shm"])
async def test_a_computing_stage_streams_its_chunks_as_it_makes_them(transport: str) -> None:
    """A handler that computes between yields without awaiting still streams: each chunk
    leaves when it is made, not with the last one when the handler finally yields the loop.
    Over shm, a chunk's send awaits the transport's put before the chunk is queued.
    """
    import time

    from tests.pipeline.sample_stages import CRUNCH_S

    s = spec({"crunch": ":Crunch", "relay": ":Relay"}, [("crunch", "relay")], transport=transport)
    async with Pipeline(s) as pipe:
        arrivals = []
        async for chunk in pipe.stream(Text("a b c")):
            arrivals.append((time.monotonic(), chunk))
    assert [c.value for _, c in arrivals] == ["a", "b", "c"]
    # Made CRUNCH_S apart; sent all at once they would arrive within a few milliseconds.
    assert arrivals[-1][0] - arrivals[0][0] > 1.5 * CRUNCH_S, arrivals


async def test_empty_stream_still_completes(demo: Pipeline) -> None:
    """A source that yields nothing still ends the stream downstream."""
    assert await demo.submit(Text("")) == Text("")


async def test_replicas_share_load_and_keep_order() -> None:
    """With two relay replicas, requests spread over both and every stream stays ordered."""
    s = spec(
        {"tokens": ":Tokens", "relay": {"impl": ":Relay", "replicas": 2}, "collect": ":Collect"},
        [("tokens", "relay"), ("relay", "collect")],
    )
    async with Pipeline(s) as pipe:
        texts = [" ".join(str(k) for k in range(i % 40 + 1)) for i in range(100)]
        outs = await asyncio.gather(*(pipe.submit(Text(t)) for t in texts))
        assert [o.value for o in outs] == texts
        stats = await pipe.statistics()
        served = {r["replica"]: r["completed"] for r in stats["replicas"] if r["stage"] == "relay"}
        assert set(served) == {0, 1}
        assert sum(served.values()) == 100
        assert min(served.values()) >= 30, served


async def test_sequential_requests_alternate_between_replicas() -> None:
    """One request at a time, each stage of two replicas alternates between them. The
    round-robin counter was one for every stage, moved on once per stage a request: with
    two stages of two replicas each, every request went to replica 0."""
    s = spec(
        {"echo": {"impl": ":Echo", "replicas": 2}, "who": {"impl": ":WhoAmI", "replicas": 2}},
        [("echo", "who")],
    )
    async with Pipeline(s) as pipe:
        replicas = [(await pipe.submit(Text("a"))).value.split("|")[2] for _ in range(8)]
    assert sorted(replicas) == ["0"] * 4 + ["1"] * 4, replicas


async def test_different_payloads_to_different_stages_and_join_by_request() -> None:
    """Outputs route per destination and a two-input stage joins them by request id."""
    s = spec(
        {"pre": ":Pre", "encode": ":Encode", "prefill": ":Prefill"},
        [("pre", "encode"), ("pre", "prefill"), ("encode", "prefill")],
    )
    async with Pipeline(s) as pipe:
        words = [f"req{i}-" + "z" * (i % 9) for i in range(60)]
        outs = await asyncio.gather(*(pipe.submit(Text(w)) for w in words))
        assert [o.value for o in outs] == [f"{w}|{len(w)}" for w in words]
        # A field holding the wrong type: the error names it (it said "expected Pixels, got
        # Ids", not where).
        with pytest.raises(PayloadError, match=r"field 'encode' of Split .*expected Pixels"):
            await pipe.submit(Text("mixed up"))


async def test_batching_groups_concurrent_requests() -> None:
    """process_batch receives batches of at most max_batch_size; outputs map back exactly."""
    s = spec(
        {"batch": {"impl": ":Batched", "max_batch_size": 8, "max_wait_ms": 30}},
        [],
    )
    async with Pipeline(s) as pipe:
        outs = await asyncio.gather(*(pipe.submit(Text(f"t{i}")) for i in range(40)))
        sizes = []
        for i, out in enumerate(outs):
            value, size = out.value.split("#")
            assert value == f"T{i}"
            sizes.append(int(size))
        assert max(sizes) <= 8
        assert max(sizes) > 1, "no batching happened"


async def test_max_concurrency_bounds_handlers_per_replica() -> None:
    """No more than max_concurrency handlers of one replica run at once."""
    s = spec({"gauge": {"impl": ":Gauge", "max_concurrency": 3}}, [])
    async with Pipeline(s) as pipe:
        outs = await asyncio.gather(*(pipe.submit(Text("x")) for _ in range(12)))
        peaks = [int(o.value.split(":")[1]) for o in outs]
        assert max(peaks) == 3


async def test_several_sinks_report_which_sink_spoke() -> None:
    """A pipeline with two sinks streams SinkOutput records and submit returns both."""
    s = spec({"a": ":Echo", "b": ":Echo", "c": ":Echo"}, [("a", "b"), ("a", "c")])
    async with Pipeline(s) as pipe:
        # Many at once: both sinks often finish together, which once lost one output.
        outs = await asyncio.gather(*(pipe.submit(Text(f"hi{i}")) for i in range(100)))
        assert outs == [{"b": Text(f"hi{i}"), "c": Text(f"hi{i}")} for i in range(100)]
        chunks = [c async for c in pipe.stream(Text("yo"))]
        assert sorted((c.stage, c.value.value) for c in chunks if isinstance(c, SinkOutput)) == [
            ("b", "yo"),
            ("c", "yo"),
        ]


async def test_a_read_after_a_request_with_several_sinks_ended_leaves_no_stray_error() -> None:
    """A request with two sinks aborted between two of its client's reads: the next read
    raises the abort, and no read task is left behind with an error nobody retrieves
    (asyncio used to log "Task exception was never retrieved" for each other sink)."""
    s = spec({"a": ":Tokens", "b": ":Relay", "c": ":Collect"}, [("a", "b"), ("a", "c")])
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        async with Pipeline(s) as pipe:
            for _ in range(3):
                stream = pipe.stream(Text("one two three"))
                await pipe.abort(await stream.start())
                with pytest.raises(RequestAborted):
                    await stream.__anext__()
                del stream
            gc.collect()
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(before)
    assert not reported, [c.get("message") for c in reported]


async def test_a_second_task_reading_a_stream_at_once_is_refused(tmp_path) -> None:
    """A read of a request's stream while another task's read of it waits is refused with
    a RuntimeError that says so, and the request goes on: the first reader gets every
    chunk. With several sinks the second read used to fail with a bare KeyError, and with
    one the first was told the client had cancelled; either way the request was aborted."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    s = spec(
        {
            "a": {"impl": ":TokensWhenTold", "env": {"LINGER_FIFO": str(fifo)}},
            "b": ":Relay",
            "c": ":Relay",
        },
        [("a", "b"), ("a", "c")],
    )
    async with Pipeline(s) as pipe:
        stream = pipe.stream(Text("one two"))
        await stream.start()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # it waits for the first chunk, which the FIFO holds back
        assert not first.done()
        with pytest.raises(RuntimeError, match="another task is reading this stream"):
            await stream.__anext__()
        await wait_for(lambda: told(fifo))
        chunks = [await asyncio.wait_for(first, 30)]
        chunks += [c async for c in stream]
        assert sorted((c.stage, c.value.index, c.value.value) for c in chunks) == [
            ("b", 0, "one"),
            ("b", 1, "two"),
            ("c", 0, "one"),
            ("c", 1, "two"),
        ]
        stats = await pipe.statistics()
        assert (stats["client"]["completed"], stats["client"]["aborted"]) == (1, 0)


@pytest.mark.parametrize("transport", ["inline", "network"])
async def test_a_stream_read_on_past_chunks_that_do_not_decode_completes(transport: str) -> None:
    """A handler may catch a chunk's PayloadError and read on. Such a chunk was taken but
    never credited, so its producer's window shrank by one each time, and a long stream
    stalled until it failed with ChunkGap. (Fetched payloads, over network, fail to decode
    in a path of their own.)"""
    s = spec(
        {"bad": ":SomeBad", "skips": ":SkipsBad"}, [("bad", "skips")],
        transport=transport, window=8, chunk_timeout="5s",
    )  # fmt: skip
    async with Pipeline(s) as pipe:
        out = await asyncio.wait_for(pipe.submit(Text("200")), 60)
    assert out == Text("100 good, 100 bad")


async def _held(pipe: Pipeline, stage: str) -> int:
    """How many Held notices ``stage`` has sent."""
    stats = await pipe.statistics()
    return sum(r["held"] for r in stats["replicas"] if r["stage"] == stage)


@pytest.mark.parametrize("between", [False, True], ids=["next", "a stage between"])
async def test_a_consumer_starved_by_a_slow_sibling_is_told_its_chunks_are_held(
    between: bool,
) -> None:
    """tokens feeds relay (streaming to the client) and count. The client stops reading:
    relay's window fills, then tokens' window to relay, and count gets nothing. Its wait
    for its next chunk passed chunk_timeout and failed a healthy request with a ChunkGap,
    advising a longer timeout. Now tokens tells count its chunks are held, not lost; with
    a stage between them (waiting for tokens, so sending nothing), that stage tells count
    in turn."""
    stages = {"tokens": ":Tokens", "relay": ":Relay", "count": ":Count"}
    edges = [("tokens", "relay"), ("tokens", "count")]
    if between:
        stages["relay2"] = ":Relay"
        edges[1:] = [("tokens", "relay2"), ("relay2", "count")]
    s = spec(stages, edges, window=4, chunk_timeout="1s")
    words = [f"w{i}" for i in range(200)]
    async with Pipeline(s) as pipe:
        relayed: list[str] = []
        counted = None
        async for out in pipe.stream(Text(" ".join(words))):
            if out.stage == "count":
                counted = out.value
                continue
            relayed.append(out.value.value)
            if len(relayed) == 10:
                # The client reads nothing for over two chunk timeouts (six notices).
                await wait_for(functools.partial(_at_least, pipe, 6), 30)
        assert relayed == words and counted == Text("200")


async def _at_least(pipe: Pipeline, n: int, stage: str = "tokens") -> bool:
    return await _held(pipe, stage) >= n


async def test_a_join_behind_a_slow_client_waits_for_it() -> None:
    """left streams to out (read by a slow client) and to the join, which reads left's
    stream to its end before right's; right's window at the join fills meanwhile, which is
    no deadlock. A first check took that full window for one and refused left's notices,
    failing the request with a ChunkGap while the client only paused."""
    s = spec(
        {"src": ":Echo", "left": ":Tokens", "right": ":Tokens", "out": ":Relay",
         "join": ":LeftThenRight"},
        [("src", "left"), ("src", "right"), ("left", "out"), ("left", "join"),
         ("right", "join")],
        window=4, chunk_timeout="1s",
    )  # fmt: skip
    words = " ".join(f"w{i}" for i in range(200))
    async with Pipeline(s) as pipe:
        relayed, joined = 0, None
        async for out in pipe.stream(Text(words)):
            if out.stage == "join":
                joined = out.value
                continue
            relayed += 1
            if relayed == 10:
                # The client reads nothing for over two chunk timeouts (six notices).
                await wait_for(functools.partial(_at_least, pipe, 6, "left"), 30)
        assert (relayed, joined) == (200, Text("200/200"))


async def test_a_request_queued_behind_a_busy_branch_does_not_starve_the_other() -> None:
    """count (max_concurrency 1) is busy with request A for three chunk timeouts: B queues
    there, tokens waits for count's credit for B, and relay, fed nothing of B meanwhile,
    failed B with a ChunkGap though B was only waiting its turn."""
    s = spec(
        {"tokens": ":Tokens", "relay": ":Collect",
         "count": {"impl": ":Count", "max_concurrency": 1}},
        [("tokens", "relay"), ("tokens", "count")],
        window=4, chunk_timeout="1s",
    )  # fmt: skip
    a = "sleep " + " ".join(f"a{i}" for i in range(20))
    b = " ".join(f"b{i}" for i in range(40))
    async with Pipeline(s) as pipe:
        first = asyncio.ensure_future(pipe.submit(Text(a)))
        await wait_for(functools.partial(_at_least, pipe, 1), 30)
        second = await asyncio.wait_for(pipe.submit(Text(b)), 60)
        assert await first == {"relay": Text(a), "count": Text("21")}
        assert second == {"relay": Text(b), "count": Text("40")}


async def _chunks_in(pipe: Pipeline, stage: str, edge: str) -> int:
    stats = await pipe.statistics()
    return sum(
        i["chunks"]
        for r in stats["replicas"]
        if r["stage"] == stage
        for i in r["inputs"]
        if i["edge"] == edge
    )


@pytest.mark.parametrize("join", [":OneThenStream", ":StreamThenStream"], ids=["one", "stream"])
async def test_a_join_waiting_for_a_streams_first_chunk_holds_no_slot(
    tmp_path: pytest.TempPathFactory, join: str
) -> None:
    """join (max_concurrency 1) reads a's chunk, then b's stream. A's text waits in gate,
    so b (max_concurrency 1) streams B first. join took its only slot for A as soon as a's
    chunk came, to wait there for b's A stream; b, past the share of a window a request not
    yet read may take, waited for join's credit for B. Nothing moved, for ever: no Held
    reached join for a request b had not begun. A handler now waits for its single-chunk
    inputs before it takes a slot, and gives its slot up while it waits for the first chunk
    of a stream."""
    fifo = os.path.join(str(tmp_path), "go")
    os.mkfifo(fifo)
    s = spec(
        {"src": ":Echo", "a": ":Echo",
         "gate": {"impl": ":EchoWhenToldIfWaiting", "env": {"LINGER_FIFO": fifo}},
         "b": {"impl": ":Tokens", "max_concurrency": 1},
         "join": {"impl": join, "max_concurrency": 1}},
        [("src", "a"), ("src", "gate"), ("gate", "b"), ("a", "join"), ("b", "join")],
        window=4, chunk_timeout="1s",
    )  # fmt: skip
    first = "wait " + " ".join(f"a{i}" for i in range(39))
    second = " ".join(f"b{i}" for i in range(60))
    async with Pipeline(s) as pipe:
        a_run = asyncio.ensure_future(pipe.submit(Text(first)))
        await wait_for(functools.partial(_chunks_in, pipe, "join", "a->join"), 30)
        assert await asyncio.wait_for(pipe.submit(Text(second)), 30) == Text("60/60")
        await wait_for(functools.partial(told, fifo), 30)
        assert await asyncio.wait_for(a_run, 30) == Text("40/40")


@pytest.mark.parametrize(
    ("a", "join"),
    [(":Echo", ":TimesItsFirstRead"), (":Tokens", ":ReadsBoth")],
    ids=["own-timeout", "gather"],
)
async def test_a_handler_that_waits_for_a_first_chunk_its_own_way_keeps_max_concurrency(
    a: str, join: str
) -> None:
    """join (max_concurrency 1) waits for b's first chunk, which comes late, under its own
    timeout in turns, or reading a and b at once. The wait gave the slot up, and it was
    not taken back when the handler's own timeout ended it, nor while the handler went on
    reading a: three requests worked at once. The slot comes back whenever the handler
    goes on, and a read in a task of its own (gather's) does not give it up."""
    s = spec(
        {"src": ":Echo", "a": a, "b": {"impl": ":LateTokens", "max_concurrency": 8},
         "join": {"impl": join, "max_concurrency": 1}},
        [("src", "a"), ("src", "b"), ("a", "join"), ("b", "join")],
    )  # fmt: skip
    async with Pipeline(s) as pipe:
        outs = await asyncio.wait_for(
            asyncio.gather(*(pipe.submit(Text("x y z")) for _ in range(3))), 60
        )
    assert all(out.value.endswith("peak 1") for out in outs), outs


async def test_a_read_left_running_by_a_handler_that_ended_holds_no_slot() -> None:
    """A handler (max_concurrency 1) leaves a task reading b's first chunk and returns. That
    read gave the slot up, then took one back after the handler had ended, which nothing
    gave back: every later request on the replica waited for a slot for ever."""
    s = spec(
        {"src": ":Echo", "a": ":Tokens", "b": ":LateTokens",
         "join": {"impl": ":LeavesAReader", "max_concurrency": 1}},
        [("src", "a"), ("src", "b"), ("a", "join"), ("b", "join")],
    )  # fmt: skip
    async with Pipeline(s) as pipe:
        for _ in range(3):
            assert await asyncio.wait_for(pipe.submit(Text("x y z")), 30) == Text("3")
