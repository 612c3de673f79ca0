"""Tests for the wire codec: exact round trips, zero-copy buffers and typed errors."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline._codec import PayloadCodec, codec_for, type_name
from pipeline._encoded import Encoded
from pipeline._errors import PayloadError

ROOT = Path(__file__).resolve().parents[2]

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    *(getattr(torch, n) for n in dir(torch) if n.startswith("float8_")),
]


class Inner(msgspec.Struct):
    tensor: torch.Tensor
    label: str


class Payload(msgspec.Struct):
    main: torch.Tensor
    many: list[torch.Tensor]
    anything: Any
    array: np.ndarray
    inner: Inner
    blob: bytes
    count: int
    ratio: float
    name: str
    maybe: torch.Tensor | None = None
    extra: dict[str, Any] = {}


class Text(msgspec.Struct):
    value: str


class Image(msgspec.Struct):
    pixels: torch.Tensor


def bits(t: torch.Tensor) -> bytes:
    """The logical contents of ``t`` as bytes in C order, so NaNs compare equal."""
    src = torch.view_as_real(t) if t.is_complex() else t
    # A fresh contiguous clone, since contiguous() keeps odd strides on dimensions of size 1.
    flat = src.clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def assert_same_tensor(a: Any, b: Any) -> None:
    """Assert ``b`` is a tensor with the dtype, shape and bits of ``a``."""
    assert isinstance(b, torch.Tensor)
    assert (b.dtype, b.shape, b.device) == (a.dtype, a.shape, a.device)
    assert bits(b) == bits(a)


def assert_same_array(a: Any, b: Any) -> None:
    """Assert ``b`` is an ndarray with the dtype, shape and bytes of ``a``."""
    assert type(b) is np.ndarray
    assert (b.dtype, b.shape) == (a.dtype, a.shape)
    assert np.ascontiguousarray(b).tobytes() == np.ascontiguousarray(a).tobytes()


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Tensors of any CPU dtype and shape, with arbitrary bits, often not contiguous."""
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    layout = draw(st.sampled_from(["plain", "transposed", "strided", "offset"]))
    if layout == "transposed" and len(shape) >= 2:
        base_shape, offset = shape[::-1], 0
    elif layout == "strided" and shape:
        base_shape, offset = (*shape[:-1], shape[-1] * 2), 0
    else:
        base_shape, offset = shape, (draw(st.integers(1, 3)) if layout == "offset" else 0)
    numel = 1
    for n in base_shape:
        numel *= n
    size = (numel + offset) * dtype.itemsize
    raw = bytearray(draw(st.binary(min_size=size, max_size=size)))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    if not raw:
        return torch.empty(0, dtype=torch.uint8).view(dtype).reshape(shape)
    flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)[offset:]
    base = flat.reshape(base_shape)
    if layout == "transposed" and len(shape) >= 2:
        return base.permute(*reversed(range(len(shape))))
    if layout == "strided" and shape:
        return base[..., ::2]
    return base


ARRAY_DTYPES = (
    hnp.scalar_dtypes()
    | hnp.byte_string_dtypes()
    | hnp.unicode_string_dtypes()
    | hnp.datetime64_dtypes()
    | hnp.timedelta64_dtypes()
    | st.just(np.dtype([("x", "<i4"), ("y", ">f8", (2,))]))
)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """numpy arrays of any non-object dtype and shape, sometimes transposed."""
    dtype = draw(ARRAY_DTYPES)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    size = dtype.itemsize * int(np.prod(shape))
    # A short random pattern tiled to the array's size keeps examples small to generate.
    seed = np.frombuffer(draw(st.binary(min_size=1, max_size=64)), dtype=np.uint8)
    array = np.resize(seed, size).view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transposed", "strided"]))
    if view == "transposed":
        return array.T
    if view == "strided" and array.ndim:
        return np.repeat(array, 2, axis=-1)[..., ::2]
    return array


