"""The shm transport's allocator: extents of any length over one byte range, freed in any order.

A FIFO ring cannot reuse space past an extent that a slow reader still holds (head-of-line
blocking). This arena keeps a list of free runs sorted by offset instead: allocation takes
the lowest run that fits (first fit), and freeing merges a run with its free neighbours, so
one held extent never blocks allocation anywhere else. First fit from the lowest address
also keeps a steady stream of payloads cycling through the same few extents, which stay
warm in the caches and the TLB.

The arena lives only in the producer: consumers never allocate, so it needs no shared state.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ("ALIGN", "Arena", "align_up")

#: Every extent, and every buffer inside one, starts on a 64-byte boundary: a cache line,
#: and enough for any dtype a tensor decoded in place may have.
ALIGN = 64


def align_up(n: int, alignment: int = ALIGN) -> int:
    """The smallest multiple of ``alignment`` (a power of two) that is at least ``n``."""
    return (n + alignment - 1) & -alignment


class Arena:
    """First-fit allocation with coalescing over ``[0, capacity)``.

    Args:
        capacity: the size of the range, a multiple of :data:`ALIGN`.

    Attributes:
        capacity: the size of the range.
        free_bytes: how many bytes are free, in all runs together.
    """

    __slots__ = ("_sizes", "_starts", "capacity", "free_bytes")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(
                f"arena capacity must be a positive multiple of {ALIGN}, not {capacity}"
            )
        self.capacity = capacity
        self.free_bytes = capacity
        # Free runs: their offsets in order, and each one's size. There are rarely more runs
        # than extents in use, so a list scan is cheaper than a tree.
        self._starts: list[int] = [0]
        self._sizes: dict[int, int] = {0: capacity}

    def allocate(self, size: int) -> int | None:
        """Take ``size`` bytes (a positive multiple of :data:`ALIGN`); their offset, or None.

        None means that no single free run is large enough, although the free bytes
        together may be.
        """
        if size <= 0 or size % ALIGN:
            raise ValueError(f"extent sizes must be positive multiples of {ALIGN}, not {size}")
        starts, sizes = self._starts, self._sizes
        for i, start in enumerate(starts):
            run = sizes[start]
            if run < size:
                continue
            del sizes[start]
            if run == size:
                del starts[i]
            else:
                # The rest of the run stays in place in the sorted list.
                starts[i] = start + size
                sizes[start + size] = run - size
            self.free_bytes -= size
            return start
        return None

    def free(self, offset: int, size: int) -> None:
        """Give back the extent ``[offset, offset + size)`` taken by :meth:`allocate`.

        Raises:
            ValueError: the extent overlaps free space or lies outside the arena, which
                means the caller freed it twice or never allocated it.
        """
        end = offset + size
        if offset < 0 or size <= 0 or end > self.capacity:
            raise ValueError(f"extent [{offset}, {end}) is not inside [0, {self.capacity})")
        starts, sizes = self._starts, self._sizes
        i = bisect_left(starts, offset)
        prev_end = starts[i - 1] + sizes[starts[i - 1]] if i > 0 else -1
        next_start = starts[i] if i < len(starts) else self.capacity + 1
        if prev_end > offset or next_start < end:
            raise ValueError(f"extent [{offset}, {end}) overlaps free space: freed twice?")
        self.free_bytes += size
        if prev_end == offset:
            # Grow the previous run instead of inserting one.
            i -= 1
            offset = starts[i]
            size += sizes[offset]
        else:
            starts.insert(i, offset)
        if next_start == end:
            size += sizes.pop(next_start)
            del starts[i + 1]
        sizes[offset] = size

    def largest_free(self) -> int:
        """The size of the largest free run: the largest extent that can be allocated now."""
        return max(self._sizes.values(), default=0)

    def runs(self) -> list[tuple[int, int]]:
        """Every free run as ``(offset, size)``, in order of offset."""
        return [(start, self._sizes[start]) for start in self._starts]
