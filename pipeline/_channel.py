"""Typed channels: the two ends of one edge inside the stage processes.

:class:`OutputChannel` (producer side) numbers each request's chunks, waits for credit,
puts the payload through the edge's transport and sends the envelope. :class:`InputChannel`
(consumer side) fetches and decodes payloads from descriptors and returns credit.

Flow control is a window of chunks per (request, edge): a producer may run at most
``window`` chunks ahead of what the consumer's handler has taken. Windows are per request,
so a request whose consumer has not started yet never starves another request's stream,
and memory held for an edge is bounded by ``window`` chunks per admitted request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline._codec import codec_for
from pipeline._encoded import Encoded, to_host
from pipeline._errors import (
    EndOfChannel,
    PayloadError,
    RequestAborted,
    TransportError,
    TransportFull,
)
from pipeline._keys import ChunkKey
from pipeline._latency import LatencyRecorder
from pipeline._messages import NO_DESCRIPTOR, Chunk, Credit
from pipeline._reorder import ReorderBuffer
from pipeline._signature import EdgePlan
from transports._protocol import Descriptor, EdgeContext, TransportReceiver, TransportSender
from transports._registry import create_transport, resolve_transport
from transports.auto import AutoPolicy
from transports.inline import InlineReceiver, InlineSender

__all__ = ("Inflow", "InputChannel", "Item", "OutputChannel", "SendTarget")

_encode_msg = msgspec.msgpack.Encoder().encode


def _bind_host(endpoint: str) -> str:
    """The address of a ``tcp://HOST:PORT`` endpoint; loopback for anything else."""
    if endpoint.startswith("tcp://"):
        return endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return "127.0.0.1"


@dataclass(frozen=True, slots=True)
class SendTarget:
    """The consumer replica of one request on one edge."""

    endpoint: str
    host: str


@dataclass(frozen=True, slots=True)
class Item:
    """A received chunk as filed in a reorder buffer: where its payload is."""

    transport: str
    descriptor: Descriptor | None
    sender: str


class Inflow:
    """One request's position on one input edge: its reorder buffer and credit marks."""

    __slots__ = ("buffer", "granted", "taken")

    def __init__(self, buffer: ReorderBuffer[Item]) -> None:
        self.buffer = buffer
        self.taken = 0
        self.granted = 0


class _Window:
    __slots__ = ("allowed", "next_seq", "waiter")

    def __init__(self, window: int) -> None:
        self.next_seq = 0
        self.allowed = window
        self.waiter: asyncio.Future[None] | None = None


