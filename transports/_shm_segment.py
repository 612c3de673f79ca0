"""The shm transport's segments: naming, creation, attaching, and sweeping what the dead left.

A segment is one file under ``/dev/shm``, opened with ``os.open`` and mapped with ``mmap``.
``multiprocessing.shared_memory`` is deliberately not used: it registers every segment with
Python's resource tracker, which unlinks or warns about segments at exit that other
processes still use.

Layout (native 8-byte words, since a descriptor never leaves its host)::

    header   MAGIC OWNER_PID OWNER_PIDNS SLOTS DATA_OFFSET CAPACITY CLOSED -
    slots    per slot, 8 words: GEN OFFSET LENGTH - RELEASED READER - -
    data     CAPACITY bytes of extents, from DATA_OFFSET (page-aligned)

Every word has a single writer, so no cross-process atomics are needed. The producer writes
the header and each slot's GEN, OFFSET and LENGTH; the consumer writes RELEASED (the
generation it has finished with) and READER (the low 32 bits of the generation it reads in
the high half, its pid in the low half: one word, so the pair is never torn). Words are read
and written through a ``memoryview`` cast to ``"Q"``, whose element access compiles to one
aligned 8-byte load or store, so no reader sees half a word.

Liveness is an ``flock``: the owner holds a shared lock on its segment for as long as it
lives, and the kernel drops it when the process dies, even by ``SIGKILL``. A sweeper that
can take the lock exclusively knows the owner is gone, whatever pid namespace it ran in and
whether or not its pid has been reused since (both common in restarted containers, which
keep ``/dev/shm``). A child forked without exec would inherit the lock and keep its
parent's segments "alive" while it runs; workers are started with spawn, which does not.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import mmap
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Iterable

from pipeline._errors import ProducerLost, TransportError
from pipeline._units import format_size
from transports._liveness import pid_alive, pid_namespace
from transports._shm_arena import align_up

__all__ = (
    "CLOSED",
    "HEADER_WORDS",
    "NAME_PATTERN",
    "PREFIX",
    "SHM_DIR",
    "SLOT_GEN",
    "SLOT_LENGTH",
    "SLOT_OFFSET",
    "SLOT_READER",
    "SLOT_RELEASED",
    "SLOT_WORDS",
    "OwnedSegment",
    "Segment",
    "attach_segment",
    "create_segment",
    "list_segments",
    "remove_segments_of",
    "segment_exists",
    "sweep_dead_owners",
)

#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"
#: Every segment name starts with this; nothing else under /dev/shm is ever touched.
PREFIX = "stagewire-shm-"
#: A segment name: the prefix, the owner's pid, and 64 random bits. Being a single path
#: component of known characters, it cannot name anything outside /dev/shm.
NAME_PATTERN = r"^stagewire-shm-[0-9]{1,10}-[0-9a-f]{16}$"
_NAME_RE = re.compile(NAME_PATTERN)

_MAGIC = int.from_bytes(b"stgwshm1", "little")
# Header words.
_MAGIC_WORD, _OWNER_PID, _OWNER_PIDNS, _SLOTS, _DATA_OFFSET, _CAPACITY = range(6)
#: Header word the producer sets to 1 when it closes the segment.
CLOSED = 6
HEADER_WORDS = 8
# Slot words: the producer writes the first three, the consumer the next two.
SLOT_WORDS = 8
SLOT_GEN, SLOT_OFFSET, SLOT_LENGTH, SLOT_RELEASED, SLOT_READER = 0, 1, 2, 4, 5

#: A segment whose header was never finished is left alone for this long if the pid in its
#: name still runs: its owner may be creating it right now.
_CREATION_GRACE_S = 60.0


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _pid_of(name: str) -> int:
    return int(name[len(PREFIX) :].partition("-")[0])


class Segment:
    """One mapped segment: its header and slot table as words, its data area as bytes.

    Attributes:
        name: the segment's file name under /dev/shm.
        words: the header and slot table, as native 8-byte words.
        data: the data area, ``capacity`` bytes.
        slots: how many extent slots the table has.
        capacity: the size of the data area.
        owner_pidns: the pid namespace of the producer.
        closed: whether :meth:`close` ran (the views are then released).
    """

    __slots__ = ("_mm", "capacity", "closed", "data", "name", "owner_pidns", "slots", "words")

    def __init__(
        self, name: str, mm: mmap.mmap, *, data_offset: int, slots: int, capacity: int
    ) -> None:
        self.name = name
        self._mm = mm
        whole = memoryview(mm)
        self.words = whole[:data_offset].cast("Q")
        self.data = whole[data_offset : data_offset + capacity]
        # The slices keep the mapping exported; the parent view itself is not needed.
        whole.release()
        self.slots = slots
        self.capacity = capacity
        self.owner_pidns = 0
        self.closed = False

    @staticmethod
    def slot_base(slot: int) -> int:
        """The index in :attr:`words` of ``slot``'s first word."""
        return HEADER_WORDS + slot * SLOT_WORDS

    def closed_by_owner(self) -> bool:
        """Whether the producer has closed this segment."""
        return self.words[CLOSED] != 0

    def close(self) -> bool:
        """Drop this process's views and unmap; idempotent.

        Returns:
            True if the mapping is gone now; False if views handed out by ``get`` still
            use it, in which case it is unmapped when the last of them is collected.
        """
        if not self.closed:
            self.closed = True
            for view in (self.words, self.data):
                # A view someone took a buffer of cannot be released; the garbage
                # collector releases it with its last user.
                with contextlib.suppress(BufferError):
                    view.release()
        try:
            self._mm.close()
        except BufferError:
            return False
        return True


