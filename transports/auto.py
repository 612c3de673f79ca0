"""The ``auto`` policy: which transport carries one payload on an edge marked ``auto``.

The order is fixed by the design:

1. inline, if the payload is at most ``inline_threshold`` bytes;
2. cuda_ipc, if it holds CUDA tensors and both ends share a host;
3. shm, if both ends share a host;
4. network otherwise.

A choice is only made among the built-in transports that are registered; a payload that
none of them can take goes inline, counted as a fallback. A chosen transport that stays
full past the edge's ``full_timeout`` also sends its payload to the edge's fallback
(inline unless configured), counted the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from transports._registry import BUILTIN
from transports.inline import MAX_INLINE

__all__ = ("AutoPolicy",)


@dataclass(frozen=True, slots=True)
class AutoPolicy:
    """Chooses a transport name per payload.

    Attributes:
        inline_threshold: largest payload, in bytes, sent inline.
        same_host: whether producer and consumer share a host identity.
    """

    inline_threshold: int
    same_host: bool

    def candidates(self) -> tuple[str, ...]:
        """Every transport this policy may choose, so receivers can open them up front."""
        wanted = ("inline", "cuda_ipc", "shm", "network")
        return tuple(name for name in wanted if name in BUILTIN)

    def choose(self, nbytes: int, *, has_cuda: bool = False) -> tuple[str, bool]:
        """Return ``(transport name, fell_back)`` for a payload of ``nbytes`` bytes."""
        # No envelope carries more than MAX_INLINE, whatever the threshold says.
        if nbytes <= min(self.inline_threshold, MAX_INLINE):
            return "inline", False
        preferred: list[str] = []
        if self.same_host:
            if has_cuda:
                preferred.append("cuda_ipc")
            preferred.append("shm")
        preferred.append("network")
        for name in preferred:
            if name in BUILTIN:
                return name, False
        return "inline", True
