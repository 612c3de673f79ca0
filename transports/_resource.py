"""What every transport end shares: being an async context manager closed by ``aclose``."""

from __future__ import annotations

from typing import Self

__all__ = ("AsyncResource",)


class AsyncResource:
    """A resource closed by an idempotent ``aclose``; ``async with`` closes it on exit."""

    __slots__ = ()

    async def aclose(self) -> None:
        """Release every resource; idempotent.

        Raises:
            Nothing: subclasses close without raising.
        """
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
