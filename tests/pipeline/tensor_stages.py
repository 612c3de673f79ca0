"""Stages whose payloads hold tensors; apart from sample_stages, so that only the tests that
move tensors make their workers import torch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import torch

from pipeline import Context, Stage

#: What Scale multiplies a frame's pixels by, one output chunk each.
FACTORS = (1, 2, 3)


class Frame(msgspec.Struct):
    """A named tensor."""

    name: str
    pixels: torch.Tensor


class Scale(Stage):
    """Streams the frame with its pixels times each of FACTORS; the frame named 'stall'
    stops after its first chunk and never ends; the frame named 'grow' comes back once,
    its pixels repeated twice over (twice the bytes)."""

    async def process(self, frame: Frame, ctx: Context) -> AsyncIterator[Frame]:
        if frame.name == "grow":
            yield Frame(frame.name, frame.pixels.repeat(2))
            return
        for k in FACTORS:
            if frame.name == "stall" and k != FACTORS[0]:
                await asyncio.Event().wait()  # never set: the stream stalls until aborted
            yield Frame(f"{frame.name}*{k}", frame.pixels * k)
