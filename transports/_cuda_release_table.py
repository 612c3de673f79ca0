"""The release table: how a cuda_ipc consumer tells its producer a payload is free, unasked.

A cuda_ipc sender owns one small shared-memory file under ``/dev/shm`` (on systems without
it, the temp directory). Every payload it puts holds one slot of the table until the
consumer is done with it; the descriptor names the table, the slot and a generation. A
slot is four 64-bit words:

- ``issued``: the generation of the payload that holds the slot (0 if never used);
- ``released``: the generation the consumer last finished with;
- ``reader`` and ``reader_ns``: the pid (and pid namespace) of the process that read it
  last, so that a producer waiting for room can reclaim the payloads of a dead reader.

Generations count up from 1 per table and are never reused, so ``(slot, generation)`` names
one payload for the life of the table: it is live while ``issued == generation`` and
``released != generation``, and stale otherwise. The consumer writes ``released`` and the
producer reads it on its next put (or while a put waits for room), so releasing costs no
message. Every word is written by one side only, as a single aligned 8-byte store.

Names carry the owner's pid and 64 random bits; tables whose owner has died are unlinked
when a process creates its first table, so a ``kill -9`` leaves a few KiB behind at most
until the next sender starts on that host.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import tempfile
import threading
from enum import Enum
from pathlib import Path

from pipeline._errors import TransportError
from transports._liveness import pid_alive, pid_namespace

__all__ = (
    "NAME_PATTERN",
    "ReleaseTable",
    "SlotState",
    "sweep_dead_tables",
)

PREFIX = "stagewire-cudaipc-"
#: A table name: one path component of known characters, so it names nothing outside the
#: table directory.
NAME_PATTERN = r"^stagewire-cudaipc-[0-9]{1,10}-[0-9a-f]{16}$"
_NAME_RE = re.compile(NAME_PATTERN)
_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())

_MAGIC = int.from_bytes(b"stgwcipc", "little")
_VERSION = 1
# Header words, then four words per slot.
_HEADER_WORDS = 8
_W_MAGIC, _W_VERSION, _W_SLOTS, _W_OWNER, _W_OWNER_NS = range(5)
_SLOT_WORDS = 4
_ISSUED, _RELEASED, _READER, _READER_NS = range(4)
_MAX_SLOTS = 1 << 20


class SlotState(Enum):
    """What a ``(slot, generation)`` pair names now."""

    LIVE = "live"
    RELEASED = "released"
    STALE = "stale"


_swept = False
_sweep_lock = threading.Lock()


def sweep_dead_tables() -> list[str]:
    """Unlink the tables whose owner died in this pid namespace; the names removed.

    Only names matching the exact pattern are touched, and only when the owner recorded
    this process's pid namespace, so a live owner in another container is never mistaken
    for a dead one.
    """
    removed: list[str] = []
    ours = pid_namespace()
    try:
        entries = list(os.scandir(_DIR))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not _NAME_RE.match(name):
            continue
        pid = int(name[len(PREFIX) :].partition("-")[0])
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            with open(entry.path, "rb") as f:
                header = f.read(_HEADER_WORDS * 8)
        except OSError:
            continue
        if len(header) < _HEADER_WORDS * 8:
            owner_ns = ours  # Torn at creation: the owner died before writing its header.
        else:
            owner_ns = int.from_bytes(header[_W_OWNER_NS * 8 : _W_OWNER_NS * 8 + 8], "little")
        if owner_ns not in (0, ours):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(name)
    return removed


def _sweep_once() -> None:
    global _swept
    with _sweep_lock:
        if not _swept:
            _swept = True
            sweep_dead_tables()


class ReleaseTable:
    """One mapped table; the owner (producer) side creates it, readers open it by name.

    Attributes:
        name: the table's file name, which descriptors carry.
        slots: how many payloads it can track at once.
        owner: whether this process created it (and unlinks it on close).
    """

    __slots__ = ("_map", "_words", "name", "owner", "slots")

    def __init__(self, name: str, slots: int, mapping: mmap.mmap, *, owner: bool) -> None:
        self.name = name
        self.slots = slots
        self.owner = owner
        self._map = mapping
        self._words: memoryview | None = memoryview(mapping).cast("Q")

    @classmethod
    def create(cls, slots: int) -> ReleaseTable:
        """Create a table of ``slots`` slots for this process to own.

        Raises:
            TransportError: the file cannot be created or its space reserved.
        """
        if not 1 <= slots <= _MAX_SLOTS:
            raise ValueError(f"slots must be between 1 and {_MAX_SLOTS}, got {slots}")
        _sweep_once()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = _DIR / name
        size = (_HEADER_WORDS + slots * _SLOT_WORDS) * 8
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create cuda_ipc release table {path}: {exc}") from exc
        try:
            try:
                # Reserve the pages now: tmpfs allocates lazily, and a full /dev/shm would
                # otherwise surface as SIGBUS on first touch.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise TransportError(
                    f"cannot reserve {size} bytes for cuda_ipc release table {path}: {exc}"
                ) from exc
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        table = cls(name, slots, mapping, owner=True)
        words = table._live_words()
        words[_W_VERSION] = _VERSION
        words[_W_SLOTS] = slots
        words[_W_OWNER] = os.getpid()
        words[_W_OWNER_NS] = pid_namespace()
        # The magic goes last: a reader that sees it sees a complete header.
        words[_W_MAGIC] = _MAGIC
        return table

    @classmethod
    def open(cls, name: str) -> ReleaseTable:
        """Map the table ``name`` that another end created.

        Raises:
            TransportError: the name is malformed, the table is gone (its producer closed
                or died), or the file is not a release table.
        """
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise TransportError(f"{name!r} is not a cuda_ipc release table name")
        path = _DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise TransportError(
                f"cuda_ipc release table {name!r} is gone: its producer closed or died"
            ) from exc
        except OSError as exc:
            raise TransportError(f"cannot open cuda_ipc release table {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER_WORDS * 8 or size % 8:
                raise TransportError(f"{path} is not a cuda_ipc release table ({size} bytes)")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = memoryview(mapping).cast("Q")
        try:
            magic, version, slots = words[_W_MAGIC], words[_W_VERSION], words[_W_SLOTS]
        finally:
            words.release()
        if magic != _MAGIC or version != _VERSION:
            mapping.close()
            raise TransportError(f"{path} is not a cuda_ipc release table of this version")
        if not 1 <= slots <= _MAX_SLOTS or size != (_HEADER_WORDS + slots * _SLOT_WORDS) * 8:
            mapping.close()
            raise TransportError(f"{path} has a corrupt header ({slots} slots, {size} bytes)")
        return cls(name, slots, mapping, owner=False)

    def _live_words(self) -> memoryview:
        words = self._words
        if words is None:
            raise TransportError(f"cuda_ipc release table {self.name!r} is closed")
        return words

    def _base(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise TransportError(f"slot {slot} is outside release table {self.name!r}")
        return _HEADER_WORDS + slot * _SLOT_WORDS

    # ---- producer side ----------------------------------------------------------------

    def issue(self, slot: int, generation: int) -> None:
        """Stamp ``slot`` as holding the payload of ``generation`` (producer only)."""
        words, base = self._live_words(), self._base(slot)
        words[base + _READER] = 0
        words[base + _READER_NS] = 0
        words[base + _ISSUED] = generation

    def is_released(self, slot: int, generation: int) -> bool:
        """Whether the consumer has finished with the payload of ``generation``."""
        return bool(self._live_words()[self._base(slot) + _RELEASED] == generation)

    def reader(self, slot: int) -> tuple[int, int]:
        """The pid and pid namespace of the last reader of ``slot`` (``(0, 0)`` if none)."""
        words, base = self._live_words(), self._base(slot)
        return words[base + _READER], words[base + _READER_NS]

    # ---- consumer side ----------------------------------------------------------------

    def state(self, slot: int, generation: int) -> SlotState:
        """What ``(slot, generation)`` names now.

        Raises:
            TransportError: the slot is outside the table, or the table is closed.
        """
        words, base = self._live_words(), self._base(slot)
        if generation <= 0 or words[base + _ISSUED] != generation:
            return SlotState.STALE
        if words[base + _RELEASED] == generation:
            return SlotState.RELEASED
        return SlotState.LIVE

    def mark_reader(self, slot: int, generation: int, pid: int, namespace: int) -> None:
        """Record that process ``pid`` read the payload of ``generation``."""
        words, base = self._live_words(), self._base(slot)
        if words[base + _ISSUED] == generation:
            words[base + _READER_NS] = namespace
            words[base + _READER] = pid

    def release(self, slot: int, generation: int) -> bool:
        """Tell the producer the payload of ``generation`` is free; False if it was stale.

        Safe from any thread, and after :meth:`close` (it then does nothing).
        """
        words = self._words
        if words is None or not 0 <= slot < self.slots:
            return False
        base = _HEADER_WORDS + slot * _SLOT_WORDS
        if words[base + _ISSUED] != generation:
            return False
        words[base + _RELEASED] = generation
        return True

    # ---- lifecycle ----------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the table's name, so no new reader can open it; mapped ends keep working."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_DIR / self.name)

    def close(self) -> None:
        """Unmap the table (and unlink it, for its owner); idempotent."""
        self.unlink()
        words, self._words = self._words, None
        if words is not None:
            words.release()
            self._map.close()
