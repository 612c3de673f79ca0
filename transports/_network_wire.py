"""The network transport's wire: its descriptor, the messages between the ends, and frame plans.

A payload is a list of *pieces*: its header, then each out-of-band buffer. Both ends derive
the same *frame plan* from the pieces' sizes and the producer's segment size, so a frame
never needs to say what it holds beyond its position in the plan. A payload of at most
:data:`EXPRESS` bytes is one ``PACK`` frame; a larger one is cut into

- ``PACK``: small pieces (at most :data:`SMALL_PIECE` bytes) copied side by side, each at a
  64-byte aligned offset, into one frame of at most a segment;
- ``WHOLE``: one piece larger than that but no larger than a segment, as its own frame;
- ``SLICE``: a part of at most :data:`SLICE_MAX` bytes (or a segment, if smaller) of a piece
  larger than a segment.

The receiver keeps ``PACK`` and ``WHOLE`` frames as they arrive (zero-copy, writable) and
reassembles ``SLICE`` frames into one buffer per piece. Frames are what transfers take turns
with: the producer sends one frame of each pending transfer in turn, so a payload waits
behind at most a frame or two of a larger one, and express payloads wait for none.

Messages (all msgspec ``array_like`` Structs, never pickle):

- consumer to producer, one frame per message: :class:`Control` (fetches, drops, acks);
- producer to consumer: ``[Part, data]`` for a frame of a payload, or ``[Part]`` alone
  when the producer refuses a fetch (``status`` says why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

from pipeline._errors import ConfigError
from pipeline._units import parse_byte_size, parse_duration
from transports._protocol import Descriptor

__all__ = (
    "ALIGN",
    "EXPRESS",
    "MAX_PIECES",
    "MAX_SEGMENT",
    "MIN_SEGMENT",
    "PACK",
    "SLICE",
    "SLICE_MAX",
    "SMALL_PIECE",
    "TOKEN_BYTES",
    "WHOLE",
    "Control",
    "Fetch",
    "FramePlan",
    "NetworkDescriptor",
    "NetworkOptions",
    "Part",
    "Status",
    "check_endpoint",
    "frame_plan",
    "is_express",
)

#: Pieces at most this size are packed together; larger ones travel as frames of their own.
SMALL_PIECE: Final = 64 * 1024
#: Packed pieces start at multiples of this, so decoded arrays are aligned for SIMD loads.
ALIGN: Final = 64
#: The most pieces (header plus buffers) one payload may have.
MAX_PIECES: Final = 65_536
#: The bounds of the segment size: below 64 KiB per-frame overheads dominate, and above
#: 64 MiB a frame is as large as the payloads segmentation exists to interleave.
MIN_SEGMENT: Final = 64 * 1024
MAX_SEGMENT: Final = 64 * 2**20
TOKEN_BYTES: Final = 16
#: The largest slice of a piece above the segment size. Such pieces are reassembled by a
#: copy on the consumer's event loop, and small slices keep each copy (and so the longest
#: the loop is blocked) short; whole frames up to the segment size need no copy at all.
SLICE_MAX: Final = 2**20
#: A payload at most this large (packed) is *express*: it travels as one frame, which the
#: receiver fetches over a connection of its own that never carries bulk frames and the
#: producer sends as soon as it is asked, outside the turns and the window. So small
#: payloads never queue behind a large one, whatever the segment size.
EXPRESS: Final = 256 * 1024
#: The largest piece size a descriptor may name (2**48 bytes, 256 TiB): a bound that keeps
#: arithmetic on forged sizes cheap; real payloads are bounded by ``capacity`` anyway.
_MAX_SIZE: Final = 2**48

_PORT = r"(?:6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})"
_HOST = (
    r"(?:\[[0-9A-Fa-f:.]{2,45}\]"  # a bracketed IPv6 address
    r"|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)"  # an IPv4 address or a host name
)
#: ``tcp://HOST:PORT`` and nothing else: no wildcard, no source address, no other protocol.
ENDPOINT_PATTERN: Final = rf"^tcp://{_HOST}:{_PORT}$"
_ENDPOINT_RE = re.compile(ENDPOINT_PATTERN)

_Size = Annotated[int, msgspec.Meta(ge=0, le=_MAX_SIZE)]


class NetworkDescriptor(Descriptor, frozen=True, tag="network", array_like=True):
    """Where a payload waits to be fetched, and the sizes that say how it is cut into frames.

    Attributes:
        endpoint: the producer's ``tcp://HOST:PORT`` that serves it.
        token: the random name the producer holds it under.
        host: the producer's host identity (informational; the payload works anywhere).
        header: the size of the payload's header, in bytes.
        buffers: the size of each out-of-band buffer, in bytes.
        segment: the producer's segment size, which fixes the frame plan.
    """

    endpoint: Annotated[str, msgspec.Meta(max_length=300, pattern=ENDPOINT_PATTERN)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    host: Annotated[str, msgspec.Meta(max_length=256)]
    header: _Size
    buffers: Annotated[list[_Size], msgspec.Meta(max_length=MAX_PIECES - 1)]
    segment: Annotated[int, msgspec.Meta(ge=MIN_SEGMENT, le=MAX_SEGMENT)]

    @property
    def sizes(self) -> list[int]:
        """Every piece's size: the header's, then each buffer's."""
        return [self.header, *self.buffers]


