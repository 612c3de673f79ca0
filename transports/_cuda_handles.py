"""CUDA IPC handles for cuda_ipc: exported once per storage, opened once per process.

Producer side:

- :class:`ExportCache` exports a storage's allocation once. ``_share_cuda_`` returns the IPC
  handle of the caching allocator's *segment* (the ``cudaMalloc`` block the storage was
  carved from) and the storage's offset in it; every later tensor over the same storage
  reuses that pair, so a put costs a dictionary lookup, not a ``cudaIpcGetMemHandle``.
- :class:`EventPool` hands out interprocess CUDA events, recorded on the producing stream
  at put and returned when the payload is released.

Consumer side:

- :class:`OpenHandles` maps each segment handle once per process, on the consumer's own
  index of the producer's GPU (found by UUID, never by the producer's index), and keeps it
  mapped (least recently used beyond a bound) so the next payload from the same segment
  costs no ``cudaIpcOpenMemHandle``.
- :class:`OpenedEvents` opens each producer event once.

Nothing here pickles: handles are raw bytes that travel in msgspec descriptors. torch's
private storage-sharing methods are used exactly as ``torch.multiprocessing.reductions``
uses them (see ``reduce_tensor`` and ``rebuild_cuda_tensor`` there).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pipeline._errors import TransportError
from transports._cuda_files import note_cuda_ipc_used

__all__ = (
    "EXPORTS",
    "OPENED",
    "EventPool",
    "ExportCache",
    "OpenHandles",
    "OpenedEvents",
    "check_start_method",
    "device_uuid",
    "local_device",
    "require_cuda",
)


def check_start_method() -> None:
    """Refuse to run in a process that inherited CUDA through ``fork``.

    Such a process cannot use CUDA at all (torch fails with "Cannot re-initialize CUDA in
    forked subprocess"); this says why and what to do instead. Only looks if this process
    has imported torch, so a CPU-only process never imports it here.

    A parent whose start method is ``fork`` is not refused: on Linux that is the implicit
    default, ``multiprocessing.get_start_method(allow_none=True)`` reports it as soon as
    anything (a ``DataLoader``, a ``Queue``) touched the default context, and such a parent
    uses CUDA IPC perfectly well; only its forked children cannot, and they are refused here.

    Raises:
        TransportError: this process was forked from a parent that had initialised CUDA.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda._is_in_bad_fork():
        start = multiprocessing.get_start_method(allow_none=True) or "the default, fork"
        raise TransportError(
            "cuda_ipc cannot use CUDA in this process: it was forked from a parent that had "
            f"already initialised CUDA (start method: {start}). CUDA IPC needs the 'spawn' "
            "start method: call torch.multiprocessing.set_start_method('spawn') before "
            "starting worker processes, or start them as fresh interpreters, as stagewire's "
            "own workers are"
        )


def require_cuda(what: str) -> Any:
    """Return the torch module once it is certain that CUDA IPC can work here.

    Args:
        what: the operation that needs CUDA, for the message (``"put"``, ``"get"``).

    Raises:
        TransportError: CUDA is not available in this process, or ``fork`` broke it.
    """
    global _ready_in
    if _ready_in == os.getpid():
        # Checked already in this very process (a forked child has another pid and is
        # checked afresh): every put and get asks, so the answer is kept.
        return sys.modules["torch"]
    import torch

    if not torch.cuda.is_available():
        raise TransportError(
            f"cuda_ipc {what}: CUDA is not available in this process (pid {os.getpid()}), "
            "so it cannot move payloads whose tensors are on a GPU; run this stage where "
            "CUDA works, or use a shm or network edge, which carry such tensors via host "
            "memory"
        )
    check_start_method()
    # Python-side CUDA state (what torch.multiprocessing's rebuild calls _lazy_init for)
    # must exist before the private storage methods below run.
    torch.cuda.init()  # type: ignore[no-untyped-call]  # torch leaves init unannotated
    _ready_in = os.getpid()
    note_cuda_ipc_used()
    return torch


#: The pid of the process in which :func:`require_cuda` last succeeded.
_ready_in = 0


_uuids: dict[int, str] = {}
_indices: dict[str, int] | None = None


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` of this process, which names the GPU on any host."""
    uuid = _uuids.get(index)
    if uuid is None:
        import torch

        uuid = _uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
    return uuid


def local_device(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``, or its current device if it has none.

    Opening a handle under the producer's index would create a context on whatever GPU
    has that index here (SGLang #22662); the UUID finds the same physical GPU. A GPU this
    process cannot see is opened from the current device through peer access.
    """
    global _indices
    import torch

    if _indices is None:
        _indices = {device_uuid(i): i for i in range(torch.cuda.device_count())}
    found = _indices.get(uuid)
    return found if found is not None else int(torch.cuda.current_device())


@dataclass(slots=True)
class _Export:
    """One exported storage: a weak reference keeps its identity from being reused."""

    weak: Any
    handle: bytes
    offset: int


@dataclass(slots=True)
class ExportCache:
    """Segment handles by storage, exported once each (one per process: :data:`EXPORTS`).

    Attributes:
        exports: how many storages were exported (each a ``cudaIpcGetMemHandle``).
    """

    exports: int = 0
    _by_storage: dict[int, _Export] = field(default_factory=dict)
    _limit: int = 128

    def export(self, flat: Any) -> tuple[bytes, int]:
        """The segment handle of ``flat``'s bytes and their offset in the segment.

        Raises:
            RuntimeError: the storage is not from this process's caching allocator (it was
                received over CUDA IPC, or wraps foreign memory); copy it first.
        """
        storage = flat.untyped_storage()
        # _cdata is the address of the StorageImpl. The weak reference held below keeps
        # that address from being reused for another storage, so an entry found here is
        # this very storage.
        entry = self._by_storage.get(storage._cdata)
        if entry is None or entry.weak.expired():
            entry = self._export(storage)
        # flat is a uint8 view, so its storage offset is a byte offset.
        return entry.handle, entry.offset + int(flat.storage_offset())

    def _export(self, storage: Any) -> _Export:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        shared = storage._share_cuda_()
        _device, handle, _size, offset, ref_counter, ref_counter_offset = shared[:6]
        # _share_cuda_ also put the storage behind torch's own IPC reference count, set to
        # one for a consumer that would rebuild it with torch.multiprocessing and count it
        # down when done. Ours never does: the producer keeps the storage alive itself until
        # the release table says so. Give the count back now, or the allocation would wait
        # in torch's "limbo" for ever once the storage dies.
        torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, ref_counter_offset)
        # StorageWeakRef is unannotated in torch.
        weak = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        entry = _Export(weak, bytes(handle), int(offset))
        self._by_storage[storage._cdata] = entry
        self.exports += 1
        if len(self._by_storage) > self._limit:
            self._forget_dead()
        return entry

    def _forget_dead(self) -> None:
        """Drop the entries of storages that died; scale the limit with those that live."""
        for key, entry in list(self._by_storage.items()):
            if entry.weak.expired():
                del self._by_storage[key]
        self._limit = max(128, 2 * len(self._by_storage))


#: The producer's export cache, shared by every sender of the process.
EXPORTS = ExportCache()


@dataclass(slots=True)
class PooledEvent:
    """An interprocess event and, once recorded, its IPC handle."""

    event: Any
    device: int
    handle: bytes = b""


class EventPool:
    """Interprocess CUDA events per device, reused once their payload is released."""

    __slots__ = ("_free", "created")

    def __init__(self) -> None:
        self._free: dict[int, list[PooledEvent]] = {}
        self.created = 0

    def record(self, device: int) -> PooledEvent:
        """An event recorded now on ``device``'s current stream, with its IPC handle."""
        import torch

        free = self._free.get(device)
        if free:
            pooled = free.pop()
        else:
            # Interprocess events must not time. Event's constructor is unannotated in torch.
            event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            pooled = PooledEvent(event, device)
            self.created += 1
        # The event is created lazily on the device of the stream it is first recorded on;
        # only then is its handle taken, so it always belongs to ``device``.
        pooled.event.record(torch.cuda.current_stream(device))
        if not pooled.handle:
            pooled.handle = bytes(pooled.event.ipc_handle())
        return pooled

    def give_back(self, pooled: PooledEvent) -> None:
        """Return an event whose payload the consumer has released."""
        self._free.setdefault(pooled.device, []).append(pooled)


@dataclass(slots=True)
class _Anchor:
    """A mapped segment: a one-byte storage at its start keeps torch's mapping open."""

    storage: Any
    base: int


class OpenHandles:
    """Mapped segments by (handle, device), least recently used dropped past ``capacity``.

    Dropping one only drops this cache's reference: every tensor built over a segment
    holds its anchor, so the mapping closes when the last of them dies.

    Attributes:
        opens: how many handles were mapped (each a ``cudaIpcOpenMemHandle``).
    """

    __slots__ = ("_open", "capacity", "opens")

    def __init__(self, capacity: int = 64) -> None:
        self._open: OrderedDict[tuple[bytes, int], _Anchor] = OrderedDict()
        self.capacity = capacity
        self.opens = 0

    def open(self, handle: bytes, device: int) -> _Anchor:
        """The mapping of segment ``handle`` on this process's ``device``.

        Raises:
            RuntimeError: CUDA could not map the handle (the producer died or freed it).
        """
        key = (handle, device)
        anchor = self._open.get(key)
        if anchor is not None:
            self._open.move_to_end(key)
            return anchor
        import torch

        # _new_shared_cuda maps the handle on ``device`` (it switches to it for the call),
        # through the caching allocator's per-process handle cache, exactly as
        # torch.multiprocessing's rebuild_cuda_tensor does. No reference count and no event
        # come with it: the release table does the one, the descriptor's event the other.
        # (When this anchor dies, torch tries to count down a reference file named "",
        # which fails quietly by design; it is what a producer that exited looks like.)
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device, handle, 1, 0, b"", 0, b"", False
            )
        anchor = self._open[key] = _Anchor(storage, int(storage.data_ptr()))
        self.opens += 1
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        return anchor


class OpenedEvents:
    """Producer events opened in this process, by (handle, device); LRU past ``capacity``."""

    __slots__ = ("_open", "capacity")

    def __init__(self, capacity: int = 1024) -> None:
        self._open: OrderedDict[tuple[bytes, int], Any] = OrderedDict()
        self.capacity = capacity

    def wait(self, handle: bytes, device: int) -> None:
        """Make ``device``'s current stream wait for the producer's event ``handle``.

        Raises:
            RuntimeError: CUDA could not open the event.
        """
        import torch

        key = (handle, device)
        event = self._open.get(key)
        if event is None:
            # from_ipc_handle is unannotated in torch.
            opened = torch.cuda.Event.from_ipc_handle(device, handle)  # type: ignore[no-untyped-call]
            event = self._open[key] = opened
            while len(self._open) > self.capacity:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(key)
        torch.cuda.current_stream(device).wait_event(event)


#: The consumer's mapped segments and opened events, shared by every receiver.
OPENED = OpenHandles()
OPENED_EVENTS = OpenedEvents()
