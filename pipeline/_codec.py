"""The wire codec: payloads to :class:`Encoded` (a msgpack header plus raw buffers) and back.

Tensors and numpy arrays never pass through msgpack as data. Each one becomes a msgpack
extension record in the header (its dtype, shape, device and the index of its buffer),
and its bytes travel out of band in ``Encoded.buffers``: a contiguous CPU tensor is sent
as a view of its own memory, and a writable buffer is decoded without a copy. Because the
record is an extension type, tensors survive fields typed ``Any`` as well as typed ones.
Nothing is ever pickled.

A CUDA tensor's bytes stay on its device: they go to ``Encoded.device_buffers`` as a flat
``uint8`` view (its ``buffers`` slot is an empty placeholder), and decoding a payload that
still carries them views the device bytes as the tensor, with no trip through the host.
A transport that cannot carry device memory gets the payload after ``to_host``; decoding
then moves such a tensor back to the device its record names, as before.

A decode may instead name the device every tensor lands on, as ``torch.load``'s
``map_location`` does: a remote client on a host without the GPU its outputs were made on
decodes them onto the CPU (``Pipeline.connect(..., device="cpu")``). Stages never do; a
decode that names no device takes the same path as before, at no extra cost per tensor.

torch and numpy are imported lazily, so a stage that moves no tensors never pays for them.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import sys
import threading
import types
import typing
from typing import Annotated, Any, Generic, TypeVar

import msgspec

from ._encoded import DECODE_ERRORS, Buffer, Encoded
from ._errors import ConfigError, PayloadError

__all__ = ("PayloadCodec", "codec_for", "resolve_device", "type_name")

T = TypeVar("T")

_EXT_TENSOR = 1
_EXT_NDARRAY = 2
#: The most dimensions a tensor or array may have on the wire (numpy's own limit).
MAX_DIMS = 64


class _Ref(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """The header's stand-in for one tensor or array: what its buffer holds, and where."""

    dtype: str
    shape: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)], ...],
        msgspec.Meta(max_length=MAX_DIMS),
    ]
    index: int
    device: str = "cpu"


_REF_ENCODER = msgspec.msgpack.Encoder()
#: What decoding a hostile header raises besides msgspec's own errors: TypeError where an
#: array lands in a set (unhashable), a Struct's own __post_init__ refusing its fields.
_HEADER_ERRORS: tuple[type[Exception], ...] = (*DECODE_ERRORS, TypeError)
_REF_DECODER = msgspec.msgpack.Decoder(_Ref)


class _CallState(threading.local):
    """The buffers of this thread's call in progress, which msgspec's fixed hooks read here."""

    outgoing: list[Buffer] | None = None
    #: Buffer index to flat CUDA bytes, for the encode in progress; None until a CUDA tensor.
    outgoing_device: dict[int, Any] | None = None
    incoming: tuple[Buffer, ...] = ()
    #: The buffer indexes the decode in progress has rebuilt a tensor or array from: each
    #: buffer backs one (what encode sends), so a second reference is refused.
    taken: set[int] | None = None
    #: The device buffers of the decode in progress; None for a host-only payload.
    incoming_device: dict[int, Any] | None = None
    #: The device the decode in progress lands every tensor on; read only by the hook of a
    #: decode that names one, so that other decodes never look at it.
    onto: str = "cpu"


_state = _CallState()


class _Unencodable(TypeError):
    """An object msgspec cannot encode; carries it so :meth:`PayloadCodec.encode` can find it."""

    def __init__(self, obj: object, reason: str) -> None:
        self.obj = obj
        self.reason = reason
        super().__init__(reason)


@functools.cache
def _plain_dtypes() -> tuple[dict[Any, str], dict[str, tuple[Any, Any]]]:
    """The dtypes torch and numpy share, by torch dtype and by name.

    A dense CPU tensor of one of these takes the short paths of :func:`_tensor_bytes` and
    :func:`_decode_tensor` through numpy, which cost 40-55% of the general ones: every
    torch call costs a microsecond or more, and far more in a process that has just woken
    with cold caches, as a stage does for each chunk.
    """
    torch = sys.modules["torch"]
    import numpy as np

    names = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
    by_dtype = {getattr(torch, n): n for n in names}
    by_name = {n: (getattr(torch, n), np.dtype(n)) for n in names}
    return by_dtype, by_name


