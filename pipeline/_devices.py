"""The accelerators a worker can use: announced when it registers, checked before setup.

A worker registers before it imports torch (which takes longer than the rest of its
start-up), so what it announces is found from the NVIDIA device files, narrowed by
``CUDA_VISIBLE_DEVICES`` as CUDA narrows them. The check before a stage's setup, where its
spec places it on a CUDA device, asks torch itself: a stage placed on a device this host
does not have fails start-up saying so, instead of with whatever its first tensor raises.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from ._errors import ConfigError

__all__ = ("check_device", "visible_devices")

_DEVICE_FILE = re.compile(r"nvidia(\d+)")


def visible_devices(
    dev: Path = Path("/dev"), environ: Mapping[str, str] | None = None
) -> list[str]:
    """``cuda:N`` for every CUDA device this process may use; ``[]`` where there is none.

    ``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it: its entries in order, up to the first
    that names no device (``-1``, an index out of range, an empty entry); an index or a
    UUID counts as one device each. Nothing is initialised, and torch is not imported.

    Raises:
        Nothing: a ``dev`` that cannot be listed counts as no device.
    """
    env = os.environ if environ is None else environ
    try:
        present = {int(m.group(1)) for f in dev.iterdir() if (m := _DEVICE_FILE.fullmatch(f.name))}
    except OSError:
        present = set()
    if not present:
        return []
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        count = len(present)
    else:
        count = 0
        seen: set[str] = set()
        for entry in (e.strip() for e in mask.split(",")):
            if not entry or entry in seen or entry.startswith("-"):
                break
            if entry.isdigit() and int(entry) not in present:
                break
            seen.add(entry)
            count += 1
    return [f"cuda:{i}" for i in range(count)]


def check_device(device: str, stage: str) -> None:
    """Check that this process can use ``device``, the one ``stage``'s spec places it on.

    ``cpu`` always passes; for a CUDA device torch is asked (the stage uses torch there).

    Raises:
        ConfigError: the device is a CUDA one, and torch here has no CUDA, sees no device,
            or has no device of that index; the message says what it does see.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    import torch

    wanted = int(index) if index else 0
    where = "this host"
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        where += f" (CUDA_VISIBLE_DEVICES={mask!r})"
    if torch.version.cuda is None:
        raise ConfigError(
            f"stage {stage!r} is placed on {device!r}, but torch {torch.__version__} here is "
            "a build without CUDA; install a CUDA build of torch on this host, or place the "
            "stage on 'cpu'"
        )
    count = torch.cuda.device_count()
    if wanted >= count:
        names = ", ".join(f"cuda:{i}" for i in range(count))
        sees = f"sees only {names}" if count else "sees no CUDA device"
        raise ConfigError(
            f"stage {stage!r} is placed on {device!r}, but {where} {sees}; place the stage "
            "on a device this host has, or run its worker on a host with more devices"
        )
