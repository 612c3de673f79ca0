"""Stages and child-process helpers of ``benchmarks/transport_bench.py``.

Worker processes import this module as ``benchmarks.transport_stages``, and the
``multiprocessing`` baseline's spawned child imports :func:`mp_echo` from it, so it stays
light: msgspec, numpy and the stage API (torch only for a source on a CUDA device).

Run the benchmark from the repository root so that this module is importable in workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np

from pipeline import Context, Stage, Stream

__all__ = (
    "Frame",
    "FramesOn",
    "Go",
    "SizedSink",
    "SizedSource",
    "Tally",
    "mp_echo",
    "prefaulted",
)


class Go(msgspec.Struct):
    """Asks :class:`SizedSource` for ``n`` frames of ``size`` bytes each."""

    size: int
    n: int = 1


class Frame(msgspec.Struct):
    """One chunk: a uint8 array (or CUDA tensor) and when its producer handed it over.

    Attributes:
        put_ns: ``time.monotonic_ns()`` in the producer just before the runtime encodes and
            puts the frame. CLOCK_MONOTONIC is one clock for every process on a host, so the
            consumer can subtract it from its own reading.
        data: a numpy uint8 array (CPU) or a torch uint8 tensor (CUDA), typed ``Any`` so
            one Struct serves both; the codec rebuilds either from its header record.
    """

    put_ns: int
    data: Any


class Tally(msgspec.Struct):
    """What :class:`SizedSink` saw of one request's frames (monotonic ns, one host clock)."""

    chunks: int
    nbytes: int
    #: ``put_ns`` of the first frame: just before its put started.
    first_put_ns: int
    #: When the first frame reached the sink's handler (fetched, decoded, released).
    first_got_ns: int
    #: When the last frame reached the sink's handler.
    last_got_ns: int


def prefaulted(size: int, device: str = "cpu") -> Any:
    """A ``size``-byte uint8 buffer whose pages are already touched (filled with 0x5A)."""
    if device.startswith("cuda"):
        import torch

        return torch.full((size,), 0x5A, dtype=torch.uint8, device=device)
    return np.full(size, 0x5A, dtype=np.uint8)


class SizedSource(Stage):
    """Streams ``n`` frames of ``size`` bytes; every frame shares one pre-faulted buffer.

    The buffer is made once per size and never written again, so a zero-copy transport
    may hold it for as long as it likes, and no fresh pages are touched per message (the
    cost LESSONS "Fresh pages are slow" warns of). Its device is the stage's ``device``.
    """

    async def setup(self) -> None:
        self._buffers: dict[int, Any] = {}

    async def process(self, go: Go, ctx: Context) -> AsyncIterator[Frame]:
        buf = self._buffers.get(go.size)
        if buf is None:
            buf = self._buffers[go.size] = prefaulted(go.size, self.device)
        for _ in range(go.n):
            yield Frame(time.monotonic_ns(), buf)


class SizedSink(Stage):
    """Counts frames and notes when the first and last reached this handler.

    It does not read the frames' bytes: the hop ends when the payload is usable here (a
    zero-copy view, or a copy the transport made), as it would for any consumer. It drops
    each frame before waiting for the next, as a consumer done with it would: a zero-copy
    view kept alive pins its shm extent, and a held 64 MiB frame would leave a default-size
    arena without room for the next one.
    """

    async def process(self, frames: Stream[Frame], ctx: Context) -> Tally:
        n = nbytes = first_put = first_got = last_got = 0
        async for frame in frames:
            last_got = time.monotonic_ns()
            if n == 0:
                first_put, first_got = frame.put_ns, last_got
            n += 1
            nbytes += int(frame.data.nbytes)
            del frame
        return Tally(n, nbytes, first_put, first_got, last_got)


class FramesOn(Stage):
    """Passes frames on as they arrive (to the client, in ``stopped_readers.py``)."""

    async def process(self, frames: Stream[Frame], ctx: Context) -> AsyncIterator[Frame]:
        async for frame in frames:
            yield frame


def mp_echo(q_in: Any, q_out: Any) -> None:
    """The ``multiprocessing.Queue`` baseline's child (spawned, so it must be importable).

    ``("echo", array)`` is sent straight back; ``("count", n)`` takes n arrays and answers
    how many bytes they held; ``None`` ends it. It leaves when its parent dies, too.
    """
    import queue

    parent = os.getppid()
    while True:
        try:
            msg = q_in.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if msg is None:
            return
        kind, arg = msg
        if kind == "echo":
            q_out.put(arg)
        else:
            total = 0
            for _ in range(arg):
                total += q_in.get().nbytes
            q_out.put(total)
