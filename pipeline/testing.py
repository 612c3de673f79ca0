"""The transport conformance suite: one definition of "a transport", public so plug-ins run it.

Subclass :class:`TransportConformance` in a test module and provide a ``transport`` fixture::

    import pytest
    from pipeline.testing import TransportConformance
    from transports import Transport

    class TestMyTransport(TransportConformance):
        @pytest.fixture
        def transport(self) -> Transport:
            return MyTransport(capacity=4 * 2**20)

Every test opens one sender and one receiver for ``EdgeContext(edge="a->b", host=...)``
(override the ``edge_context`` fixture to pass options), moves payloads the way the runtime
does (codec, ``put``, the descriptor inside an envelope, ``decode_descriptor``, ``get``,
decode, ``release``), and reads ``transport.capabilities`` to decide what to expect:

- ``bounded``: the suite fills the transport with chunks of :attr:`fill_chunk_bytes` until
  a put times out, so build it small (a few MiB; at least 2 MiB, since one round-trip payload
  holds a 1 MiB tensor);
- ``detects_stale``: a released descriptor must be refused rather than read;
- ``host_local``: a descriptor used by a receiver on another host must be refused.
- ``survives_producer``: a payload got must stay whole after its sender closes.

Every edge crosses a process boundary, so one test puts payloads from a sender in a freshly
spawned interpreter, which re-creates the transport from a :class:`TransportRecipe`: the
name and options :func:`transports.create_transport` takes, as a worker does. The
``transport_recipe`` fixture finds one from the transport's class and attributes; override
it when that cannot work (the test then skips and says so)::

    class TestMyTransport(TransportConformance):
        @pytest.fixture
        def transport_recipe(self, tmp_path) -> TransportRecipe:
            return TransportRecipe("mypkg.mod:MyTransport", {"directory": str(tmp_path)})

        @pytest.fixture
        def transport(self, transport_recipe) -> Transport:
            return create_transport(transport_recipe.name, transport_recipe.options)

A producer may overwrite its buffers once ``put`` returns, and the suite checks that the
consumer still gets what was put; set :attr:`TransportConformance.borrows_buffers` for a
transport configured to borrow them instead (network with ``copy_on_put: false``).

Randomised tests print their seed; set ``STAGEWIRE_CONFORMANCE_SEED`` to replay one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar, TypeVar

import msgspec
import pytest
import pytest_asyncio
import torch

from pipeline._codec import codec_for
from pipeline._encoded import Encoded
from pipeline._errors import ConfigError, TransportError
from pipeline._host import host_identity
from pipeline._keys import ChunkKey
from transports._protocol import (
    Descriptor,
    EdgeContext,
    Transport,
    TransportCapabilities,
    TransportReceiver,
    TransportSender,
    TransportStatistics,
)
from transports._registry import create_transport

__all__ = ("CPU_DTYPES", "TransportConformance", "TransportRecipe")

T = TypeVar("T")

#: The deadline of any single step that must not block; passing it fails the test as a hang.
_STEP = 10.0
#: The deadline of a spawned producer's first answer: a fresh interpreter imports torch.
_SPAWN = 60.0
_EDGE = "a->b"
_WRONG_TAG = "stagewire-conformance-wrong-tag"
_keys = itertools.count()


def _cpu_dtypes() -> tuple[torch.dtype, ...]:
    """Every dtype of which a strided, non-quantized CPU tensor can be made and copied."""
    found: dict[torch.dtype, None] = {}
    for value in vars(torch).values():
        if not isinstance(value, torch.dtype) or value in found:
            continue
        with warnings.catch_warnings():
            # complex32 warns that it is experimental when allocated; this is only a probe.
            warnings.simplefilter("ignore")
            try:
                probe = torch.empty((2, 3), dtype=value)
                if probe.is_quantized:
                    continue
                probe.t().contiguous()
            except RuntimeError:  # Also NotImplementedError: sub-byte dtypes cannot be copied.
                continue
        found[value] = None
    return tuple(sorted(found, key=str))


#: The dtypes whose round trip the suite checks.
CPU_DTYPES = _cpu_dtypes()


class _Tensors(msgspec.Struct):
    """A payload of tensors, as a stage would send."""

    label: str
    tensors: list[torch.Tensor]


class _Blobs(msgspec.Struct):
    """A payload of plain bytes, which travel in the header."""

    label: str
    data: bytes
    parts: list[bytes]


class _Envelope(msgspec.Struct, array_like=True):
    """The part of a chunk envelope that carries a descriptor."""

    key: ChunkKey
    descriptor: msgspec.Raw


class _Foreign(Descriptor, frozen=True, tag="stagewire-conformance-foreign"):
    """A descriptor of no transport under test."""

    where: str = "nowhere"


class _ForeignArray(Descriptor, frozen=True, tag="stagewire-conformance-array", array_like=True):
    """An array-like descriptor of no transport under test, shaped like an inline one."""

    header: bytes = b""
    buffers: tuple[bytes, ...] = ()


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def _seeded(what: str) -> random.Random:
    """A random generator for ``what``, its seed printed so that a failure can be replayed."""
    seed = int(os.environ.get("STAGEWIRE_CONFORMANCE_SEED") or random.randrange(2**32))
    print(f"{what}: seed {seed} (set STAGEWIRE_CONFORMANCE_SEED={seed} to replay)")
    return random.Random(seed)


def _key(request_id: str = "conformance", seq: int | None = None) -> ChunkKey:
    """A chunk key on the suite's edge, unique unless ``seq`` is given."""
    return ChunkKey(request_id, _EDGE, next(_keys) if seq is None else seq)


