"""Finding a transport by name: built-ins, ``module:Class`` import paths, entry points.

Plug-ins register under the ``stagewire.transports`` entry-point group, or are named in
YAML by import path (``transport: mypkg.rdma:RdmaTransport``).
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from pipeline._errors import ConfigError, TransportError
from transports._protocol import Transport

__all__ = ("AUTO", "BUILTIN", "ENTRY_POINT_GROUP", "create_transport", "resolve_transport")

ENTRY_POINT_GROUP = "stagewire.transports"
#: The policy name: chooses a concrete transport per payload (see ``transports.auto``).
AUTO = "auto"
#: Built-in transports by name, as import paths so that unused ones are never imported.
BUILTIN: dict[str, str] = {
    "inline": "transports.inline:InlineTransport",
    "shm": "transports.shm:ShmTransport",
    "cuda_ipc": "transports.cuda_ipc:CudaIpcTransport",
    "network": "transports.network:NetworkTransport",
}


def _import_path(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"transport {path!r} is not a known name or a 'module:Class' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"transport {path!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ConfigError(f"transport {path!r}: {module_name!r} has no {attr!r}") from exc


@cache
def resolve_transport(name: str) -> type[Transport]:
    """Return the transport class for ``name``.

    Raises:
        ConfigError: no built-in, entry point or import path matches, or the object found
            does not implement the Transport protocol.
    """
    if name in BUILTIN:
        cls = _import_path(BUILTIN[name])
    elif ":" in name:
        cls = _import_path(name)
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            known = sorted(
                {*BUILTIN, AUTO, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))}
            )
            raise ConfigError(f"unknown transport {name!r}; known: {', '.join(known)}")
        cls = found[0].load()
    for attr in ("name", "capabilities", "open_sender", "open_receiver"):
        if not hasattr(cls, attr):
            raise ConfigError(f"transport {name!r} ({cls!r}) lacks {attr!r}: not a Transport")
    return cls  # type: ignore[no-any-return]  # checked structurally just above


def create_transport(name: str, options: dict[str, Any] | None = None) -> Transport:
    """Instantiate the transport named ``name`` with ``options``.

    Raises:
        ConfigError: unknown transport, or it rejects its options.
    """
    cls = resolve_transport(name)
    try:
        return cls(**(options or {}))
    except (TypeError, ValueError, TransportError) as exc:
        raise ConfigError(f"transport {name!r} rejected its options: {exc}") from exc
