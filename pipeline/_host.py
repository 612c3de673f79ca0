"""Host identity and addresses.

Identity: the same for every process on one machine, different across machines. shm and
cuda_ipc descriptors name their host, and are refused on any other. The identity comes from
the machine id (or, failing that, the host name and boot id), so containers that share a
kernel but not ``/dev/shm`` should set ``STAGEWIRE_HOST_ID`` explicitly.

Addresses: a worker's data port must be reachable by every other process of its pipeline,
so by default it binds the address of this host's interface that routes to the master (the
master's peers reach this host by the same network), not loopback, which on another host
would name the wrong machine.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
from functools import cache
from pathlib import Path

__all__ = (
    "address_toward",
    "host_identity",
    "is_wildcard",
    "on_this_host",
    "split_endpoint",
    "tcp_endpoint",
)

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


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of ``tcp://HOST:PORT`` (brackets of an IPv6 host removed); else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def is_wildcard(host: str) -> bool:
    """Whether ``host`` binds every interface (``0.0.0.0``, ``::``, ``*``): no peer's address."""
    if host == "*":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_unspecified
    except ValueError:
        return False


def on_this_host(endpoint: str) -> str:
    """``endpoint`` as a process of this host connects to it: a wildcard bind (every
    interface) is reached at loopback; any other endpoint as it is."""
    parts = split_endpoint(endpoint)
    if parts is None or not is_wildcard(parts[0]):
        return endpoint
    loopback = "::1" if ":" in parts[0] else "127.0.0.1"
    return tcp_endpoint(loopback, parts[1])


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://HOST:PORT``, with an IPv6 host in brackets."""
    host = host.removeprefix("[").removesuffix("]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def address_toward(endpoint: str) -> str:
    """The address of this host's interface that routes to ``endpoint``'s host.

    The kernel picks it as it would for a connection there (a UDP socket is connected, which
    sends nothing). Loopback for a master on loopback or on ``ipc://``.

    Raises:
        OSError: the endpoint's host does not resolve, or no route leads there.
    """
    parts = split_endpoint(endpoint)
    if parts is None:
        return "127.0.0.1"
    host, port = parts
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        address = probe.getsockname()[0]
    assert isinstance(address, str)
    return address