@st.composite
def payloads(draw: st.DrawFn) -> Payload:
    """Payloads mixing tensors, arrays, bytes, nesting and plain fields."""
    return Payload(
        main=draw(tensors()),
        many=draw(st.lists(tensors(), max_size=3)),
        anything=draw(st.one_of(tensors(), arrays(), st.lists(tensors(), max_size=2))),
        array=draw(arrays()),
        inner=Inner(draw(tensors()), draw(st.text(max_size=5))),
        blob=draw(st.binary(max_size=16)),
        count=draw(st.integers(-(2**63), 2**64 - 1)),
        ratio=draw(st.floats(allow_nan=False)),
        name=draw(st.text(max_size=8)),
        maybe=draw(st.none() | tensors()),
        extra=draw(st.dictionaries(st.text(max_size=3), tensors() | arrays(), max_size=2)),
    )


def check_payload(sent: Payload, got: Payload) -> None:
    """Assert that ``got`` equals ``sent`` field by field, tensors bitwise."""
    assert type(got) is Payload
    assert_same_tensor(sent.main, got.main)
    assert len(got.many) == len(sent.many)
    for a, b in zip(sent.many, got.many, strict=True):
        assert_same_tensor(a, b)
    for a, b in [
        (sent.anything, got.anything),
        *zip(sent.extra.values(), got.extra.values(), strict=True),
    ]:
        if isinstance(a, list):
            for x, y in zip(a, b, strict=True):
                assert_same_tensor(x, y)
        elif isinstance(a, torch.Tensor):
            assert_same_tensor(a, b)
        else:
            assert_same_array(a, b)
    assert list(got.extra) == list(sent.extra)
    assert_same_array(sent.array, got.array)
    assert_same_tensor(sent.inner.tensor, got.inner.tensor)
    assert got.inner.label == sent.inner.label
    assert (got.blob, got.count, got.ratio, got.name) == (
        sent.blob,
        sent.count,
        sent.ratio,
        sent.name,
    )
    if sent.maybe is None:
        assert got.maybe is None
    else:
        assert_same_tensor(sent.maybe, got.maybe)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads(), st.booleans())
def test_round_trip_is_exact(payload: Payload, as_bytes: bool) -> None:
    """Every field of a payload survives encode and decode with dtype, shape and bits intact."""
    codec = codec_for(Payload)
    encoded = codec.encode(payload)
    if as_bytes:
        # A transport that received the frames as bytes: decoding must copy, not warn.
        encoded = Encoded(encoded.header, tuple(bytes(b) for b in encoded.buffers))
    check_payload(payload, codec.decode(encoded))


@settings(max_examples=60, deadline=None)
@given(tensors() | arrays())
def test_any_typed_codec_round_trips_bare_values(value: Any) -> None:
    """A codec for ``Any`` round-trips a bare tensor or array, not only Struct fields."""
    got = codec_for(Any).decode(codec_for(Any).encode(value))
    if isinstance(value, torch.Tensor):
        assert_same_tensor(value, got)
    else:
        assert_same_array(value, got)


def test_codec_for_is_cached() -> None:
    """codec_for returns the same codec object for the same type."""
    assert codec_for(Text) is codec_for(Text)
    assert codec_for(Text) is not codec_for(Image)


def test_plain_struct_has_no_buffers() -> None:
    """A payload without tensors encodes to a header alone and decodes equal."""
    encoded = codec_for(Text).encode(Text("hello"))
    assert encoded.buffers == ()
    assert codec_for(Text).decode(encoded) == Text("hello")


def test_encode_shares_contiguous_tensor_memory() -> None:
    """Encoding a contiguous CPU tensor exposes its own memory, not a copy."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    encoded = codec_for(Image).encode(Image(tensor))
    (buffer,) = encoded.buffers
    assert np.frombuffer(buffer, dtype=np.uint8).ctypes.data == tensor.data_ptr()
    assert memoryview(buffer).nbytes == tensor.nbytes


def test_encode_copies_non_contiguous_tensor() -> None:
    """A transposed tensor is sent as a contiguous copy holding its logical order."""
    tensor = torch.arange(12, dtype=torch.int64).reshape(3, 4).T
    (buffer,) = codec_for(Image).encode(Image(tensor)).buffers
    assert np.frombuffer(buffer, dtype=np.uint8).ctypes.data != tensor.data_ptr()
    assert bytes(buffer) == tensor.contiguous().numpy().tobytes()


def test_encoded_keeps_tensor_memory_alive() -> None:
    """The buffers of an Encoded stay valid after the payload's tensor is dropped."""
    tensor = torch.arange(1 << 16, dtype=torch.int32)
    expected = tensor.numpy().tobytes()
    encoded = codec_for(Image).encode(Image(tensor))
    del tensor
    gc.collect()
    churn = [torch.full((1 << 16,), -1, dtype=torch.int32) for _ in range(8)]
    assert bytes(encoded.buffers[0]) == expected
    assert all(int(c[0]) == -1 for c in churn)


