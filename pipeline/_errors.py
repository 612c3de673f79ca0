"""The exception tree of stagewire.

Every error a user can catch derives from :class:`PipelineError`::

    PipelineError
    ├── ConfigError         a spec, YAML file or stage class is wrong; nothing started
    ├── StageError          a stage's ``process`` raised for one request
    ├── StageUnavailable    the replica holding a request died or never came up
    │   └── MasterUnavailable   a remote master did not answer, or went away
    ├── ChunkGap            a chunk did not arrive within ``chunk_timeout``
    ├── TransportError      a transport could not move or find a payload
    │   ├── TransportFull   no capacity freed up within the put's deadline
    │   └── ProducerLost    the process holding a payload is gone (a consumer's
    │                       channel reports it as StageUnavailable of the producer)
    ├── PayloadError        a payload did not match its declared type
    ├── RequestAborted      the request was cancelled (client cancel or ``abort``)
    └── RequestTimeout      the request passed its deadline

:class:`EndOfChannel` sits outside the tree: the end of a stream is a signal, not an error.

Errors cross process boundaries as :class:`FailureInfo` records (never pickled) and are
rebuilt at the client by :func:`failure_to_error`.
"""

from __future__ import annotations

import traceback as _traceback

import msgspec

__all__ = (
    "MASTER_STAGE",
    "ChunkGap",
    "ConfigError",
    "EndOfChannel",
    "FailureInfo",
    "MasterUnavailable",
    "PayloadError",
    "PipelineError",
    "ProducerLost",
    "RequestAborted",
    "RequestTimeout",
    "StageError",
    "StageUnavailable",
    "TransportError",
    "TransportFull",
    "describe_failure",
    "error_to_failure",
    "failure_to_error",
    "message_of",
    "wire_text",
)


class EndOfChannel(Exception):
    """The stream ended normally: its final chunk has been consumed."""


class PipelineError(Exception):
    """The root of every stagewire error."""

    #: Where the failure happened in another process (a stage's handler or setup), its
    #: traceback as that process formatted it; empty otherwise.
    traceback: str = ""


class ConfigError(PipelineError):
    """A spec, YAML file or stage class is invalid; raised before any process starts.

    The message names the file, the field path and the line where they are known.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        path: str | None = None,
        line: int | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.path = path
        self.line = line
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        elif line is not None:
            where = f"line {line}: "
        field = f"{path}: " if path else ""
        super().__init__(f"{where}{field}{message}")


class StageError(PipelineError):
    """A stage's handler raised while processing one request; the stage keeps serving.

    Attributes:
        traceback: the handler's traceback as the worker formatted it (its last frames,
            bounded in size), or ``""``: what to read when the message is not enough.
    """

    def __init__(self, stage: str, request_id: str, message: str, traceback: str = "") -> None:
        self.stage = stage
        self.request_id = request_id
        self.message = message
        self.traceback = traceback
        super().__init__(f"stage {stage!r} failed request {request_id}: {message}")


class StageUnavailable(PipelineError):
    """The replica bound to a request died, or no replica of a stage is available."""

    def __init__(self, stage: str, message: str, *, request_id: str | None = None) -> None:
        self.stage = stage
        self.request_id = request_id
        self.message = message
        rid = f" (request {request_id})" if request_id else ""
        super().__init__(f"stage {stage!r} unavailable{rid}: {message}")


#: The ``stage`` of a :class:`MasterUnavailable`, and of its :class:`FailureInfo` record: a
#: client rebuilds such a record as MasterUnavailable (naming its own endpoint for the master).
MASTER_STAGE = "@master"


class MasterUnavailable(StageUnavailable):
    """A remote master (:meth:`Pipeline.connect`) did not answer: nothing serves at its
    endpoint, it refused the connection, or it went away while requests were in flight.

    Attributes:
        endpoint: the master's control endpoint.
    """

    def __init__(self, endpoint: str, message: str, *, request_id: str | None = None) -> None:
        self.endpoint = endpoint
        self.stage = MASTER_STAGE
        self.request_id = request_id
        self.message = message
        rid = f" (request {request_id})" if request_id else ""
        # Not StageUnavailable's wording: no stage is at fault, the master is.
        PipelineError.__init__(self, f"the master at {endpoint} is unavailable{rid}: {message}")


class ChunkGap(PipelineError):
    """A chunk was not received within the chunk timeout; the request fails, never hangs."""

    def __init__(
        self,
        request_id: str,
        edge: str,
        seq: int,
        timeout: float,
        *,
        advice: str = "raise chunk_timeout if the upstream stage is slow",
        message: str | None = None,
    ) -> None:
        """``advice`` ends the message; ``message``, when given, is the whole of it (as
        rebuilt from a failure record)."""
        self.request_id = request_id
        self.edge = edge
        self.seq = seq
        self.timeout = timeout
        super().__init__(
            message
            or f"request {request_id}: chunk {seq} on edge {edge!r} did not arrive within "
            f"{timeout:g}s (chunk_timeout); {advice}"
        )


class TransportError(PipelineError):
    """A transport could not store, find or deliver a payload."""


class ProducerLost(TransportError):
    """The process holding a payload is gone (it exited, or nothing listens at its port
    any more), so the payload cannot be fetched.

    A consumer's channel turns it into :class:`StageUnavailable` naming the producer's
    stage: the request was in flight on a replica that died, whichever process noticed
    first.
    """


class TransportFull(TransportError):
    """A bounded transport had no room for a payload within the put's deadline.

    The ``auto`` policy may then send the payload another way, counted as a fallback.
    """


class PayloadError(PipelineError):
    """A payload did not match the type its stage declared.

    Attributes:
        field: the path of the offending field (``$.pixels``), when known.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.message = message
        self.field = field
        super().__init__(message)