def check_endpoint(endpoint: object) -> str | None:
    """Why ``endpoint`` is not a ``tcp://HOST:PORT`` a receiver may connect to, or ``None``."""
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        return f"endpoint {endpoint!r} is not a string of at most 300 characters"
    if _ENDPOINT_RE.fullmatch(endpoint) is None:
        return f"endpoint {endpoint!r} is not tcp://HOST:PORT"
    return None


def check_descriptor(desc: NetworkDescriptor) -> str | None:
    """Why ``desc`` breaks the constraints decoding enforces, or ``None``.

    Decoding checks them already, but a descriptor built in Python skips that, so ``get``
    checks again before it connects or allocates anything.
    """
    problem = check_endpoint(desc.endpoint)
    if problem is not None:
        return problem
    if not isinstance(desc.token, bytes) or len(desc.token) != TOKEN_BYTES:
        return f"the token is not {TOKEN_BYTES} bytes"
    if not isinstance(desc.segment, int) or not MIN_SEGMENT <= desc.segment <= MAX_SEGMENT:
        return f"segment size {desc.segment!r} is outside [{MIN_SEGMENT}, {MAX_SEGMENT}]"
    if not isinstance(desc.buffers, list | tuple) or len(desc.buffers) >= MAX_PIECES:
        return f"the buffer list is not a list of fewer than {MAX_PIECES} sizes"
    for size in desc.sizes:
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= _MAX_SIZE:
            return f"size {size!r} is not a byte count"
    return None


class Fetch(msgspec.Struct, frozen=True, array_like=True):
    """Ask for a payload; its frames come back tagged with ``xid``.

    ``sizes`` repeats the descriptor's, so the producer refuses a descriptor whose sizes were
    changed instead of sending frames the receiver would reject one by one.
    """

    xid: int
    token: bytes
    sizes: list[int]


class Control(msgspec.Struct, frozen=True, array_like=True):
    """Everything one receiver has to tell one producer, batched into one message.

    Attributes:
        fetch: payloads to send.
        drop: tokens to forget without sending (released, never fetched, or abandoned).
        ack: data messages consumed since the last ack; each returns its bytes to the
            producer's window for this receiver, and proves ZMQ is done with its buffer.
    """

    fetch: list[Fetch] = []
    drop: list[bytes] = []
    ack: int = 0


class Status:
    """Why a producer answered a fetch with :class:`Part` alone."""

    OK: Final = 0
    #: The token is not held: released, already sent, or never stored here.
    UNKNOWN: Final = 1
    #: The sizes of the fetch differ from those of the stored payload.
    MISMATCH: Final = 2
    #: The token is being sent already, to this or another receiver.
    BUSY: Final = 3

    REASONS: Final = {
        UNKNOWN: "the producer does not hold it (stale descriptor: released, already fetched,"
        " or never stored there)",
        MISMATCH: "its sizes differ from those of the payload stored under its token"
        " (forged or corrupted descriptor)",
        BUSY: "it is being sent already (stale descriptor: fetched twice)",
    }


class Part(msgspec.Struct, frozen=True, array_like=True):
    """The first frame of every producer message: which fetch, which frame of its plan."""

    xid: int
    index: int
    status: int = Status.OK


#: Frame kinds of a plan.
PACK: Final = 0
WHOLE: Final = 1
SLICE: Final = 2


