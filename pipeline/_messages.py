"""Wire messages of the control plane (master <-> workers) and the data plane (stage <-> stage).

Every message is a tagged msgspec Struct; a socket's decoder accepts exactly its union, so
anything else (garbage bytes, a forged type) fails to decode and is dropped and counted.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline._encoded import Encoded
from pipeline._errors import FailureInfo, PayloadError

__all__ = (
    "CLOSING",
    "MAX_CONTROL_MESSAGE",
    "NO_DESCRIPTOR",
    "WIRE_CODEC",
    "Abort",
    "Admit",
    "Alive",
    "Assignment",
    "Cancel",
    "Chunks",
    "ChunksOut",
    "ControlToClient",
    "ControlToMaster",
    "ControlToWorker",
    "Credit",
    "DataMessage",
    "Drop",
    "Failed",
    "Finished",
    "FromClient",
    "Gone",
    "Grant",
    "Heartbeat",
    "Held",
    "Hello",
    "Output",
    "Peer",
    "PeerTable",
    "Peers",
    "Ready",
    "Register",
    "ReportAsk",
    "SetupFailed",
    "Shutdown",
    "Spill",
    "Started",
    "StatsAnswer",
    "StatsAsk",
    "StatsReply",
    "StatsRequest",
    "Submit",
    "Welcome",
    "check_client_payload",
    "decode_batch",
    "encode_batch",
    "encode_message",
)


class _Msg(msgspec.Struct, frozen=True, tag_field="m", array_like=True):
    pass


# ---- data plane ---------------------------------------------------------------------------


class Chunks(_Msg, frozen=True, tag="c"):
    """A run of consecutive chunks of one request on one edge: each is an envelope.

    ``descriptors`` is a msgpack array whose element ``i`` describes chunk ``first + i``: a
    descriptor of ``transport``, or nil for a chunk without payload (the end of a stream
    that has no payload of its own). It stays raw so that the receiving transport decodes
    the whole array at once. Only the run's last chunk can be final, as ``final`` says.
    A sender joins the chunks of one (request, edge) that leave in the same batch into one
    run, so the key's request and edge, the sender and the timestamp travel once per run;
    every chunk still carries its own descriptor. ``credit`` asks for credit as soon as
    the run's last chunk is taken: the sender's byte window is full.
    """

    request_id: str
    edge: str
    first: int
    final: bool
    transport: str
    descriptors: msgspec.Raw
    sender: str
    host: str
    sent_ns: int
    credit: bool = False


class ChunksOut(_Msg, frozen=True, tag="c"):
    """:class:`Chunks` as a sender encodes it: its descriptors are still a list of transport
    Structs (or None), which encodes to the array :class:`Chunks` reads raw.
    """

    request_id: str
    edge: str
    first: int
    final: bool
    transport: str
    descriptors: list[Any]
    sender: str
    host: str
    sent_ns: int
    credit: bool = False


#: A chunk's descriptor when it carries no payload: msgpack nil.
NO_DESCRIPTOR = msgspec.Raw(b"\xc0")


class Credit(_Msg, frozen=True, tag="k"):
    """The consumer has taken chunks ``0 .. upto-1`` of (request, edge): more may be sent.

    ``done``: the consumer's handler finished without reading the stream to its end; it
    will read nothing more of this request on this edge, so send nothing more.
    ``window``: how many chunks past ``upto`` may now be sent (0: the edge's window).
    """

    request_id: str
    edge: str
    upto: int
    done: bool = False
    window: int = 0


class Held(_Msg, frozen=True, tag="h"):
    """The producer of (request, edge) is alive but held: it waits to send another of its
    outputs of the request (for credit from a slower consumer, say), so the next chunk on
    this edge is late, not lost. The consumer's wait for it starts over (see
    ``ReorderBuffer.alive``), instead of failing the request with a ChunkGap."""

    request_id: str
    edge: str


class Spill(_Msg, frozen=True, tag="s"):
    """The producer's end of ``edge`` has no room left in ``transport`` (its shm arena):
    the consumer copies the payloads it holds there for requests whose readers stopped
    into its own memory, and releases them (see ``InputChannel.spill``). Without this,
    requests whose readers stopped (a client that reads no more, a handler waiting on
    another output) could hold the whole arena, and starve those being read."""

    edge: str
    transport: str


#: Encodes one message of this module (any of them) to msgpack.
encode_message = msgspec.msgpack.Encoder().encode


def encode_batch(envelopes: list[bytes]) -> bytes:
    """Join encoded data messages into one msgpack array: one frame, one decode.

    Each envelope is already a complete msgpack value, so an array header followed by the
    envelopes is a valid msgpack array of them; nothing is re-encoded.
    """
    n = len(envelopes)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(envelopes)


def decode_batch(frame: bytes | memoryview) -> list[DataMessage]:
    """Decode a frame made by :func:`encode_batch`.

    Raises:
        msgspec.DecodeError: the frame is not a batch of data messages.
        UnicodeDecodeError: a string in it is not UTF-8.
    """
    return _batch_decoder.decode(frame)


# ---- control plane: worker -> master ------------------------------------------------------


class Register(_Msg, frozen=True, tag="register"):
    """A worker announces itself and its data endpoint."""

    stage: str
    replica: int
    host: str
    pid: int
    data_endpoint: str
    devices: list[str] = []
    #: Where the worker accepts same-host links (empty: ZMQ only).
    local_endpoint: str = ""
    #: Its pid namespace (``transports._liveness.pid_namespace``): ``pid`` means something
    #: to another process only within the same one.
    pidns: int = 0


class Ready(_Msg, frozen=True, tag="ready"):
    """The worker's stage finished ``setup`` and serves requests."""

    stage: str
    replica: int