class RequestAborted(PipelineError):
    """The request was cancelled before it completed."""

    def __init__(self, request_id: str, reason: str = "aborted") -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"request {request_id} aborted: {reason}")


class RequestTimeout(PipelineError):
    """The request did not complete before its deadline."""

    def __init__(self, request_id: str, timeout: float, *, detail: str = "") -> None:
        self.request_id = request_id
        self.timeout = timeout
        more = f" ({detail})" if detail else ""
        super().__init__(
            f"request {request_id} did not complete within {timeout:g}s, its request_timeout{more}"
        )


class FailureInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A wire record of a request failure, rebuilt into an exception at the client."""

    kind: str
    message: str
    request_id: str = ""
    stage: str = ""
    edge: str = ""
    seq: int = 0
    timeout: float = 0.0
    field: str = ""
    traceback: str = ""


#: The most characters of a handler's exception message sent on: one of tens of MB (an
#: input quoted whole) passed every control message's size cap, and the connection it
#: took (the worker's to its master, a remote client's) dropped with every request on it.
MESSAGE_CHARS = 8192


def message_of(exc: BaseException) -> str:
    """``str(exc)`` (its first :data:`MESSAGE_CHARS` characters), or a stand-in when the
    exception's own ``__str__`` fails."""
    try:
        text = str(exc)
    except Exception as e:
        return f"<the message of this {type(exc).__name__} could not be made: {e!r}>"
    return bounded(text)


def bounded(text: str) -> str:
    """``text``'s first :data:`MESSAGE_CHARS` characters, saying how many more it had, as
    the wire can carry them (:func:`wire_text`)."""
    if len(text) > MESSAGE_CHARS:
        text = f"{text[:MESSAGE_CHARS]}... ({len(text) - MESSAGE_CHARS} more characters)"
    return wire_text(text)


def wire_text(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate, which is what ``os.fsdecode`` and
    ``os.listdir`` make of a file name that is not UTF-8, becomes its escape (``\\udce9``).

    A message is encoded as UTF-8, and a lone surrogate has no UTF-8 form: a stage's
    error naming such a file could not be reported, and its request waited for ever.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def error_to_failure(exc: BaseException, *, stage: str, request_id: str) -> FailureInfo:
    """Describe ``exc`` as a :class:`FailureInfo` raised in ``stage`` for ``request_id``.

    A ChunkGap or StageUnavailable of another request (a pipeline the stage's own code
    calls) is the stage's failure, not one of this pipeline's edges or stages.
    """
    if isinstance(exc, ChunkGap) and exc.request_id == request_id:
        return FailureInfo(
            "chunk_gap", bounded(str(exc)), exc.request_id, stage, exc.edge, exc.seq, exc.timeout
        )
    # Every message is bounded: a handler may raise any of these with a text of its own.
    if isinstance(exc, PayloadError):
        message = bounded(f"stage {stage!r}: {exc.message}")
        return FailureInfo("payload", message, request_id, stage, field=exc.field or "")
    if isinstance(exc, TransportError):
        return FailureInfo("transport", bounded(f"stage {stage!r}: {exc}"), request_id, stage)
    if isinstance(exc, StageUnavailable) and exc.request_id == request_id:
        return FailureInfo("unavailable", bounded(exc.message), request_id, exc.stage)
    text = message_of(exc)
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return FailureInfo("stage", message, request_id, stage, traceback=format_traceback(exc))


def describe_failure(exc: PipelineError) -> FailureInfo | None:
    """The fields from which :func:`failure_to_error` rebuilds ``exc`` exactly (for a remote
    master's client), or None for an error it does not rebuild.
    """
    match exc:
        case StageError():
            return FailureInfo(
                "stage", wire_text(exc.message), exc.request_id, exc.stage,
                traceback=wire_text(exc.traceback),
            )  # fmt: skip
        case StageUnavailable():
            return FailureInfo(
                "unavailable", wire_text(exc.message), exc.request_id or "", exc.stage
            )
        case ChunkGap():
            return FailureInfo(
                "chunk_gap", wire_text(str(exc)), exc.request_id, edge=exc.edge, seq=exc.seq,
                timeout=exc.timeout,
            )  # fmt: skip
        case PayloadError():
            return FailureInfo("payload", wire_text(exc.message), field=exc.field or "")
        case TransportError():
            return FailureInfo("transport", wire_text(str(exc)))
        case RequestAborted():
            return FailureInfo("aborted", wire_text(exc.reason), exc.request_id)
        case RequestTimeout():
            return FailureInfo("timeout", str(exc), exc.request_id, timeout=exc.timeout)
    return None


#: The most frames, and characters, of a handler's traceback sent to the client.
TRACEBACK_FRAMES = 16
TRACEBACK_CHARS = 8192


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback, innermost frames last, bounded to what a client can take."""
    text = "".join(_traceback.format_exception(exc, limit=-TRACEBACK_FRAMES))
    if len(text) > TRACEBACK_CHARS:
        text = "...\n" + text[-TRACEBACK_CHARS:]
    return wire_text(text)


def failure_to_error(info: FailureInfo) -> PipelineError:
    """Rebuild the exception a :class:`FailureInfo` describes."""
    match info.kind:
        case "chunk_gap":
            return ChunkGap(
                info.request_id, info.edge, info.seq, info.timeout, message=info.message or None
            )
        case "payload":
            return PayloadError(info.message, field=info.field or None)
        case "transport":
            return TransportError(info.message)
        case "unavailable":
            return StageUnavailable(info.stage, info.message, request_id=info.request_id)
        case "aborted":
            return RequestAborted(info.request_id, info.message)
        case "timeout":
            return RequestTimeout(info.request_id, info.timeout)
        case _:
            return StageError(info.stage, info.request_id, info.message, info.traceback)