class OutputChannel:
    """The producer's end of one edge."""

    def __init__(
        self,
        plan: EdgePlan,
        *,
        host: str,
        endpoint: str,
        send: Callable[[str, bytes], None],
    ) -> None:
        self.plan = plan
        self._host = host
        self._endpoint = endpoint
        self._send = send
        self._windows: dict[str, _Window] = {}
        ctx = EdgeContext(
            plan.name,
            host,
            plan.transport.options,
            plan.inline_threshold,
            bind_host=_bind_host(endpoint),
        )
        self._transports = edge = plan.transports
        # Built once: choosing happens per chunk, and only the peer's host varies.
        self._local_policy = AutoPolicy(plan.inline_threshold, same_host=True)
        self._remote_policy = AutoPolicy(plan.inline_threshold, same_host=False)
        self._senders: dict[str, TransportSender] = {
            name: create_transport(name, edge.options[name]).open_sender(ctx) for name in edge.names
        }
        self._fixed = None if edge.auto else self._senders[edge.kind]
        # Statistics name what carried each chunk by the transport's own name, so a plug-in
        # given by import path shows up as, say, "rdma".
        self._names = {n: str(getattr(resolve_transport(n), "name", n)) for n in edge.names}
        # Transports that take tensors still on a GPU; the others get host copies.
        self._on_device = frozenset(
            n
            for n in edge.names
            if getattr(resolve_transport(n).capabilities, "device_buffers", False)
        )
        self.chunks = 0
        self.bytes = 0
        self.fallbacks = 0
        self.used: dict[str, int] = {}

    def _window(self, request_id: str) -> _Window:
        win = self._windows.get(request_id)
        if win is None:
            win = self._windows[request_id] = _Window(self.plan.window)
        return win

    async def send(
        self, request_id: str, encoded: Encoded | None, final: bool, target: SendTarget
    ) -> None:
        """Send one chunk of ``request_id``, waiting for credit first.

        ``encoded`` of ``None`` sends a payload-less final chunk: the end of a stream.

        Raises:
            RequestAborted: the request was aborted while waiting for credit.
            TransportError: the transport could not store the payload.
        """
        win = self._window(request_id)
        while win.next_seq >= win.allowed:
            win.waiter = asyncio.get_running_loop().create_future()
            try:
                await win.waiter
            finally:
                win.waiter = None
        seq = win.next_seq
        win.next_seq += 1
        key = ChunkKey(request_id, self.plan.name, seq)
        if encoded is None:
            name, raw = "", NO_DESCRIPTOR
        else:
            name, sender = self._choose(encoded, target)
            if encoded.device_buffers and name not in self._on_device:
                encoded = to_host(encoded)
            descriptor: Descriptor
            try:
                if isinstance(sender, InlineSender):
                    # Inline never waits: no coroutine for the most frequent, smallest chunks.
                    descriptor = sender.wrap(encoded)
                else:
                    descriptor = await sender.put(
                        key, encoded, timeout=self._transports.full_timeout
                    )
            except TransportFull:
                name = self._transports.fallback or ""
                if not name:
                    raise
                self.fallbacks += 1
                if encoded.device_buffers and name not in self._on_device:
                    encoded = to_host(encoded)
                descriptor = await self._senders[name].put(
                    key, encoded, timeout=self.plan.chunk_timeout
                )
            raw = msgspec.Raw(_encode_msg(descriptor))
            self.bytes += encoded.nbytes
            shown = self._names[name]
            self.used[shown] = self.used.get(shown, 0) + 1
        self.chunks += 1
        msg = Chunk(key, final, name, raw, self._endpoint, self._host, time.monotonic_ns())
        self._send(target.endpoint, _encode_msg(msg))

    def _choose(self, encoded: Encoded, target: SendTarget) -> tuple[str, TransportSender]:
        if self._fixed is not None:
            return self._transports.kind, self._fixed
        policy = self._local_policy if target.host == self._host else self._remote_policy
        name, fell_back = policy.choose(encoded.nbytes, has_cuda=encoded.has_device_buffers)
        if fell_back:
            self.fallbacks += 1
        return name, self._senders[name]

    def on_credit(self, credit: Credit) -> None:
        """Apply credit from the consumer: chunks below ``upto`` were taken."""
        win = self._windows.get(credit.request_id)
        if win is None:
            return
        allowed = credit.upto + self.plan.window
        if allowed > win.allowed:
            win.allowed = allowed
            if win.waiter is not None and not win.waiter.done():
                win.waiter.set_result(None)

    def forget(self, request_id: str, reason: str | None = None) -> None:
        """Drop a request's window, failing a sender that waits on it."""
        win = self._windows.pop(request_id, None)
        if win is not None and win.waiter is not None and not win.waiter.done():
            win.waiter.set_exception(RequestAborted(request_id, reason or "finished"))

    @property
    def open_windows(self) -> int:
        """Requests with credit state on this edge."""
        return len(self._windows)

    def statistics(self) -> dict[str, Any]:
        """Counters for this edge's producer side."""
        return {
            "edge": self.plan.name,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "fallbacks": self.fallbacks,
            "transport": self._transports.kind,
            "used": dict(self.used),
            "transports": {
                name: dataclasses.asdict(sender.statistics())
                for name, sender in self._senders.items()
            },
        }

    async def aclose(self) -> None:
        """Close every transport end; idempotent."""
        for request_id in list(self._windows):
            self.forget(request_id, "channel closed")
        for sender in self._senders.values():
            await sender.aclose()