class SetupFailed(_Msg, frozen=True, tag="setup_failed"):
    """The worker could not load or set up its stage; it will exit."""

    stage: str
    replica: int
    message: str
    #: The failure's traceback as the worker formatted it (bounded), for ``--debug``.
    traceback: str = ""


class Heartbeat(_Msg, frozen=True, tag="hb"):
    """Liveness, both ways; ``inflight`` counts requests the sender holds. From a worker,
    since its last beat: ``ended``, requests whose handler ended there, nothing it sent
    needing that process once got; ``drained``, (request id, upstream stage) pairs: all the
    payloads of that request from that stage are there (see ``StageActor.take_reports``).
    ``answers``: the :class:`ReportAsk` whose answer this beat completes (0: none); every
    report the worker had when the ask came went in it or an earlier beat."""

    stage: str
    replica: int
    inflight: int = 0
    ended: tuple[str, ...] = ()
    drained: tuple[tuple[str, str], ...] = ()
    answers: int = 0
    #: From a worker: for how many seconds its event loop has not run (a handler holds it);
    #: 0 while it runs.
    stalled: float = 0.0


class ReportAsk(_Msg, frozen=True, tag="report?"):
    """From the master to a worker's heartbeat thread: send what you have to report of
    your requests now, with ``answers`` set to ``token``. Asked of a dead replica's
    consumers before failing its requests: a request they have every payload of goes on."""

    token: int


class Failed(_Msg, frozen=True, tag="failed"):
    """A request failed in this worker's stage."""

    stage: str
    replica: int
    info: FailureInfo


class StatsReply(_Msg, frozen=True, tag="stats"):
    """A worker's statistics, answering :class:`StatsRequest` ``token``."""

    stage: str
    replica: int
    token: int
    stats: dict[str, Any]


#: What a control message carrying a payload needs beyond the payload's own bytes and its
#: buffers' headers (its tag, token, the sink's name, msgpack lengths), generously.
ENVELOPE_BYTES = 64 * 1024
#: What msgpack writes before each out-of-band buffer at most (a bin 32 header): a payload
#: of many small tensors carries one per tensor, beyond the envelope.
BUFFER_HEADER_BYTES = 5
#: Largest control message a socket accepts, in bytes.
MAX_CONTROL_MESSAGE = 64 * 1024 * 1024
#: How long a master waits for its replicas' statistics; those silent are named unanswered.
STATS_WAIT_S = 5.0
#: Payload bytes of one request's outputs a master sends a remote client ahead of what it
#: knows the client has read (at least one output goes, however large); the client grants
#: more once it has read half of that, or half its window of outputs.
REMOTE_WINDOW_BYTES = 64 * 1024 * 1024


