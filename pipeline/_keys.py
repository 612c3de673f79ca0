"""Chunk keys: the names every chunk of every request travels under.

A key is ``(request_id, edge, seq)``. ``seq`` is dense from 0 per (request, edge) and the
last chunk of a stream is marked final. The orchestrator and every sender derive keys the
same way, so a consumer can wait on a key before its chunk exists.
"""

from __future__ import annotations

import msgspec

__all__ = ("CLIENT", "ChunkKey", "edge_name")

#: The pseudo-stage standing for the client: sources read from it, sinks write to it.
CLIENT = "@client"


class ChunkKey(msgspec.Struct, frozen=True, array_like=True):
    """The identity of one chunk: ``seq`` counts 0, 1, 2, ... per (request, edge)."""

    request_id: str
    edge: str
    seq: int

    def __str__(self) -> str:
        return f"{self.request_id}/{self.edge}/{self.seq}"


def edge_name(src: str, dst: str) -> str:
    """The name of the edge from stage ``src`` to stage ``dst``."""
    return f"{src}->{dst}"
