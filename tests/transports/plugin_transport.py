"""A plug-in transport defined outside the ``transports`` package: payloads travel as files.

:class:`EchoTransport` echoes each payload through a file in a directory that both ends
name in their options, so it works between processes on one host, which is all a pipeline
edge needs. It is everything inline is not:

- bounded: a sender holds at most ``capacity`` bytes of unreleased files, and a put waits
  for the consumer to release space, up to its deadline;
- stale-detecting: file names are never reused and ``release`` deletes the file, so a
  released descriptor can never be read again;
- host-local: a descriptor names its host and is refused on any other.

The tests import it by path (``tests.transports.plugin_transport:EchoTransport``) and
through a fake entry point, and run the public conformance suite and a real pipeline over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, ClassVar

import msgspec

# Only public names, as a third party would import them: the errors and keys from
# ``pipeline``, the payload and the protocol's types from ``transports``.
from pipeline import ChunkKey, TransportError
from transports import (
    Descriptor,
    EdgeContext,
    Encoded,
    TransportCapabilities,
    TransportStatistics,
)

__all__ = ("EchoDescriptor", "EchoReceiver", "EchoSender", "EchoTransport")

#: How often a put waiting for capacity looks again: space is freed by another process,
#: which has no way to wake this one.
_POLL = 0.005

#: A single path component that cannot climb out of the transport's directory.
_Component = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")]


class EchoDescriptor(Descriptor, frozen=True, tag="echo"):
    """Where one payload's file is, and how to cut it back into header and buffers."""

    host: str
    folder: _Component
    file: _Component
    sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]


_decoder = msgspec.msgpack.Decoder(EchoDescriptor)


def _write(path: Path, encoded: Encoded) -> None:
    """Write the payload to a hidden file, then rename it, so no reader sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(encoded.header)
        for buf in encoded.buffers:
            f.write(buf)
    tmp.replace(path)


def _stored(directory: Path) -> int:
    """Bytes held by the finished files of ``directory``."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.startswith("."):
                    # A file may be released while we look.
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
    except FileNotFoundError:
        return 0
    return total


def _read(path: Path) -> bytearray:
    """The file's bytes, in memory this process owns (so decoded tensors may share it)."""
    with path.open("rb") as f:
        return bytearray(f.read())