def _tensor_bytes(t: Any) -> tuple[str, tuple[int, ...], str, Buffer, Any]:
    """Describe tensor ``t`` and expose its bytes, copying only when it is not contiguous.

    Returns ``(dtype, shape, device, host bytes, device bytes)``: a CUDA tensor's bytes stay
    on its device as a flat uint8 tensor (the host bytes are then an empty placeholder);
    any other tensor's are host bytes and the device bytes are None.
    """
    torch = sys.modules["torch"]
    if (
        t.is_cpu
        and t.layout == torch.strided
        and not t.requires_grad
        and (name := _plain_dtypes()[0].get(t.dtype)) is not None
        and t.is_contiguous()
        # A lazily negated view (the imaginary part of a conjugate) is not its bytes.
        and not t.is_neg()
        and t.numel()
    ):
        # The array's base is the tensor, so the buffer keeps the bytes alive.
        return name, tuple(t.shape), "cpu", memoryview(t.numpy()).cast("B"), None
    if t.layout != torch.strided:
        raise _Unencodable(t, f"{t.layout} tensors are not supported")
    if t.is_quantized:
        raise _Unencodable(t, "quantized tensors are not supported")
    if t.is_meta:
        raise _Unencodable(t, "meta tensors have no data to send")
    device = str(t.device)
    # is_cuda reads the tensor's device and never initialises CUDA. Other accelerators
    # (mps, xpu, ...) still go through host memory.
    on_cuda = t.is_cuda
    t = t.detach() if on_cuda else t.detach().cpu()
    # resolve_conj and resolve_neg are no-ops unless a lazy bit is set, which view() refuses.
    t = t.resolve_conj().resolve_neg()
    # A complex tensor is copied, if at all, as its (real, imag) pairs: the same bytes, and
    # allocating a complex32 tensor makes torch warn. On CUDA the copy is queued on the
    # current stream, which is the stream a device transport orders its hand-off after.
    src = (torch.view_as_real(t) if t.is_complex() else t).contiguous()
    # A contiguous tensor may still carry any stride on a dimension of size 1, which
    # reshape keeps and view refuses; its elements are dense, so as_strided is exact.
    flat = src.as_strided((src.numel(),), (1,)).view(torch.uint8)
    dtype, shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
    if on_cuda:
        return dtype, shape, device, b"", flat
    # Viewing as uint8 gives numpy a dtype it knows (bfloat16 and float8 have none); the
    # array's base is a tensor sharing the storage, so the buffer keeps the bytes alive.
    return dtype, shape, device, memoryview(flat.numpy()), None


def _array_bytes(a: Any) -> tuple[str, tuple[int, ...], str, Buffer]:
    """Describe numpy array ``a`` and expose its bytes, copying only when not contiguous."""
    np = sys.modules["numpy"]
    if a.dtype.hasobject:
        raise _Unencodable(a, "numpy arrays of Python objects are not supported")
    if type(a).__module__.startswith("numpy.ma"):
        raise _Unencodable(a, "masked arrays are not supported; send data and mask separately")
    # Not ascontiguousarray: it turns a 0-d array into a 1-d one.
    a = a if a.flags.c_contiguous else a.copy(order="C")
    descr = np.lib.format.dtype_to_descr(a.dtype)
    name = descr if isinstance(descr, str) else repr(descr)
    # Dtypes of item size zero cannot be viewed as bytes; there are no bytes to send anyway.
    buf: Buffer = memoryview(a.reshape(-1).view(np.uint8)) if a.nbytes else b""
    return name, a.shape, "cpu", buf


def _enc_hook(obj: Any) -> Any:
    """Replace a tensor or array by an extension record and queue its bytes as a buffer."""
    on_device = None
    if (torch := sys.modules.get("torch")) is not None and isinstance(obj, torch.Tensor):
        code, (dtype, shape, device, buf, on_device) = _EXT_TENSOR, _tensor_bytes(obj)
    elif (np := sys.modules.get("numpy")) is not None and isinstance(obj, np.ndarray):
        code, (dtype, shape, device, buf) = _EXT_NDARRAY, _array_bytes(obj)
    elif np is not None and isinstance(obj, np.generic):
        raise _Unencodable(obj, "numpy scalars are not supported; use .item() or a 0-d array")
    else:
        raise _Unencodable(obj, f"objects of type {type(obj).__qualname__} are not supported")
    out = _state.outgoing
    if out is None:
        out = _state.outgoing = []
    out.append(buf)
    if on_device is not None:
        held = _state.outgoing_device
        if held is None:
            held = _state.outgoing_device = {}
        held[len(out) - 1] = on_device
    ref = _Ref(dtype, shape, len(out) - 1, device)
    return msgspec.msgpack.Ext(code, _REF_ENCODER.encode(ref))


