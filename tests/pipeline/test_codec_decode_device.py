"""Tests for decoding onto a chosen device: ``PayloadCodec.decode(..., device=...)`` and
``resolve_device``, which check it.

This host may have no GPU, so the sending side is forged: a payload encoded on the CPU has
its tensor records rewritten to name a CUDA device this process cannot use, as a remote
client on a CPU-only host receives a GPU sink's outputs. CPU uint8 tensors stand in for
device buffers, since decoding does not care where a buffer lives.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline._codec import _REF_DECODER, _REF_ENCODER, codec_for, resolve_device
from pipeline._encoded import Encoded
from pipeline._errors import ConfigError, PayloadError
from tests.pipeline.test_codec_device import Mixed, bits

#: A CUDA device this process cannot use: cuda:0 without CUDA, one past the last with it.
MISSING = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda:0"


def sent_from(encoded: Encoded, device: str) -> Encoded:
    """``encoded`` as if each tensor in it had been sent from ``device``: the same bytes, in
    writable buffers, with every tensor record naming that device."""

    def rename(code: int, data: memoryview) -> msgspec.msgpack.Ext:
        ref = _REF_DECODER.decode(data)
        if code == 1:  # a tensor; arrays are always on the host
            ref = msgspec.structs.replace(ref, device=device)
        return msgspec.msgpack.Ext(code, _REF_ENCODER.encode(ref))

    header = msgspec.msgpack.encode(msgspec.msgpack.decode(encoded.header, ext_hook=rename))
    assert header != encoded.header or not encoded.buffers
    buffers = tuple(bytearray(memoryview(b)) for b in encoded.buffers)
    return Encoded(header, buffers)


def cases() -> list[torch.Tensor]:
    """Tensors of several dtypes and shapes, some through the short path and some not."""
    return [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(),
        torch.tensor(-7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.empty(0, 5),
        torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
    ]


def test_a_tensor_sent_from_a_device_this_process_lacks_decodes_onto_the_chosen_one() -> None:
    """Records naming a CUDA device this process lacks fail to decode by default, and with
    ``device="cpu"`` give the exact tensors (dtype, shape, bytes) on the CPU, for typed and
    untyped fields and for an untyped codec; arrays and plain fields are untouched."""
    want = cases()
    value = Mixed(want, np.arange(4), "x", extra=torch.ones(2, dtype=torch.float16))
    for codec, encoded in (
        (codec_for(Mixed), codec_for(Mixed).encode(value)),
        (codec_for(Any), codec_for(Any).encode({"tensors": want, "extra": value.extra})),
    ):
        forged = sent_from(encoded, MISSING)
        with pytest.raises(PayloadError, match=f"sent from device '{MISSING}'"):
            codec.decode(forged)
        got = codec.decode(forged, device="cpu")
        tensors = got.tensors if isinstance(got, Mixed) else got["tensors"]
        extra = got.extra if isinstance(got, Mixed) else got["extra"]
        for w, t in zip([*want, value.extra], [*tensors, extra], strict=True):
            assert t.device == torch.device("cpu")
            assert (t.dtype, t.shape, bits(t)) == (w.dtype, w.shape, bits(w))
        if isinstance(got, Mixed):
            assert np.array_equal(got.array, value.array) and got.label == "x"


def test_a_tensor_decoded_onto_the_cpu_shares_its_writable_buffer() -> None:
    """On the CPU, a tensor sent from elsewhere takes the path of one sent from the CPU: a
    view of its writable buffer, no copy."""
    encoded = codec_for(Mixed).encode(Mixed([torch.arange(8.0)], np.arange(1), "x"))
    forged = sent_from(encoded, MISSING)
    got = codec_for(Mixed).decode(forged, device="cpu")
    start = np.frombuffer(forged.buffers[0], np.uint8).ctypes.data
    assert got.tensors[0].data_ptr() == start
    assert torch.equal(got.tensors[0], torch.arange(8.0))


def test_tensors_land_on_the_chosen_device_whatever_device_they_came_from() -> None:
    """With ``device="meta"``, tensors sent from the CPU and from a missing GPU both land
    on meta with their dtype and shape; numpy arrays stay arrays."""
    value = Mixed(cases(), np.arange(3), "m", extra=torch.ones(2, 2))
    encoded = codec_for(Mixed).encode(value)
    for payload in (encoded, sent_from(encoded, MISSING)):
        got = codec_for(Mixed).decode(payload, device="meta")
        for w, t in zip([*value.tensors, value.extra], [*got.tensors, got.extra], strict=True):
            assert t.is_meta and (t.dtype, t.shape) == (w.dtype, w.shape)
        assert isinstance(got.array, np.ndarray) and np.array_equal(got.array, value.array)


def test_device_bytes_are_moved_onto_the_chosen_device() -> None:
    """A tensor that came as device bytes (as over cuda_ipc) is moved onto the chosen
    device, and is the very view of those bytes where it already is there."""
    want = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    encoded = codec_for(Mixed).encode(Mixed([want], np.arange(2), "d"))
    flat = torch.frombuffer(bytearray(encoded.buffers[0]), dtype=torch.uint8)
    stand_in = Encoded(encoded.header, (b"", *encoded.buffers[1:]), device_buffers={0: flat})
    moved = codec_for(Mixed).decode(stand_in, device="meta").tensors[0]
    assert moved.is_meta and (moved.dtype, moved.shape) == (want.dtype, want.shape)
    kept = codec_for(Mixed).decode(stand_in, device="cpu").tensors[0]
    assert kept.data_ptr() == flat.data_ptr() and torch.equal(kept, want)


def test_the_chosen_device_holds_for_its_own_decode_only() -> None:
    """A decode naming a device, one that fails included, leaves later decodes on the same
    thread deciding by each record's device as before."""
    encoded = codec_for(Mixed).encode(Mixed([torch.ones(3)], np.arange(1), "x"))
    forged = sent_from(encoded, MISSING)
    assert torch.equal(codec_for(Mixed).decode(forged, device="cpu").tensors[0], torch.ones(3))
    with pytest.raises(PayloadError, match="holds 3 bytes"):
        codec_for(Mixed).decode(Encoded(forged.header, (bytearray(3), b"")), device="cpu")
    with pytest.raises(PayloadError, match=f"sent from device '{MISSING}'"):
        codec_for(Mixed).decode(forged)
    assert codec_for(Mixed).decode(encoded).tensors[0].device == torch.device("cpu")


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    """A CPU tensor of any bytes, of a dtype numpy shares or one it lacks (bfloat16)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                  torch.int64, torch.uint8, torch.complex128]))  # fmt: skip
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    size = int(np.prod(shape)) * dtype.itemsize
    raw = bytearray(draw(st.binary(min_size=size, max_size=size)))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(st.lists(_tensors(), max_size=4))
def test_decoding_onto_the_cpu_is_exact_for_any_tensor(tensors: list[torch.Tensor]) -> None:
    """Any tensors sent from a missing GPU decode onto the CPU with their exact bytes."""
    encoded = codec_for(Any).encode(tensors)
    got = codec_for(Any).decode(sent_from(encoded, MISSING), device="cpu")
    assert [(t.dtype, t.shape, bits(t)) for t in got] == [
        (t.dtype, t.shape, bits(t)) for t in tensors
    ]


@pytest.mark.parametrize(("given_", "want"), [("cpu", "cpu"), ("cpu:0", "cpu"), ("meta", "meta")])
def test_resolve_device_gives_the_canonical_name(given_: str, want: str) -> None:
    """Devices every process can use pass, by their canonical names."""
    assert resolve_device(given_) == want


@pytest.mark.parametrize("device", ["gpu", "", "cuda:x", "CPU"])
def test_a_name_that_is_no_device_is_a_config_error_saying_what_to_pass(device: str) -> None:
    """A name torch does not know is a one-line ConfigError naming it and suggesting cpu."""
    with pytest.raises(ConfigError) as info:
        resolve_device(device)
    message = str(info.value)
    assert f"device {device!r} is not a torch device" in message
    assert "pass 'cpu'" in message and "\n" not in message


def test_a_device_this_process_cannot_use_is_a_config_error() -> None:
    """A CUDA device this process lacks, and a backend torch here was built without, are
    one-line ConfigErrors suggesting cpu."""
    for device in (MISSING, "cuda:99", "xpu"):
        if device == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
            continue
        with pytest.raises(ConfigError) as info:
            resolve_device(device)
        message = str(info.value)
        assert message.startswith(f"device {device!r} cannot be used here")
        assert "pass 'cpu'" in message and "\n" not in message


class _Pixels(msgspec.Struct):
    pixels: torch.Tensor


def test_an_array_sent_where_a_tensor_is_declared_lands_on_the_chosen_device() -> None:
    """It was made a tensor on the CPU, whatever device the decode named."""
    encoded = codec_for(_Pixels).encode(_Pixels(np.zeros((2, 3), np.uint8)))  # type: ignore[arg-type]
    got = codec_for(_Pixels).decode(encoded, device="meta").pixels
    assert got.is_meta and (got.dtype, got.shape) == (torch.uint8, (2, 3))
    assert codec_for(_Pixels).decode(encoded).pixels.device.type == "cpu"
