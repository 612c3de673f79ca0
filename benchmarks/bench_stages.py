"""Stages used by the benchmarks; worker processes import them as ``benchmarks.bench_stages``.

Run benchmarks from the repository root so that this module is importable in the workers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from pipeline import Context, Stage, Stream

__all__ = ("Blob", "Burst", "Count", "Counted", "Relay", "Start", "StreamRelay")


class Blob(msgspec.Struct):
    """An opaque payload: ``data`` is the 1 KiB (or any size) body."""

    data: bytes


class Start(msgspec.Struct):
    """Asks :class:`Burst` for ``n`` chunks of ``size`` bytes each."""

    n: int
    size: int = 1024


class Counted(msgspec.Struct):
    """How many chunks :class:`Count` received, and their total payload bytes."""

    chunks: int
    nbytes: int


class Relay(Stage):
    """Returns its input unchanged: one chunk in, one chunk out."""

    async def process(self, x: Blob, ctx: Context) -> Blob:
        return x


class Burst(Stage):
    """Streams ``n`` chunks of ``size`` bytes for one request."""

    async def process(self, x: Start, ctx: Context) -> AsyncIterator[Blob]:
        blob = Blob(b"\x5a" * x.size)
        for _ in range(x.n):
            yield blob


class StreamRelay(Stage):
    """Passes a stream through chunk by chunk, as it arrives."""

    async def process(self, xs: Stream[Blob], ctx: Context) -> AsyncIterator[Blob]:
        async for x in xs:
            yield x


class Count(Stage):
    """Consumes a stream and returns how many chunks (and bytes) it held."""

    async def process(self, xs: Stream[Blob], ctx: Context) -> Counted:
        n = nbytes = 0
        async for x in xs:
            n += 1
            nbytes += len(x.data)
        return Counted(n, nbytes)
