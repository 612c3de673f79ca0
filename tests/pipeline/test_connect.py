"""``Pipeline.connect``: a client in this process of a real ``stagewire master`` process.

Every master here is a real process serving on a loopback port, with its workers started as
``stagewire worker`` processes, as on other hosts; each test stops what it started by pid.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch
import zmq
import zmq.asyncio

from pipeline import (
    ConfigError,
    MasterUnavailable,
    PayloadError,
    Pipeline,
    PipelineError,
    RemotePipeline,
    RequestAborted,
    SinkOutput,
    StageError,
    StageUnavailable,
)
from pipeline._codec import codec_for
from pipeline._messages import (
    REMOTE_WINDOW_BYTES,
    WIRE_CODEC,
    Cancel,
    ControlToClient,
    Finished,
    Submit,
    encode_message,
)
from pipeline._remote import REMOTE_WINDOW
from pipeline._remote_stream import RemoteResponseStream
from stages.text import Text, Token
from tests.pipeline.conftest import grid_module, wait_for, workers_announced
from tests.pipeline.tensor_stages import FACTORS, Frame
from tests.procs import free_port, kill_all, start_stagewire

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[2]

#: Two sinks: the words streamed back one by one (relay), and how many there were (count).
WORDS = """\
name: words
stages:
  tokens: {impl: "tests.pipeline.sample_stages:Tokens", max_concurrency: 64}
  relay: {impl: "tests.pipeline.sample_stages:Relay", max_concurrency: 64}
  count: {impl: "tests.pipeline.sample_stages:Count", max_concurrency: 64}
edges:
  - {from: tokens, to: relay}
  - {from: tokens, to: count}
"""

#: One stage whose stream stalls on the word 'stall': a request that holds until aborted.
STALL = """\
name: stall
stages:
  tokens: {impl: "tests.pipeline.sample_stages:Tokens"}
edges: []
"""

TENSORS = """\
name: tensors
stages:
  scale: {impl: "tests.pipeline.tensor_stages:Scale"}
edges: []
"""

#: A stage module only the master's host has: its output type cannot be imported here.
HIDDEN_MODULE = grid_module("int16")

HIDDEN = """\
name: hidden
stages:
  grid: {impl: "connect_hidden_stages:Gridify"}
edges: []
"""


def _start(*args: str, err: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m pipeline ARGS``, stderr to a file, ``env`` added to ours."""
    return start_stagewire(*args, err=err, env={**os.environ, **(env or {})})