def _take(index: int) -> None:
    """Note that buffer ``index`` backs a tensor or array of the decode in progress.

    Raises:
        PayloadError: it backs one already. Encode never sends a buffer twice, and a header
            that references one many times would have each reference copy it (a read-only
            buffer), or alias it.
    """
    taken = _state.taken
    if taken is None:
        taken = _state.taken = set()
    elif index in taken:
        raise PayloadError(f"buffer {index} is referenced twice")
    taken.add(index)


def _buffer_for(ref: _Ref, itemsize: int) -> memoryview:
    """The buffer ``ref`` points at, checked for size, as a writable flat byte view."""
    buffers = _state.incoming
    if not 0 <= ref.index < len(buffers):
        raise PayloadError(f"buffer {ref.index} is referenced but only {len(buffers)} were sent")
    _take(ref.index)
    view = memoryview(buffers[ref.index])
    expected = math.prod(ref.shape) * itemsize
    if view.nbytes != expected:
        raise PayloadError(
            f"buffer {ref.index} holds {view.nbytes} bytes but a {ref.dtype} array of shape "
            f"{ref.shape} needs {expected}"
        )
    # Decoded tensors and arrays must be writable, and torch warns on read-only memory, so
    # a read-only buffer is copied once; a writable one is shared.
    if view.readonly or not view.c_contiguous:
        return memoryview(bytearray(view))
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _device_tensor(flat: Any, ref: _Ref, dtype: Any, uint8: Any) -> Any:
    """View the flat uint8 device bytes ``flat`` as the tensor ``ref`` describes, in place.

    The tensor stays on the device the transport put the bytes on, which for ``cuda_ipc`` is
    the consumer's own index of the producer's GPU and may differ from ``ref.device``.
    """
    expected = math.prod(ref.shape) * dtype.itemsize
    if flat.dtype != uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise PayloadError(f"device buffer {ref.index} is not a flat contiguous uint8 tensor")
    if flat.numel() != expected:
        raise PayloadError(
            f"device buffer {ref.index} holds {flat.numel()} bytes but a {ref.dtype} tensor "
            f"of shape {ref.shape} needs {expected}"
        )
    return flat.view(dtype).reshape(ref.shape)


