"""A client of a remote master: ``async with Pipeline.connect("tcp://HOST:7600") as pipe``.

:class:`RemotePipeline` offers the embedded pipeline's calls (``submit``, ``stream``,
``abort``, ``statistics``) over one ZMQ DEALER socket to the control endpoint of a
``stagewire master``, so code written against one works against the other:

- On entering, it says ``Hello`` until the master answers ``Welcome`` (the pipeline's
  sources, sinks and payload types by import path) or ``timeout`` passes. It imports the
  payload types it can, and decodes outputs as those types; where it cannot (the stages'
  code is not installed on this host) it decodes them untyped (plain dicts and lists;
  tensors and arrays still decode) and says so once in a log line. Only the modules the
  master names are imported, as a YAML file's ``impl`` would be: connect to masters you
  trust.
- Every request travels in the codec's wire form: the input and each output are the payload
  codec's msgpack header with tensors and arrays as out-of-band buffers, all in one control
  message. Nothing is pickled. An output tensor decodes onto the device it was sent from
  (``cuda:0`` for a sink on a GPU), or, with ``device``, onto that one: a client on a host
  without the GPU gets the tensors on its CPU.
- Many requests share the socket, told apart by a token per request; one reader dispatches
  the master's answers to each request's queue, in order.
- A request never waits forever on a master that has gone. When the connection drops (the
  master stopped or restarted), every request in flight on it fails at once with
  :class:`MasterUnavailable`, since its answers may have been lost with it. A request made
  after that waits, unsent, until a master welcomes the client again, and fails the same
  way if none has within ``timeout``; a new master (a restart the client did not see as a
  drop) fails every request sent before its ``Welcome``. While requests are in flight and
  the master is quiet, the client says ``Hello`` again, and a request that has heard
  nothing for ``timeout`` fails the same way (a master that is unreachable, or stuck). A
  request also fails with :class:`RequestTimeout` once past the pipeline's
  ``request_timeout`` (which the master enforces first) plus ``timeout``, from when it was
  sent.
- A connection that ZMQ gives up for good (a refused handshake, a message past the size
  limit) is replaced by a fresh one (:mod:`pipeline._remote_link`), so the client serves
  again once the master is fixed.
- Leaving a stream early, cancelling the task that reads it, :meth:`RemotePipeline.abort`
  and closing the client all send ``Cancel``, which aborts the request in every stage.
  Closing never stops the master or its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import warnings
from types import TracebackType
from typing import Any, Self, cast

import msgspec
import structlog

from pipeline._api import SinkOutput
from pipeline._codec import PayloadCodec, codec_for, resolve_device
from pipeline._encoded import DECODE_ERRORS, Encoded, to_host
from pipeline._errors import (
    ConfigError,
    MasterUnavailable,
    PayloadError,
    PipelineError,
    RequestAborted,
    RequestTimeout,
)
from pipeline._lifecycle import LoopBound
from pipeline._logging import configure_logging
from pipeline._messages import (
    REMOTE_WINDOW_BYTES,
    STATS_WAIT_S,
    WIRE_CODEC,
    Alive,
    Cancel,
    ControlToClient,
    Finished,
    FromClient,
    Grant,
    Hello,
    Output,
    Started,
    StatsAnswer,
    StatsAsk,
    Submit,
    Welcome,
    check_client_payload,
)
from pipeline._remote_link import MasterLink
from pipeline._remote_stream import Call, RemoteResponseStream
from pipeline._security import resolve_keys
from pipeline._type_paths import import_type

__all__ = ("RemotePipeline", "RemoteResponseStream")

log = structlog.get_logger("stagewire.remote")

#: While connecting, a ``Hello`` is resent this often: the master may start after the
#: client, and it answers only once its workers are ready.
HELLO_INTERVAL_S = 0.25
#: With requests in flight, the client pings when it has heard nothing for this long (or a
#: quarter of its ``timeout``, if shorter).
PING_AFTER_S = 2.0
#: Outputs of one request the master may send ahead of what the client has read: the
#: client grants more as it reads (half a window at a time), so a slow reader holds the
#: request at the master and nothing piles up on either side. Bytes are bounded too
#: (:data:`REMOTE_WINDOW_BYTES`).
REMOTE_WINDOW = 64
#: How long closing waits for its ``Cancel`` messages to leave.
CANCEL_LINGER_MS = 500

_decode = msgspec.msgpack.Decoder(ControlToClient).decode


def _codec(path: str, missing: dict[str, str]) -> tuple[Any, PayloadCodec[Any]]:
    """The type named ``path`` and its codec; records in ``missing`` why not, untyped."""
    tp, why = import_type(path)
    if why:
        missing[path] = why
    try:
        return tp, codec_for(tp)
    except PayloadError as exc:
        missing[path] = str(exc)
        return Any, codec_for(Any)


class _AskAgain(Exception):
    """The connection dropped while a question waited for its answer."""


class _Closed(Exception):
    """The client closed while a question waited for its answer."""


class RemotePipeline(LoopBound):
    """A client of a pipeline served by a remote master (``stagewire master``).

    Made by :meth:`Pipeline.connect`; use as ``async with``. Its ``submit``, ``stream``
    and ``abort`` are the embedded :class:`Pipeline`'s, with the same results and the same
    exceptions; ``statistics`` gives this client's counters, and the embedded pipeline's
    statistics at the master under ``master``.

    Attributes:
        endpoint: the master's control endpoint.
        timeout: seconds to wait for the master's answer: on connecting, whenever it
            goes quiet while requests are in flight, and, for a request made while the
            connection is down, for a master to welcome the client again.
        device: where output tensors land (``"cpu"``, ``"cuda:1"``), whatever device
            they were sent from; None: the device each was sent from.
    """

    _what = "remote pipeline"

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = 10.0,
        keys: str | os.PathLike[str] | None = None,
        device: str | None = None,
    ) -> None:
        """Check the arguments; connects nothing (``start`` or ``async with`` does).

        Raises:
            ConfigError: ``timeout`` is not a positive finite number of seconds, ``keys``
                (or ``STAGEWIRE_KEYS``) names no valid key pair, or ``device`` no device
                this process can use.
        """
        try:
            seconds = float(timeout)
        except (TypeError, ValueError, OverflowError):
            seconds = math.nan
        if not 0 < seconds < math.inf:
            # inf hung the connect: it is what a silent master is judged by, not a wait.
            raise ConfigError(
                f"timeout must be a positive, finite number of seconds, not {timeout!r}"
            )
        self.endpoint = endpoint
        self.timeout = seconds
        self.device = None if device is None else resolve_device(device)
        self._keys = resolve_keys(keys)
        self._link = MasterLink(
            endpoint,
            self._keys,
            self.timeout,
            on_message=self._on_frames,
            on_error=self._on_error,
            on_dropped=self._on_dropped,
            on_refused=self._on_refused,
        )
        self._watchdog: asyncio.Task[None] | None = None
        self._welcome: Welcome | None = None
        #: When the master refused this client, and what it said, while connecting.
        self._refusals: list[tuple[float, str]] = []
        self._answered = asyncio.Event()
        self._source_type: Any = Any
        self._source_codec: PayloadCodec[Any] = codec_for(Any)
        self._sink_codecs: dict[str, PayloadCodec[Any]] = {}
        #: The master's payload types not importable here, by path.
        self._untyped: list[str] = []
        self._calls: dict[int, Call] = {}
        self._by_id: dict[str, Call] = {}
        self._tokens = itertools.count(1)
        self._stats_tokens = itertools.count(1)
        self._stats_asked: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._heard = 0.0
        self._pinged = 0.0
        #: The connection dropped and no Welcome has come since: new requests wait for one.
        self._rejoining = False
        #: Set while a master has welcomed the client (cleared while it rejoins).
        self._welcomed_now = asyncio.Event()
        self._closed = False
        self.counts = dict.fromkeys(
            ("submitted", "completed", "failed", "aborted", "garbage", "restarts"), 0
        )

    def __repr__(self) -> str:
        name = self._welcome.pipeline if self._welcome else "?"
        return f"<RemotePipeline {name!r} at {self.endpoint}>"

    def __del__(self) -> None:
        # getattr: __init__ may have raised before setting them.
        link = getattr(self, "_link", None)
        if link is not None and link.opened and not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}: use 'async with'", ResourceWarning, stacklevel=1)

    # ---- what the master serves --------------------------------------------------------

    @property
    def name(self) -> str:
        """The pipeline's name."""
        return self._welcomed().pipeline

    @property
    def sources(self) -> list[str]:
        """The stages fed by the client."""
        return list(self._welcomed().sources)

    @property
    def source_type(self) -> Any:
        """The source stage's input type, if it can be imported here; else ``Any``."""
        self._welcomed()
        return self._source_type

    @property
    def sinks(self) -> list[str]:
        """The stages whose outputs come back."""
        return list(self._welcomed().sinks)

    def _welcomed(self) -> Welcome:
        if self._welcome is None or self._closed:
            raise RuntimeError(
                "the remote pipeline is not connected: use 'async with Pipeline.connect(...)'"
            )
        return self._welcome

    # ---- connecting ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and wait until the master answers.

        Raises:
            ConfigError: the endpoint is not a ZMQ endpoint.
            MasterUnavailable: no answer within ``timeout``, or the master refused the
                handshake (its CURVE keys differ from this client's).
            PipelineError: the master refuses clients (a batch ``stagewire run``).
        """
        if self._link.opened or self._closed:
            raise RuntimeError("a RemotePipeline connects once")
        if not structlog.is_configured():
            configure_logging()
        self._bind()
        loop = asyncio.get_running_loop()
        try:
            self._link.open()
            deadline = loop.time() + self.timeout
            while self._welcome is None:
                left = deadline - loop.time()
                refusals = self._refusals
                # Only a master that will never serve clients refuses (a batch run); one
                # that will but is not ready yet stays silent, and is asked again.
                if refusals:
                    raise PipelineError(
                        f"the master at {self.endpoint} refuses clients: {refusals[0][1]}"
                    )
                if self._link.refused:
                    raise MasterUnavailable(self.endpoint, self._link.refused)
                if left <= 0:
                    raise MasterUnavailable(
                        self.endpoint,
                        f"no answer within {self.timeout:g}s; check that `stagewire master` "
                        "runs there and its workers are all ready (it answers once they are), "
                        "that this host can reach the address, and, with CURVE, the keys",
                    )
                self._answered.clear()
                self._send(Hello())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, min(HELLO_INTERVAL_S, left))):
                        await self._answered.wait()
        except BaseException:
            await self.aclose()
            raise
        self._watchdog = loop.create_task(self._watch())

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _adopt(self, welcome: Welcome) -> None:
        """Take the master's description: on connecting, again after it restarted, and as
        the answer to a ping; then send the requests made while no master had welcomed
        the client."""
        previous, self._welcome = self._welcome, welcome
        self._rejoining = False
        self._welcomed_now.set()
        if previous is None or previous.instance != welcome.instance:
            if previous is not None:
                self.counts["restarts"] += 1
                log.warning("remote_master_restarted", endpoint=self.endpoint)
                # Those in flight when the connection dropped have failed already (see
                # _on_dropped). Any sent since went to the old master, or raced this
                # Welcome: the new one never started them, or may have (then the Cancel
                # that failing sends stops them there). Waiting on could hang.
                self._fail_in_flight(
                    "a new master answered at this endpoint (it restarted) while the request "
                    "was in flight; submit it again"
                )
            self._learn_types(welcome)
        for call in list(self._calls.values()):
            if call.held is not None:
                try:
                    self._send_submit(call, call.held)
                except MasterUnavailable as exc:
                    self._end(call, exc)
        self._answered.set()

    def _learn_types(self, welcome: Welcome) -> None:
        """Import the master's payload types: a new master may run other code."""
        missing: dict[str, str] = {}
        self._source_type, self._source_codec = _codec(welcome.source_type, missing)
        self._sink_codecs = {
            sink: _codec(welcome.sink_types.get(sink, ""), missing)[1] for sink in welcome.sinks
        }
        self._untyped = sorted(missing)
        if missing:
            log.warning(
                "remote_types_untyped",
                endpoint=self.endpoint,
                pipeline=welcome.pipeline,
                types=sorted(missing),
                error=next(iter(missing.values())),
                hint="outputs decode as plain dicts and lists (tensors and arrays still "
                "decode); install the stages' code on this host for typed values",
            )

    # ---- the socket ----------------------------------------------------------------------

    def _send(self, msg: FromClient) -> None:
        """Send ``msg`` to the master; one that awaits an answer raises if it cannot leave,
        any other is dropped then (the socket is renewed by the watchdog).

        Raises:
            MasterUnavailable: a Submit or StatsAsk could not be sent.
            RuntimeError: the client is closed.
        """
        if self._closed:
            raise RuntimeError("the remote pipeline is closed")
        if self._link.send(msg) or not isinstance(msg, Submit | StatsAsk):
            return
        raise MasterUnavailable(self.endpoint, f"{self._link.why_down()}; submit again then")

    def _on_error(self, exc: BaseException, frames: list[bytes]) -> None:
        self.counts["garbage"] += 1
        log.warning("remote_message_failed", endpoint=self.endpoint, error=repr(exc))

    def _on_refused(self, reason: str) -> None:
        """The master refused this client's handshake (its CURVE keys, or none)."""
        log.error("refused_by_master", endpoint=self.endpoint, reason=reason)
        self._answered.set()  # a connecting start() says so at once

    def _on_dropped(self) -> None:
        """The connection to the master dropped: every request in flight on it fails at once.

        Its answers may have been lost with the connection (a restarted master never knew
        of it), so waiting on could hang. Requests made from now on wait until a master
        welcomes the client again (the one back may be a new one, still starting); the
        watchdog says Hello once ZMQ has connected again.
        """
        self._rejoining = True
        self._welcomed_now.clear()
        # A statistics question in flight went with the connection: asked again once
        # a master welcomes the client.
        for asked in self._stats_asked.values():
            if not asked.done():
                asked.set_exception(_AskAgain())
        self._fail_in_flight(
            "the connection dropped while the request was in flight (the master stopped, "
            "restarted or became unreachable); submit it again once it serves"
        )

    def _fail_in_flight(self, why: str) -> None:
        """Fail every request sent to the master (not those waiting to be sent) with ``why``."""
        for call in list(self._calls.values()):
            if call.held is None:
                self._end(call, MasterUnavailable(self.endpoint, why, request_id=call.request_id))

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.counts["garbage"] += 1
            return
        try:
            msg = _decode(frames[0])
        except DECODE_ERRORS:
            self.counts["garbage"] += 1
            return
        self._heard = asyncio.get_running_loop().time()
        if isinstance(msg, Welcome):
            self._adopt(msg)
            return
        if isinstance(msg, Alive):
            return  # the master checking on us: being heard from is all it says
        if isinstance(msg, StatsAnswer):
            asked = self._stats_asked.get(msg.token)
            if asked is not None and not asked.done():
                asked.set_result(msg.stats)
            return
        if msg.token == 0:
            if isinstance(msg, Finished) and self._welcome is None:
                self._refusals.append((self._heard, msg.error or msg.kind))
                self._answered.set()
            return
        call = self._calls.get(msg.token)
        if call is None:
            return  # given up here, its Cancel sent: what it still sent is not wanted
        if isinstance(msg, Started):
            call.request_id = msg.request_id
            self._by_id[msg.request_id] = call
        elif isinstance(msg, Finished):
            self._forget(call)
            self.counts["completed" if not msg.kind else "failed"] += 1
        call.queue.put_nowait(msg)

    # ---- requests ------------------------------------------------------------------------

    def _submit(self, value: Any) -> Call:
        """Send ``value`` as a new request.

        Raises:
            PayloadError: it does not match the source's type, or is too large.
            MasterUnavailable: it could not be sent (the connection is gone).
            RuntimeError: the client is not connected, or runs on another event loop.
        """
        welcome = self._welcomed()
        self._check_here()
        if len(welcome.sources) != 1:
            raise PayloadError(
                f"this pipeline has several sources ({welcome.sources}); a remote master "
                "serves pipelines with one"
            )
        tp = self._source_type
        if tp is not Any and not isinstance(value, tp):
            raise PayloadError(
                f"input for stage {welcome.sources[0]!r} must be {tp.__name__}, "
                f"got {type(value).__name__}"
            )
        encoded = to_host(self._source_codec.encode(value))
        check_client_payload(encoded, "the input, encoded,")
        token = next(self._tokens)
        call = Call(token, asyncio.get_running_loop().time(), None)
        call.granted = REMOTE_WINDOW
        # msgspec writes any buffer (a memoryview of a tensor's memory) as bytes.
        buffers = cast("list[bytearray]", list(encoded.buffers))
        submit = Submit(token, encoded.header, WIRE_CODEC, buffers, window=REMOTE_WINDOW)
        if self._rejoining:
            # Sent now, it would reach whatever listens once ZMQ reconnects: a new master
            # still starting, which cannot serve it. It waits for a Welcome instead.
            call.held = submit
        else:
            self._send_submit(call, submit)
        self._calls[token] = call
        self.counts["submitted"] += 1
        return call

    def _send_submit(self, call: Call, submit: Submit) -> None:
        """Send a request's Submit; its deadline counts from now, as the master's does.

        Raises:
            MasterUnavailable: it could not be sent.
        """
        self._send(submit)
        now = asyncio.get_running_loop().time()
        call.held = None
        call.sent_at = now
        timeout = self._welcome.request_timeout if self._welcome else 0.0
        call.deadline = now + timeout + self.timeout if timeout > 0 else None

    def _read_one(self, call: Call, nbytes: int) -> None:
        """The reader took one output of ``call`` (of ``nbytes``): grant more once half a
        window of outputs, or of bytes, is read (the master holds back outputs past
        :data:`REMOTE_WINDOW_BYTES` unread, which it learns of from grants)."""
        call.read += 1
        call.read_bytes += nbytes
        half = call.granted - call.read <= REMOTE_WINDOW // 2
        if (half or call.read_bytes >= REMOTE_WINDOW_BYTES // 2) and self._calls.get(
            call.token
        ) is call:
            call.granted = call.read + REMOTE_WINDOW
            call.read_bytes = 0
            self._send(Grant(call.token, call.granted))

    def _decode_output(self, msg: Output) -> Any:
        """An output chunk's value, typed where the sink's type is known here.

        Raises:
            PayloadError: it does not decode as that type.
        """
        codec = self._sink_codecs.get(msg.stage) or codec_for(Any)
        value = codec.decode(Encoded(msg.value, tuple(msg.buffers)), device=self.device)
        if self._welcome is not None and len(self._welcome.sinks) > 1:
            return SinkOutput(msg.stage, value)
        return value

    def _forget(self, call: Call) -> None:
        self._calls.pop(call.token, None)
        if call.request_id is not None:
            self._by_id.pop(call.request_id, None)

    def _end(self, call: Call, exc: PipelineError, *, outcome: str = "failed") -> None:
        """End a request here with ``exc`` and stop it at the master (if it is there)."""
        if self._calls.get(call.token) is not call:
            return
        self._forget(call)
        self.counts[outcome] += 1
        call.queue.put_nowait(exc)
        if not self._closed and call.held is None:
            self._send(Cancel(call.token))  # never raises: a Cancel that cannot leave is dropped

    def _give_up(self, call: Call, reason: str) -> None:
        """The client left the request's stream before it ended: abort it everywhere."""
        aborted = RequestAborted(call.request_id or "(not started)", reason)
        self._end(call, aborted, outcome="aborted")

    def stream(self, value: Any) -> RemoteResponseStream:
        """Submit ``value`` and iterate over every sink chunk, in order."""
        return RemoteResponseStream(self, value)

    async def submit(self, value: Any) -> Any:
        """Submit ``value`` and return the final sink output (a dict per sink if several).

        Raises:
            StageError: a stage raised for this request.
            StageUnavailable: a replica bound to this request died, or a stage had no
                ready replica for ``replica_wait``.
            MasterUnavailable: the master stopped answering, stopped, restarted or is not
                serving yet (starting), or the request could not be sent.
            ChunkGap: a chunk went missing past ``chunk_timeout``.
            PayloadError: the input or a payload did not match its declared type, or the
                input is too large for one message.
            RequestTimeout: the request passed its deadline.
            RequestAborted: the request was aborted, or the client closed.
            PipelineError: the master answered out of turn (a request it had not admitted).
            RuntimeError: the client is not connected, or runs on another event loop.
        """
        sinks = self._welcomed().sinks
        last: dict[str, Any] = {}
        stream = self.stream(value)
        try:
            async for chunk in stream:
                if isinstance(chunk, SinkOutput):
                    last[chunk.stage] = chunk.value
                else:
                    last[sinks[0]] = chunk
        finally:
            await stream.aclose()
        if len(sinks) == 1:
            return last.get(sinks[0])
        return last

    async def abort(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Cancel a request in every stage; False if it had already ended (or is not ours).

        Raises:
            RuntimeError: the client is not connected, or runs on another event loop.
        """
        self._welcomed()
        self._check_here()
        call = self._by_id.get(request_id)
        if call is None:
            return False
        self._end(call, RequestAborted(request_id, reason), outcome="aborted")
        return True

    async def statistics(self) -> dict[str, Any]:
        """Counters of this client (requests by outcome, those in flight, garbage received,
        master restarts seen, connections renewed after ZMQ gave one up),
        the master's payload types that decode untyped here, and under ``master`` what
        :meth:`Pipeline.statistics` gives at the master: its client side and every
        replica's counters.

        Raises:
            MasterUnavailable: the master did not answer within ``timeout`` (plus what the
                master waits for its replicas), or the question could not be sent.
            RuntimeError: the client is not connected, runs on another event loop, or was
                closed while it waited.
        """
        self._welcomed()
        self._check_here()
        loop = asyncio.get_running_loop()
        # The master waits up to STATS_WAIT_S for its replicas' figures (a replica whose
        # loop a handler holds does not answer), then answers with what it has.
        wait = self.timeout + STATS_WAIT_S
        try:
            async with asyncio.timeout(wait):
                while True:
                    # Asked while the connection is down, the question would be lost with
                    # it, or reach a master still starting: it waits for a Welcome.
                    await self._welcomed_now.wait()
                    if self._closed:
                        raise _Closed
                    token = next(self._stats_tokens)
                    answer: asyncio.Future[dict[str, Any]] = loop.create_future()
                    self._stats_asked[token] = answer
                    try:
                        self._send(StatsAsk(token))
                        master = await answer
                        break
                    except _AskAgain:
                        continue
                    finally:
                        self._stats_asked.pop(token, None)
        except TimeoutError:
            raise MasterUnavailable(self.endpoint, f"no statistics within {wait:g}s") from None
        except _Closed:
            raise RuntimeError(
                "the remote pipeline was closed while it waited for statistics"
            ) from None
        welcome = self._welcomed()
        return {
            "endpoint": self.endpoint,
            "pipeline": welcome.pipeline,
            "client": {**self.counts, "active": len(self._calls), "renewed": self._link.reopened},
            "untyped": list(self._untyped),
            "master": master,
        }

    # ---- liveness ------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Ping a quiet master while requests wait on it, and fail them if it stays quiet;
        greet a master connected again."""
        loop = asyncio.get_running_loop()
        ping_after = min(PING_AFTER_S, self.timeout / 4)
        while True:
            await asyncio.sleep(ping_after / 2)
            try:
                self._watch_once(loop.time(), ping_after)
            except Exception as exc:  # the only bound on waiting requests: it must go on
                log.error("remote_watch_failed", endpoint=self.endpoint, error=repr(exc))

    def _watch_once(self, now: float, ping_after: float) -> None:
        """One look at the connection and at the requests waiting on it."""
        if self._link.needs_reopen(now) and self._link.reopen():
            self._on_dropped()  # nothing sent on the old socket will be answered
        if self._rejoining and self._link.connected:
            self._send(Hello())  # unanswered while a new master waits for its workers
        if not self._calls:
            return
        if now - self._heard >= ping_after and now - self._pinged >= ping_after:
            self._pinged = now
            self._send(Hello())
        for call in list(self._calls.values()):
            if call.held is not None:
                if now - call.sent_at > self.timeout:
                    self._end(call, MasterUnavailable(self.endpoint, self._unwelcomed(now, call)))
                continue
            quiet = now - max(self._heard, call.sent_at)
            if quiet > self.timeout:
                self._end(
                    call,
                    MasterUnavailable(
                        self.endpoint,
                        f"no answer for {quiet:.3g}s while the request was in flight: "
                        "the master stopped or cannot be reached",
                        request_id=call.request_id,
                    ),
                )
            elif call.deadline is not None and now > call.deadline:
                limit = self._welcome.request_timeout if self._welcome else 0.0
                self._end(call, RequestTimeout(call.request_id or f"#{call.token}", limit))

    def _unwelcomed(self, now: float, call: Call) -> str:
        """Why a request made after the connection dropped was never sent."""
        why = (
            self._link.refused
            if self._link.refused
            else "check that `stagewire master` runs there and its workers are all ready"
        )
        return (
            f"the request was made while the connection was down, and no master has "
            f"welcomed this client again for {now - call.sent_at:.3g}s: {why}"
        )

    # ---- closing -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Abort the requests still in flight at the master, and disconnect; idempotent.

        The master and its workers go on serving. Callers at once all wait for the one
        close; from another event loop it runs on the client's own, or, if that loop has
        closed, the connection is dropped at once.

        Raises:
            Nothing.
        """
        await self._close_once()

    def _close_now(self) -> None:
        self._closed = True
        self._link.close_now()

    async def _close(self) -> None:
        if self._closed:
            return
        for call in list(self._calls.values()):
            self._end(
                call,
                RequestAborted(call.request_id or "(not started)", "the client closed"),
                outcome="aborted",
            )
        self._closed = True
        # A statistics() waiting for its answer, or for a master's Welcome, ends now.
        for asked in self._stats_asked.values():
            if not asked.done():
                asked.set_exception(_Closed())
        self._welcomed_now.set()
        # Everything that frees a resource happens before the first await, so that closing
        # cancelled midway still leaves no socket open.
        if self._watchdog is not None:
            self._watchdog.cancel()
        # Cancels sent just before (a stream left, then the client closed) must leave too:
        # the linger holds only what has not left yet, and only that long.
        self._link.close(linger=CANCEL_LINGER_MS)
        try:
            if self._watchdog is not None:
                await asyncio.gather(self._watchdog, return_exceptions=True)
            # Terminating waits (at most the linger) for the cancels to leave: not in the loop.
            await self._link.aclose()
        except BaseException:
            self._link.close_now()  # cancelled: the context must not outlive the client
            raise
