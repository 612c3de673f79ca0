"""The tiny VLM's weights: generated once from a fixed seed, cached in a file, verified on load.

Nothing is downloaded. On first use :func:`ensure_weights` derives every tensor from the
seed and writes them, in the format of :mod:`stages.tensorfile`, to
``$STAGEWIRE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/stagewire``, else ``~/.cache/stagewire``).
Afterwards each stage reads only its own part of that file (``vision.`` or ``decoder.``),
checked against the pinned :data:`TINY_VLM_DIGEST`.

The values come from SHAKE-256 of ``"{seed}/{tensor name}"``, read as little-endian
``uint32`` and mapped to a uniform distribution, not from ``torch.manual_seed``: a hash is
specified to the bit on every platform and torch version, so the file is the same
everywhere, and its digest can be pinned.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import math
import os
import time
import warnings
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from stages.model import EOS, TINY_VLM, Decoder, TinyVLM, VisionEncoder, VLMConfig
from stages.tensorfile import TensorFileError, TensorFileHeader, read_tensors, write_tensor_file

__all__ = (
    "TINY_VLM_DIGEST",
    "TINY_VLM_SEED",
    "cache_dir",
    "default_path",
    "ensure_weights",
    "generate_state",
    "load_decoder",
    "load_model",
    "load_vision",
    "write_weights",
)

TINY_VLM_SEED = 3
#: SHA-256 of the header of the weights generated from TINY_VLM and TINY_VLM_SEED; the
#: header lists every tensor's SHA-256, so this one digest pins every byte.
TINY_VLM_DIGEST = "46007e4bdb34fa24ba768fd0f9320789449f09729dc849cf0210149ba5ee351b"

M = TypeVar("M", bound=nn.Module)


def cache_dir() -> Path:
    """The directory generated weights are cached in."""
    if explicit := os.environ.get("STAGEWIRE_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stagewire"


def default_path() -> Path:
    """Where :func:`ensure_weights` puts the TINY_VLM weights; the name carries the digest."""
    return cache_dir() / f"tiny-vlm-{TINY_VLM_DIGEST[:16]}.swt"


#: The output head's bias, by token: printable ASCII 0, EOS +1, every other token -4. The
#: model stays random, but its samples read as text and some end with EOS.
_HEAD_BIAS_OTHER, _HEAD_BIAS_EOS = -4.0, 1.0


def _head_bias(config: VLMConfig) -> NDArray[np.float32]:
    bias = np.full(config.vocab_size, _HEAD_BIAS_OTHER, dtype=np.float32)
    bias[ord(" ") : ord("~") + 1] = 0.0
    bias[EOS] = _HEAD_BIAS_EOS
    return bias


def _uniform(seed: int, name: str, n: int, std: float) -> NDArray[np.float32]:
    """``n`` values uniform on ``[-a, a]`` with standard deviation ``std``, from the hash."""
    raw = hashlib.shake_256(f"{seed}/{name}".encode()).digest(4 * n)
    u = (np.frombuffer(raw, dtype="<u4").astype(np.float64) + 0.5) / 2.0**32
    return ((2.0 * u - 1.0) * (std * math.sqrt(3.0))).astype(np.float32)


def _values(
    name: str, n: int, fan_in: int, norms: set[str], config: VLMConfig, seed: int
) -> NDArray[np.float32]:
    """One tensor's values, by its role in the model."""
    if name == "decoder.head.bias":
        return _head_bias(config)
    if name in norms:
        return np.full(n, 1.0 if name.endswith(".weight") else 0.0, dtype=np.float32)
    if name.endswith(".bias"):
        return np.zeros(n, dtype=np.float32)
    if name.endswith("embed.weight"):
        return _uniform(seed, name, n, 1.0)
    if name.endswith(".pos"):
        return _uniform(seed, name, n, 0.5)
    # Linear weights, (out, in): unit-gain scaling keeps activations of order one.
    return _uniform(seed, name, n, 1.0 / math.sqrt(fan_in))


def generate_state(
    config: VLMConfig = TINY_VLM, seed: int = TINY_VLM_SEED
) -> dict[str, torch.Tensor]:
    """Derive every parameter of a :class:`TinyVLM` from ``seed``, deterministically.

    LayerNorm weights are one and biases zero (the head's, see :func:`_head_bias`); every
    other tensor is uniform, scaled by its role, from SHAKE-256 of ``"{seed}/{name}"``.
    """
    # A template on the CPU names every tensor and its shape; its own random init is
    # ignored. (On the meta device it would cost no memory but seconds of first-use setup.)
    template = TinyVLM(config)
    norms = {
        f"{mod_name}.{p}"
        for mod_name, mod in template.named_modules()
        if isinstance(mod, nn.LayerNorm)
        for p in ("weight", "bias")
    }
    state: dict[str, torch.Tensor] = {}
    for name, param in template.state_dict().items():
        shape = tuple(param.shape)
        values = _values(name, math.prod(shape), shape[-1], norms, config, seed)
        state[name] = torch.from_numpy(values.reshape(shape))
    return state