def _decode_tensor(ref: _Ref) -> Any:
    """Rebuild the tensor ``ref`` describes, on the device it was sent from."""
    import torch

    dtype = getattr(torch, ref.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise PayloadError(f"unknown tensor dtype {ref.dtype!r}")
    # A host-only payload pays one attribute read here; only device payloads look further.
    device_buffers = _state.incoming_device
    if device_buffers is not None:
        flat = device_buffers.get(ref.index)
        if flat is not None:
            _take(ref.index)
            return _device_tensor(flat, ref, dtype, torch.uint8)
    view = _buffer_for(ref, dtype.itemsize)
    plain = _plain_dtypes()[1].get(ref.dtype)
    if plain is not None and ref.device == "cpu" and view.nbytes:
        np = sys.modules["numpy"]
        return torch.from_numpy(np.frombuffer(view, plain[1]).reshape(ref.shape))
    # frombuffer refuses empty buffers; an empty uint8 tensor viewed as ``dtype`` also avoids
    # allocating dtypes (complex32) whose constructors warn.
    u8 = torch.uint8
    raw = torch.frombuffer(view, dtype=u8) if view.nbytes else torch.empty(0, dtype=u8)
    t = raw.view(dtype).reshape(ref.shape)
    if ref.device == "cpu":
        return t
    try:
        return t.to(ref.device)
    # torch raises AssertionError, not RuntimeError, when it was built without CUDA, and
    # ModuleNotFoundError for a device whose backend package is not installed (hpu).
    except Exception as e:
        raise PayloadError(
            f"a tensor was sent from device {ref.device!r}, which this process cannot use: {e}"
        ) from e


def _decode_tensor_onto(ref: _Ref, onto: str) -> Any:
    """Rebuild the tensor ``ref`` describes on device ``onto``, whatever device it was sent from.

    Host bytes become a CPU tensor, as for a tensor sent from the CPU, which moves to
    ``onto`` unless that is the CPU; device bytes (a transport that carries device memory)
    are viewed where the transport put them and moved to ``onto``.
    """
    device_buffers = _state.incoming_device
    if device_buffers is not None and ref.index in device_buffers:
        tensor = _decode_tensor(ref)
    else:
        tensor = _decode_tensor(ref if ref.device == "cpu" else _on_cpu(ref))
        if onto == "cpu":
            return tensor
    try:
        return tensor.to(onto)
    # As in _decode_tensor: a failed move raises any of these, depending on the device.
    except (RuntimeError, AssertionError, ValueError) as e:
        raise PayloadError(
            f"cannot decode a tensor sent from device {ref.device!r} onto {onto!r}: {e}"
        ) from e


def _on_cpu(ref: _Ref) -> _Ref:
    """``ref`` as if its tensor had been sent from the CPU: its bytes are the same."""
    return msgspec.structs.replace(ref, device="cpu")


def _decode_array(ref: _Ref) -> Any:
    """Rebuild the numpy array ``ref`` describes."""
    import numpy as np

    try:
        if ref.dtype.startswith("["):
            # A structured dtype travels as the repr of its descr, as in the .npy format.
            dtype = np.lib.format.descr_to_dtype(ast.literal_eval(ref.dtype))
        else:
            dtype = np.dtype(ref.dtype)
    # literal_eval and descr_to_dtype raise many kinds of error on malformed input.
    except Exception as e:
        raise PayloadError(f"unknown array dtype {ref.dtype!r}") from e
    if dtype.hasobject:
        raise PayloadError("numpy arrays of Python objects are not accepted")
    if not dtype.itemsize and dtype.kind in "SU":
        # 'S0', 'U0': numpy widens them to one byte or character an item when it allocates,
        # so a shape checked against 0 bytes would allocate anything. (Empty void and
        # structured dtypes allocate nothing, whatever the shape.)
        raise PayloadError(f"numpy arrays of the zero-size dtype {ref.dtype!r} are not accepted")
    view = _buffer_for(ref, dtype.itemsize)
    if not view.nbytes:
        return np.empty(ref.shape, dtype)
    return np.frombuffer(view, dtype).reshape(ref.shape)


def _ext_hook(code: int, data: memoryview) -> Any:
    """Turn an extension record from the header back into a tensor or array."""
    try:
        ref = _REF_DECODER.decode(data)
    except DECODE_ERRORS as e:
        raise PayloadError(f"malformed buffer reference in header: {e}") from e
    if code not in (_EXT_TENSOR, _EXT_NDARRAY):
        raise PayloadError(f"unknown extension type {code} in header")
    try:
        return _decode_tensor(ref) if code == _EXT_TENSOR else _decode_array(ref)
    # A shape that fits the buffer can still be too large for torch or numpy, e.g. (0, 2**63).
    except (RuntimeError, ValueError, OverflowError, MemoryError) as e:
        raise PayloadError(f"cannot rebuild a {ref.dtype} array of shape {ref.shape}: {e}") from e


def _ext_hook_onto(code: int, data: memoryview) -> Any:
    """:func:`_ext_hook` for a decode that names a device: tensors land on ``_state.onto``."""
    if code != _EXT_TENSOR:
        return _ext_hook(code, data)
    try:
        ref = _REF_DECODER.decode(data)
    except DECODE_ERRORS as e:
        raise PayloadError(f"malformed buffer reference in header: {e}") from e
    try:
        return _decode_tensor_onto(ref, _state.onto)
    # As in _ext_hook: a shape that fits the buffer can still be too large for torch.
    except (RuntimeError, ValueError, OverflowError) as e:
        raise PayloadError(f"cannot rebuild a {ref.dtype} array of shape {ref.shape}: {e}") from e


def _dec_hook(type_: Any, obj: Any) -> Any:
    """Accept ``obj`` for a field of a custom type (a tensor or array) if it is one already,
    or the other of the two: a numpy array where a tensor is declared becomes one (sharing
    its memory), and a CPU tensor where an array is declared.

    The extension hook has rebuilt tensors and arrays before msgspec asks about the field's
    type, so there is nothing else to convert, only a kind to check.
    """
    if isinstance(type_, type) and isinstance(obj, type_):
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(type_, type) and issubclass(type_, torch.Tensor):
        if type(obj) is torch.Tensor:
            # A field declared as a tensor subclass: the wire carries a tensor's bytes only.
            return obj.as_subclass(type_)
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
            # (A read-only array, decoded from bytes, is copied: torch would warn.)
            t = torch.from_numpy(obj if obj.flags.writeable else obj.copy())
            return t if type_ is torch.Tensor else t.as_subclass(type_)
    np = sys.modules.get("numpy")
    if (
        np is not None
        and type_ is np.ndarray
        and torch is not None
        and isinstance(obj, torch.Tensor)
        and obj.device.type == "cpu"
    ):
        with contextlib.suppress(TypeError):  # a dtype numpy lacks (bfloat16): refused below
            return obj.numpy()
    name = getattr(type_, "__qualname__", repr(type_))
    raise TypeError(f"Expected `{name}`, got `{type(obj).__name__}`")


def _dec_hook_onto(type_: Any, obj: Any) -> Any:
    """:func:`_dec_hook` for a decode that names a device: a tensor it makes of an array
    lands there too, as the tensors the extension hook rebuilt did."""
    value = _dec_hook(type_, obj)
    torch = sys.modules.get("torch")
    if value is not obj and torch is not None and isinstance(value, torch.Tensor):
        device = torch.device(_state.onto)
        if value.device != device:
            try:
                return value.to(device)
            except Exception as e:  # no such device here: msgspec names the field
                raise TypeError(f"cannot move the tensor to {_state.onto!r}: {e}") from e
    return value


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def _locate(value: Any, target: object, path: str = "$") -> str | None:
    """The path of ``target`` inside ``value`` (``$.items[2]``), found by identity, or None."""
    if value is target:
        return path
    if isinstance(value, msgspec.Struct):
        children: Any = ((f"{path}.{f}", getattr(value, f)) for f in value.__struct_fields__)
    elif isinstance(value, dict):
        children = ((f"{path}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, list | tuple | set | frozenset):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for child_path, child in children:
        if (found := _locate(child, target, child_path)) is not None:
            return found
    return None


def _encode_error(value: Any, e: Exception) -> PayloadError:
    """The PayloadError for an encode failure, naming the offending field where it is found."""
    if not isinstance(e, _Unencodable):
        return PayloadError(f"cannot encode payload: {e}")
    where = _locate(value, e.obj)
    at = f" at `{where}`" if where else ""
    return PayloadError(f"cannot encode payload{at}: {e.reason}", field=where)


def _narrowed(value: Any, cls: type[msgspec.Struct]) -> Any:
    """An instance of ``cls`` with the fields ``value`` (of a subclass) has of ``cls``."""
    return cls(**{f: getattr(value, f) for f in cls.__struct_fields__})


def type_name(tp: Any) -> str:
    """A type as a message names it: ``Base``, ``Base | None``, ``list[Token]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or not args:
        if tp is type(None):
            return "None"
        if isinstance(tp, type):
            return tp.__qualname__
        return repr(tp).replace("typing.", "")
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    name = getattr(origin, "__qualname__", None) or repr(origin).replace("typing.", "")
    return f"{name}[{', '.join(type_name(a) for a in args)}]"


class PayloadCodec(Generic[T]):
    """Encodes values of one declared type to :class:`Encoded`, and decodes them back.

    Args:
        type_: the declared payload type: a ``msgspec.Struct`` class, any type msgspec can
            decode, or ``Any``.

    Attributes:
        type: the declared payload type.
    """

    __slots__ = ("_check", "_decoder", "_decoder_onto", "_narrow", "type")

    def __init__(self, type_: type[T] | Any) -> None:
        self.type = type_
        # Only a plain class can be checked with isinstance; generics and Any cannot.
        self._check: type | None = type_ if isinstance(type_, type) and type_ is not Any else None
        #: A Struct class: an instance of a subclass travels as one of this class.
        self._narrow: type[msgspec.Struct] | None = (
            self._check if self._check is not None and issubclass(self._check, msgspec.Struct)
            else None
        )  # fmt: skip
        try:
            self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(
                type_, ext_hook=_ext_hook, dec_hook=_dec_hook
            )
        # TypeError for a type msgspec cannot decode, NameError for an annotation naming
        # something that does not exist.
        except Exception as e:
            raise PayloadError(f"cannot build a codec for {type_name(type_)}: {e}") from e
        #: The decoder of decodes that name a device, built on the first one.
        self._decoder_onto: msgspec.msgpack.Decoder[T] | None = None

    def encode(self, value: T) -> Encoded:
        """Encode ``value``, sharing the memory of contiguous CPU tensors and arrays.

        A CUDA tensor's bytes stay on its device, in ``device_buffers``.

        Raises:
            PayloadError: ``value`` is not of the declared type, or holds an object that
                cannot be encoded (the message names where).
        """
        check = self._check
        if check is not None and type(value) is not check:
            if not isinstance(value, check):
                raise PayloadError(f"expected {check.__qualname__}, got {type(value).__qualname__}")
            if self._narrow is not None:
                # Its consumer decodes the declared class: a subclass's tag or extra fields
                # would not decode there.
                try:
                    value = _narrowed(value, self._narrow)
                except Exception as e:  # the declared class's own __post_init__, say
                    raise PayloadError(
                        f"cannot send {type(value).__qualname__} as the declared "
                        f"{check.__qualname__}: {type(e).__name__}: {e}"
                    ) from e
        # Only the encode hook sets ``outgoing``, and every exit below clears it again, so
        # a payload without tensors touches the thread-local state once.
        try:
            header = _ENCODER.encode(value)
        # TypeError, ValueError, OverflowError from msgspec; torch's own errors for tensors
        # it cannot give bytes of (nested tensors, strided sub-byte dtypes).
        except Exception as e:
            _state.outgoing = _state.outgoing_device = None
            raise _encode_error(value, e) from e
        except BaseException:
            _state.outgoing = _state.outgoing_device = None
            raise
        out = _state.outgoing
        if out is None:
            return Encoded(header, (), len(header))
        _state.outgoing = None
        on_device = _state.outgoing_device
        if on_device is None:
            return Encoded(header, tuple(out))
        _state.outgoing_device = None
        return Encoded(header, tuple(out), device_buffers=on_device)

    def decode(self, encoded: Encoded, *, device: str | None = None) -> T:
        """Decode ``encoded`` as the declared type, sharing writable buffers' memory.

        Tensors whose bytes are in ``encoded.device_buffers`` are views of those device
        tensors: no copy, and they keep the device memory alive.

        Args:
            encoded: the payload.
            device: where every tensor lands, whatever device it was sent from, as
                :func:`resolve_device` gives it (``"cpu"``, ``"cuda:1"``): one sent from
                another device is rebuilt there from its bytes (on the CPU, as one sent from
                the CPU is), one that came as device bytes is moved there. Default: the
                device it was sent from.

        Raises:
            PayloadError: the header is malformed, a buffer is missing or of the wrong size,
                the payload does not match the declared type (``field`` names where), or a
                tensor's device cannot be used here.
        """
        buffers = encoded.buffers
        # A header that references buffers when none were sent finds ``incoming`` empty,
        # since every decode that sets it clears it again.
        if buffers:
            _state.incoming = buffers
            device_buffers = encoded.device_buffers
            if device_buffers:
                _state.incoming_device = device_buffers
        try:
            if device is None:
                return self.decode_header(encoded.header)
            return self._decode_onto(encoded.header, device)
        finally:
            if buffers:
                _state.incoming = ()
                _state.incoming_device = None
                _state.taken = None

    def _decode_onto(self, header: bytes, device: str) -> T:
        """Decode ``header`` (its buffers set already) with every tensor landing on ``device``.

        Its own decoder's extension hook reads ``device``, so that a decode naming none
        pays nothing per tensor for the option.
        """
        decoder = self._decoder_onto
        if decoder is None:
            decoder = self._decoder_onto = msgspec.msgpack.Decoder(
                self.type, ext_hook=_ext_hook_onto, dec_hook=_dec_hook_onto
            )
        _state.onto = device
        try:
            return decoder.decode(header)
        # A ValidationError is a DecodeError too: _decode_error tells them apart.
        except _HEADER_ERRORS as e:
            raise self._decode_error(e) from e

    def onto(self, device: str) -> PayloadCodec[T]:
        """This codec, with every decode landing every tensor on ``device`` (as
        :func:`resolve_device` gives it), as :meth:`decode` with ``device`` does."""
        return _OntoCodec(self.type, device)

    def decode_header(self, header: bytes) -> T:
        """Decode a payload that has no out-of-band buffers from its header alone.

        Raises:
            PayloadError: as :meth:`decode`; a header that references buffers finds none.
        """
        try:
            return self._decoder.decode(header)
        # A ValidationError is a DecodeError too: _decode_error tells them apart.
        except _HEADER_ERRORS as e:
            raise self._decode_error(e) from e

    def _decode_error(self, e: Exception) -> PayloadError:
        """The PayloadError for a header msgspec refused, naming the field where it can."""
        if not isinstance(e, msgspec.ValidationError):
            return PayloadError(f"malformed {self._name()} payload header: {e}")
        message = str(e)
        _, sep, rest = message.rpartition(" - at `")
        field = rest[:-1] if sep else None
        return PayloadError(f"invalid {self._name()} payload: {message}", field=field)

    def _name(self) -> str:
        return type_name(self.type)

    def __repr__(self) -> str:
        return f"PayloadCodec({self._name()})"


@functools.cache
def codec_for(type_: Any) -> PayloadCodec[Any]:
    """The shared codec for ``type_``, built on first use.

    Raises:
        PayloadError: msgspec cannot decode ``type_``.
    """
    return PayloadCodec(type_)


class _OntoCodec(PayloadCodec[T]):
    """A codec whose decodes land every tensor on one device (see :meth:`PayloadCodec.onto`)."""

    def __init__(self, type_: type[T] | Any, device: str) -> None:
        super().__init__(type_)
        self.device = device

    def decode(self, encoded: Encoded, *, device: str | None = None) -> T:
        return super().decode(encoded, device=device or self.device)

    def decode_header(self, header: bytes) -> T:
        return self._decode_onto(header, self.device)


def resolve_device(device: str) -> str:
    """The device ``device`` names, checked usable by this process, for decoding onto it.

    ``cpu`` (also ``cpu:0``) gives ``"cpu"``, and ``meta`` (shapes and dtypes, no data)
    always passes. A CUDA device is checked as a stage's placement is, without initialising
    CUDA: torch must be a CUDA build that sees a device of that index. Any other device
    (``mps``, ``xpu``, ...) is tried with an empty tensor.

    Raises:
        ConfigError: ``device`` names no torch device, or one this process cannot use; the
            message says what to pass instead.
    """
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"device {device!r} is not a torch device; pass 'cpu', or 'cuda:N' for a GPU of "
            "this host"
        ) from e
    if parsed.type == "cpu":
        return "cpu"
    name = str(parsed)
    if parsed.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ConfigError(
                f"device {device!r} cannot be used here: torch {torch.__version__} is a build "
                "without CUDA; pass 'cpu' to decode tensors onto the host"
            )
        count = torch.cuda.device_count()
        if (parsed.index or 0) >= count:
            have = ", ".join(f"'cuda:{i}'" for i in range(count))
            sees = f"sees only {have}" if count else "sees no CUDA device"
            raise ConfigError(
                f"device {device!r} cannot be used here: this host {sees}; pass 'cpu'"
                + (f" or one of {have}" if count else " to decode tensors onto the host")
            )
        return name
    try:
        torch.empty(0, device=parsed)
    # Each backend fails its own way here: AssertionError (not compiled in),
    # NotImplementedError, RuntimeError, ModuleNotFoundError, ...
    except Exception as e:
        # The first sentence: some backends explain at length, and this stays one line.
        reason = str(e).strip().split("\n")[0].split(". ")[0] or type(e).__name__
        raise ConfigError(
            f"device {device!r} cannot be used here ({reason}); pass 'cpu' to decode tensors "
            "onto the host"
        ) from e
    return name