class InputChannel:
    """The consumer's end of one edge."""

    def __init__(
        self,
        plan: EdgePlan,
        *,
        host: str,
        send: Callable[[str, bytes], None],
    ) -> None:
        self.plan = plan
        self._host = host
        self._send = send
        self._codec = codec_for(plan.payload_type)
        self._ctx = EdgeContext(plan.name, host, plan.transport.options, plan.inline_threshold)
        self._transports = plan.transports
        self._receivers: dict[str, TransportReceiver] = {}
        #: The inline receiver once opened: its payloads are read without a coroutine.
        self._inline: InlineReceiver | None = None
        self._credit_step = max(1, plan.window // 2)
        self.hop = LatencyRecorder()
        self.chunks = 0

    def receiver(self, name: str) -> TransportReceiver:
        """The receiving end of transport ``name`` on this edge, opened on first use.

        Raises:
            TransportError: this edge does not carry payloads by ``name``.
        """
        recv = self._receivers.get(name)
        if recv is None:
            if name not in self._transports.names:
                raise TransportError(
                    f"edge {self.plan.name!r} does not use transport {name!r} "
                    f"(allowed: {', '.join(self._transports.names)})"
                )
            options = self._transports.options[name]
            recv = create_transport(name, options).open_receiver(self._ctx)
            self._receivers[name] = recv
            if isinstance(recv, InlineReceiver):
                self._inline = recv
        return recv

    def admit(self, chunk: Chunk) -> Item:
        """Parse a chunk's descriptor and note its hop latency.

        Raises:
            TransportError: the descriptor is not valid for its transport.
        """
        self.chunks += 1
        if chunk.host == self._host:
            self.hop.add((time.monotonic_ns() - chunk.sent_ns) / 1000)
        if not chunk.transport:
            return Item("", None, chunk.sender)
        desc = self.receiver(chunk.transport).decode_descriptor(chunk.descriptor)
        return Item(chunk.transport, desc, chunk.sender)

    def open(self, request_id: str, *, chunk_timeout: float | None = None) -> Inflow:
        """Start receiving ``request_id`` on this edge."""
        timeout = self.plan.chunk_timeout if chunk_timeout is None else chunk_timeout
        return Inflow(
            ReorderBuffer(
                request_id, self.plan.name, chunk_timeout=timeout, on_discard=self.discard
            )
        )

    async def next(self, inflow: Inflow) -> Any:
        """The next payload of a request on this edge, in order, returning credit as it goes.

        Raises:
            EndOfChannel: the stream has ended.
            ChunkGap: the next chunk did not arrive within the chunk timeout.
            PayloadError: a chunk without payload came before the end, or did not decode.
            TransportError: the payload could not be fetched.
            RequestAborted: the request was aborted.
        """
        # Chunks of a busy stream are usually buffered already, and small ones inline: both
        # are taken without creating a coroutine, which is a large share of a chunk's cost.
        got = inflow.buffer.get_nowait()
        item, final = got if got is not None else await inflow.buffer.get()
        if item.descriptor is None:
            if final:
                raise EndOfChannel
            raise PayloadError(f"chunk without payload on edge {self.plan.name!r} before its end")
        if item.transport == "inline" and self._inline is not None:
            value = self._codec.decode(self._inline.take(item.descriptor))
        else:
            value = await self.fetch(item)
        inflow.taken += 1
        if not final and inflow.taken - inflow.granted >= self._credit_step:
            credit = Credit(inflow.buffer.request_id, self.plan.name, inflow.taken)
            self._send(item.sender, _encode_msg(credit))
            inflow.granted = inflow.taken
        return value

    async def fetch(self, item: Item) -> Any:
        """Materialise and decode an item's payload, then release the transport's hold.

        Raises:
            TransportError: the payload could not be fetched.
            PayloadError: the payload does not match the edge's type.
        """
        assert item.descriptor is not None
        recv = self.receiver(item.transport)
        try:
            encoded = await recv.get(item.descriptor)
            return self._codec.decode(encoded)
        finally:
            await recv.release(item.descriptor)

    def discard(self, item: Item) -> None:
        """Release an item that will never be consumed (duplicate, aborted, late)."""
        if item.descriptor is None:
            return
        recv = self._receivers.get(item.transport)
        if recv is not None:
            task = asyncio.get_running_loop().create_task(recv.release(item.descriptor))
            _background.add(task)
            task.add_done_callback(_background.discard)

    def statistics(self) -> dict[str, Any]:
        """Counters for this edge's consumer side."""
        return {
            "edge": self.plan.name,
            "chunks": self.chunks,
            "hop_p50_us": self.hop.percentile(50),
            "hop_p99_us": self.hop.percentile(99),
        }

    async def aclose(self) -> None:
        """Close every transport end; idempotent."""
        for recv in self._receivers.values():
            await recv.aclose()


_background: set[asyncio.Task[None]] = set()
