"""The network transport's consumer end: fetches payloads from producers' endpoints.

Two connections per producer endpoint, opened on first use: an *express* one for payloads
of one small frame (and for drops), and a *bulk* one for the rest, so that small payloads
never queue behind a large one's frames. ``decode_descriptor`` starts the inbound at once (a
prefetch), so by the time the runtime calls ``get`` the payload is often already here.

Nothing a descriptor says is trusted: it is validated again before use, the payload must
fit ``capacity`` before anything is allocated, and a inbound that receives nothing for
``fetch_timeout`` fails naming the endpoint. Tokens released or taken are remembered (a
bounded number of them) and refused as stale; the producer refuses them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import structlog

from pipeline._encoded import DECODE_ERRORS, Encoded
from pipeline._errors import ProducerLost, TransportError
from pipeline._latency import LatencyRecorder
from pipeline._logging import count_dropped
from transports._network_connection import Connection
from transports._network_inbound import DONE, FAILED, PENDING, Inbound
from transports._network_wire import (
    Fetch,
    NetworkDescriptor,
    NetworkOptions,
    Status,
    check_descriptor,
    frame_plan,
    is_express,
)
from transports._protocol import Descriptor, EdgeContext, TransportStatistics
from transports._resource import AsyncResource

_log = structlog.get_logger("stagewire.transports.network")

__all__ = ("NetworkReceiver",)

#: Tokens released or fetched that a receiver remembers, to refuse them without asking the
#: producer (which refuses them too, so forgetting the oldest only costs a round trip).
_REMEMBER = 16_384
#: How long a stalled connection closed by the sweeper keeps its queued drops, in ms.
_DROP_LINGER_MS = 200

_descriptor_decoder = msgspec.msgpack.Decoder(NetworkDescriptor)


class NetworkReceiver(AsyncResource):
    """The consumer's end of a network edge: fetches payloads from producers' endpoints.

    Args:
        edge: the edge this end serves.
        options: the transport's parsed options.
    """

    def __init__(self, edge: EdgeContext, options: NetworkOptions) -> None:
        self._edge = edge
        self._options = options
        self._what = f"network receiver for edge {edge.edge!r}"
        #: Two connections per producer: express (small payloads, drops) and bulk.
        self._conns: dict[tuple[str, bool], Connection] = {}
        self._fetches: dict[bytes, Inbound] = {}
        self._finished: dict[bytes, None] = {}
        #: Descriptors their producer refused (the sizes are not those of what it holds
        #: under the token, or it holds nothing there), by token: their release must not
        #: drop what the token names, which a genuine descriptor may still fetch.
        self._refused: dict[bytes, NetworkDescriptor] = {}
        #: Tokens returned by ``get`` and not yet released, counted as held in statistics.
        self._taken: set[bytes] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        #: Acknowledge after this many bytes even mid-batch, to keep the window open.
        self.ack_bytes = max(1, options.window // 4)
        self.chunks = 0
        self.bytes = 0
        self.errors = 0
        self._latency = LatencyRecorder()

    def _error(self, message: str) -> TransportError:
        self.errors += 1
        return TransportError(f"{self._what}: {message}")

    def decode_descriptor(self, raw: bytes | memoryview) -> NetworkDescriptor:
        """Parse a network descriptor and start fetching its payload.

        Raises:
            TransportError: ``raw`` is not a valid network descriptor.
        """
        try:
            desc = _descriptor_decoder.decode(raw)
        except DECODE_ERRORS as exc:
            raise self._error(f"bad network descriptor: {exc}") from exc
        token = desc.token
        if (
            not self._closed
            and token not in self._fetches
            and token not in self._finished
            and sum(desc.sizes) <= self._options.capacity
        ):
            with contextlib.suppress(TransportError, RuntimeError):
                # RuntimeError: no running loop, so no prefetch; ``get`` fetches instead.
                # TransportError: the producer cannot be reached; ``get`` says so.
                asyncio.get_running_loop()
                self._start(desc)
        return desc

    def _check(self, descriptor: Descriptor) -> NetworkDescriptor:
        if self._closed:
            raise self._error("closed")
        if not isinstance(descriptor, NetworkDescriptor):
            raise self._error(f"got a {type(descriptor).__name__}, not a NetworkDescriptor")
        problem = check_descriptor(descriptor)
        if problem is not None:
            raise self._error(f"forged or corrupted descriptor: {problem}")
        return descriptor

    def _start(self, desc: NetworkDescriptor) -> Inbound:
        """Check ``desc`` and ask its producer for the payload."""
        desc = self._check(desc)
        token = desc.token
        if token in self._finished:
            raise self._error(f"stale descriptor: token {token.hex()} was released or fetched")
        sizes = desc.sizes
        total = sum(sizes)
        if total > self._options.capacity:
            raise self._error(
                f"the descriptor names {total} bytes, more than the capacity of "
                f"{self._options.capacity} any producer of this edge may hold (forged?)"
            )
        plan = frame_plan(sizes, desc.segment)
        try:
            conn = self._connection(desc.endpoint, bulk=not is_express(plan))
        except TransportError as exc:
            raise self._error(str(exc)) from exc.__cause__
        xid = conn.next_xid
        conn.next_xid += 1
        now = time.monotonic()
        inbound = Inbound(desc, conn, xid, sizes, plan, now, now, [None] * len(sizes))
        conn.fetches[xid] = inbound
        self._fetches[token] = inbound
        conn.fetch(Fetch(xid, token, sizes))
        self._arm_sweeper()
        return inbound

    async def get(self, descriptor: Descriptor) -> Encoded:
        """Wait for the payload (fetching it unless a prefetch already did) and return it as
        writable buffers that belong to the caller.

        Raises:
            TransportError: the descriptor is stale (released or fetched before), forged,
                larger than the capacity, or not a network one; its producer refused it or
                sent nothing for ``fetch_timeout`` seconds; or the receiver is closed.
        """
        desc = self._check(descriptor)
        inbound = self._fetches.get(desc.token)
        if inbound is None:
            inbound = self._start(desc)
        elif inbound.desc != desc:
            raise self._error(
                f"token {desc.token.hex()} is being fetched with other sizes or endpoint "
                "(forged descriptor)"
            )
        if inbound.state == PENDING:
            waiter = asyncio.get_running_loop().create_future()
            inbound.waiters.append(waiter)
            await waiter
        if inbound.taken:
            raise self._error(f"stale descriptor: token {desc.token.hex()} was taken already")
        inbound.taken = True
        if inbound.refused:
            # The producer still holds whatever the token names (or never did): a forged
            # descriptor must not spoil the genuine one at this receiver, nor its release.
            self._fetches.pop(desc.token, None)
            refused = self._refused
            refused[desc.token] = desc
            if len(refused) > _REMEMBER:
                del refused[next(iter(refused))]
        elif inbound.error is not None and not inbound.dropped:
            # Failed without a word to the producer (the connection was lost): it still
            # holds the payload, so the release that follows must tell it, anew.
            self._fetches.pop(desc.token, None)
        else:
            self._forget(desc.token)
        if inbound.error is not None:
            raise inbound.error
        assert inbound.result is not None
        self._taken.add(desc.token)
        self.chunks += 1
        self.bytes += inbound.result.nbytes
        return inbound.result

    async def release(self, descriptor: Descriptor) -> None:
        """Tell the producer to drop a payload that was never fetched, stop a inbound under
        way, and refuse the descriptor from now on; idempotent.

        Raises:
            Nothing: releasing an unknown, released, foreign or forged descriptor does
                nothing, since it runs after failed gets too.
        """
        if (
            self._closed
            or not isinstance(descriptor, NetworkDescriptor)
            or check_descriptor(descriptor) is not None
        ):
            return
        token = descriptor.token
        inbound = self._fetches.get(token)
        if inbound is not None and inbound.desc != descriptor:
            return  # another descriptor of the token is being fetched: this one is forged
        if self._refused.get(token) == descriptor:
            del self._refused[token]
            return  # its producer refused it: what the token names is not this one's
        self._taken.discard(token)
        if inbound is not None:
            if inbound.state == PENDING:
                self.fail(inbound, "released while it was being fetched", drop=True, count=False)
            inbound.taken = True
            self._forget(token)
            if inbound.error is None or inbound.dropped or inbound.refused:
                return
            # Its (pre)fetch failed with its connection, and the producer was not told.
        if inbound is not None or token not in self._finished:
            try:
                conn = self._connection(descriptor.endpoint, bulk=False)
            except TransportError:
                return  # Nobody to tell: the producer is unreachable.
            conn.drop(token)
            self._remember(token)

    def _connection(self, endpoint: str, *, bulk: bool) -> Connection:
        """The express or bulk connection to ``endpoint``, connected on first use.

        Raises:
            TransportError: ZMQ refused the endpoint.
        """
        conn = self._conns.get((endpoint, bulk))
        if conn is None:
            conn = self._conns[endpoint, bulk] = Connection(self, endpoint)
        return conn

    def _remember(self, token: bytes) -> None:
        finished = self._finished
        finished[token] = None
        if len(finished) > _REMEMBER:
            del finished[next(iter(finished))]

    def _forget(self, token: bytes) -> None:
        """``token`` is done with: refuse it from now on."""
        self._fetches.pop(token, None)
        self._remember(token)

    # -- called by connections --------------------------------------------------------------

    def completed(self, inbound: Inbound) -> None:
        """Every frame of ``inbound`` arrived: wake the gets that wait for it."""
        inbound.result = inbound.assemble()
        inbound.state = DONE
        self._latency.add((time.monotonic() - inbound.started) * 1e6)
        self._wake(inbound)

    def refused(self, inbound: Inbound, status: int) -> None:
        """The producer answered the fetch of ``inbound`` with a status instead of frames."""
        reason = Status.REASONS.get(status, f"unknown status {status}")
        inbound.refused = True
        self.fail(inbound, f"producer refused the payload: {reason}", drop=False)

    def fail(
        self,
        inbound: Inbound,
        why: str,
        *,
        drop: bool,
        count: bool = True,
        error: type[TransportError] = TransportError,
    ) -> None:
        """End ``inbound`` with ``error``; ``drop`` tells the producer to forget its token."""
        if inbound.state != PENDING:
            return
        conn = inbound.conn
        conn.fetches.pop(inbound.xid, None)
        if drop and not conn.sock.closed:
            conn.drop(inbound.desc.token)
            inbound.dropped = True
        if count:
            self.errors += 1
        inbound.state = FAILED
        inbound.pieces = []
        inbound.error = error(
            f"{self._what}: fetching token {inbound.desc.token.hex()} from producer "
            f"{conn.endpoint} failed: {why}"
        )
        self._wake(inbound)

    @staticmethod
    def _wake(inbound: Inbound) -> None:
        waiters, inbound.waiters = inbound.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def garbage(self, conn: Connection, why: str) -> None:
        """Count a message from ``conn``'s producer that is not one (logged now and then)."""
        self.errors = count_dropped(
            _log, "network_message_dropped", self.errors, producer=conn.endpoint, why=why
        )

    def connection_lost(self, conn: Connection, why: str, *, refused: bool = False) -> None:
        """Fail every inbound on ``conn`` (``ProducerLost``, or a plain ``TransportError``
        when the producer refused the handshake), and forget the connection if nothing
        else uses it."""
        error = TransportError if refused else ProducerLost
        for inbound in list(conn.fetches.values()):
            self.fail(inbound, why, drop=False, error=error)
        for lane, known in list(self._conns.items()):
            if known is conn:
                # A later inbound reconnects; meanwhile no socket retries a dead endpoint.
                del self._conns[lane]
                conn.close()

    # -- deadlines ----------------------------------------------------------------------------

    def _arm_sweeper(self) -> None:
        if self._sweeper is None and not self._closed:
            interval = min(1.0, self._options.fetch_timeout / 4)
            self._sweeper = asyncio.get_running_loop().call_later(interval, self._sweep)

    def _sweep(self) -> None:
        """Fail fetches that received nothing for ``fetch_timeout``; close dead connections."""
        self._sweeper = None
        timeout = self._options.fetch_timeout
        limit = time.monotonic() - timeout
        pending = False
        for lane, conn in list(self._conns.items()):
            stalled = [f for f in conn.fetches.values() if f.progress < limit]
            for inbound in stalled:
                self.fail(
                    inbound,
                    f"no data arrived for {timeout:g}s (fetch_timeout); the producer may "
                    "have exited or be unreachable from this host",
                    drop=True,
                )
            if stalled and not conn.fetches:
                # Everything asked of this producer went unanswered: reconnect next time
                # rather than keep a socket retrying a dead endpoint.
                conn.flush()
                # A moment for the drops just queued to leave, should the producer be alive.
                conn.close(linger_ms=_DROP_LINGER_MS)
                del self._conns[lane]
            pending = pending or bool(conn.fetches)
        if pending:
            self._arm_sweeper()

    # -- the rest of the protocol ---------------------------------------------------------------

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes fetched so far, how long fetches took (µs), and how many payloads
        are being fetched, or were fetched and not yet released."""
        return TransportStatistics(
            "network",
            self.chunks,
            self.bytes,
            errors=self.errors,
            latency_p50_us=self._latency.percentile(50),
            latency_p99_us=self._latency.percentile(99),
            by_transport={"network": self.chunks},
            held=len(self._fetches) + len(self._taken),
        )

    async def aclose(self) -> None:
        """Close every connection (linger 0) and fail gets still waiting; idempotent.

        Raises:
            Nothing: closing twice, or while gets wait, is safe.
        """
        if self._closed:
            return
        for inbound in list(self._fetches.values()):
            self.fail(inbound, "the receiver was closed", drop=False, count=False)
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._fetches.clear()
        self._taken.clear()

    def __repr__(self) -> str:
        return (
            f"<NetworkReceiver edge={self._edge.edge!r} producers={len(self._conns)} "
            f"fetching={len(self._fetches)}>"
        )