def test_encode_detaches_tensors_that_require_grad() -> None:
    """A tensor that requires grad is sent as its data, and arrives without grad."""
    tensor = torch.ones(3, requires_grad=True)
    got = codec_for(Image).decode(codec_for(Image).encode(Image(tensor * 2)))
    assert not got.pixels.requires_grad
    assert torch.equal(got.pixels, torch.full((3,), 2.0))


def test_encode_resolves_lazily_negated_views() -> None:
    """A view whose negation is only a flag (the imaginary part of a conjugate; torch's
    negative view, contiguous) is sent as the values it stands for, not the bytes under it."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    negated = torch._neg_view(torch.tensor([1.0, -5.0]))
    assert negated.is_contiguous()
    for view, values in ((z.conj().imag, [-2.0, 4.0]), (negated, [-1.0, 5.0])):
        assert view.is_neg() and view.dtype == torch.float32
        got = codec_for(Image).decode(codec_for(Image).encode(Image(view)))
        assert torch.equal(got.pixels, torch.tensor(values))


def test_decode_from_writable_buffer_shares_memory() -> None:
    """A tensor decoded from a bytearray is a view of that bytearray."""
    encoded = codec_for(Image).encode(Image(torch.arange(8, dtype=torch.float64)))
    frame = bytearray(encoded.buffers[0])
    got = codec_for(Image).decode(Encoded(encoded.header, (frame,)))
    start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert got.pixels.data_ptr() == start
    frame[:8] = np.float64(42.0).tobytes()
    assert float(got.pixels[0]) == 42.0


def test_decode_from_bytes_copies() -> None:
    """A tensor decoded from read-only bytes owns a writable copy."""
    encoded = codec_for(Image).encode(Image(torch.arange(8, dtype=torch.float64)))
    frame = bytes(encoded.buffers[0])
    got = codec_for(Image).decode(Encoded(encoded.header, (frame,)))
    start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert not start <= got.pixels.data_ptr() < start + len(frame)
    got.pixels[0] = 7.0
    assert frame == encoded.buffers[0]


def test_decoded_array_is_writable() -> None:
    """numpy arrays decode writable even from bytes, and share a writable buffer."""
    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    codec = codec_for(Any)
    encoded = codec.encode(array)
    frame = bytearray(encoded.buffers[0])
    shared = codec.decode(Encoded(encoded.header, (frame,)))
    assert shared.ctypes.data == np.frombuffer(frame, dtype=np.uint8).ctypes.data
    copied = codec.decode(Encoded(encoded.header, (bytes(frame),)))
    assert copied.flags.writeable
    assert_same_array(array, copied)


def test_decode_type_mismatch_names_field() -> None:
    """Decoding a field of the wrong type raises PayloadError naming the field."""
    encoded = codec_for(Any).encode(Text(value=5))  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(PayloadError) as info:
        codec_for(Text).decode(encoded)
    assert info.value.field == "$.value"
    assert "$.value" in str(info.value)
    assert "Text" in str(info.value)


def test_decode_tensor_field_rejects_non_tensor() -> None:
    """A tensor-typed field holding a number or text raises PayloadError naming it (an
    array is taken for a tensor: see test_an_array_and_a_tensor_each_decode_...)."""
    for wrong in (3, "pixels"):
        encoded = codec_for(Any).encode({"pixels": wrong})
        with pytest.raises(PayloadError) as info:
            codec_for(Image).decode(encoded)
        assert info.value.field == "$.pixels"


def test_encode_wrong_top_level_type() -> None:
    """Encoding a value that is not of the declared class raises PayloadError."""
    with pytest.raises(PayloadError, match="expected Text, got str"):
        codec_for(Text).encode("hello")  # type: ignore[arg-type]  # wrong on purpose


def test_encode_unsupported_object_names_path() -> None:
    """Encoding an unsupported object raises PayloadError naming where it sits."""
    with pytest.raises(PayloadError) as info:
        codec_for(Any).encode(Inner(torch.zeros(1), label=[1, object()]))  # type: ignore[arg-type]
    assert info.value.field == "$.label[1]"
    assert "object" in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        np.array([object()]),
        np.float32(1.0),
        torch.zeros(3).to_sparse(),
        torch.empty(2, device="meta"),
    ],
    ids=["object-array", "numpy-scalar", "sparse", "meta"],
)
def test_encode_unsupported_values(value: Any) -> None:
    """Object arrays, numpy scalars, sparse and meta tensors are refused with PayloadError."""
    with pytest.raises(PayloadError, match=r"not supported|no data"):
        codec_for(Any).encode({"x": value})


def test_a_tensor_torch_cannot_give_bytes_of_is_a_payload_error() -> None:
    """A nested tensor made torch raise its own error (RuntimeError), not PayloadError."""
    with pytest.warns(UserWarning, match="nested"):
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(PayloadError, match="cannot encode payload"):
        codec_for(Any).encode({"x": nested})


class _Labelled(torch.Tensor):
    """A tensor subclass defined outside torch."""


def test_a_tensor_subclass_of_any_module_encodes_as_a_tensor() -> None:
    """One defined outside torch's modules was refused as an unsupported object."""
    t = torch.arange(4.0).as_subclass(_Labelled)
    out = codec_for(Image).decode(codec_for(Image).encode(Image(t)))
    assert torch.equal(out.pixels, torch.arange(4.0))