class OwnedSegment(Segment):
    """A segment this process created: it holds the liveness lock and unlinks on close."""

    __slots__ = ("_fd",)

    def __init__(
        self, name: str, mm: mmap.mmap, fd: int, *, data_offset: int, slots: int, capacity: int
    ) -> None:
        super().__init__(name, mm, data_offset=data_offset, slots=slots, capacity=capacity)
        self._fd = fd

    def destroy(self) -> None:
        """Tell readers it is closed, unlink it, unmap it and drop the lock; idempotent."""
        if self._fd < 0:
            return
        if not self.closed:
            self.words[CLOSED] = 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(self.name))
        with _owned_lock:
            _owned.pop(self.name, None)
        self.close()
        fd, self._fd = self._fd, -1
        os.close(fd)


def free_space() -> int:
    """Bytes that an unprivileged process may still allocate under /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_segment(capacity: int, slots: int) -> OwnedSegment:
    """Create, reserve, pre-fault and map a new segment with ``slots`` slots.

    Dead owners' segments are swept first, once per process. The whole size is reserved
    with ``posix_fallocate``, since tmpfs otherwise allocates on first touch and a full
    /dev/shm would then be a SIGBUS in the middle of a run; the mapping is pre-faulted with
    ``MAP_POPULATE``, since touching a fresh page costs far more than copying into it.

    Raises:
        TransportError: /dev/shm lacks the space, or the segment cannot be created.
    """
    _sweep_once()
    data_offset = align_up((HEADER_WORDS + slots * SLOT_WORDS) * 8, mmap.PAGESIZE)
    size = data_offset + align_up(capacity, mmap.PAGESIZE)
    free = free_space()
    if size > free:
        raise TransportError(
            f"the shm transport needs {format_size(size)} of {SHM_DIR} for a segment of "
            f"capacity {format_size(capacity)}, but only {format_size(free)} is free: lower "
            f"the transport's `capacity` option or enlarge {SHM_DIR} (docker run --shm-size, "
            "or a larger memory-backed emptyDir on Kubernetes)"
        )
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise TransportError(f"cannot create shm segment {path}: {exc.strerror}") from exc
    try:
        # Held until the segment is destroyed or this process dies: see sweep_dead_owners.
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise TransportError(
                f"cannot reserve {format_size(size)} in {SHM_DIR} ({exc.strerror}); "
                f"{format_size(free_space())} is free: lower the transport's `capacity` "
                f"option or enlarge {SHM_DIR}"
            ) from exc
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            raise TransportError(f"cannot map shm segment {name}: {exc.strerror}") from exc
        segment = OwnedSegment(
            name, mm, fd, data_offset=data_offset, slots=slots, capacity=capacity
        )
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    words = segment.words
    words[_OWNER_PID] = os.getpid()
    words[_OWNER_PIDNS] = segment.owner_pidns = pid_namespace()
    words[_SLOTS] = slots
    words[_DATA_OFFSET] = data_offset
    words[_CAPACITY] = capacity
    # Last: a segment with its magic written is complete, for readers and sweepers alike.
    words[_MAGIC_WORD] = _MAGIC
    with _owned_lock:
        _owned[name] = os.getpid()
    return segment


def attach_segment(name: str) -> Segment:
    """Map an existing segment that another process (or this one) created.

    The mapping is pre-faulted once here, so reading extents later costs no page faults.
    The segment is not registered anywhere: only its owner may remove it.

    Raises:
        ProducerLost: there is no such segment (its producer closed it or died).
        TransportError: the name or the segment is not a valid one.
    """
    if not _NAME_RE.fullmatch(name):
        raise TransportError(f"{name!r} is not an shm segment name")
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProducerLost(
            f"shm segment {name!r} does not exist: its producer closed it or died"
        ) from None
    except OSError as exc:
        raise TransportError(f"cannot open shm segment {name!r}: {exc.strerror}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < mmap.PAGESIZE:
            raise TransportError(f"shm segment {name!r} is not initialised ({size} bytes)")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)  # The mapping keeps its own reference to the file.
    head = memoryview(mm)[: HEADER_WORDS * 8].cast("Q")
    magic, slots, data_offset, capacity = (
        head[_MAGIC_WORD],
        head[_SLOTS],
        head[_DATA_OFFSET],
        head[_CAPACITY],
    )
    owner_pidns = head[_OWNER_PIDNS]
    head.release()
    if (
        magic != _MAGIC
        or slots < 1
        or data_offset % 8
        or data_offset < (HEADER_WORDS + slots * SLOT_WORDS) * 8
        or data_offset + capacity > size
    ):
        mm.close()
        raise TransportError(f"shm segment {name!r} has an invalid header")
    segment = Segment(name, mm, data_offset=data_offset, slots=slots, capacity=capacity)
    segment.owner_pidns = owner_pidns
    return segment


def segment_exists(name: str) -> bool:
    """Whether segment ``name`` still has a name under /dev/shm."""
    return os.path.exists(_path(name))


def list_segments() -> list[str]:
    """The names of every shm transport segment under /dev/shm, whoever owns them."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _NAME_RE.fullmatch(n))