def check_client_payload(encoded: Encoded, what: str) -> None:
    """Refuse ``what`` (a remote client's input, or an output for it) that one control
    message cannot carry: its bytes, with a header per buffer and the envelope, must stay
    within :data:`MAX_CONTROL_MESSAGE`, or the receiving socket drops the connection.

    Raises:
        PayloadError: the payload is past the limit; the message says what to do instead.
    """
    size = encoded.nbytes + BUFFER_HEADER_BYTES * len(encoded.buffers)
    limit = MAX_CONTROL_MESSAGE - ENVELOPE_BYTES
    if size > limit:
        parts = f" in {len(encoded.buffers)} buffers" if len(encoded.buffers) > 1 else ""
        raise PayloadError(
            f"{what} is {size} bytes{parts}, more than a remote client can be sent or send in "
            f"one message ({limit}); pass large data by reference (a path or URL) instead"
        )


#: The payload codec's msgpack header, tensors and arrays as out-of-band buffers beside
#: it (:class:`~pipeline.RemotePipeline`): typed values, never pickled.
WIRE_CODEC = "codec"


class Submit(_Msg, frozen=True, tag="submit"):
    """A remote client's request: the source's input, as ``wire`` says."""

    #: The client's own number for the request (from 1), echoed in every answer.
    token: int
    #: The codec's header (:data:`WIRE_CODEC`, the only form so far).
    input: bytes
    wire: str = WIRE_CODEC
    #: The input's out-of-band buffers (tensor and array bytes).
    buffers: list[bytearray] = []
    #: Outputs the master may send before the client grants more (:class:`Grant`); 0
    #: for no limit (a client that reads everything at once, as ``submit`` did).
    window: int = 0


class Cancel(_Msg, frozen=True, tag="cancel"):
    """A remote client gives up its request ``token``: abort it everywhere."""

    token: int


class Hello(_Msg, frozen=True, tag="hello"):
    """A client connects, or checks that the master is still there: :class:`Welcome` answers.

    A master that takes no clients (a batch ``stagewire run``) answers with
    :class:`Finished` for ``token`` instead, saying so; a master still waiting for its
    workers answers nothing yet.
    """

    #: Echoed by a refusal; 0, which no request uses.
    token: int = 0


class Grant(_Msg, frozen=True, tag="grant"):
    """A remote client has read outputs of request ``token``: the master may send up to
    ``allowed`` in all (cumulative, so a repeated or late grant changes nothing)."""

    token: int
    allowed: int


class StatsAsk(_Msg, frozen=True, tag="stats_ask"):
    """A remote client asks for the pipeline's statistics, as ``Pipeline.statistics``
    gives them at the master (its client side and every replica's counters)."""

    token: int


#: What a remote client sends; the master hands it to its client server, if it has one.
FromClient = Submit | Cancel | Hello | Grant | StatsAsk

ControlToMaster = (
    Register
    | Ready
    | SetupFailed
    | Heartbeat
    | Failed
    | StatsReply
    | Submit
    | Cancel
    | Hello
    | Grant
    | StatsAsk
)


# ---- control plane: master -> worker ------------------------------------------------------


class Peer(msgspec.Struct, frozen=True, array_like=True):
    """Where one replica listens for data, and the host it runs on."""

    endpoint: str
    host: str
    #: Where it accepts same-host links (empty: ZMQ only); see ``pipeline._local_link``.
    local: str = ""
    #: Its process id on its host (0: unknown).
    pid: int = 0
    #: The pid namespace ``pid`` belongs to (0: unknown).
    pidns: int = 0


PeerTable = dict[str, dict[int, Peer]]


class Assignment(_Msg, frozen=True, tag="assign"):
    """What a registered worker serves: the whole spec and where its peers listen."""

    spec: dict[str, Any]
    stage: str
    replica: int
    client: Peer
    peers: PeerTable
    #: What the master's request messages carry when they come on the data path.
    token: bytes = b""


class Peers(_Msg, frozen=True, tag="peers"):
    """The data endpoints of every replica, resent whenever one changes."""

    peers: PeerTable


class Admit(_Msg, frozen=True, tag="admit"):
    """Expect a request; ``route`` names the replica chosen for every stage."""

    request_id: str
    route: dict[str, int]
    #: The pipeline's token (``Assignment.token``): on the data path, which anyone who can
    #: reach a data socket may write to, a request message without it is garbage.
    token: bytes = b""
    #: The data endpoint of each replica in ``route``: which incarnation of a replica
    #: slot the request was routed to, should the slot's replica die and restart.
    endpoints: dict[str, str] = msgspec.field(default_factory=dict)


