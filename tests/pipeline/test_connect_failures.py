"""``Pipeline.connect`` when the master or the path to it misbehaves: restarts, refused
handshakes, oversize messages, a graceful stop, a client cut off without a close.

The masters here are embedded pipelines serving clients in this process, as ``stagewire
master`` does, with their workers as real processes; where a test is about the client's
reaction to a master that misbehaves, the master is a fake: a plain ZMQ ROUTER speaking the
protocol. Every socket is on the loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from pipeline import MasterUnavailable, PayloadError, Pipeline, PipelineSpec
from pipeline._codec import codec_for
from pipeline._encoded import Encoded
from pipeline._errors import MASTER_STAGE
from pipeline._messages import (
    BUFFER_HEADER_BYTES,
    ENVELOPE_BYTES,
    MAX_CONTROL_MESSAGE,
    WIRE_CODEC,
    ControlToClient,
    ControlToMaster,
    Finished,
    Hello,
    Output,
    Started,
    Submit,
    Welcome,
    check_client_payload,
    encode_message,
)
from pipeline._remote_stream import error_of
from pipeline._serve import ClientServer
from stages.text import Text, Token
from tests.pipeline.conftest import SAMPLE, wait_for
from tests.procs import ROOT, free_port

_to_client = msgspec.msgpack.Decoder(ControlToClient).decode
_to_master = msgspec.msgpack.Decoder(ControlToMaster).decode


def _spec(stage: str, bind: str, **defaults: Any) -> PipelineSpec:
    """One sample stage, source and sink, its master bound to ``bind``."""
    return PipelineSpec.from_dict(
        {
            "name": "failures",
            "master": {"bind": bind},
            "defaults": {"heartbeat_interval": "200ms", "heartbeat_timeout": "2s", **defaults},
            "stages": {"s": {"impl": f"{SAMPLE}:{stage}"}},
            "edges": [],
        }
    )


@contextlib.asynccontextmanager
async def _serving(spec: PipelineSpec) -> AsyncIterator[tuple[Pipeline, ClientServer]]:
    """``spec`` started and serving remote clients, as ``stagewire master`` runs it; stopped
    as a SIGTERM stops that."""
    pipe = Pipeline(spec)
    pipe._serves_clients = True
    await pipe.start()
    server = ClientServer(pipe)
    server.install()
    try:
        yield pipe, server
    finally:
        await server.aclose()
        await pipe.aclose()


# ---- a fake master ------------------------------------------------------------------------


class FakeMaster:
    """A ROUTER at ``port`` that welcomes as ``instance``, starts each request and answers
    it with its input's text as the one output; plain or, with ``curve``, CURVE only."""

    def __init__(self, port: int, instance: str, *, curve: bool = False) -> None:
        self.port = port
        self.instance = instance
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        #: What the next request's output is instead of its answer (a message too large).
        self.next_output: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> FakeMaster:
        """Bind (the port a fake before it held is freed a moment after it closed)."""

        def bound() -> bool:
            try:
                self.sock.bind(f"tcp://127.0.0.1:{self.port}")
            except zmq.ZMQError:
                return False
            return True

        await wait_for(bound, timeout=10)
        self._task = asyncio.ensure_future(self._serve())
        return self

    def welcome(self) -> Welcome:
        return Welcome("fake", ["s"], ["s"], "stages.text:Text", {"s": "stages.text:Text"},
                       self.instance)  # fmt: skip

    async def _serve(self) -> None:
        while True:
            identity, body = await self.sock.recv_multipart()
            msg = _to_master(body)
            if isinstance(msg, Hello):
                await self.sock.send_multipart([identity, encode_message(self.welcome())])
            elif isinstance(msg, Submit):
                answers: list[bytes] = [encode_message(Started(msg.token, f"r{msg.token}"))]
                if self.next_output is not None:
                    answers.append(self.next_output)
                    self.next_output = None
                elif not msgspec.msgpack.decode(msg.input, type=Text).value.endswith("stall"):
                    answers.append(encode_message(Output(msg.token, "s", msg.input)))
                    answers.append(encode_message(Finished(msg.token)))
                for answer in answers:
                    await self.sock.send_multipart([identity, answer])

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()


# ---- restarts -----------------------------------------------------------------------------


