"""A verified tensor file: a JSON header with per-tensor SHA-256s, then raw tensor bytes.

The layout, in the spirit of safetensors (which is not a dependency here)::

    8 bytes   magic b"SWTENSR1"
    8 bytes   header length N, little-endian uint64
    N bytes   header: JSON of TensorFileHeader (free-form metadata, and per tensor its
              dtype, shape, byte offset, byte length and SHA-256)
    padding   zeros up to a multiple of 64 bytes
    data      each tensor's raw little-endian float32 bytes, 64-byte aligned

Why not ``torch.save``: ``torch.load(weights_only=True)`` is safe against code execution,
but it unpickles a zip archive as a whole. Here a reader parses plain JSON and then reads
only the byte ranges it wants, so a stage never touches another stage's tensors.

Verification is in two steps: the header's SHA-256 must equal a digest the caller pins,
and each tensor read must match the SHA-256 its header entry lists. Every byte a reader
uses is thereby tied to the pinned digest, without hashing the parts it does not read.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import torch

from pipeline._encoded import DECODE_ERRORS

__all__ = (
    "TensorEntry",
    "TensorFileError",
    "TensorFileHeader",
    "read_header",
    "read_tensors",
    "write_tensor_file",
)

MAGIC = b"SWTENSR1"
ALIGN = 64
#: A header larger than this is refused unread (a corrupt length field).
MAX_HEADER = 1 << 20


class TensorFileError(Exception):
    """A tensor file is missing, malformed, or does not match its checksums."""


class TensorEntry(msgspec.Struct, frozen=True):
    """Where one tensor lies in the data section, and its SHA-256."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sha256: str


class TensorFileHeader(msgspec.Struct, frozen=True):
    """The JSON header of a tensor file."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]
    format: str = "stagewire-tensors/1"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_tensor_file(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
) -> str:
    """Write ``tensors`` to ``path`` atomically; returns the header's SHA-256.

    Raises:
        TensorFileError: a tensor is not float32.
        OSError: the file cannot be written.
    """
    entries: dict[str, TensorEntry] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise TensorFileError(f"tensor {name!r} is {t.dtype}; only float32 is supported")
        blob = t.detach().cpu().contiguous().numpy().astype("<f4").tobytes()
        digest = hashlib.sha256(blob).hexdigest()
        entries[name] = TensorEntry("float32", tuple(t.shape), offset, len(blob), digest)
        blobs.append(blob)
        offset = _aligned(offset + len(blob))
    header = msgspec.json.encode(TensorFileHeader(metadata, entries))
    start = _aligned(16 + len(header))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may write the same file at once; each writes a private temporary
    # file and renames it into place, so a reader never sees a partial file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        # mkstemp makes the file private; tensors are not secret, and a cache directory
        # shared between users should serve them all.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for entry, blob in zip(entries.values(), blobs, strict=True):
                f.seek(start + entry.offset)
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return hashlib.sha256(header).hexdigest()


def read_header(path: Path) -> tuple[TensorFileHeader, str, int]:
    """Read and parse a tensor file's header, without verifying it.

    Returns:
        The header, its SHA-256, and the offset of the data section.

    Raises:
        TensorFileError: the file is missing, truncated, or its header is malformed.
    """
    try:
        with path.open("rb") as f:
            prefix = f.read(16)
            if len(prefix) < 16:
                raise TensorFileError(f"{path}: truncated file ({len(prefix)} bytes)")
            if prefix[:8] != MAGIC:
                raise TensorFileError(f"{path}: not a stagewire tensor file (bad magic)")
            (n,) = struct.unpack("<Q", prefix[8:])
            if n > MAX_HEADER:
                raise TensorFileError(f"{path}: header length {n} is implausible")
            raw = f.read(n)
    except OSError as e:
        raise TensorFileError(f"{path}: cannot read: {e.strerror or e}") from e
    if len(raw) != n:
        raise TensorFileError(f"{path}: truncated header ({len(raw)} of {n} bytes)")
    try:
        header = msgspec.json.decode(raw, type=TensorFileHeader)
    # A ValidationError is a DecodeError; invalid UTF-8 and deep nesting raise their own.
    except DECODE_ERRORS as e:
        raise TensorFileError(f"{path}: malformed header: {e}") from e
    return header, hashlib.sha256(raw).hexdigest(), _aligned(16 + n)


def read_tensors(
    path: Path, digest: str, prefix: str = ""
) -> tuple[TensorFileHeader, dict[str, torch.Tensor]]:
    """Read the tensors whose names start with ``prefix``, verifying every byte read.

    Args:
        path: the file.
        digest: the SHA-256 the header must have.
        prefix: e.g. ``"vision."``; it is stripped from the returned names.

    Returns:
        The verified header, and the tensors (writable, on the CPU).

    Raises:
        TensorFileError: the header's digest differs, a tensor is truncated or corrupt, or
            no tensor has the prefix.
    """
    if sys.byteorder != "little":
        raise TensorFileError("tensors are stored little-endian; big-endian hosts are unsupported")
    header, actual, start = read_header(path)
    if actual != digest:
        raise TensorFileError(f"{path}: header checksum is {actual}, expected {digest}")
    out: dict[str, torch.Tensor] = {}
    with path.open("rb") as f:
        for name, e in header.tensors.items():
            if not name.startswith(prefix):
                continue
            if e.dtype != "float32" or e.nbytes != 4 * math.prod(e.shape):
                raise TensorFileError(f"{path}: tensor {name!r} has an unsupported layout")
            f.seek(start + e.offset)
            # A bytearray is writable, so torch shares it without copying or warning.
            buf = bytearray(e.nbytes)
            if f.readinto(buf) != e.nbytes:
                raise TensorFileError(f"{path}: tensor {name!r} is truncated")
            if hashlib.sha256(buf).hexdigest() != e.sha256:
                raise TensorFileError(f"{path}: tensor {name!r} does not match its checksum")
            tensor = torch.frombuffer(buf, dtype=torch.float32).reshape(e.shape)
            out[name.removeprefix(prefix)] = tensor
    if not out:
        raise TensorFileError(f"{path}: no tensors under {prefix!r}")
    return header, out