class Abort(_Msg, frozen=True, tag="abort"):
    """Cancel a request and release everything held for it."""

    request_id: str
    reason: str
    token: bytes = b""


class Drop(_Msg, frozen=True, tag="drop"):
    """A request completed: forget everything held for it."""

    request_id: str
    token: bytes = b""


class Gone(_Msg, frozen=True, tag="gone"):
    """A request goes on without ``stage``, whose replica on its route died once every
    consumer of that replica had what it reads: send that stage nothing more of it."""

    request_id: str
    stage: str
    token: bytes = b""


class StatsRequest(_Msg, frozen=True, tag="stats?"):
    """Ask for statistics; the reply carries the same token."""

    token: int


#: The reason a master's ``Shutdown`` gives when the pipeline closes.
CLOSING = "pipeline closing"


class Shutdown(_Msg, frozen=True, tag="shutdown"):
    """Run teardown and exit."""

    reason: str = ""
    #: The master does not count this worker as serving (it declared it dead, or it is a
    #: master restarted since the worker registered): a worker started by hand registers
    #: again, its stage still set up; one a launcher started exits as one that lost its
    #: master.
    unknown: bool = False
    #: A registration refused because its slot's holder was heard from lately: it may
    #: have died just now (the newcomer restarted in its place), so registering again
    #: after this many seconds may succeed. 0: it will not.
    retry_in: float = 0.0


ControlToWorker = (
    Assignment | Peers | Admit | Abort | Drop | Gone | Heartbeat | StatsRequest | Shutdown
)


# ---- control plane: master -> remote client -----------------------------------------------


class Welcome(_Msg, frozen=True, tag="welcome"):
    """A master that serves clients answers :class:`Hello`: what it runs.

    Types are import paths (``module:QualName``), empty where there is none to give (``Any``,
    or a type that cannot be imported by name): the client decodes those untyped.
    """

    pipeline: str
    sources: list[str]
    sinks: list[str]
    #: The source stage's input type.
    source_type: str
    #: Each sink's output type.
    sink_types: dict[str, str]
    #: Random for each run of the master: a client that sees it change knows the master
    #: restarted, and that the requests it had in flight there are lost.
    instance: str
    #: The pipeline's ``request_timeout`` in seconds; 0 for none.
    request_timeout: float = 0.0


class Started(_Msg, frozen=True, tag="started"):
    """A remote client's request ``token`` was admitted as ``request_id``."""

    token: int
    request_id: str


class Output(_Msg, frozen=True, tag="output"):
    """One output chunk of a remote client's request, encoded by the sink's codec."""

    token: int
    #: The sink that produced it.
    stage: str
    #: The codec's header.
    value: bytes
    #: The value's out-of-band buffers.
    buffers: list[bytearray] = []


class Finished(_Msg, frozen=True, tag="finished"):
    """A remote client's request ended: completed (no ``error``) or failed."""

    token: int
    #: The exception's class name (``StageError``, ``PayloadError``, ...), or empty.
    kind: str = ""
    error: str = ""
    #: The error's fields, from which the client rebuilds the very exception (its stage,
    #: request id, traceback, ...); None where ``kind`` and ``error`` are all there is.
    failure: FailureInfo | None = None


class Alive(_Msg, frozen=True, tag="alive"):
    """The master checks that a client with requests in flight is still connected (a send
    to one that went away fails at once); for the client, a sign the master is there."""


class StatsAnswer(_Msg, frozen=True, tag="stats_answer"):
    """The answer to :class:`StatsAsk` ``token``."""

    token: int
    stats: dict[str, Any]


ControlToClient = Welcome | Started | Output | Finished | Alive | StatsAnswer


# ---- what a data socket accepts -----------------------------------------------------------

#: Stage to stage: chunks, credit and the producer's words about them (``Held``,
#: ``Spill``). Master to stage: the request messages too (``Admit``, ``Abort``, ``Drop``),
#: which the master sends on the data path so that they travel with (and before) a
#: request's first chunks instead of racing them on another socket.
DataMessage = Chunks | Credit | Held | Spill | Admit | Abort | Drop | Gone

_batch_decoder = msgspec.msgpack.Decoder(list[DataMessage])
