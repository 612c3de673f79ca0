"""Host identity: the same for every process on one machine, different across machines.

shm and cuda_ipc descriptors name their host, and are refused on any other. The identity
comes from the machine id (or, failing that, the host name and boot id), so containers that
share a kernel but not ``/dev/shm`` should set ``STAGEWIRE_HOST_ID`` explicitly.
"""

from __future__ import annotations

import hashlib
import os
import socket
from functools import cache
from pathlib import Path

__all__ = ("host_identity",)

_SOURCES = ("/etc/machine-id", "/var/lib/dbus/machine-id", "/proc/sys/kernel/random/boot_id")


@cache
def host_identity() -> str:
    """A short stable identifier of this machine (override with ``STAGEWIRE_HOST_ID``)."""
    override = os.environ.get("STAGEWIRE_HOST_ID")
    if override:
        return override
    parts = [socket.gethostname()]
    for source in _SOURCES:
        try:
            parts.append(Path(source).read_text().strip())
            break
        except OSError:
            continue
    return hashlib.blake2s("|".join(parts).encode(), digest_size=8).hexdigest()
