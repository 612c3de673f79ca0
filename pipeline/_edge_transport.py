"""An edge's transports, resolved from its spec: what may carry a payload, with what options.

A pinned edge (``transport: shm``) uses one transport and, if configured, a fallback for
payloads that find it full. An ``auto`` edge may use every installed transport of the
``auto`` order, with options keyed by transport name, and falls back to inline. Both ends
of an edge resolve it the same way, so a receiver opens exactly what a sender may use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline._errors import ConfigError
from transports._registry import AUTO, create_transport
from transports.auto import AutoPolicy

__all__ = ("EdgeTransports", "resolve_edge_transports")

#: How long a put waits for a full transport when a fallback is ready to take the payload.
_FALLBACK_WAIT = 1.0


@dataclass(frozen=True, slots=True)
class EdgeTransports:
    """The transports one edge may use.

    Attributes:
        kind: the configured kind, ``auto`` or a transport name.
        names: every transport a payload on this edge may travel by, fallback included.
        options: each transport's options.
        fallback: where a payload goes when its transport stays full, if anywhere.
        full_timeout: how long a put waits for room before falling back or failing.
    """

    kind: str
    names: tuple[str, ...]
    options: Mapping[str, dict[str, Any]]
    fallback: str | None
    full_timeout: float

    @property
    def auto(self) -> bool:
        """Whether the edge chooses a transport per payload."""
        return self.kind == AUTO


def resolve_edge_transports(
    edge: str,
    kind: str,
    options: Mapping[str, Any],
    *,
    fallback: str | None,
    full_timeout: float | None,
    chunk_timeout: float,
    inline_threshold: int,
    path: str | None = None,
) -> EdgeTransports:
    """Work out which transports ``edge`` may use, checking that each accepts its options.

    ``path`` is where the spec sets this transport (``edges.2.transport``, or
    ``defaults.transport``), for errors to name the field and its line.

    Raises:
        ConfigError: a transport is unknown, rejects its options, or ``auto`` options are
            not keyed by transport name; the message names the edge.
    """

    def at(field: str) -> str | None:
        return f"{path}.{field}" if path else None

    if kind == AUTO:
        names = list(AutoPolicy(inline_threshold, same_host=True).candidates())
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(
                f"edge {edge!r}: options of an 'auto' transport are keyed by transport name "
                f"({', '.join(names)}); got {unknown}",
                path=at("options"),
            )
        per: dict[str, dict[str, Any]] = {}
        for name in names:
            opts = options.get(name, {})
            if not isinstance(opts, Mapping):
                raise ConfigError(
                    f"edge {edge!r}: options for {name!r} must be a mapping",
                    path=at(f"options.{name}"),
                )
            per[name] = dict(opts)
        fallback = fallback or "inline"
    else:
        names = [kind]
        per = {kind: dict(options)}
    if fallback is not None and fallback == kind != AUTO:
        raise ConfigError(
            f"edge {edge!r}: a fallback must be another transport than {kind!r} itself (a "
            "payload it cannot take, it would not take again)",
            path=at("fallback"),
        )
    if fallback is not None and fallback not in names:
        if fallback == AUTO:
            raise ConfigError(
                f"edge {edge!r}: a fallback must be a transport, not 'auto'", path=at("fallback")
            )
        names.append(fallback)
        per[fallback] = {}
    for name in names:
        try:
            create_transport(name, per[name])
        except ConfigError as exc:
            if name == fallback and name != kind:
                field = "fallback"
            elif kind == AUTO:
                field = f"options.{name}" if name in options else "kind"
            else:
                field = "options" if options else "kind"
            raise ConfigError(f"edge {edge!r}: {exc.message}", path=at(field)) from exc
    if full_timeout is None:
        full_timeout = _FALLBACK_WAIT if fallback is not None else chunk_timeout
    return EdgeTransports(kind, tuple(names), per, fallback, full_timeout)
