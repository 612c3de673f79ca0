"""A bounded latency recorder: the hot path appends, ``statistics()`` reads percentiles."""

from __future__ import annotations

from collections import deque

__all__ = ("LatencyRecorder",)


class LatencyRecorder:
    """Keeps the most recent samples (in microseconds) and reports percentiles of them."""

    __slots__ = ("_samples", "count")

    def __init__(self, capacity: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=capacity)
        self.count = 0

    def add(self, micros: float) -> None:
        """Record one sample."""
        self._samples.append(micros)
        self.count += 1

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) of the retained samples; 0.0 when empty."""
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]
