"""A network-transport producer in a process of its own, driven by tests over stdin/stdout.

Run as ``python -m tests.transports.network_producer OPTIONS_JSON SIZES_JSON``. It puts one
payload per size (see :func:`payload`), prints ``ready``, then one hex-encoded descriptor per
line, and then answers commands read from stdin, one per line:

- ``stats``: print the sender's statistics as JSON (``held``, ``held_bytes``, ``chunks``);
- ``exit`` (or end of input): close the sender and exit.

Tests rebuild each payload with :func:`payload` to compare it byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
import numpy as np

from pipeline._encoded import Encoded
from pipeline._keys import ChunkKey
from transports import EdgeContext
from transports.network import NetworkTransport

EDGE = "producer->consumer"


def payload(index: int, size: int) -> Encoded:
    """Payload ``index``: a header, a ``size``-byte numpy buffer (copied on put, since it is
    mutable) and a ``bytes`` buffer of a third of that (sent by reference)."""
    rng = np.random.default_rng(index)
    array = rng.integers(0, 256, size, dtype=np.uint8)
    tail = rng.integers(0, 256, size // 3 + 1, dtype=np.uint8).tobytes()
    return Encoded(f"payload {index} of {size} bytes".encode(), (array.data, tail))


async def _serve(options: dict[str, object], sizes: list[int]) -> None:
    loop = asyncio.get_running_loop()
    transport = NetworkTransport(**options)
    async with transport.open_sender(EdgeContext(EDGE, "producer-host")) as sender:
        descriptors = []
        for i, size in enumerate(sizes):
            encoded = payload(i, size)
            descriptors.append(await sender.put(ChunkKey("r", EDGE, i), encoded, timeout=30))
            # The producer reuses its buffers at once: the sent bytes must not change.
            np.frombuffer(encoded.buffers[0], dtype=np.uint8)[:] = 0
        print("ready", flush=True)
        for desc in descriptors:
            print(msgspec.msgpack.encode(desc).hex(), flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line == "stats":
                stats = sender.statistics()
                report = {"held": stats.held, "held_bytes": sender.held_bytes}
                print(json.dumps({**report, "chunks": stats.chunks}), flush=True)
            elif line in ("exit", ""):
                return


if __name__ == "__main__":
    asyncio.run(_serve(json.loads(sys.argv[1]), json.loads(sys.argv[2])))