class _LabelledImage(msgspec.Struct):
    pixels: _Labelled


def test_a_field_declared_as_a_tensor_subclass_decodes_as_one() -> None:
    """It passed the build-time check and encoded, then failed every decode: the wire
    rebuilds a plain tensor, which the field refused."""
    codec = codec_for(_LabelledImage)
    out = codec.decode(codec.encode(_LabelledImage(torch.arange(3.0).as_subclass(_Labelled))))
    assert type(out.pixels) is _Labelled and torch.equal(out.pixels, torch.arange(3.0))


class _Array(msgspec.Struct):
    values: np.ndarray


def test_an_array_and_a_tensor_each_decode_where_the_other_is_declared() -> None:
    """A numpy array sent where a tensor is declared (a raw uint8 image, say) was refused at
    the consumer: "Expected `Tensor`, got `ndarray`". Each is now taken for the other."""
    pixels = np.arange(24, dtype=np.uint8).reshape(2, 4, 3)
    out = codec_for(Image).decode(codec_for(Image).encode(Image(pixels)))  # type: ignore[arg-type]
    assert isinstance(out.pixels, torch.Tensor) and out.pixels.dtype == torch.uint8
    assert out.pixels.numpy().tolist() == pixels.tolist()
    back = codec_for(_Array).decode(codec_for(_Array).encode(_Array(torch.arange(3))))  # type: ignore[arg-type]
    assert isinstance(back.values, np.ndarray) and back.values.tolist() == [0, 1, 2]
    with pytest.raises(PayloadError, match="Expected `ndarray`, got `Tensor`"):
        codec_for(_Array).decode(
            codec_for(_Array).encode(_Array(torch.zeros(2, dtype=torch.bfloat16)))
        )  # type: ignore[arg-type]


class _Abstract(msgspec.Struct):
    n: int

    def __post_init__(self) -> None:
        if type(self) is _Abstract:
            raise TypeError("send a subclass")


class _Concrete(_Abstract):
    pass


def test_a_subclass_its_declared_class_refuses_to_become_is_a_payload_error() -> None:
    """Sent as the declared class, which its own __post_init__ refuses: a bare TypeError
    escaped encode."""
    with pytest.raises(PayloadError, match="cannot send _Concrete as the declared _Abstract"):
        codec_for(_Abstract).encode(_Concrete(1))


class _Tagged(msgspec.Struct, tag=True):
    n: int


class _TaggedChild(_Tagged, tag=True):
    extra: int = 0


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    n: int


class _StrictChild(_Strict):
    extra: int = 0


@pytest.mark.parametrize(
    ("base", "child"), [(_Tagged, _TaggedChild), (_Strict, _StrictChild)], ids=["tag", "strict"]
)
def test_an_instance_of_a_subclass_travels_as_its_declared_class(base: Any, child: Any) -> None:
    """A stage declared to return a class, returning a subclass's instance: its consumer
    decodes the declared class, which refused the subclass's tag or extra field."""
    codec = codec_for(base)
    assert codec.decode(codec.encode(child(3, extra=9))) == base(3)