def write_weights(
    path: Path,
    state: dict[str, torch.Tensor],
    config: VLMConfig = TINY_VLM,
    seed: int = TINY_VLM_SEED,
) -> str:
    """Write a model's tensors, with its config and seed, to ``path``; returns the digest.

    Raises:
        TensorFileError: a tensor is not float32.
        OSError: the file cannot be written.
    """
    metadata = {"model": "tiny-vlm", "config": msgspec.to_builtins(config), "seed": seed}
    return write_tensor_file(path, state, metadata)


def ensure_weights(path: Path | None = None) -> Path:
    """Return the TINY_VLM weights file, generating it first if it is not there.

    Raises:
        TensorFileError: freshly generated weights do not match the pinned digest (the
            generator changed; update TINY_VLM_DIGEST deliberately).
        OSError: the cache directory is not writable.
    """
    path = default_path() if path is None else path
    if path.exists():
        return path
    _generate(path)
    return path


def _generate(path: Path) -> None:
    """Write the TINY_VLM weights to ``path`` (atomically: a reader never sees part).

    Raises:
        TensorFileError: the weights generated do not match the pinned digest.
        OSError: ``path`` cannot be written, saying where and what to do.
    """
    _remove_stale_temporaries(path)
    try:
        digest = write_weights(path, generate_state())
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot write the model's weights to {path}: {e.strerror or e}; set "
            "STAGEWIRE_CACHE_DIR to a writable directory",
        ) from e
    if digest != TINY_VLM_DIGEST:
        path.unlink(missing_ok=True)
        raise TensorFileError(f"generated weights have digest {digest}, expected {TINY_VLM_DIGEST}")


#: A temporary weights file untouched this long was left by a writer that died (one being
#: written now, by a worker starting beside this one, is seconds old).
STALE_TEMPORARY_S = 3600.0


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of writes of ``path`` that were killed before their
    rename (each a whole model's size); nothing else."""
    cutoff = time.time() - STALE_TEMPORARY_S
    for tmp in path.parent.glob(f"{glob.escape(path.name)}*.tmp"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()


def _read(path: Path | None, prefix: str) -> tuple[TensorFileHeader, dict[str, torch.Tensor]]:
    """The tensors under ``prefix`` of the weights file, verified.

    The cached file (no ``path`` given) is generated again when it fails verification, as
    a damaged disk or an interrupted copy leaves it: it holds nothing but what the fixed
    seed makes. A file given by path is the caller's, and is never overwritten.
    """
    file = ensure_weights(path)
    try:
        return read_tensors(file, TINY_VLM_DIGEST, prefix)
    except TensorFileError as e:
        if path is not None:
            raise TensorFileError(
                f"{e} (in {file}: a copy of the weights made from the fixed seed; delete "
                "it, or pass no path, to have them generated again)"
            ) from e
        warnings.warn(
            f"the cached weights in {file} are damaged ({e}); generating them again",
            stacklevel=3,
        )
    _generate(file)
    return read_tensors(file, TINY_VLM_DIGEST, prefix)


def _load(module: M, prefix: str, path: Path | None, device: str) -> M:
    header, tensors = _read(path, prefix)
    # The digest already pins the config; checking it too catches a digest pinned for a
    # file of another shape, with a clearer message than load_state_dict's.
    try:
        config = msgspec.convert(header.metadata.get("config"), VLMConfig)
    except msgspec.ValidationError as e:
        raise TensorFileError(f"weights carry no valid model config: {e}") from e
    if config != TINY_VLM:
        raise TensorFileError(f"weights are for {config}, not {TINY_VLM}")
    # strict: a missing or unexpected tensor is an error, never a silently random weight.
    module.load_state_dict(tensors, strict=True)
    # Inference only: without gradients no autograd graph is recorded, and no
    # inference_mode context has to be held across a stage's awaits and yields.
    return module.requires_grad_(False).to(device).eval()


def load_vision(path: Path | None = None, device: str = "cpu") -> VisionEncoder:
    """The vision encoder, reading only its own tensors.

    Raises:
        TensorFileError: the file is malformed or fails verification.
    """
    return _load(VisionEncoder(TINY_VLM), "vision.", path, device)


def load_decoder(path: Path | None = None, device: str = "cpu") -> Decoder:
    """The decoder, reading only its own tensors.

    Raises:
        TensorFileError: the file is malformed or fails verification.
    """
    return _load(Decoder(TINY_VLM), "decoder.", path, device)


def load_model(path: Path | None = None, device: str = "cpu") -> TinyVLM:
    """The whole model, for the single-process reference.

    Raises:
        TensorFileError: the file is malformed or fails verification.
    """
    return _load(TinyVLM(TINY_VLM), "", path, device)