class EchoSender:
    """Producer end: writes each payload to a file of its own folder."""

    def __init__(self, edge: EdgeContext, root: Path, capacity: int) -> None:
        self._edge = edge
        self._capacity = capacity
        self._folder = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._dir = root / self._folder
        self._dir.mkdir(parents=True)
        self._names = itertools.count()
        self._reserved = 0
        self._closing = asyncio.Event()
        self.chunks = 0
        self.bytes = 0
        self.errors = 0

    def _error(self, message: str) -> TransportError:
        self.errors += 1
        return TransportError(f"echo sender for edge {self._edge.edge!r}: {message}")

    async def put(
        self, key: ChunkKey, encoded: Encoded, *, timeout: float | None = None
    ) -> EchoDescriptor:
        """Write ``encoded`` to a new file once there is room for it.

        Raises:
            TransportError: the payload exceeds the capacity, no room within ``timeout``,
                the write failed, or the sender is closed.
        """
        size = encoded.nbytes
        if size > self._capacity:
            raise self._error(f"{key}: {size} bytes exceed the capacity of {self._capacity}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closing.is_set():
                raise self._error("closed")
            if _stored(self._dir) + self._reserved + size <= self._capacity:
                break
            wait = _POLL if deadline is None else min(_POLL, deadline - loop.time())
            if wait <= 0:
                raise self._error(f"{key}: no room for {size} bytes within {timeout:g}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), wait)
        # Reserved bytes count as stored until the file exists, so concurrent puts
        # cannot both take the last of the space.
        self._reserved += size
        name = f"{next(self._names)}-{key.seq}"
        try:
            await asyncio.to_thread(_write, self._dir / name, encoded)
        except OSError as exc:
            raise self._error(f"{key}: cannot write the payload: {exc}") from exc
        finally:
            self._reserved -= size
        self.chunks += 1
        self.bytes += size
        sizes = [len(encoded.header), *(memoryview(b).nbytes for b in encoded.buffers)]
        return EchoDescriptor(self._edge.host, self._folder, name, sizes)

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes written so far."""
        return TransportStatistics(
            "echo", self.chunks, self.bytes, errors=self.errors, by_transport={"echo": self.chunks}
        )

    async def aclose(self) -> None:
        """Fail waiting puts and delete every file this sender wrote; idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        await asyncio.to_thread(shutil.rmtree, self._dir, ignore_errors=True)


class EchoReceiver:
    """Consumer end: reads files named by descriptors and deletes them on release."""

    def __init__(self, edge: EdgeContext, root: Path) -> None:
        self._edge = edge
        self._root = root
        self._closed = False
        self._pinned: set[Path] = set()
        self.chunks = 0
        self.bytes = 0
        self.errors = 0

    def _error(self, message: str) -> TransportError:
        self.errors += 1
        return TransportError(f"echo receiver for edge {self._edge.edge!r}: {message}")

    def decode_descriptor(self, raw: bytes | memoryview) -> EchoDescriptor:
        """Parse an echo descriptor.

        Raises:
            TransportError: ``raw`` is not an echo descriptor.
        """
        try:
            return _decoder.decode(raw)
        # msgspec raises UnicodeDecodeError, not DecodeError, for strings that are not UTF-8.
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise self._error(f"bad descriptor: {exc}") from exc

    def _path(self, descriptor: EchoDescriptor) -> Path:
        return self._root / descriptor.folder / descriptor.file

    async def get(self, descriptor: Descriptor) -> Encoded:
        """Read the payload's file.

        Raises:
            TransportError: the descriptor is not an echo one, names another host, is
                stale or does not match its file, or the receiver is closed.
        """
        if self._closed:
            raise self._error("closed")
        if not isinstance(descriptor, EchoDescriptor):
            raise self._error(f"got a {type(descriptor).__name__}, not an EchoDescriptor")
        if descriptor.host != self._edge.host:
            raise self._error(
                f"the descriptor names host {descriptor.host!r}; this is {self._edge.host!r}"
            )
        path = self._path(descriptor)
        try:
            data = await asyncio.to_thread(_read, path)
        except FileNotFoundError as exc:
            raise self._error(f"{descriptor.file!r} is stale or was never written") from exc
        except OSError as exc:
            raise self._error(f"cannot read {descriptor.file!r}: {exc}") from exc
        if len(data) != sum(descriptor.sizes):
            raise self._error(
                f"{descriptor.file!r} holds {len(data)} bytes, not {sum(descriptor.sizes)}"
            )
        view = memoryview(data)
        offsets = list(itertools.accumulate(descriptor.sizes, initial=0))
        parts = [view[start:end] for start, end in itertools.pairwise(offsets)]
        self._pinned.add(path)
        self.chunks += 1
        self.bytes += len(data)
        return Encoded(bytes(parts[0]), tuple(parts[1:]))

    async def release(self, descriptor: Descriptor) -> None:
        """Delete the payload's file; never raises, since it runs after a failed get too."""
        if isinstance(descriptor, EchoDescriptor) and descriptor.host == self._edge.host:
            path = self._path(descriptor)
            self._pinned.discard(path)
            await asyncio.to_thread(path.unlink, missing_ok=True)

    def statistics(self) -> TransportStatistics:
        """Chunks and bytes read so far."""
        return TransportStatistics(
            "echo", self.chunks, self.bytes, errors=self.errors, by_transport={"echo": self.chunks}
        )

    async def aclose(self) -> None:
        """Delete the files read but not released; idempotent."""
        self._closed = True
        pinned, self._pinned = self._pinned, set()
        for path in pinned:
            await asyncio.to_thread(path.unlink, missing_ok=True)


class EchoTransport:
    """Payloads through files under ``directory``, at most ``capacity`` bytes per sender."""

    name: ClassVar[str] = "echo"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        bounded=True, detects_stale=True, host_local=True
    )

    def __init__(self, *, directory: str | None = None, capacity: int = 4 * 2**20) -> None:
        # The registry turns TypeError into ConfigError, so every bad option raises one.
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise TypeError(f"capacity must be a positive number of bytes, got {capacity!r}")
        self.root = Path(directory or Path(tempfile.gettempdir()) / "stagewire-echo")
        self.capacity = capacity

    def open_sender(self, edge: EdgeContext) -> EchoSender:
        """Open the producer's end, with a folder of its own."""
        return EchoSender(edge, self.root, self.capacity)

    def open_receiver(self, edge: EdgeContext) -> EchoReceiver:
        """Open the consumer's end."""
        return EchoReceiver(edge, self.root)