@dataclass(frozen=True, slots=True)
class FramePlan:
    """One frame of a payload.

    Attributes:
        kind: ``PACK``, ``WHOLE`` or ``SLICE``.
        length: the frame's size in bytes.
        piece: for ``WHOLE`` and ``SLICE``, the piece it carries.
        offset: for ``SLICE``, where in the piece it starts.
        members: for ``PACK``, ``(piece, offset in the frame)`` of every packed piece.
    """

    kind: int
    length: int
    piece: int = -1
    offset: int = 0
    members: tuple[tuple[int, int], ...] = ()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def frame_plan(sizes: list[int], segment: int) -> list[FramePlan]:
    """The frames that carry pieces of ``sizes`` with segments of ``segment`` bytes.

    A payload that fits :data:`EXPRESS` bytes when packed is one ``PACK`` frame. Otherwise
    the small pieces are packed first (in order), then every larger piece follows in order,
    whole or in slices.
    """
    packed = _pack(list(enumerate(sizes)), EXPRESS)
    if len(packed) == 1 and packed[0].length <= EXPRESS:
        return packed
    frames = _pack(
        [(piece, size) for piece, size in enumerate(sizes) if size <= SMALL_PIECE], segment
    )
    step = min(segment, SLICE_MAX)
    for piece, size in enumerate(sizes):
        if size <= SMALL_PIECE:
            continue
        if size <= segment:
            frames.append(FramePlan(WHOLE, size, piece))
            continue
        for offset in range(0, size, step):
            frames.append(FramePlan(SLICE, min(step, size - offset), piece, offset))
    return frames


def _pack(pieces: list[tuple[int, int]], limit: int) -> list[FramePlan]:
    """``PACK`` frames of at most ``limit`` bytes holding ``pieces`` (index, size) in order;
    a piece larger than ``limit`` gets a frame of its own."""
    frames: list[FramePlan] = []
    members: list[tuple[int, int]] = []
    used = 0
    for piece, size in pieces:
        start = _align(used) if members else 0
        if members and start + size > limit:
            frames.append(FramePlan(PACK, used, members=tuple(members)))
            members, start = [], 0
        members.append((piece, start))
        used = start + size
    if members:
        frames.append(FramePlan(PACK, used, members=tuple(members)))
    return frames


def is_express(plan: list[FramePlan]) -> bool:
    """Whether a payload of this plan travels on the express connection."""
    return len(plan) == 1 and plan[0].kind == PACK and plan[0].length <= EXPRESS


@dataclass(frozen=True, slots=True)
class NetworkOptions:
    """The network transport's options, parsed and checked.

    Attributes:
        capacity: bytes a sender holds unfetched before ``put`` waits.
        fetch_timeout: seconds a ``get`` waits without any data arriving before it fails,
            and a sender waits for a receiver's acknowledgement before abandoning it.
        segment_size: the largest frame a sender sends, and so the largest buffer that
            arrives without a copy; larger buffers go in slices of at most 1 MiB.
        window: bytes a sender has in flight to one receiver before it waits for acks.
        copy_on_put: copy pieces that may change after ``put`` (tensors, bytearrays); when
            false, large pieces are sent by reference too (small ones are still packed, a
            copy), and the producer must never modify a payload after putting it.
    """

    capacity: int = 2**30
    fetch_timeout: float = 30.0
    segment_size: int = 16 * 2**20
    window: int = 32 * 2**20
    copy_on_put: bool = True

    @classmethod
    def parse(
        cls,
        capacity: object = "1GiB",
        fetch_timeout: object = 30.0,
        segment_size: object = "16MiB",
        window: object = "32MiB",
        copy_on_put: object = True,
    ) -> NetworkOptions:
        """Check and convert options as they come from YAML.

        Raises:
            ConfigError: an option is not a size, duration or boolean, or is out of range.
        """
        try:
            cap = parse_byte_size(capacity)
            seg = parse_byte_size(segment_size)
            win = parse_byte_size(window)
            timeout = parse_duration(fetch_timeout)
        except ValueError as exc:  # PydanticCustomError is a ValueError.
            raise ConfigError(f"network transport: {exc}") from exc
        if cap < 1:
            raise ConfigError(f"network transport: capacity must be positive, got {capacity!r}")
        if not timeout > 0:
            raise ConfigError(
                f"network transport: fetch_timeout must be positive, got {fetch_timeout!r}"
            )
        if not MIN_SEGMENT <= seg <= MAX_SEGMENT:
            raise ConfigError(
                f"network transport: segment_size must lie in [64KiB, 64MiB], got {segment_size!r}"
            )
        if win < seg:
            raise ConfigError(
                f"network transport: window ({window!r}) must hold at least one segment "
                f"({segment_size!r})"
            )
        if not isinstance(copy_on_put, bool):
            raise ConfigError(
                f"network transport: copy_on_put must be true or false, got {copy_on_put!r}"
            )
        return cls(cap, timeout, seg, win, copy_on_put)