async def _serve(
    config: Path,
    tmp: Path,
    procs: list[subprocess.Popen[bytes]],
    *,
    endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Start ``stagewire master`` on ``config`` and the workers it names, adding each
    process to ``procs`` (for the caller to stop); returns its endpoint once it serves."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    err = tmp / f"master-{len(procs)}.err"
    procs.append(_start("master", str(config), "--bind", endpoint, err=err, env=env))

    await workers_announced(err)
    found = re.findall(r"stagewire worker (--master \S+ --stage (\S+) --replica \d+)",
                       err.read_text())  # fmt: skip
    for command, stage in found:
        wlog = tmp / f"{stage}-{len(procs)}.err"
        procs.append(_start("worker", *command.split(), "--headless", err=wlog, env=env))

    async def serving() -> bool:
        return "serving " in err.read_text(errors="replace")

    await wait_for(serving, timeout=60)
    return endpoint


async def _summary(master: subprocess.Popen[bytes], err: Path) -> str:
    """Stop a master with SIGTERM and return its line saying what it served."""
    os.kill(master.pid, signal.SIGTERM)
    code = await asyncio.to_thread(master.wait, 60)
    text = await asyncio.to_thread(err.read_text)
    found = re.search(r"^took .*$", text, re.MULTILINE)
    assert code == 0 and found is not None, text
    return found.group(0)


@dataclass
class Served:
    config: Path
    endpoint: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def words(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    """A ``stagewire master`` serving WORDS, with its three workers."""
    tmp = tmp_path_factory.mktemp("words")
    config = tmp / "words.yaml"
    config.write_text(WORDS)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield Served(config, await _serve(config, tmp, procs))
    finally:
        kill_all(procs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def remote(words: Served) -> AsyncIterator[RemotePipeline]:
    """One client connection to the WORDS master, shared by the tests."""
    async with Pipeline.connect(words.endpoint) as pipe:
        yield pipe


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded(words: Served) -> AsyncIterator[Pipeline]:
    """The same pipeline embedded in this process, to compare with."""
    async with Pipeline.from_yaml(words.config) as pipe:
        yield pipe


def _sentence(i: int) -> str:
    return " ".join(f"w{i}n{k}" for k in range(1 + i % 7))


async def test_submit_and_stream_give_what_the_embedded_pipeline_gives(
    remote: RemotePipeline, embedded: Pipeline
) -> None:
    """For the same inputs, a remote master's outputs equal the embedded pipeline's: the
    final output of each sink as a dict, and every chunk as typed values."""
    assert (remote.name, remote.sources, remote.sinks) == ("words", ["tokens"], ["relay", "count"])
    for i in range(4):
        text = Text(_sentence(i))
        got = await remote.submit(text)
        assert got == await embedded.submit(text)
        n = len(text.value.split())
        assert got == {"relay": Token(n - 1, f"w{i}n{n - 1}"), "count": Text(str(n))}
        # Chunks of different sinks may interleave either way; each sink's come in order.
        streamed = [chunk async for chunk in remote.stream(text)]
        local = [chunk async for chunk in embedded.stream(text)]
        for sink in ("relay", "count"):
            assert [c.value for c in streamed if c.stage == sink] == [
                c.value for c in local if c.stage == sink
            ]


async def test_stream_yields_each_chunk_in_order_with_the_masters_request_id(
    remote: RemotePipeline,
) -> None:
    """``async with pipe.stream(x)`` knows the request's id at the master before the first
    chunk, and every sink's chunks come in order."""
    words = [f"t{k}" for k in range(40)]
    async with remote.stream(Text(" ".join(words))) as stream:
        assert stream.request_id is not None and re.fullmatch(r"[0-9a-f]+-\d+", stream.request_id)
        chunks = [chunk async for chunk in stream]
    assert all(isinstance(c, SinkOutput) for c in chunks)
    relayed = [c.value for c in chunks if c.stage == "relay"]
    assert relayed == [Token(k, w) for k, w in enumerate(words)]
    assert [c.value for c in chunks if c.stage == "count"] == [Text("40")]


async def _held_at(stream: RemoteResponseStream, most: int) -> None:
    """Wait until ``stream``'s client holds (about) ``most`` outputs it has not read, the
    master having sent what the client's grants allow; then check no more come meanwhile."""
    call = stream._call
    assert call is not None
    await wait_for(lambda: call.queue.qsize() >= most - 1)

    async def grows() -> bool:
        return call.queue.qsize() > most

    with pytest.raises(TimeoutError):
        await wait_for(grows, timeout=1.0)


async def test_a_slow_reader_holds_its_request_at_the_master(remote: RemotePipeline) -> None:
    """The master sends a request's outputs only as far as its client has granted (a
    window, renewed as the client reads): a client that stops reading holds the stream at
    the master, nothing piles up in its queue, and every chunk still comes, in order."""
    n = 20 * REMOTE_WINDOW
    words = [f"s{k}" for k in range(n)]
    async with remote.stream(Text(" ".join(words))) as stream:
        first = await anext(stream)
        await _held_at(stream, REMOTE_WINDOW)
        rest = [chunk async for chunk in stream]
    relayed = [c.value for c in [first, *rest] if c.stage == "relay"]
    assert relayed == [Token(k, w) for k, w in enumerate(words)]
    assert [c.value for c in [first, *rest] if c.stage == "count"] == [Text(str(n))]


async def test_a_slow_reader_of_large_outputs_holds_a_bounded_number_of_bytes(
    tmp_path: Path,
) -> None:
    """The window counted outputs only: of 3 MiB outputs a client that stopped reading was
    sent a whole window (64, 192 MiB) per request. At most REMOTE_WINDOW_BYTES of them are
    out now, and every output still comes, in order."""
    config = tmp_path / "flood.yaml"
    config.write_text(
        "name: flood\n"
        "stages:\n"
        '  flood: {impl: "tests.pipeline.sample_stages:Flood", '
        "params: {count: 40, size: 3145728}}\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs)
        async with Pipeline.connect(endpoint) as pipe, pipe.stream(Text("go")) as stream:
            first = await anext(stream)
            # The last output sent may pass the bound.
            await _held_at(stream, REMOTE_WINDOW_BYTES // (3 * 2**20) + 1)
            rest = [chunk async for chunk in stream]
        assert [b.seq for b in [first, *rest]] == list(range(40))
    finally:
        kill_all(procs)


async def test_fifty_concurrent_requests_over_one_connection_get_their_own_outputs(
    remote: RemotePipeline,
) -> None:
    """Requests in flight together on one socket are told apart: each gets its own."""
    before = (await remote.statistics())["client"]
    texts = [_sentence(i) for i in range(50)]
    results = await asyncio.gather(*(remote.submit(Text(t)) for t in texts))
    for text, result in zip(texts, results, strict=True):
        words = text.split()
        assert result == {
            "relay": Token(len(words) - 1, words[-1]),
            "count": Text(str(len(words))),
        }
    stats = await remote.statistics()
    after = stats["client"]
    assert after["completed"] - before["completed"] == 50
    assert after["active"] == 0 and after["garbage"] == 0
    # And what the embedded pipeline's statistics give, from the master: its client side
    # and every replica's counters.
    master = stats["master"]
    assert master["client"]["completed"] >= 50 and master["garbage"] == 0
    assert sorted(r["stage"] for r in master["replicas"]) == ["count", "relay", "tokens"]
    assert all(r["completed"] >= 50 for r in master["replicas"])


async def test_a_stage_error_fails_only_that_request_with_the_embedded_error(
    remote: RemotePipeline, embedded: Pipeline
) -> None:
    """StageError, with the stage, the master's request id, message and traceback, fails
    the request whose stage raised; the requests beside it and after it succeed."""
    bad, good = await asyncio.gather(
        remote.submit(Text("a boom c")), remote.submit(Text("a b c")), return_exceptions=True
    )
    with pytest.raises(StageError) as local:
        await embedded.submit(Text("a boom c"))
    assert isinstance(bad, StageError), bad
    assert (bad.stage, bad.message) == (local.value.stage, local.value.message)
    assert str(bad) == str(local.value).replace(local.value.request_id, bad.request_id)
    assert re.fullmatch(r"[0-9a-f]+-\d+", bad.request_id)
    assert bad.traceback.rstrip().endswith("RuntimeError: relay refused 'boom'")
    assert good == {"relay": Token(2, "c"), "count": Text("3")}
    assert (await remote.submit(Text("after")))["count"] == Text("1")


async def test_a_wrong_typed_input_is_a_payload_error_for_that_request_only(
    remote: RemotePipeline, embedded: Pipeline, words: Served
) -> None:
    """Refused by the client, as embedded, when it knows the source's type; refused by the
    master, which decodes with that type, when the client sent it untyped."""
    with pytest.raises(PayloadError) as info:
        await remote.submit(Token(0, "not a Text"))
    with pytest.raises(PayloadError) as local:
        await embedded.submit(Token(0, "not a Text"))
    assert str(info.value) == str(local.value)
    # A client that could not import the source type sends what it has, untyped.
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(words.endpoint)
        wrong = codec_for(Any).encode({"value": 7})
        right = codec_for(Any).encode(Text("fine"))
        for token, enc in ((1, wrong), (2, right)):
            await sock.send(encode_message(Submit(token, enc.header, WIRE_CODEC)))
        ended: dict[int, Finished] = {}
        async with asyncio.timeout(30):
            while len(ended) < 2:
                msg = msgspec.msgpack.decode(await sock.recv(), type=ControlToClient)
                if isinstance(msg, Finished):
                    ended[msg.token] = msg
    finally:
        sock.close(linger=0)
        ctx.term()
    assert ended[1].kind == "PayloadError" and "Expected `str`, got `int`" in ended[1].error
    assert ended[2].kind == ""


async def test_every_way_of_leaving_a_request_cancels_it_at_the_master(tmp_path: Path) -> None:
    """A stream dropped after a ``break``, left from ``async with``, whose reading task is
    cancelled, aborted by id, or open when the client closes: each request, stalled in its
    stage, is cancelled at the master; the master and its worker serve on."""
    config = tmp_path / "stall.yaml"
    config.write_text(STALL)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs)
        async with Pipeline.connect(endpoint) as pipe:
            async for chunk in pipe.stream(Text("a stall")):
                assert chunk == Token(0, "a")
                break
            async with pipe.stream(Text("b stall")) as stream:
                async for chunk in stream:
                    assert chunk == Token(0, "b")
                    break
            first = asyncio.Event()

            async def read() -> None:
                async for _ in pipe.stream(Text("c stall")):
                    first.set()

            reader = asyncio.ensure_future(read())
            async with asyncio.timeout(30):
                await first.wait()
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            async with pipe.stream(Text("d stall")) as stream:
                assert stream.request_id is not None
                assert await anext(stream) == Token(0, "d")
                assert await pipe.abort(stream.request_id, "no longer wanted")
                with pytest.raises(RequestAborted, match="no longer wanted"):
                    await anext(stream)
                assert not await pipe.abort(stream.request_id)
            left_open = pipe.stream(Text("e stall"))
            assert await anext(left_open) == Token(0, "e")
        with pytest.raises(RequestAborted, match="the client closed"):
            await anext(left_open)
        # A Cancel the master reads with its Submit, before the request's task has run a
        # step, is counted too (it was not: the task's own count never ran).
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            enc = codec_for(Any).encode(Text("f stall"))
            await sock.send(encode_message(Submit(1, enc.header, WIRE_CODEC)))
            await sock.send(encode_message(Cancel(1)))
        finally:
            sock.close(linger=1000)
            ctx.term()
        # The master serves on (its worker too), and counts what its clients cancelled.
        async with Pipeline.connect(endpoint) as pipe:
            assert await pipe.submit(Text("still here")) == Token(1, "here")
        summary = await _summary(procs[0], tmp_path / "master-0.err")
        assert summary.startswith(
            "took 7 requests: 1 completed, 0 failed, 6 cancelled by their clients, 0 whose "
            "clients went away"
        ), summary
    finally:
        kill_all(procs)


async def test_connecting_where_nothing_listens_fails_within_the_timeout() -> None:
    """No master: MasterUnavailable after ``timeout``, one line naming the endpoint and what
    to check; a bad endpoint or key directory is a ConfigError at once."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(MasterUnavailable) as info:
        async with Pipeline.connect(endpoint, timeout=1.0):
            pass
    assert 1.0 <= time.monotonic() - t0 < 3.0
    message = str(info.value)
    assert endpoint in message and "`stagewire master` runs there" in message
    assert "\n" not in message and isinstance(info.value, StageUnavailable)
    with pytest.raises(ConfigError, match="not-an-endpoint"):
        async with Pipeline.connect("not-an-endpoint", timeout=1.0):
            pass
    with pytest.raises(ConfigError, match="no CURVE key pair in"):
        Pipeline.connect(endpoint, keys="no/such/keys")
    with pytest.raises(ConfigError, match="timeout"):
        Pipeline.connect(endpoint, timeout=0)
    # An infinite timeout hung the connect for good (a socket left open held the close).
    with pytest.raises(ConfigError, match="positive, finite number of seconds, not inf"):
        Pipeline.connect(endpoint, timeout=math.inf)
    with pytest.raises(ConfigError, match="positive, finite number of seconds"):
        Pipeline.connect(endpoint, timeout=10**400)  # past a float: it raised OverflowError


async def test_a_batch_run_refuses_clients_and_a_starting_master_waits(
    tmp_path: Path,
) -> None:
    """A ``stagewire run`` master refuses a client at once, in one clear line, even while
    it waits for its workers; a ``stagewire master`` still waiting for its workers answers
    nothing yet (the client's timeout says what to check), then serves once they are up."""
    config = tmp_path / "stall.yaml"
    config.write_text(STALL)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    err = tmp_path / "run.err"
    procs = [
        _start("run", str(config), "--external-workers", "--bind", endpoint,
               "--input", '{"value": "a stall"}', err=err)
    ]  # fmt: skip
    try:
        await workers_announced(err)
        t0 = time.monotonic()
        with pytest.raises(PipelineError) as refusal:
            async with Pipeline.connect(endpoint, timeout=10):
                pass
        assert time.monotonic() - t0 < 5 and not isinstance(refusal.value, MasterUnavailable)
        assert str(refusal.value).startswith(f"the master at {endpoint} refuses clients: ")
        assert "takes no submissions" in str(refusal.value)
    finally:
        kill_all(procs)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    err = tmp_path / "master.err"
    procs = [_start("master", str(config), "--bind", endpoint, err=err)]
    try:
        await workers_announced(err)
        with pytest.raises(MasterUnavailable, match="workers are all ready"):
            async with Pipeline.connect(endpoint, timeout=1.0):
                pass
        procs.append(
            _start("worker", "--master", endpoint, "--stage", "tokens", "--headless",
                   err=tmp_path / "worker.err")
        )  # fmt: skip
        # Asked while its workers come up, it waits and then welcomes, never refuses.
        async with Pipeline.connect(endpoint, timeout=60) as pipe:
            assert pipe.name == "stall"
    finally:
        kill_all(procs)


async def test_a_tensor_payload_round_trips_typed(tmp_path: Path) -> None:
    """A Struct holding a tensor goes in and comes back as that Struct, its tensors with
    their dtype (bfloat16 included), shape and values."""
    config = tmp_path / "tensors.yaml"
    config.write_text(TENSORS)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs)
        async with Pipeline.connect(endpoint) as pipe:
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                pixels = torch.arange(24, dtype=dtype).reshape(2, 3, 4)
                chunks = [c async for c in pipe.stream(Frame("f", pixels))]
                assert [c.name for c in chunks] == [f"f*{k}" for k in FACTORS]
                for k, chunk in zip(FACTORS, chunks, strict=True):
                    assert isinstance(chunk, Frame)
                    assert chunk.pixels.dtype == dtype and chunk.pixels.shape == (2, 3, 4)
                    assert torch.equal(chunk.pixels, pixels * k)
            last = await pipe.submit(Frame("g", torch.ones(5, dtype=torch.uint8)))
            assert torch.equal(last.pixels, torch.full((5,), FACTORS[-1], dtype=torch.uint8))
            # Larger than one control message: a clear error, and nothing sent.
            with pytest.raises(PayloadError, match="by reference"):
                await pipe.submit(Frame("big", torch.zeros(64 * 1024 * 1024, dtype=torch.uint8)))
            assert (await pipe.statistics())["client"]["submitted"] == 4
            # An output too large for one: that request fails, clearly; the next is served.
            with pytest.raises(PayloadError, match="more than a remote client can be sent"):
                await pipe.submit(Frame("grow", torch.ones(40 * 1024 * 1024, dtype=torch.uint8)))
            assert (await pipe.submit(Frame("h", torch.ones(2)))).name == f"h*{FACTORS[-1]}"
    finally:
        kill_all(procs)


async def test_outputs_whose_type_this_host_lacks_decode_untyped(tmp_path: Path) -> None:
    """A sink type the client cannot import (the stage's code is only on the master's
    host): outputs come as plain dicts, their tensors still decoded, and the client says so."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "connect_hidden_stages.py").write_text(HIDDEN_MODULE)
    config = tmp_path / "hidden.yaml"
    config.write_text(HIDDEN)
    env = {"PYTHONPATH": os.pathsep.join([str(extra), str(ROOT)])}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs, env=env)
        with pytest.raises(ImportError):
            __import__("connect_hidden_stages")
        async with Pipeline.connect(endpoint) as pipe:
            out = await pipe.submit(Text("abc"))
            assert isinstance(out, dict) and out["label"] == "abc"
            cells = out["cells"]
            assert isinstance(cells, torch.Tensor) and cells.dtype == torch.int16
            assert torch.equal(cells, torch.arange(6, dtype=torch.int16).reshape(3, 2))
            assert (await pipe.statistics())["untyped"] == ["connect_hidden_stages:Grid"]
    finally:
        kill_all(procs)


REMOTE_ONLY = """\
import msgspec

from pipeline import Context, Stage


class Req(msgspec.Struct):
    n: int


class Double(Stage):
    async def process(self, req: Req, ctx: Context) -> Req:
        return Req(2 * req.n)
"""


def _submit_to(endpoint: str, value: str) -> subprocess.CompletedProcess[str]:
    """``stagewire submit`` of ``value`` to ``endpoint``, run to its end."""
    command = [sys.executable, "-m", "pipeline", "submit", "--master", endpoint, "--input", value]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


async def test_submit_of_an_input_the_master_refuses_exits_2(tmp_path: Path) -> None:
    """A source type only the master's host has: ``submit`` cannot check the input, the
    master refuses it before starting the request, and that is the user's bad input, exit
    code 2, as where the type is known (it was 1, a failed request)."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "remote_only_stages.py").write_text(REMOTE_ONLY)
    config = tmp_path / "remote_only.yaml"
    config.write_text('stages:\n  double: {impl: "remote_only_stages:Double"}\n')
    env = {"PYTHONPATH": os.pathsep.join([str(extra), str(ROOT)])}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs, env=env)
        good, bad = [
            await asyncio.to_thread(_submit_to, endpoint, value)
            for value in ('{"n": 21}', '{"n": "x"}')
        ]
    finally:
        kill_all(procs)
    assert good.returncode == 0 and good.stdout.split() == ['{"n":42}'], good.stderr
    assert bad.returncode == 2, bad.stderr
    assert "PayloadError: --input refused by the master: " in bad.stderr, bad.stderr


async def test_a_master_that_freezes_dies_or_restarts_fails_requests_in_flight(
    tmp_path: Path,
) -> None:
    """A request in flight on a master that stops answering (SIGSTOP) fails with
    MasterUnavailable after the client's timeout, on one that dies (SIGKILL) at once; a
    restarted master at the same address serves the same client again."""
    config = tmp_path / "stall.yaml"
    config.write_text(STALL)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs)
        master = procs[0]
        async with Pipeline.connect(endpoint, timeout=1.5) as pipe:
            stream = pipe.stream(Text("a stall"))
            assert await anext(stream) == Token(0, "a")
            os.kill(master.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                with pytest.raises(MasterUnavailable, match="no answer for"):
                    await anext(stream)
                assert 1.5 <= time.monotonic() - t0 < 4.0
            finally:
                os.kill(master.pid, signal.SIGCONT)
            assert await pipe.submit(Text("thawed out")) == Token(1, "out")

            stream = pipe.stream(Text("b stall"))
            assert await anext(stream) == Token(0, "b")
            os.kill(master.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(MasterUnavailable, match="connection dropped"):
                await anext(stream)
            assert time.monotonic() - t0 < 1.5
            for p in procs:  # its worker, which would wait for it a while
                p.kill()
                p.wait()

            await _serve(config, tmp_path, procs, endpoint=endpoint)
            # Asked before the master that came back has welcomed the client, statistics
            # wait for it, as a request does (the question was lost with the connection,
            # and the call failed after its whole timeout); the client has learnt by then
            # that the master is a new one.
            stats = await pipe.statistics()
            assert stats["client"]["restarts"] == 1 and stats["master"]["replicas"], stats
            assert await pipe.submit(Text("born again")) == Token(1, "again")
    finally:
        kill_all(procs)


async def test_statistics_come_while_a_replica_holds_its_loop(tmp_path: Path) -> None:
    """The master waits a few seconds for a replica's figures before it answers without
    them; a client whose timeout was shorter gave up first (MasterUnavailable, though the
    master was there all along). It now waits for the master's answer, which names the
    silent replica."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    config = tmp_path / "holds.yaml"
    config.write_text(
        "name: holds\n"
        "defaults: {heartbeat_interval: 200ms, heartbeat_timeout: 1s}\n"
        "stages:\n"
        '  tokens: {impl: "tests.pipeline.sample_stages:Tokens"}\n'
        '  holds: {impl: "tests.pipeline.sample_stages:HoldsLoop"}\n'
        "edges: [{from: tokens, to: holds}]\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoint = await _serve(config, tmp_path, procs, env={"LINGER_FIFO": str(fifo)})
        async with Pipeline.connect(endpoint, timeout=1.0) as pipe:
            held = asyncio.ensure_future(pipe.submit(Text("a b")))
            # The master hears that the replica's loop is held.
            log = tmp_path / "master-0.err"
            await wait_for(lambda: "replica_stalled" in log.read_text(), timeout=30)
            stats = await pipe.statistics()
            assert stats["master"]["unanswered"] == ["holds[0]"], stats["master"]
            # Closed while a second question waits on the master's wait, that question ends
            # at once (it waited its whole time, then blamed the master).
            asking = asyncio.ensure_future(pipe.statistics())
            await asyncio.sleep(0)  # asked
            async with asyncio.timeout(3):
                await pipe.aclose()
                with pytest.raises(RuntimeError, match="closed while it waited"):
                    await asking
            with pytest.raises(RequestAborted, match="the client closed"):
                await held
        with fifo.open("w") as f:
            f.write("go\n")
    finally:
        kill_all(procs)


async def test_a_client_is_used_from_its_own_loop_and_closed_from_any(words: Served) -> None:
    """Another loop's submit is refused at once (it hung until its own timer fired, and
    touched the socket from a second thread); two closes at once both wait for the context
    to end; a client whose loop has closed says so, and its close from this loop drops the
    connection at once (it raised "Event loop is closed" and leaked the context)."""
    client = Pipeline.connect(words.endpoint)
    await client.start()
    got: list[BaseException | Any] = []

    def other_loop() -> None:
        try:
            got.append(asyncio.run(client.submit(Text("x"))))
        except BaseException as exc:  # handed back to the test
            got.append(exc)

    await asyncio.to_thread(other_loop)
    assert isinstance(got[0], RuntimeError) and "another event loop" in str(got[0]), got
    assert await client.submit(Text("a b")) == {"relay": Token(1, "b"), "count": Text("2")}
    link = client._link
    ended: list[bool] = []

    async def close() -> None:
        await client.aclose()
        ended.append(link._ctx is None)

    await asyncio.wait_for(asyncio.gather(close(), close()), 20)
    assert ended == [True, True]

    stranded = Pipeline.connect(words.endpoint)
    await asyncio.to_thread(asyncio.run, stranded.start())  # its loop closes with the thread
    with pytest.raises(RuntimeError, match="has closed"):
        await stranded.submit(Text("y"))
    await asyncio.wait_for(stranded.aclose(), 5)
    assert stranded._link._ctx is None
