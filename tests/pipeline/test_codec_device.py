"""Tests for device buffers in the codec: CUDA bytes stay on the GPU until a transport or
``to_host`` moves them.

CPU tests pin the host-only behaviour and the decode routing (CPU uint8 tensors stand in
for device buffers, since decoding does not care where a buffer lives); tests that make
CUDA tensors carry the ``gpu`` marker and skip cleanly without a CUDA device.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from pipeline._codec import codec_for
from pipeline._encoded import NO_DEVICE_BUFFERS, Encoded, to_host
from pipeline._errors import PayloadError

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()


class Mixed(msgspec.Struct):
    """A payload mixing tensors, an array and plain fields."""

    tensors: list[torch.Tensor]
    array: np.ndarray
    label: str
    extra: Any = None


def bits(t: torch.Tensor) -> bytes:
    """The logical contents of ``t`` as bytes in C order, wherever it lives."""
    src = torch.view_as_real(t) if t.is_complex() else t
    flat = src.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def test_host_only_payload_is_returned_by_to_host_unchanged() -> None:
    """to_host of a payload with nothing on a device is the very same object, for payloads
    with and without buffers."""
    codec = codec_for(Mixed)
    for value in (
        Mixed([], np.zeros(0), "empty"),
        Mixed([torch.arange(6).reshape(2, 3)], np.arange(4), "cpu", extra=torch.ones(2)),
    ):
        encoded = codec.encode(value)
        assert not encoded.has_device_buffers
        assert encoded.device_buffers is NO_DEVICE_BUFFERS
        assert to_host(encoded) is encoded


def test_host_only_device_buffers_cannot_change() -> None:
    """The shared empty device_buffers of host-only payloads refuses every mutation."""
    encoded = Encoded(b"h")
    mutations: list[Callable[[dict[int, Any]], object]] = [
        lambda d: d.__setitem__(0, b""),
        lambda d: d.update({0: b""}),
        lambda d: d.setdefault(0, b""),
        lambda d: d.pop(0),
        lambda d: d.clear(),
    ]
    for mutate in mutations:
        with pytest.raises(TypeError, match="cannot be changed"):
            mutate(encoded.device_buffers)
    assert len(NO_DEVICE_BUFFERS) == 0


def test_decode_views_device_buffers_in_place() -> None:
    """A reference whose buffer is a device buffer becomes a view of that tensor itself
    (dtype and shape applied, no copy); its host slot is only a placeholder."""
    codec = codec_for(Mixed)
    want = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.tensor([True, False])]
    encoded = codec.encode(Mixed(want, np.arange(3), "x"))
    flats = {0: torch.frombuffer(bytearray(encoded.buffers[0]), dtype=torch.uint8)}
    placeholders = (b"", *encoded.buffers[1:])
    stand_in = Encoded(encoded.header, placeholders, device_buffers=flats)
    assert stand_in.has_device_buffers
    assert stand_in.nbytes == encoded.nbytes, "device bytes count towards nbytes"
    got = codec.decode(stand_in)
    assert got.tensors[0].data_ptr() == flats[0].data_ptr()
    assert torch.equal(got.tensors[0], want[0])
    assert torch.equal(got.tensors[1], want[1])


@pytest.mark.parametrize(
    "flat",
    [
        torch.zeros(47, dtype=torch.uint8),
        torch.zeros(12, dtype=torch.float32),
        torch.zeros(2, 24, dtype=torch.uint8),
        torch.zeros(96, dtype=torch.uint8)[::2],
    ],
    ids=["short", "not-uint8", "not-flat", "strided"],
)
def test_bad_device_buffer_is_payload_error(flat: torch.Tensor) -> None:
    """A device buffer of the wrong size, dtype or layout raises PayloadError."""
    codec = codec_for(Mixed)
    encoded = codec.encode(Mixed([torch.zeros(12)], np.arange(1), "x"))
    bad = Encoded(encoded.header, (b"", *encoded.buffers[1:]), device_buffers={0: flat})
    with pytest.raises(PayloadError, match="device buffer 0"):
        codec.decode(bad)


def test_to_host_copies_device_buffers_into_their_slots() -> None:
    """to_host fills each placeholder with its device buffer's bytes, as a writable buffer,
    and the result decodes to the same values."""
    codec = codec_for(Mixed)
    value = Mixed([torch.arange(5, dtype=torch.int16), torch.ones(2, 2)], np.arange(2), "y")
    encoded = codec.encode(value)
    flats = {i: torch.frombuffer(bytearray(encoded.buffers[i]), dtype=torch.uint8) for i in (0, 1)}
    stand_in = Encoded(encoded.header, (b"", b"", encoded.buffers[2]), device_buffers=flats)
    host = to_host(stand_in)
    assert not host.has_device_buffers
    assert [bytes(memoryview(b)) for b in host.buffers] == [
        bytes(memoryview(b)) for b in encoded.buffers
    ]
    assert all(not memoryview(b).readonly for b in host.buffers[:2])
    assert host.nbytes == encoded.nbytes
    got = codec.decode(host)
    assert all(torch.equal(a, b) for a, b in zip(value.tensors, got.tensors, strict=True))


def test_cpu_encode_never_initialises_cuda() -> None:
    """Encoding and decoding CPU tensors leaves CUDA uninitialised in a fresh process."""
    script = (
        "import msgspec, torch\n"
        "from pipeline._codec import codec_for\n"
        "class T(msgspec.Struct):\n"
        "    t: torch.Tensor\n"
        "c = codec_for(T)\n"
        "e = c.encode(T(torch.arange(4).t()))\n"
        "assert not e.has_device_buffers\n"
        "assert torch.equal(c.decode(e).t, torch.arange(4))\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def _cuda_cases() -> dict[str, torch.Tensor]:
    """CUDA tensors of several dtypes and layouts."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    raw = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda", generator=gen)
    return {
        "float32 matrix": raw[: 4 * 60].view(torch.float32).reshape(6, 10),
        "float16 transposed": raw[: 2 * 48].view(torch.float16).reshape(6, 8).t(),
        "bfloat16 3-d": raw[: 2 * 24].view(torch.bfloat16).reshape(2, 3, 4),
        "int64 offset view": raw[: 8 * 9].view(torch.int64)[2:],
        "uint8 strided": raw.reshape(256, 256)[:, ::3],
        "bool": (raw[:20] % 2).bool(),
        "complex64": raw[: 8 * 5].view(torch.complex64),
        "0-d": raw[:4].view(torch.int32)[0],
        "empty": torch.empty(0, 4, device="cuda"),
        "large": raw,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_round_trip_stays_on_the_device() -> None:
    """CUDA tensors of several dtypes and shapes encode to device buffers (host slots are
    placeholders), and decode on their device, equal, sharing memory when contiguous."""
    cases = _cuda_cases()
    codec = codec_for(Mixed)
    encoded = codec.encode(Mixed([*cases.values()], np.arange(3), "gpu", torch.ones(2)))
    assert sorted(encoded.device_buffers) == list(range(len(cases)))
    for index, flat in encoded.device_buffers.items():
        assert flat.is_cuda and flat.dtype == torch.uint8 and flat.dim() == 1
        assert encoded.buffers[index] == b""
    assert len(encoded.buffers) == len(cases) + 2, "the CPU tensor and array stay host buffers"
    got = codec.decode(encoded)
    for (name, want), tensor in zip(cases.items(), got.tensors, strict=True):
        assert tensor.device == want.device, name
        assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), name
        assert bits(tensor) == bits(want), name
    large = got.tensors[-1]
    assert large.data_ptr() == cases["large"].data_ptr(), "a contiguous tensor was copied"
    assert not got.extra.is_cuda and torch.equal(got.extra, torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_to_host_matches_cpu_bytes() -> None:
    """to_host holds exactly the bytes .cpu() gives, and decoding it brings every tensor
    back to its CUDA device."""
    cases = _cuda_cases()
    codec = codec_for(Mixed)
    encoded = codec.encode(Mixed([*cases.values()], np.arange(3), "gpu"))
    host = to_host(encoded)
    assert not host.has_device_buffers and host.nbytes == encoded.nbytes
    for index, flat in encoded.device_buffers.items():
        assert bytes(memoryview(host.buffers[index])) == flat.cpu().numpy().tobytes()
    got = codec.decode(host)
    for (name, want), tensor in zip(cases.items(), got.tensors, strict=True):
        assert tensor.device == want.device, name
        assert bits(tensor) == bits(want), name