def test_a_header_nested_past_the_recursion_limit_is_a_payload_error() -> None:
    """msgspec raises RecursionError for it, which escaped every wire boundary."""
    header = b"\x81\xa1x" + b"\x91" * 200_000 + b"\xc0"
    with pytest.raises(PayloadError, match="malformed"):
        codec_for(Any).decode(Encoded(header))


def test_a_tensor_from_a_device_backend_not_installed_here_is_a_payload_error() -> None:
    """torch raises ModuleNotFoundError for such a device (hpu), which escaped."""
    encoded = codec_for(Image).encode(Image(torch.zeros(2)))
    ref = msgspec.msgpack.encode(("float32", (2,), 0, "hpu"))
    header = msgspec.msgpack.encode({"pixels": msgspec.msgpack.Ext(1, ref)})
    with pytest.raises(PayloadError, match="'hpu'"):
        codec_for(Image).decode(Encoded(header, encoded.buffers))


@pytest.mark.parametrize(
    ("tp", "name"),
    [
        (Text, "Text"),
        (Text | None, "Text | None"),
        (list[Text], "list[Text]"),
        (dict[str, Text | int], "dict[str, Text | int]"),
        (Any, "Any"),
    ],
)
def test_types_are_named_as_written(tp: Any, name: str) -> None:
    """Messages named typing aliases by their class: "produces Optional but expects Base"."""
    assert type_name(tp) == name


@pytest.mark.parametrize(
    "header",
    [b"", b"\xc1", b"\x81\xa5value", b"\x01", b"\xd4\x01\x00", b"\xd4\x07\x00"],
    ids=["empty", "invalid-opcode", "truncated", "not-a-map", "bad-ref", "unknown-ext"],
)
def test_garbage_header(header: bytes) -> None:
    """A malformed or meaningless header raises PayloadError."""
    with pytest.raises(PayloadError):
        codec_for(Text).decode(Encoded(header))


@pytest.mark.parametrize(
    ("code", "ref"),
    [
        (1, ("no_such_dtype", (1,), 0)),
        (1, ("__dict__", (1,), 0)),
        (2, ("[('x', 'nonsense')]", (1,), 0)),
        (2, ("O", (1,), 0)),
        (1, ("float32", (0, 2**63), 0)),
        (2, ("<f4", (0, 2**63), 0)),
        (1, ("float32", (-1,), 0)),
        (1, ("float32", "not-a-shape", 0)),
        (2, ("S0", (2**20,), 0)),
        (2, ("U0", (2**40,), 0)),
    ],
    ids=[
        "dtype",
        "dtype-attr",
        "descr",
        "object",
        "tensor-huge",
        "array-huge",
        "neg",
        "shape",
        "zero-size-bytes",
        "zero-size-str",
    ],
)
def test_bad_buffer_reference(code: int, ref: tuple[Any, ...]) -> None:
    """A reference with an unknown dtype or an impossible shape raises PayloadError; a
    zero-size dtype ('S0', which numpy widens to one byte an item as it allocates) used to
    decode to an array of any size from a 0-byte buffer."""
    header = msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(code, msgspec.msgpack.encode(ref))})
    with pytest.raises(PayloadError):
        codec_for(Any).decode(Encoded(header, (bytearray(),)))


@pytest.mark.parametrize("dims", [65, 60_000])
def test_a_shape_of_more_dimensions_than_numpy_takes_is_refused_as_it_is_read(dims: int) -> None:
    """A shape past numpy's 64 dimensions is refused by the header's schema. It used to
    reach the size check, whose product over tens of thousands of dimensions took seconds
    (quadratic in the shape's length: days for a header of the size inline data allows)."""
    ref = msgspec.msgpack.encode(("<f4", (1,) * dims, 0))
    header = msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(2, ref)})
    with pytest.raises(PayloadError, match="length <= 64"):
        codec_for(Any).decode(Encoded(header, (bytearray(4),)))


