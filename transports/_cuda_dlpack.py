"""Tensors over memory that torch did not allocate, with a callback once torch frees them.

A cuda_ipc consumer maps its producer's GPU memory and must know when the last tensor
over a payload's bytes has died, however many views the codec and the stage made of it:
only then may the producer reuse them. DLPack gives exactly that. A ``DLManagedTensor``
built here points at the bytes, and torch calls its ``deleter`` when the tensor's storage
is freed; the deleter runs the owner's ``on_free`` callback.

The structures follow ``dlpack.h`` (the unversioned ``DLManagedTensor``, capsule name
``"dltensor"``), which ``torch.from_dlpack`` accepts as a capsule. The same code wraps
host memory (``device_index=None``), so it is tested on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

__all__ = ("live_wrappers", "wrap_memory")

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_UINT = 1
_CAPSULE_NAME = b"dltensor"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

#: Everything a live wrapper needs kept alive, by the address of its DLManagedTensor:
#: the structure itself, its shape array, the owner's keep-alive object and callback.
_live: dict[int, tuple[_DLManagedTensor, Any, object, Callable[[], None]]] = {}


def _on_delete(managed: Any) -> None:
    """The deleter torch calls (from any thread; ctypes takes the GIL) when it frees one."""
    address = ctypes.cast(managed, ctypes.c_void_p).value
    entry = _live.pop(address or 0, None)
    if entry is not None:
        # An exception here cannot propagate into torch; ctypes reports it as unraisable.
        entry[3]()


# Module-level, so the C function pointer lives as long as any tensor that may call it.
_DELETER = _Deleter(_on_delete)


def live_wrappers() -> int:
    """How many wrapped regions torch has not freed yet (for tests and statistics)."""
    return len(_live)


def wrap_memory(
    pointer: int,
    nbytes: int,
    device_index: int | None,
    *,
    keepalive: object,
    on_free: Callable[[], None],
) -> Any:
    """A flat ``torch.uint8`` tensor over ``nbytes`` bytes at ``pointer``, without a copy.

    Args:
        pointer: the address of the first byte (a device pointer for a CUDA device).
        nbytes: how many bytes the tensor covers.
        device_index: the CUDA device the memory is mapped on, or None for host memory.
        keepalive: an object that must outlive the tensor (e.g. what maps the memory).
        on_free: called exactly once: when torch frees the tensor's storage (from whatever
            thread drops the last reference), or before this function raises.

    Raises:
        RuntimeError: torch refused the tensor (``on_free`` has then already run).
    """
    from torch.utils.dlpack import from_dlpack

    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    tensor = managed.dl_tensor
    tensor.data = pointer
    if device_index is None:
        tensor.device = _DLDevice(_KDL_CPU, 0)
    else:
        tensor.device = _DLDevice(_KDL_CUDA, device_index)
    tensor.ndim = 1
    tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    tensor.shape = shape
    # Null strides mean compact row-major, which a 1-d tensor always is.
    tensor.strides = None
    tensor.byte_offset = 0
    managed.deleter = _DELETER
    address = ctypes.addressof(managed)
    _live[address] = (managed, shape, keepalive, on_free)
    try:
        capsule = _capsule_new(address, _CAPSULE_NAME, None)
        return from_dlpack(capsule)
    except BaseException:
        # torch never took ownership, so it will never call the deleter: do its part.
        entry = _live.pop(address, None)
        if entry is not None:
            on_free()
        raise