async def test_a_request_made_while_the_master_restarts_is_served_by_the_new_one() -> None:
    """A request made after the connection dropped waits until a master welcomes the client
    again, then goes to it: never to a new master still starting, which cannot serve it
    (it used to drop it, and its answers to pings kept the client waiting for ever)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    remote = Pipeline.connect(endpoint, timeout=10)
    async with _serving(_spec("Echo", endpoint)):
        await remote.start()
        assert await remote.submit(Text("before")) == Text("before")
    try:
        # The first master stopped; the client saw its connection drop.
        await wait_for(lambda: remote._rejoining, timeout=10)
        request = asyncio.ensure_future(remote.submit(Text("made during the restart")))
        async with _serving(_spec("Echo", endpoint)):
            async with asyncio.timeout(30):
                assert await request == Text("made during the restart")
            stats = await remote.statistics()
            assert stats["client"]["restarts"] == 1 and stats["client"]["failed"] == 0
    finally:
        await remote.aclose()


async def test_a_master_not_serving_yet_answers_a_request_at_once() -> None:
    """A master still waiting for its workers leaves a Hello unanswered (the client asks
    again) but answers a request with MasterUnavailable, instead of dropping it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pipe = Pipeline(_spec("Echo", endpoint))
    pipe._serves_clients = True
    starting = asyncio.ensure_future(pipe.start(launch=False))  # no worker will come
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        await wait_for(lambda: pipe._master is not None and bool(pipe._master.endpoint))
        sock.connect(endpoint)
        header = codec_for(Text).encode(Text("too early")).header
        await sock.send(encode_message(Hello()))
        await sock.send(encode_message(Submit(7, header, WIRE_CODEC)))
        async with asyncio.timeout(10):
            answer = _to_client(await sock.recv())
        # The first answer is the request's: the Hello before it got none.
        assert isinstance(answer, Finished) and answer.token == 7
        assert answer.kind == "MasterUnavailable" and answer.failure is not None
        assert answer.failure.stage == MASTER_STAGE
        error = error_of(answer, endpoint)
        assert isinstance(error, MasterUnavailable) and error.endpoint == endpoint
        assert "it is not serving (it is starting" in str(error)
    finally:
        sock.close(linger=0)
        ctx.term()
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await pipe.aclose()


async def test_a_new_master_fails_the_requests_the_old_one_started() -> None:
    """A Welcome from a new master instance (a restart the client never saw as a drop) fails
    the requests in flight with MasterUnavailable: the new master will never answer them,
    and its answers to pings would otherwise keep them waiting for ever."""
    port = free_port()
    master = await FakeMaster(port, "first").start()
    try:
        async with Pipeline.connect(f"tcp://127.0.0.1:{port}", timeout=1.0) as remote:
            stream = remote.stream(Text("a stall"))
            assert await stream.start() == "r1"
            master.instance = "second"  # its next answer to a ping says so
            async with asyncio.timeout(10):
                with pytest.raises(MasterUnavailable, match="a new master answered"):
                    await anext(stream)
            assert remote.counts["restarts"] == 1
            assert await remote.submit(Text("then")) == Text("then")
    finally:
        await master.aclose()


# ---- connections ZMQ gives up -------------------------------------------------------------


async def test_a_client_refused_by_a_rekeyed_master_recovers_once_it_is_fixed() -> None:
    """A master back with CURVE keys the client lacks refuses its handshake (a protocol
    error, after which ZMQ never reconnects): a request fails with MasterUnavailable saying
    why, never a raw ZMQ error, and once the master is back as before the client serves."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    master = await FakeMaster(port, "plain").start()
    try:
        async with Pipeline.connect(endpoint, timeout=1.0) as remote:
            assert await remote.submit(Text("before")) == Text("before")
            await master.aclose()
            await wait_for(lambda: remote._rejoining, timeout=10)  # it saw the drop
            master = await FakeMaster(port, "keyed", curve=True).start()
            # ZMQ reports the refusal as a protocol error or without detail, depending on
            # when it notices: either way the error says the master refused the connection.
            async with asyncio.timeout(10):
                with pytest.raises(MasterUnavailable, match="refused the connection") as info:
                    await remote.submit(Text("refused"))
                with pytest.raises(MasterUnavailable, match="refused the connection"):
                    await remote.submit(Text("refused again"))
            await master.aclose()
            master = await FakeMaster(port, "fixed").start()
            await wait_for(lambda: not remote._rejoining, timeout=10)
            async with asyncio.timeout(10):
                assert await remote.submit(Text("after")) == Text("after")
            # (The fake answers no statistics: the client's own counters.) After a protocol
            # error ZMQ never reconnects, so the client must have opened a fresh socket;
            # after a refusal without detail ZMQ reconnects by itself.
            if "one side uses CURVE" in str(info.value):
                assert remote._link.reopened >= 1
            assert remote.counts["restarts"] == 1
    finally:
        await master.aclose()


async def test_a_message_past_the_size_limit_does_not_leave_the_client_dead() -> None:
    """An answer larger than the client takes ends its connection for good at ZMQ's level;
    the client renews it and serves the next request."""
    port = free_port()
    master = await FakeMaster(port, "one").start()
    try:
        async with Pipeline.connect(f"tcp://127.0.0.1:{port}", timeout=1.0) as remote:
            master.next_output = encode_message(
                Output(1, "s", b"\0" * (MAX_CONTROL_MESSAGE + 1024))
            )
            async with asyncio.timeout(10):
                with pytest.raises(MasterUnavailable, match="connection dropped"):
                    await remote.submit(Text("the big one"))
            await wait_for(lambda: not remote._rejoining, timeout=10)
            async with asyncio.timeout(10):
                assert await remote.submit(Text("next")) == Text("next")
            assert remote._link.reopened == 1
    finally:
        await master.aclose()


def test_the_size_check_counts_each_buffers_header() -> None:
    """A payload of many buffers passes the check only if its message, with msgpack's header
    before each buffer, fits what the receiving socket takes."""
    n = 40_000
    header = b"\x90"
    limit = MAX_CONTROL_MESSAGE - ENVELOPE_BYTES
    backing = bytearray(limit)

    def payload(size: int) -> Encoded:
        view = memoryview(backing)
        return Encoded(header, tuple(view[i * size : (i + 1) * size] for i in range(n)))

    # Within the limit counting the bytes alone, past it counting the headers too.
    too_big = payload((limit - len(header)) // n)
    assert too_big.nbytes <= limit
    with pytest.raises(PayloadError, match=f"in {n} buffers, more than a remote client"):
        check_client_payload(too_big, "an output")
    largest = payload((limit - len(header) - BUFFER_HEADER_BYTES * n) // n)
    check_client_payload(largest, "an output")
    message = encode_message(Output(1, "sink", largest.header, list(largest.buffers)))
    assert len(message) <= MAX_CONTROL_MESSAGE


# ---- a master stopped, a client cut off ---------------------------------------------------


async def test_a_master_stopped_gracefully_fails_requests_in_flight_as_master_unavailable() -> None:
    """A master stopped as SIGTERM stops it fails the requests in flight with what a killed
    one gives, MasterUnavailable, not RequestAborted (which says the client cancelled)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    async with _serving(_spec("Tokens", endpoint)):
        remote = Pipeline.connect(endpoint, timeout=10)
        await remote.start()
        stream = remote.stream(Text("a stall"))
        assert await anext(stream) == Token(0, "a")
    try:
        async with asyncio.timeout(10):
            with pytest.raises(MasterUnavailable, match="the master stopped while the request"):
                await anext(stream)
    finally:
        await remote.aclose()


