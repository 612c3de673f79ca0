"""The network transport's producer end: holds payloads until a receiver fetches them.

``put`` freezes a payload into frames (see ``_network_store``) under a random token, within
the sender's capacity, and returns a descriptor naming the endpoint of the sender's server
(see ``_network_server``), which listens from the first ``put`` on.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections import OrderedDict

from pipeline._encoded import Buffer, Encoded
from pipeline._errors import TransportError, TransportFull
from pipeline._keys import ChunkKey
from transports._network_server import Server
from transports._network_store import BlockPool, Capacity, Held, freeze, piece_views
from transports._network_wire import (
    MAX_PIECES,
    NetworkDescriptor,
    NetworkOptions,
    frame_plan,
    is_express,
)
from transports._protocol import EdgeContext, TransportStatistics
from transports._resource import AsyncResource

__all__ = ("NetworkSender",)

#: The most idle block bytes a sender keeps for reuse (or its capacity, if smaller).
_POOL_KEEP = 256 * 2**20

#: How many endpoints of consumers declared gone a sender remembers.
_GONE_KEPT = 256


class NetworkSender(AsyncResource):
    """The producer's end of a network edge: holds payloads for receivers to fetch.

    Args:
        edge: the edge this end serves; ``bind_host`` says where to listen.
        options: the transport's parsed options.
    """

    def __init__(self, edge: EdgeContext, options: NetworkOptions) -> None:
        self._edge = edge
        self._options = options
        self._what = f"network sender for edge {edge.edge!r}"
        self._capacity = Capacity(options.capacity)
        self._pool = BlockPool(min(options.capacity, _POOL_KEEP), options.segment_size)
        self._server: Server | None = None
        self._closed = False
        #: Puts begun so far: a payload's put tells when it began, against the news of
        #: its consumer's end.
        self._begun = 0
        #: Endpoints of consumers declared gone, latest last, each with the puts begun
        #: before the news (see ``readers_gone``).
        self._gone: OrderedDict[str, int] = OrderedDict()
        self.chunks = 0
        self.bytes = 0
        self.errors = 0

    @property
    def endpoint(self) -> str | None:
        """The ``tcp://HOST:PORT`` receivers fetch from; ``None`` until the first ``put``."""
        return None if self._server is None else self._server.endpoint

    @property
    def held_bytes(self) -> int:
        """Bytes held for receivers that have not fetched them yet."""
        return self._capacity.used

    def _error(self, message: str, kind: type[TransportError] = TransportError) -> TransportError:
        self.errors += 1
        return kind(f"{self._what}: {message}")

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> NetworkDescriptor:
        """Hold a copy of ``encoded`` (``bytes`` pieces by reference) until a receiver fetches
        it, waiting up to ``timeout`` seconds for capacity.

        Raises:
            TransportFull: no capacity freed up within ``timeout``, or there never will be:
                the payload exceeds the whole capacity or has too many buffers (at once,
                without waiting; an edge's ``fallback`` takes it).
            TransportError: the sender cannot listen on its bind address, or it is closed.
        """
        if self._closed:
            raise self._error(f"{key}: closed")
        begun = self._begun
        self._begun += 1
        nbytes = encoded.nbytes
        if nbytes > self._options.capacity:
            raise self._error(
                f"{key}: {nbytes} bytes exceed the capacity of {self._options.capacity}; "
                "raise the transport's capacity option",
                TransportFull,
            )
        if len(encoded.buffers) >= MAX_PIECES:
            raise self._error(
                f"{key}: {len(encoded.buffers)} buffers; at most {MAX_PIECES - 1}", TransportFull
            )
        server = self._server
        if server is None:
            try:
                server = self._server = Server(
                    self._edge, self._options, self._capacity, self._pool
                )
            except TransportError:
                self.errors += 1
                raise
        try:
            await self._capacity.take(nbytes, timeout, f"{self._what}: {key}")
        except TransportError:
            self.errors += 1
            raise
        try:
            if self._closed:
                raise self._error(f"{key}: closed")
            pieces = piece_views(encoded, copy=self._options.copy_on_put)
            sizes = [view.nbytes for view, _ in pieces]
            plan = frame_plan(sizes, self._options.segment_size)
            frames: list[Buffer] = []
            blocks: list[bytearray | None] = []
            # The loop runs between copied megabytes: however large the payload, a put
            # blocks it for one megabyte's copy at a time.
            for _ in freeze(pieces, plan, self._pool, frames, blocks):
                await asyncio.sleep(0)
                if self._closed:
                    raise self._error(f"{key}: closed")
            express = is_express(plan)
        except BaseException:
            self._capacity.give(nbytes)
            raise
        token = secrets.token_bytes(16)
        server.hold(Held(token, sizes, nbytes, frames, blocks, express, begun=begun))
        self.chunks += 1
        self.bytes += nbytes
        return NetworkDescriptor(
            server.endpoint,
            token,
            self._edge.host,
            sizes[0],
            sizes[1:],
            self._options.segment_size,
        )

    def note_reader(self, descriptor: NetworkDescriptor, endpoint: str, pid: int) -> None:
        """Say where ``descriptor`` was sent: the consumer's data endpoint (and its pid,
        unused here), so that :meth:`readers_gone` can drop its payload. A payload for a
        consumer already gone (its put began before the news and finished after) is dropped
        at once; one whose put began after the news is for a consumer that came back at
        the same endpoint (a worker that rejoined), and is kept."""
        server = self._server
        held = None if server is None else server.held.get(descriptor.token)
        if server is not None and held is not None:
            held.reader = endpoint
            news = self._gone.get(endpoint)
            if news is not None and held.begun < news:
                server.drop(held)

    def readers_gone(self, endpoints: set[str]) -> None:
        """Drop the payloads sent to consumers that are gone (declared dead by the master):
        none of them will be fetched, and a fetch under way will not complete. So are those
        whose puts are under way now, as they finish (:meth:`note_reader`)."""
        for endpoint in endpoints:
            self._gone.pop(endpoint, None)  # latest last
            self._gone[endpoint] = self._begun
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
        if self._server is not None:
            self._server.drop_for(endpoints)

    # -- the rest of the protocol ---------------------------------------------------------

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes put so far, how long transfers took to leave (µs), and how many
        payloads wait to be fetched or are being sent."""
        server = self._server
        return TransportStatistics(
            "network",
            self.chunks,
            self.bytes,
            errors=self.errors + (0 if server is None else server.errors),
            latency_p50_us=0.0 if server is None else server.latency.percentile(50),
            latency_p99_us=0.0 if server is None else server.latency.percentile(99),
            by_transport={"network": self.chunks},
            held=0 if server is None else len(server.held),
        )

    async def aclose(self) -> None:
        """Close the socket (linger 0), fail waiting puts, and drop everything held;
        idempotent.

        Raises:
            Nothing: closing twice, or while puts wait, is safe.
        """
        if self._closed:
            return
        self._closed = True
        self._capacity.close(TransportError(f"{self._what}: closed while the put waited"))
        if self._server is not None:
            self._server.close()
        # Blocks handed to ZMQ are never reused now: the pool goes with the sender.
        self._pool.clear()

    def __repr__(self) -> str:
        return (
            f"<NetworkSender edge={self._edge.edge!r} endpoint={self.endpoint!r} "
            f"held_bytes={self.held_bytes} pid={os.getpid()}>"
        )