@pytest.mark.parametrize("dtype", ["V0", "[]", "[('a', '<f4', (0,))]"])
def test_arrays_of_zero_size_items_that_allocate_nothing_round_trip(dtype: str) -> None:
    """Empty void and structured items take no memory whatever the shape, so, unlike 'S0'
    and 'U0', they are not refused: what encode sends decodes back."""
    descr = np.dtype(ast.literal_eval(dtype) if dtype.startswith("[") else dtype)
    codec = codec_for(Any)
    got = codec.decode(codec.encode(np.zeros(3, descr)))
    assert got.dtype == descr and got.shape == (3,)


def test_a_buffer_referenced_twice_is_refused() -> None:
    """Encode sends each tensor's bytes once. A header that references one buffer many
    times (a read-only one: each reference took a copy of its own, a 1 MiB payload asking
    for GiBs) is refused."""
    buffer = bytes(4 * 1024)
    ref = msgspec.msgpack.Ext(2, msgspec.msgpack.encode(("<f4", (1024,), 0)))
    header = msgspec.msgpack.encode({"x": [ref] * 3})
    with pytest.raises(PayloadError, match="buffer 0 is referenced twice"):
        codec_for(Any).decode(Encoded(header, (buffer,)))


class _Tags(msgspec.Struct):
    tags: frozenset[Any]


def test_an_array_where_a_set_member_is_due_is_a_payload_error() -> None:
    """An array in a set field cannot be a member (unhashable): a PayloadError, where
    msgspec's TypeError used to escape the decode."""
    ref = msgspec.msgpack.Ext(2, msgspec.msgpack.encode(("<f4", (1,), 0)))
    header = msgspec.msgpack.encode({"tags": [ref]})
    with pytest.raises(PayloadError, match="unhashable"):
        codec_for(_Tags).decode(Encoded(header, (bytearray(4),)))


def test_buffer_size_mismatch() -> None:
    """A buffer whose size does not match dtype and shape raises PayloadError."""
    encoded = codec_for(Image).encode(Image(torch.zeros(2, 3)))
    for frame in (bytearray(23), bytearray(25), b""):
        with pytest.raises(PayloadError, match="bytes"):
            codec_for(Image).decode(Encoded(encoded.header, (frame,)))


def test_buffer_index_out_of_range() -> None:
    """A reference to a buffer that was not sent raises PayloadError."""
    encoded = codec_for(Image).encode(Image(torch.zeros(2)))
    with pytest.raises(PayloadError, match="buffer 0"):
        codec_for(Image).decode(Encoded(encoded.header, ()))


def test_unavailable_device_is_reported() -> None:
    """A tensor sent from a device this process lacks raises PayloadError naming it."""
    codec = codec_for(Image)
    encoded = codec.encode(Image(torch.zeros(2)))
    ref = msgspec.msgpack.encode(("float32", (2,), 0, "cuda:7"))
    header = msgspec.msgpack.encode({"pixels": msgspec.msgpack.Ext(1, ref)})
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(PayloadError, match="cuda:7"):
        codec.decode(Encoded(header, encoded.buffers))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_returns_to_its_device() -> None:
    """A CUDA tensor is sent through host memory and decoded back onto its device."""
    tensor = torch.arange(6, device="cuda").reshape(2, 3).T
    got = codec_for(Image).decode(codec_for(Image).encode(Image(tensor)))
    assert got.pixels.device == tensor.device
    assert torch.equal(got.pixels, tensor)


def test_codecs_are_thread_safe() -> None:
    """Concurrent encodes and decodes on many threads never mix their buffers."""
    codec = codec_for(Image)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(200):
                tensor = torch.full((k + 1,), k, dtype=torch.int64)
                got = codec.decode(codec.encode(Image(tensor)))
                assert torch.equal(got.pixels, tensor)
        except BaseException as e:  # reported to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors


def test_import_does_not_import_torch() -> None:
    """Importing the codec and round-tripping plain payloads leaves torch unimported."""
    script = (
        "import sys, msgspec\n"
        "from pipeline._codec import codec_for\n"
        "class T(msgspec.Struct):\n"
        "    v: list[int]\n"
        "c = codec_for(T)\n"
        "assert c.decode(c.encode(T([1, 2]))) == T([1, 2])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_codec_repr_and_type() -> None:
    """A codec remembers and shows its declared type."""
    codec: PayloadCodec[Text] = PayloadCodec(Text)
    assert codec.type is Text
    assert repr(codec) == "PayloadCodec(Text)"