def _pattern(index: int, size: int) -> bytes:
    """``size`` bytes that differ for every ``index``."""
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


def _blob(index: int, size: int) -> Encoded:
    """A raw payload of one ``size``-byte buffer, distinct for every ``index``."""
    return Encoded(f"blob {index}".encode(), (_pattern(index, size),))


def _raw(encoded: Encoded) -> tuple[bytes, list[bytes]]:
    """The bytes of an encoded payload, for comparison."""
    return bytes(encoded.header), [bytes(memoryview(b)) for b in encoded.buffers]


def _random_tensor(
    dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator
) -> torch.Tensor:
    """A tensor of random bits (valid bools for bool), so NaN patterns and padding travel too."""
    raw = torch.randint(
        0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen
    )
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _tensor_cases(dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` in every layout the codec must carry."""
    make = functools.partial(_random_tensor, dtype, gen=gen)
    return {
        "0-d": make(()),
        "empty": make((0,)),
        "empty 3-d": make((3, 0, 2)),
        "vector": make((7,)),
        "matrix": make((4, 5)),
        "3-d": make((2, 3, 4)),
        "transposed": make((6, 4)).t(),
        "strided": make((4, 9))[:, ::3],
        "offset view": make((10,))[3:],
        "broadcast": make((1, 3)).expand(4, 3),
        "1 MiB": make((2**20 // dtype.itemsize,)),
    }


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in order, for a bitwise comparison."""
    flat = (torch.view_as_real(t) if t.is_complex() else t).contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _assert_same_tensor(got: object, want: torch.Tensor, what: str) -> None:
    """Fail unless ``got`` is a tensor of ``want``'s dtype, shape, device and bits."""
    assert isinstance(got, torch.Tensor), f"{what}: got a {type(got).__name__}"
    assert (got.dtype, tuple(got.shape), got.device) == (want.dtype, tuple(want.shape), want.device)
    assert _tensor_bytes(got) == _tensor_bytes(want), f"{what}: the bytes differ"


async def _within(aw: Awaitable[T], what: str, seconds: float = _STEP) -> T:
    """Await ``aw``, failing the test as a hang if it takes longer than ``seconds``."""
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            return await aw
    except TimeoutError:
        if deadline.expired():
            pytest.fail(f"{what} did not finish within {seconds:g}s")
        raise


async def _let_run() -> None:
    """Yield to the loop many times, so a started task reaches the point where it waits."""
    for _ in range(50):
        await asyncio.sleep(0)  # A scheduling point, not a delay.


def _check_descriptor(desc: object) -> None:
    """Fail unless ``desc`` is a tagged descriptor Struct."""
    assert isinstance(desc, Descriptor), f"put returned a {type(desc).__name__}, not a Descriptor"
    assert type(desc).__struct_config__.tag is not None, "descriptors must be tagged Structs"


def _through_envelope(receiver: TransportReceiver, key: ChunkKey, desc: Descriptor) -> Descriptor:
    """Send ``desc`` inside an envelope and parse it back at the receiver, as the runtime does."""
    wire = _envelope_encoder.encode(_Envelope(key, msgspec.Raw(msgspec.msgpack.encode(desc))))
    parsed = receiver.decode_descriptor(memoryview(_envelope_decoder.decode(wire).descriptor))
    assert parsed == desc, f"descriptor {desc!r} came back from the wire as {parsed!r}"
    return parsed


async def _put(sender: TransportSender, key: ChunkKey, encoded: Encoded) -> Descriptor:
    """Put ``encoded``, expecting the transport to have room, and check the descriptor."""
    desc = await _within(sender.put(key, encoded, timeout=_STEP), f"put of {key}")
    _check_descriptor(desc)
    return desc


async def _carry(
    sender: TransportSender, receiver: TransportReceiver, key: ChunkKey, encoded: Encoded
) -> tuple[Descriptor, Encoded]:
    """Put ``encoded``, carry its descriptor in an envelope, and get the payload back."""
    desc = _through_envelope(receiver, key, await _put(sender, key, encoded))
    return desc, await _within(receiver.get(desc), f"get of {key}")


async def _release_all(receiver: TransportReceiver, descs: list[Descriptor]) -> None:
    """Release every descriptor in ``descs``."""
    for desc in descs:
        await _within(receiver.release(desc), "release")


def _invalid_utf8_tag(desc: Descriptor) -> bytes:
    """``desc`` on the wire with its tag's characters replaced by bytes that are not UTF-8.

    msgspec raises ``UnicodeDecodeError``, not ``DecodeError``, for such strings (msgspec
    issue #714), so a transport must catch both.
    """
    tag = type(desc).__struct_config__.tag
    valid = msgspec.msgpack.encode(desc)
    if not isinstance(tag, str) or not tag:
        return b"\xa2\xd0\xfe"  # A bare two-byte string that is not UTF-8.
    encoded_tag = msgspec.msgpack.encode(tag)
    prefix = encoded_tag[: len(encoded_tag) - len(tag.encode())]
    return valid.replace(encoded_tag, prefix + b"\xff" * len(tag.encode()), 1)


def _retagged(desc: Descriptor) -> bytes:
    """``desc`` on the wire with its tag replaced by one no transport uses."""
    obj = msgspec.to_builtins(desc, builtin_types=(bytes, bytearray, memoryview))
    if isinstance(obj, list) and obj:
        obj[0] = _WRONG_TAG
    elif isinstance(obj, dict):
        obj[type(desc).__struct_config__.tag_field or "t"] = _WRONG_TAG
    return msgspec.msgpack.encode(obj)


@dataclass(frozen=True, slots=True)
class TransportRecipe:
    """How another process builds the transport under test, as a worker builds an edge's:
    what :func:`transports.create_transport` takes.

    Attributes:
        name: a built-in name, an entry-point name, or a ``module:Class`` import path that a
            fresh interpreter with this process's ``sys.path`` can import.
        options: the transport's options, of types that JSON carries.
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)


def _state(obj: object) -> dict[str, Any] | None:
    """The instance attributes of ``obj``, or None if it keeps them in slots."""
    attributes = getattr(obj, "__dict__", None)
    return None if attributes is None else dict(attributes)


def _recipe_for(transport: Transport) -> TransportRecipe | None:
    """A recipe that rebuilds ``transport``, or None if none is found.

    The name is the class's import path. The options tried are none, the transport's
    attributes, and the fields of its ``options`` attribute, each through JSON as a child
    gets them; the first that builds a transport of the same class with equal attributes
    wins, so a recipe is never a guess.
    """
    cls = type(transport)
    state = _state(transport)
    if state is None:
        return None
    name = f"{cls.__module__}:{cls.__qualname__}"
    for candidate in ({}, state, state.get("options")):
        try:
            options = msgspec.json.decode(msgspec.json.encode(candidate))
            if not isinstance(options, dict):
                continue
            rebuilt = create_transport(name, options)
        except (ConfigError, TypeError, ValueError, msgspec.MsgspecError):
            continue
        if type(rebuilt) is cls and _state(rebuilt) == state:
            return TransportRecipe(name, options)
    return None


class _ProducerOrder(msgspec.Struct, frozen=True):
    """What a spawned producer reads on its stdin: the transport's recipe and the edge."""

    transport: str
    options: dict[str, Any]
    edge: str
    host: str
    edge_options: dict[str, Any]
    inline_threshold: int
    bind_host: str


def _cross_process_payloads() -> list[Encoded]:
    """What the spawned producer puts: a tiny and a larger raw payload, and two tensors."""
    tensors = [torch.arange(2**16, dtype=torch.int64), torch.full((3, 5), 2.5).bfloat16()]
    return [
        _blob(1, 16),
        _blob(2, 64 * 1024),
        codec_for(_Tensors).encode(_Tensors("from another process", tensors)),
    ]


def _produce() -> None:
    """A spawned producer's entry point (see :func:`_spawned_producer`).

    It reads a :class:`_ProducerOrder` as JSON from stdin, puts each of
    :func:`_cross_process_payloads` and prints its descriptor (msgpack, in hex), keeps its
    sender open, as a live producer does, until the next line of stdin, then closes the
    sender and prints its statistics as JSON. Nothing else may reach stdout.
    """
    replies, sys.stdout = sys.stdout, sys.stderr
    order = msgspec.json.decode(sys.stdin.buffer.readline(), type=_ProducerOrder)

    def reply(line: bytes) -> None:
        replies.buffer.write(line + b"\n")
        replies.flush()

    async def serve() -> None:
        transport = create_transport(order.transport, order.options)
        edge = EdgeContext(
            order.edge, order.host, order.edge_options, order.inline_threshold, order.bind_host
        )
        sender = transport.open_sender(edge)
        try:
            for i, payload in enumerate(_cross_process_payloads()):
                desc = await sender.put(_key("cross-process", i), payload, timeout=_STEP)
                reply(msgspec.msgpack.encode(desc).hex().encode())
            await asyncio.to_thread(sys.stdin.buffer.readline)
            stats = sender.statistics()
        finally:
            await sender.aclose()
        reply(msgspec.json.encode(stats))

    asyncio.run(serve())


class _Producer:
    """A spawned producer process, from the consumer's side."""

    def __init__(self, proc: asyncio.subprocess.Process, errors: IO[bytes]) -> None:
        self.proc = proc
        self._errors = errors

    def stderr(self) -> str:
        """The end of what the producer wrote to stderr."""
        self._errors.seek(0)
        return self._errors.read()[-4000:].decode(errors="replace")

    async def tell(self, line: bytes) -> None:
        """Write one line to the producer's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        await _within(self.proc.stdin.drain(), "a write to the producer process")

    async def line(self, what: str, seconds: float = _STEP) -> bytes:
        """The producer's next line, ``what``; fails the test, with its stderr, if it ends."""
        assert self.proc.stdout is not None
        line = await _within(self.proc.stdout.readline(), f"the producer process's {what}", seconds)
        if not line:
            status = await _within(self.proc.wait(), "the producer process's exit")
            pytest.fail(
                f"the producer process exited with status {status} before its {what}:\n"
                + self.stderr()
            )
        return line.rstrip(b"\n")

    async def finish(self) -> TransportStatistics:
        """Let the producer close its sender and exit; its sender's last statistics."""
        await self.tell(b"close")
        stats = msgspec.json.decode(await self.line("statistics"), type=TransportStatistics)
        status = await _within(self.proc.wait(), "the producer process's exit")
        assert status == 0, f"the producer process exited with status {status}:\n{self.stderr()}"
        return stats


@contextlib.asynccontextmanager
async def _spawned_producer(order: bytes) -> AsyncIterator[_Producer]:
    """A fresh interpreter, as the spawn start method makes (nothing inherited but the
    environment and this ``sys.path``), running :func:`_produce` on ``order``; killed if still
    running on the way out, and always reaped."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with tempfile.TemporaryFile() as errors:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from pipeline.testing import _produce; _produce()",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env=env,
            # An inline descriptor holds its payload, and so makes a long line.
            limit=2**24,
        )
        try:
            producer = _Producer(proc, errors)
            await producer.tell(order)
            yield producer
        finally:
            if proc.returncode is None:
                proc.kill()
            assert proc.stdin is not None
            proc.stdin.close()
            await _within(proc.wait(), "the producer process's exit")


async def _eventually(probe: Callable[[], bool], seconds: float = _STEP) -> bool:
    """Whether ``probe`` comes true within ``seconds``, looking again at each turn of the loop.

    A release may reach the sender's bookkeeping through a socket or another thread, which
    announces nothing this side could wait on, so the loop runs until it shows.
    """
    deadline = time.monotonic() + seconds
    while not probe():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0)  # A scheduling point, not a delay.
    return True


class TransportConformance:
    """What every transport must do; subclass it and provide a ``transport`` fixture.

    Attributes:
        fill_chunk_bytes: the buffer size of the chunks that fill a bounded transport.
        max_fill_chunks: chunks put before concluding that a bounded transport never fills.
        exhaust_timeout: the deadline of a put into a full transport.
        max_overrun: how long past its deadline such a put may take to give up, and how
            long a blocked put may take to notice ``aclose``: a second, room enough for a
            loaded two-core machine, and far less than ignoring the deadline takes.
        churn_rounds: put/get/release cycles run to tempt a transport into reusing space.
        borrows_buffers: the transport under test is configured to keep references to the
            producer's buffers rather than copy or own them at ``put`` (network with
            ``copy_on_put: false``), so its producer promises never to modify a payload
            once put, and the suite skips checking that it may.
    """

    fill_chunk_bytes: ClassVar[int] = 64 * 1024
    max_fill_chunks: ClassVar[int] = 4096
    exhaust_timeout: ClassVar[float] = 0.2
    max_overrun: ClassVar[float] = 1.0
    churn_rounds: ClassVar[int] = 64
    borrows_buffers: ClassVar[bool] = False

    @pytest.fixture
    def transport(self) -> Transport:
        """The transport under test; subclasses must override this fixture."""
        raise NotImplementedError("a TransportConformance subclass must define `transport`")

    @pytest.fixture
    def transport_recipe(self, transport: Transport) -> TransportRecipe | None:
        """How a spawned process re-creates the transport under test, found from its class
        and attributes, or None (the cross-process test then skips); override it to name
        the transport's import path and options outright."""
        return _recipe_for(transport)

    @pytest.fixture
    def edge_context(self) -> EdgeContext:
        """The edge both ends are opened for."""
        return EdgeContext(edge=_EDGE, host=host_identity())

    @pytest_asyncio.fixture
    async def sender(
        self, transport: Transport, edge_context: EdgeContext
    ) -> AsyncIterator[TransportSender]:
        """The producer's end, closed after the test."""
        end = transport.open_sender(edge_context)
        try:
            yield end
        finally:
            await _within(end.aclose(), "sender aclose")

    @pytest_asyncio.fixture
    async def receiver(
        self, transport: Transport, edge_context: EdgeContext
    ) -> AsyncIterator[TransportReceiver]:
        """The consumer's end, closed after the test."""
        end = transport.open_receiver(edge_context)
        try:
            yield end
        finally:
            await _within(end.aclose(), "receiver aclose")

    def _check_gave_up_at_deadline(self, elapsed: float) -> None:
        """Fail unless a put that timed out waited for its deadline, and not much longer."""
        deadline = self.exhaust_timeout
        what = f"a put with a {deadline:g}s deadline into a full transport gave up"
        assert elapsed >= 0.9 * deadline, f"{what} after {elapsed:.3f}s, before its deadline"
        assert elapsed <= deadline + self.max_overrun, (
            f"{what} after {elapsed:.3f}s, more than {self.max_overrun:g}s past its deadline:"
            " put must honour its timeout"
        )

    async def _fill(self, sender: TransportSender) -> tuple[list[Descriptor], float]:
        """Put chunks without releasing until a put times out, which it must do at its
        deadline; the puts held and the wait of the one that timed out."""
        held: list[Descriptor] = []
        what = f"a put with a {self.exhaust_timeout:g}s deadline"
        for i in range(self.max_fill_chunks):
            start = time.monotonic()
            put = sender.put(_key(), _blob(i, self.fill_chunk_bytes), timeout=self.exhaust_timeout)
            try:
                held.append(await _within(put, what, self.exhaust_timeout + _STEP))
            except TransportError:
                assert held, f"a bounded transport must hold one {self.fill_chunk_bytes}-byte chunk"
                waited = time.monotonic() - start
                self._check_gave_up_at_deadline(waited)
                return held, waited
        pytest.fail(
            f"a bounded transport took {self.max_fill_chunks} chunks of {self.fill_chunk_bytes}"
            " bytes without filling; build it with less capacity in the fixture"
        )

    def test_implements_the_protocols(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """The transport and both of its ends satisfy the runtime-checkable Protocols."""
        assert isinstance(transport, Transport)
        assert isinstance(transport.name, str)
        assert transport.name
        assert isinstance(transport.capabilities, TransportCapabilities)
        assert isinstance(sender, TransportSender)
        assert isinstance(receiver, TransportReceiver)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("dtype", CPU_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
    async def test_tensor_round_trip(
        self, sender: TransportSender, receiver: TransportReceiver, dtype: torch.dtype
    ) -> None:
        """Tensors of every CPU dtype and layout arrive bit for bit, and outlive release."""
        gen = torch.Generator().manual_seed(_seeded(f"tensors of {dtype}").randrange(2**63))
        cases = _tensor_cases(dtype, gen)
        codec = codec_for(_Tensors)
        desc, got = await _carry(
            sender, receiver, _key(), codec.encode(_Tensors(str(dtype), [*cases.values()]))
        )
        value = codec.decode(got)
        # The runtime releases right after decoding, so decoded tensors must not depend on
        # what release frees.
        await _within(receiver.release(desc), "release")
        assert value.label == str(dtype)
        assert len(value.tensors) == len(cases)
        for (name, want), tensor in zip(cases.items(), value.tensors, strict=True):
            _assert_same_tensor(tensor, want, f"{dtype} {name}")

    @pytest.mark.asyncio
    async def test_raw_bytes_round_trip(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Bytes payloads, and raw encodings with every kind of buffer, arrive unchanged."""
        rng = _seeded("raw bytes")
        big = bytearray(rng.randbytes(2**20))
        encodings = [
            Encoded(b""),
            Encoded(b"\x00"),
            Encoded(rng.randbytes(10_000)),
            Encoded(b"h", (b"", b"", b"")),
            Encoded(b"mixed", (b"one", bytearray(b"two" * 100), memoryview(big), b"")),
        ]
        blobs = _Blobs("blobs", rng.randbytes(50_000), [b"", b"\x00" * 7, rng.randbytes(3)])
        encodings.append(codec_for(_Blobs).encode(blobs))
        for i, encoded in enumerate(encodings):
            desc, got = await _carry(sender, receiver, _key(), encoded)
            assert _raw(got) == _raw(encoded), f"raw payload {i} changed in transit"
            if i == len(encodings) - 1:
                assert codec_for(_Blobs).decode(got) == blobs
            await _within(receiver.release(desc), "release")

    @pytest.mark.asyncio
    async def test_out_of_order_put_and_get(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Twenty chunks put concurrently in one order and got in another are each intact."""
        rng = _seeded("out of order")
        request = f"ooo-{rng.randrange(10**6)}"
        codec = codec_for(_Tensors)
        payloads = [
            _Tensors(f"chunk {i}", [torch.full((256,), i, dtype=torch.int32)]) for i in range(20)
        ]
        put_order = rng.sample(range(20), 20)
        puts = [_put(sender, _key(request, i), codec.encode(payloads[i])) for i in put_order]
        descs = dict(zip(put_order, await asyncio.gather(*puts), strict=True))
        for i in rng.sample(range(20), 20):
            desc = _through_envelope(receiver, _key(request, i), descs[i])
            value = codec.decode(await _within(receiver.get(desc), f"get of chunk {i}"))
            assert value.label == f"chunk {i}", f"chunk {i} came back as {value.label!r}"
            _assert_same_tensor(value.tensors[0], payloads[i].tensors[0], f"chunk {i}")
        await _release_all(receiver, [descs[i] for i in rng.sample(range(20), 20)])

    @pytest.mark.asyncio
    async def test_release_and_reuse(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Many times the capacity passes through when each chunk is released, and a payload
        still held meanwhile is never overwritten."""
        rounds = 200
        if transport.capabilities.bounded:
            held, _ = await self._fill(sender)
            await _release_all(receiver, held)
            rounds = max(rounds, 4 * len(held))
        pinned_payload = _blob(10**6, self.fill_chunk_bytes)
        pinned, pinned_got = await _carry(sender, receiver, _key(), pinned_payload)
        for r in range(rounds):
            payload = _blob(r, self.fill_chunk_bytes)
            desc, got = await _carry(sender, receiver, _key(), payload)
            assert _raw(got) == _raw(payload), f"round {r} of {rounds} came back changed"
            await _within(receiver.release(desc), "release")
        assert _raw(pinned_got) == _raw(pinned_payload), "a payload not yet released changed"
        await _within(receiver.release(pinned), "release")

    @pytest.mark.asyncio
    async def test_decoded_tensor_outlives_release(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """A tensor decoded before release keeps its values while the space is reused."""
        codec = codec_for(_Tensors)
        want = torch.arange(self.fill_chunk_bytes // 8, dtype=torch.int64)
        desc, got = await _carry(sender, receiver, _key(), codec.encode(_Tensors("kept", [want])))
        kept = codec.decode(got).tensors[0]
        await _within(receiver.release(desc), "release")
        for r in range(self.churn_rounds):
            churn, _ = await _carry(sender, receiver, _key(), _blob(r, self.fill_chunk_bytes))
            await _within(receiver.release(churn), "release")
        _assert_same_tensor(kept, want, "a tensor decoded before release")

    @pytest.mark.asyncio
    async def test_a_payload_got_outlives_its_sender(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """With ``survives_producer``, what ``get`` returned stays whole once its sender has
        closed (all a dying producer's end can do to it), and its release then raises
        nothing; a received descriptor not yet got may fail, but only with TransportError."""
        if not transport.capabilities.survives_producer:
            pytest.skip("the transport does not declare survives_producer")
        codec = codec_for(_Tensors)
        want = torch.arange(self.fill_chunk_bytes // 8, dtype=torch.int64)
        raw = _blob(3, self.fill_chunk_bytes)
        desc, got = await _carry(sender, receiver, _key(), codec.encode(_Tensors("kept", [want])))
        raw_desc, raw_got = await _carry(sender, receiver, _key(), raw)
        late_key = _key()
        late = _through_envelope(receiver, late_key, await _put(sender, late_key, raw))
        kept = codec.decode(got).tensors[0]
        await _within(sender.aclose(), "sender aclose")
        _assert_same_tensor(kept, want, "a tensor got before its sender closed")
        assert _raw(raw_got) == _raw(raw), "a payload got before its sender closed changed"
        await _release_all(receiver, [desc, raw_desc])
        try:
            late_got = await _within(receiver.get(late), "get of a payload whose sender closed")
        except TransportError:
            pass
        else:
            assert _raw(late_got) == _raw(raw), "a payload whose sender closed read changed"
        await _within(receiver.release(late), "release of a payload whose sender closed")

    @pytest.mark.asyncio
    async def test_stale_descriptor(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """A released descriptor is refused if the transport detects staleness, and otherwise
        still reads its own bytes, never newer data."""
        payload = _blob(7, self.fill_chunk_bytes)
        desc, _ = await _carry(sender, receiver, _key(), payload)
        await _within(receiver.release(desc), "release")
        await _within(receiver.release(desc), "a second release of one descriptor")
        for phase in ("just after release", "after the space was reused"):
            if transport.capabilities.detects_stale:
                with pytest.raises(TransportError):
                    await _within(receiver.get(desc), f"get of a stale descriptor {phase}")
            else:
                got = await _within(receiver.get(desc), f"get of a released descriptor {phase}")
                assert _raw(got) == _raw(payload), f"a released descriptor read new data {phase}"
                await _within(receiver.release(desc), "release")
            for r in range(self.churn_rounds):
                churn, _ = await _carry(sender, receiver, _key(), _blob(r, self.fill_chunk_bytes))
                await _within(receiver.release(churn), "release")

    @pytest.mark.asyncio
    async def test_capacity_exhaustion_and_deadline(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """A full bounded transport fails a put at its deadline, neither early nor late, and
        takes puts again once space is released; an unbounded one takes 200 unreleased puts."""
        if not transport.capabilities.bounded:
            held = [await _put(sender, _key(), _blob(i, self.fill_chunk_bytes)) for i in range(200)]
            got = await _within(receiver.get(held[-1]), "get of the last of 200 puts")
            assert _raw(got) == _raw(_blob(199, self.fill_chunk_bytes))
            await _release_all(receiver, held)
            return
        held, _ = await self._fill(sender)
        start = time.monotonic()
        put = sender.put(_key(), _blob(0, self.fill_chunk_bytes), timeout=self.exhaust_timeout)
        with pytest.raises(TransportError):
            await _within(put, "a put into a full transport", self.exhaust_timeout + _STEP)
        self._check_gave_up_at_deadline(time.monotonic() - start)
        await _within(receiver.release(held.pop(0)), "release")
        payload = _blob(1, self.fill_chunk_bytes)
        desc, got = await _carry(sender, receiver, _key(), payload)
        assert _raw(got) == _raw(payload)
        await _release_all(receiver, [desc, *held])

    @pytest.mark.asyncio
    async def test_blocked_put_resumes_when_space_is_released(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """A put waiting on a full bounded transport completes once a chunk is released."""
        if not transport.capabilities.bounded:
            pytest.skip("an unbounded transport never waits for capacity")
        held, _ = await self._fill(sender)
        payload = _blob(1, self.fill_chunk_bytes)
        waiting = asyncio.ensure_future(sender.put(_key(), payload, timeout=_STEP))
        await _let_run()
        assert not waiting.done(), "a put into a full transport must wait for capacity"
        await _within(receiver.release(held.pop()), "release")
        desc = await _within(waiting, "a put after space was released")
        got = await _within(receiver.get(desc), "get")
        assert _raw(got) == _raw(payload)
        await _release_all(receiver, [desc, *held])

    @pytest.mark.asyncio
    async def test_close_while_blocked(
        self, transport: Transport, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """A put blocked on a full bounded transport fails promptly when the sender closes."""
        if not transport.capabilities.bounded:
            pytest.skip("an unbounded transport never blocks a put")
        held, _ = await self._fill(sender)
        # The size that was just refused: a smaller payload might fit what is left.
        payload = _blob(0, self.fill_chunk_bytes)
        blocked = asyncio.ensure_future(sender.put(_key(), payload, timeout=30.0))
        await _let_run()
        assert not blocked.done(), "a put with a 30s deadline into a full transport must wait"
        start = time.monotonic()
        await _within(sender.aclose(), "aclose with a put blocked")
        with pytest.raises(TransportError):
            await _within(blocked, "a blocked put after aclose", self.max_overrun)
        assert time.monotonic() - start <= self.max_overrun
        await _release_all(receiver, held)

    @pytest.mark.asyncio
    async def test_use_after_close(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Put after the sender closes and get after the receiver closes raise TransportError,
        and closing twice, even at once, is harmless."""
        desc, _ = await _carry(sender, receiver, _key(), _blob(1, 1024))
        await _within(asyncio.gather(sender.aclose(), sender.aclose()), "sender aclose")
        with pytest.raises(TransportError):
            await _within(sender.put(_key(), _blob(2, 1024), timeout=1.0), "put after aclose")
        await _within(receiver.aclose(), "receiver aclose")
        await _within(receiver.aclose(), "a second receiver aclose")
        with pytest.raises(TransportError):
            await _within(receiver.get(desc), "get after aclose")

    @pytest.mark.asyncio
    async def test_garbage_descriptor(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Random bytes, truncations, wrong tags and foreign descriptors all raise
        TransportError, never another exception."""
        rng = _seeded("garbage descriptors")
        desc = await _put(sender, _key(), _blob(3, 64))
        valid = msgspec.msgpack.encode(desc)
        garbage = [
            b"",
            b"\xc1",
            valid + b"\x00",
            _retagged(desc),
            _invalid_utf8_tag(desc),
            b"\xa2\xd0\xfe",
            msgspec.msgpack.encode(_Foreign()),
            msgspec.msgpack.encode(_ForeignArray(b"h", (b"x",))),
            msgspec.msgpack.encode({"t": _WRONG_TAG}),
            msgspec.msgpack.encode([_WRONG_TAG]),
            msgspec.msgpack.encode(5),
            msgspec.msgpack.encode(None),
            *(valid[:n] for n in range(1, len(valid), max(1, len(valid) // 32))),
            *(rng.randbytes(rng.randrange(1, 200)) for _ in range(100)),
        ]
        for raw in garbage:
            for form in (raw, memoryview(raw)):
                try:
                    receiver.decode_descriptor(form)
                except TransportError:
                    continue
                except Exception as exc:
                    pytest.fail(
                        f"decode_descriptor({raw[:40]!r}) raised {exc!r}, not TransportError"
                    )
                pytest.fail(f"decode_descriptor({raw[:40]!r}) accepted garbage")
        for foreign in (_Foreign(), _ForeignArray(b"h", (b"x",))):
            with pytest.raises(TransportError):
                await _within(receiver.get(foreign), "get of a foreign descriptor")
        await _within(receiver.release(desc), "release")

    @pytest.mark.asyncio
    async def test_descriptor_from_another_host(
        self, transport: Transport, sender: TransportSender, edge_context: EdgeContext
    ) -> None:
        """A host-local descriptor used by a receiver on another host is a clear error."""
        if not transport.capabilities.host_local:
            pytest.skip("the transport's descriptors name no host-local resource")
        key = _key()
        desc = await _put(sender, key, _blob(4, 1024))
        elsewhere = EdgeContext(
            edge_context.edge,
            f"{edge_context.host}-elsewhere",
            edge_context.options,
            edge_context.inline_threshold,
        )
        remote = transport.open_receiver(elsewhere)
        try:
            with pytest.raises(TransportError):
                await _within(remote.get(_through_envelope(remote, key, desc)), "get elsewhere")
        finally:
            await _within(remote.aclose(), "receiver aclose")

    @pytest.mark.asyncio
    async def test_statistics(self, sender: TransportSender, receiver: TransportReceiver) -> None:
        """Both ends count chunks and bytes, in snapshots that later traffic leaves alone."""
        before = sender.statistics(), receiver.statistics()
        frozen = [(s.chunks, s.bytes, dict(s.by_transport)) for s in before]
        for stats in before:
            assert isinstance(stats, TransportStatistics)
            assert isinstance(stats.transport, str)
            assert stats.transport
        n = 5
        for i in range(n):
            desc, _ = await _carry(sender, receiver, _key(), _blob(i, 4096))
            await _within(receiver.release(desc), "release")
        after = sender.statistics(), receiver.statistics()
        for end, old, new in zip(("sender", "receiver"), before, after, strict=True):
            assert new.chunks == old.chunks + n, (
                f"the {end} counted {new.chunks - old.chunks} of {n} chunks"
            )
            assert new.bytes > old.bytes, f"the {end} counted no bytes"
        assert [(s.chunks, s.bytes, dict(s.by_transport)) for s in before] == frozen, (
            "a statistics snapshot changed after it was taken"
        )

    @pytest.mark.asyncio
    async def test_nothing_is_held_once_every_payload_is_released(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Once every payload put has been released, got first or not, neither end reports
        any ``held``: release frees whatever put and get took."""
        n = 6
        descs = [await _put(sender, _key(), _blob(i, 4096)) for i in range(n)]
        for desc in descs[::2]:
            await _within(receiver.get(desc), "get")
        await _release_all(receiver, descs)
        held = receiver.statistics().held
        assert held == 0, (
            f"the receiver still holds {held} payloads once all {n} were released:"
            " release must free what get took"
        )
        if not await _eventually(lambda: sender.statistics().held == 0):
            pytest.fail(
                f"the sender still holds {sender.statistics().held} payloads {_STEP:g}s after"
                f" all {n} were released: release must free what put took"
            )

    @pytest.mark.asyncio
    async def test_a_producer_may_reuse_its_buffers_once_put_returns(
        self, sender: TransportSender, receiver: TransportReceiver
    ) -> None:
        """Buffers and tensors the producer overwrites once put has returned, before the
        consumer gets them and again after, reach the consumer as they were at put."""
        if self.borrows_buffers:
            pytest.skip("the transport is declared to borrow buffers (borrows_buffers = True)")
        size = self.fill_chunk_bytes
        block, backing = bytearray(_pattern(1, size)), bytearray(_pattern(2, size))
        tensor = torch.arange(size // 8, dtype=torch.int64)
        payloads = [
            Encoded(b"reused buffers", (block, memoryview(backing))),
            codec_for(_Tensors).encode(_Tensors("a reused tensor", [tensor])),
        ]
        wants = [_raw(payload) for payload in payloads]
        descs = [await _put(sender, _key(), payload) for payload in payloads]

        def reuse(fill: int) -> None:
            block[:] = backing[:] = bytes([fill]) * size
            tensor.fill_(fill)

        reuse(0xAA)
        gots = [await _within(receiver.get(desc), "get") for desc in descs]
        reuse(0x55)
        for i, (got, want) in enumerate(zip(gots, wants, strict=True)):
            assert _raw(got) == want, (
                f"payload {i} changed when its producer reused its buffers after put returned:"
                " put kept references to them instead of copying or owning them (the torn-data"
                " bug); a transport configured so must say borrows_buffers = True"
            )
        await _release_all(receiver, descs)

    @pytest.mark.asyncio
    async def test_payloads_put_in_another_process_arrive_intact(
        self,
        transport_recipe: TransportRecipe | None,
        receiver: TransportReceiver,
        edge_context: EdgeContext,
    ) -> None:
        """A sender in a freshly spawned process, with the transport re-created from its
        recipe as a worker's is, puts payloads that a receiver here gets intact."""
        if transport_recipe is None:
            pytest.skip(
                "cannot tell how to re-create the transport in another process: override the"
                " transport_recipe fixture to return TransportRecipe(import path, options)"
            )
        try:
            order = msgspec.json.encode(
                _ProducerOrder(
                    transport_recipe.name,
                    transport_recipe.options,
                    edge_context.edge,
                    edge_context.host,
                    edge_context.options,
                    edge_context.inline_threshold,
                    edge_context.bind_host,
                )
            )
        except TypeError as exc:
            pytest.skip(f"the transport's or the edge's options cannot travel as JSON: {exc}")
        wants = _cross_process_payloads()
        async with _spawned_producer(order) as producer:
            lines = [await producer.line("first descriptor", _SPAWN)]
            lines += [await producer.line("next descriptor") for _ in wants[1:]]
            for i, (line, want) in enumerate(zip(lines, wants, strict=True)):
                try:
                    desc = receiver.decode_descriptor(bytes.fromhex(line.decode()))
                    got = await _within(receiver.get(desc), f"get of payload {i}")
                except TransportError as exc:
                    pytest.fail(
                        f"payload {i}, put by a sender in process {producer.proc.pid}, cannot be"
                        f" got in this one ({exc}): every pipeline edge crosses processes"
                    )
                assert _raw(got) == _raw(want), f"payload {i} from another process changed"
                await _within(receiver.release(desc), "release")
            stats = await producer.finish()
        assert stats.chunks == len(wants), (
            f"the producer's sender counted {stats.chunks} of {len(wants)} chunks"
        )