def _owner_gone(name: str, now: float) -> bool:
    """Whether the process that created segment ``name`` no longer holds it."""
    try:
        fd = os.open(_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # Already gone, or not ours to judge.
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # Its owner holds the lock: it is alive.
        head = os.pread(fd, 8, 0)
        if len(head) == 8 and int.from_bytes(head, sys.byteorder) == _MAGIC:
            return True
        # An unfinished header: creation crashed, or is under way at this very moment.
        young = now - os.fstat(fd).st_mtime < _CREATION_GRACE_S
        return not (young and pid_alive(_pid_of(name)))
    finally:
        os.close(fd)  # Also drops the lock just taken.


def _unlink(name: str) -> bool:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        return False
    return True


def sweep_dead_owners() -> list[str]:
    """Unlink the segments whose owner process has died; the names removed.

    Runs automatically once per process before its first segment is created. It only
    ever touches names that match the shm transport's exact pattern.
    """
    now = time.time()
    return [name for name in list_segments() if _owner_gone(name, now) and _unlink(name)]


def remove_segments_of(pids: Iterable[int], *, held_too: bool = False) -> list[str]:
    """Unlink the segments created by one of ``pids`` that no process holds; the names
    removed.

    For a parent that knows which worker pids it started, once they have exited. A name
    carries its creator's pid as its own pid namespace numbers it, so another deployment
    sharing /dev/shm from another namespace (a container on the host's IPC namespace) can
    have a live segment under the same pid: its owner's lock keeps it. With ``held_too``,
    held segments go as well (tests that must not leave one behind). A process still using
    a removed segment keeps its mapping; only new readers fail.
    """
    wanted = {int(pid) for pid in pids}
    now = time.time()
    return [
        name
        for name in list_segments()
        if _pid_of(name) in wanted and (held_too or _owner_gone(name, now)) and _unlink(name)
    ]


_sweep_lock = threading.Lock()
_swept_in_pid = 0


def _sweep_once() -> None:
    global _swept_in_pid
    with _sweep_lock:
        if _swept_in_pid != os.getpid():
            _swept_in_pid = os.getpid()
            sweep_dead_owners()


# Segments this process created and has not destroyed, with the pid that created them: a
# child forked later inherits this table but must not unlink its parent's segments.
_owned: dict[str, int] = {}
#: Reentrant: any allocation under it may run the cycle collector, whose finalizers may
#: destroy a sender left in a cycle, which takes it again in the same thread.
_owned_lock = threading.RLock()


@atexit.register
def _unlink_owned_at_exit() -> None:
    """Unlink this process's segments whose senders were never closed."""
    global _owned
    with _owned_lock:
        # Swapped, not iterated in place: a finalizer run meanwhile (see _owned_lock)
        # removes its segment from the table, which must not change under the loop.
        owned, _owned = _owned, {}
    pid = os.getpid()
    for name, creator in owned.items():
        if creator == pid:
            _unlink(name)
