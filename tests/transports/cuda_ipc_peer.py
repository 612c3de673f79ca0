"""A cuda_ipc consumer in a process of its own, driven line by line by the tests.

``python -m tests.transports.cuda_ipc_peer MODE [OPTIONS_JSON]`` opens a cuda_ipc receiver
for edge ``a->b`` on this host (the transport built from ``OPTIONS_JSON``) and answers one
JSON line on stdout for each line on stdin, which holds a descriptor's msgpack in hex:

- ``consume``: get, decode as :class:`Tensors`, drop the tensors, release, and reply with
  each tensor's dtype, shape, device and SHA-256;
- ``hold``: the same, but keep the tensors (released all the same) until a line ``drop``
  comes (the producer must keep the bytes until the tensors die, not just until release);
- ``die``: get, reply, and exit at once without releasing: a reader that died;
- ``hop``: get, wait for the producer's event, drop, release, and reply with the time the
  get took (the benchmark's consumer).

``python -m tests.transports.cuda_ipc_peer bench`` runs :func:`benchmark` on a GPU and
prints the hop latency per payload size.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from pipeline._codec import codec_for
from pipeline._host import host_identity
from pipeline._keys import ChunkKey
from transports._cuda_files import remove_cuda_files_of
from transports._cuda_handles import OPENED
from transports._protocol import EdgeContext
from transports.cuda_ipc import CudaIpcDescriptor, CudaIpcTransport

ROOT = Path(__file__).resolve().parents[2]
EDGE = "a->b"


class Tensors(msgspec.Struct):
    """The payload the peer decodes."""

    tensors: list[torch.Tensor]


def fingerprint(t: torch.Tensor) -> dict[str, Any]:
    """What a test compares: dtype, shape, device type and a hash of the bytes in order."""
    src = torch.view_as_real(t) if t.is_complex() else t
    flat = src.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
    digest = hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
    return {
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "device": t.device.type,
        "sha256": digest,
    }


def descriptor_line(descriptor: CudaIpcDescriptor) -> bytes:
    """The stdin line that hands ``descriptor`` to the peer."""
    return msgspec.msgpack.encode(descriptor).hex().encode() + b"\n"


async def _serve(mode: str, options: dict[str, Any]) -> None:
    receiver = CudaIpcTransport(**options).open_receiver(EdgeContext(EDGE, host_identity()))
    codec = codec_for(Tensors)
    held: list[Any] = []
    try:
        while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
            if line == "drop":
                held.clear()
                _reply({"dropped": True})
                continue
            descriptor = receiver.decode_descriptor(bytes.fromhex(line))
            start = time.perf_counter()
            encoded = await receiver.get(descriptor)
            got_us = (time.perf_counter() - start) * 1e6
            if mode == "hop":
                del encoded
                await receiver.release(descriptor)
                _reply({"get_us": got_us})
                continue
            value = codec.decode(encoded)
            del encoded
            reply = {
                "tensors": [fingerprint(t) for t in value.tensors],
                "opens": OPENED.opens,
                "pid": os.getpid(),
            }
            if mode == "die":
                _reply(reply)
                os._exit(0)
            if mode == "hold":
                held.append(value)
            del value
            # Released before the reply, so the producer can rely on it having happened.
            await receiver.release(descriptor)
            _reply(reply)
    finally:
        await receiver.aclose()


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Peer:
    """A running peer process, from the producer's side."""

    def __init__(self, mode: str, options: dict[str, Any] | None = None) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.transports.cuda_ipc_peer",
                mode,
                json.dumps(options or {}),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def send(self, line: bytes) -> dict[str, Any]:
        """Send one line and wait for the peer's reply (blocking: tests call it off-loop)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line)
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the peer exited: {self.stderr()}")
        result: dict[str, Any] = json.loads(reply)
        return result

    def stderr(self) -> str:
        """What the peer wrote to stderr (only once it has exited)."""
        if self.process.poll() is None:
            return "(still running)"
        assert self.process.stderr is not None
        return self.process.stderr.read().decode(errors="replace")

    def close(self, timeout: float = 30.0) -> int:
        """End the peer (an empty line stops it) and return its exit status."""
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write(b"\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                pass
        try:
            return self.process.wait(timeout)
        finally:
            # What the CUDA driver and torch left in /dev/shm for the peer, however it ended.
            if self.process.poll() is not None:
                remove_cuda_files_of([self.process.pid])
            for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
                if stream is not None:
                    stream.close()


async def benchmark(
    sizes: tuple[int, ...] = (2**20, 2**22, 2**24, 2**26, 2**28, 2**30), rounds: int = 50
) -> dict[int, dict[str, float]]:
    """Hop latency of cuda_ipc by payload size: median put, get and round trip, in µs.

    The producer is this process and the consumer a ``hop`` peer. Each round puts the same
    CUDA tensor (so its export is cached, as a producer reusing an output buffer would),
    the peer gets it, releases it and answers; the round trip also holds a pipe's write
    and read each way. With no copy of the data, every figure should be flat in the size.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    transport = CudaIpcTransport(capacity=2 * max(sizes) + 2**20)
    sender = transport.open_sender(EdgeContext(EDGE, host_identity()))
    peer = Peer("hop", {"capacity": 2 * max(sizes) + 2**20})
    codec = codec_for(Tensors)
    results: dict[int, dict[str, float]] = {}
    try:
        for size in sizes:
            payload = Tensors([torch.ones(size, dtype=torch.uint8, device=device)])
            torch.cuda.synchronize()
            put_us, get_us, trip_us = [], [], []
            for i in range(rounds + 5):
                start = time.perf_counter()
                descriptor = await sender.put(
                    ChunkKey("bench", EDGE, i), codec.encode(payload), timeout=10
                )
                put_done = time.perf_counter()
                reply = await asyncio.to_thread(peer.send, descriptor_line(descriptor))
                end = time.perf_counter()
                if i >= 5:  # The first rounds open handles and events.
                    put_us.append((put_done - start) * 1e6)
                    get_us.append(float(reply["get_us"]))
                    trip_us.append((end - start) * 1e6)
            results[size] = {
                "put_us": statistics.median(put_us),
                "get_us": statistics.median(get_us),
                "hop_us": statistics.median(put_us) + statistics.median(get_us),
                "round_trip_us": statistics.median(trip_us),
            }
    finally:
        peer.close()
        await sender.aclose()
    return results


def main() -> None:
    mode = sys.argv[1]
    if mode == "bench":
        for size, row in asyncio.run(benchmark()).items():
            cells = "  ".join(f"{k} {v:9.1f}" for k, v in row.items())
            print(f"{size / 2**20:8.0f} MiB  {cells}")
        return
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    asyncio.run(_serve(mode, options))


if __name__ == "__main__":
    main()