class Forwarder:
    """A TCP forwarder to ``port`` on the loopback address whose path can be cut without a
    close (:meth:`cut`), as a partition or a frozen host cuts it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listen_port = 0
        self._server: asyncio.Server | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Forwarder:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]
        self._pumps += [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def cut(self) -> None:
        """Forward nothing more, either way, and accept no one; close nothing."""
        assert self._server is not None
        self._server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def aclose(self) -> None:
        await self.cut()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for w in self._writers), return_exceptions=True)


async def test_the_master_cancels_the_requests_of_a_client_cut_off_without_a_close() -> None:
    """A client whose path to the master goes silent, no TCP close ever coming, is dropped
    by the master's heartbeats (after twice ``heartbeat_timeout``), and its request is
    cancelled in every stage."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    spec = _spec("Tokens", endpoint, heartbeat_timeout="1s")
    async with _serving(spec) as (pipe, server):
        forwarder = await Forwarder(int(endpoint.rsplit(":", 1)[1])).start()
        remote = Pipeline.connect(f"tcp://127.0.0.1:{forwarder.listen_port}", timeout=30)
        try:
            await remote.start()
            stream = remote.stream(Text("a stall"))
            assert await anext(stream) == Token(0, "a")
            orch = pipe._master_or_fail().orch
            assert len(orch.requests) == 1 and server.abandoned == 0
            await forwarder.cut()
            await wait_for(lambda: server.abandoned == 1 and not orch.requests, timeout=10)
            await stream.aclose()
        finally:
            await remote.aclose()
            await forwarder.aclose()


# ---- stagewire submit ---------------------------------------------------------------------


def test_submit_checks_its_timeout_before_the_master() -> None:
    """``stagewire submit --timeout 0`` says what is wrong with --timeout, in one line,
    instead of blaming --master."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "submit", "--master",
         f"tcp://127.0.0.1:{free_port()}", "--input", '{"value": "x"}', "--timeout", "0"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: --timeout must be a positive number of seconds, not 0"


async def test_a_service_that_is_no_master_is_not_blamed_on_keys() -> None:
    """A port where another service greets first (an SSH-style banner) fails the
    handshake without detail: the error said the CURVE keys did not match, though no
    process had any. It now says the peer may be no stagewire process, and to check the
    address."""
    server = await asyncio.start_server(_greet_and_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(MasterUnavailable) as info:
            async with Pipeline.connect(f"tcp://127.0.0.1:{port}", timeout=5):
                pass
        message = str(info.value)
        assert "no stagewire process" in message and "check the address" in message, message
    finally:
        server.close()
        await server.wait_closed()


async def _greet_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-Example\r\n")
    with contextlib.suppress(OSError):
        await writer.drain()
        await reader.read(64)  # what the client sends first, then the service hangs up
    writer.close()
