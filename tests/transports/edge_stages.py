"""Stages for tests of what travels along an edge: patterned arrays of chosen sizes.

Every chunk's array is filled with a byte derived from its sequence number, so a consumer
can tell a chunk that arrived twice, out of order or with someone else's bytes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import torch
from pydantic import BaseModel

from pipeline import Context, Stage, Stream
from stages.text import Text
from tests.pipeline.conftest import wait_for


class Piece(msgspec.Struct):
    """One chunk of a stream: its position and a patterned array."""

    seq: int
    data: np.ndarray


def pattern(seq: int) -> int:
    """The byte every element of chunk ``seq`` holds."""
    return (seq * 37 + 11) % 251


class Alternate(Stage):
    """Streams ``count`` pieces whose sizes cycle through ``sizes``.

    With sizes on both sides of the inline threshold, consecutive chunks of one request
    travel by different transports under ``auto``.
    """

    class Params(BaseModel):
        count: int = 8
        sizes: list[int] = [512, 16 * 1024]
        #: A file to wait for (up to 30 s) before the second piece (empty: no wait).
        second_after: str = ""
        #: A file created once the second piece has had a moment to leave (empty: none).
        second_sent: str = ""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Piece]:
        params = self.params
        assert isinstance(params, Alternate.Params)
        count = int(text.value) if text.value else params.count
        for seq in range(count):
            if seq == 1 and params.second_after:
                # Another process makes it and nothing announces it: the tests' shared poll.
                await wait_for(Path(params.second_after).exists, 30, interval=0.01)
            size = params.sizes[seq % len(params.sizes)]
            yield Piece(seq, np.full(size, pattern(seq), np.uint8))
            if seq == 1 and params.second_sent:
                # The chunk leaves in the outbox's flush, which the loop runs before it
                # resumes this: a few turns are plenty (a same-host link writes at once).
                for _ in range(3):
                    await asyncio.sleep(0)
                await asyncio.to_thread(Path(params.second_sent).touch)


class Verify(Stage):
    """Checks that pieces arrive exactly once, in order, with their own bytes."""

    class Params(BaseModel):
        delay: float = 0.0
        #: Seconds the first piece is computed on, holding the event loop as a model does.
        block: float = 0.0
        #: A file created as that compute starts (empty: none), for a test to wait on.
        mark: str = ""

    async def process(self, pieces: Stream[Piece], ctx: Context) -> Text:
        assert isinstance(self.params, Verify.Params)
        return await _verify(pieces, self.params.delay, self.params.block, self.params.mark)


class Keep(Stage):
    """Says it has the first piece, then keeps it until its request is aborted, or with
    ``fail`` raises while it holds the piece.

    Read from shm the piece's array is a view of the producer's extent, which the producer
    holds until the view dies.
    """

    class Params(BaseModel):
        fail: bool = False

    async def process(self, pieces: Stream[Piece], ctx: Context) -> AsyncIterator[Text]:
        assert isinstance(self.params, Keep.Params)
        async for piece in pieces:
            kept = piece
            yield Text(f"kept {kept.seq}")
            if self.params.fail:
                raise RuntimeError(f"failed holding piece {kept.seq}")
            await asyncio.Event().wait()  # until the abort cancels this


class OnePiece(Stage):
    """Returns one 16 KiB piece."""

    async def process(self, text: Text, ctx: Context) -> Piece:
        return Piece(0, np.full(16 * 1024, pattern(0), np.uint8))


class FailOnPiece(Stage):
    """Raises while it holds its one piece (a view of an shm extent, read from shm)."""

    async def process(self, piece: Piece, ctx: Context) -> Text:
        raise RuntimeError(f"failed holding piece {piece.seq}")


class MeasurePieces(Stage):
    """Batches: each piece's size, as text (with ``fail``, raises while holding them)."""

    class Params(BaseModel):
        fail: bool = False

    async def process(self, piece: Piece, ctx: Context) -> Text:
        return (await self.process_batch([piece], [ctx]))[0]

    async def process_batch(self, pieces: list[Piece], ctxs: list[Context]) -> list[Text]:
        assert isinstance(self.params, MeasurePieces.Params)
        if self.params.fail:
            raise RuntimeError(f"failed holding {len(pieces)} pieces")
        return [Text(str(p.data.size)) for p in pieces]


def _compute(seconds: float, mark: str) -> None:
    """Hold the loop for ``seconds``, as a model's compute does, creating ``mark`` (a file
    path; empty: none) as it starts."""
    if mark:
        with open(mark, "x"):
            pass
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


async def _verify(
    pieces: Stream[Piece] | Stream[TensorPiece], delay: float, block: float = 0.0, mark: str = ""
) -> Text:
    """Check each piece's position and bytes, sleeping ``delay`` after each (holding it),
    and blocking the loop ``block`` seconds after the first (creating ``mark`` then)."""
    seen = 0
    total = 0
    async for piece in pieces:
        if piece.seq != seen:
            raise AssertionError(f"expected piece {seen}, got {piece.seq}")
        data = piece.data
        size = int(data.numel() if isinstance(data, torch.Tensor) else data.size)
        if size and not bool((data == pattern(piece.seq)).all()):
            raise AssertionError(f"piece {piece.seq} holds bytes that are not its own")
        seen += 1
        total += size
        if delay:
            # The point is a slow consumer: it holds the stream open while chunks queue.
            await asyncio.sleep(delay)
        if block and seen == 1:
            # Compute that holds the loop, as a model does: nothing else here runs.
            _compute(block, mark)
    return Text(f"{seen}:{total}")


class TensorPiece(msgspec.Struct):
    """One chunk of a stream: its position and a patterned tensor."""

    seq: int
    data: torch.Tensor


class TensorFlood(Stage):
    """Streams ``count`` patterned tensors of ``size`` bytes on ``device``."""

    class Params(BaseModel):
        count: int = 4
        size: int = 1024 * 1024
        device: str = "cuda"

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[TensorPiece]:
        p = self.params
        assert isinstance(p, TensorFlood.Params)
        for seq in range(p.count):
            data = torch.full((p.size,), pattern(seq), dtype=torch.uint8, device=p.device)
            yield TensorPiece(seq, data)


class TensorDrain(Stage):
    """:class:`Verify` for tensor pieces, slow by default: each piece is held a minute."""

    class Params(BaseModel):
        delay: float = 60.0

    async def process(self, pieces: Stream[TensorPiece], ctx: Context) -> Text:
        assert isinstance(self.params, TensorDrain.Params)
        return await _verify(pieces, self.params.delay)


def make_cuda_files(pid: int) -> list[str]:
    """Create, for process ``pid``, the two files CUDA IPC leaves in /dev/shm (the driver's
    and torch's reference counts), named as they name them; their paths."""
    paths = [
        f"/dev/shm/cuda.shm.{os.getuid()}.{pid:x}.1",
        f"/dev/shm/torch_{pid}_{secrets.randbelow(2**31)}_0",
    ]
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    return paths


class LeavesCudaFiles(Stage):
    """Echoes its text, having made this process's CUDA IPC files at setup: what a worker
    that shared GPU memory leaves behind when it is killed."""

    async def setup(self) -> None:
        make_cuda_files(os.getpid())

    async def process(self, text: Text, ctx: Context) -> Text:
        return text
