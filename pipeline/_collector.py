"""The cyclic garbage collector around a process's start-up.

Importing torch and a stage's modules and loading its weights allocates a few hundred
thousand long-lived objects. With the collector running, a process pays for traversing
them again and again while they accumulate: about 0.9 s of a worker's start-up here, a
third of it. Later, every full collection traverses them all again, a pause of well over
100 ms in the middle of serving.

So a process stagewire starts (a worker, ``stagewire run``) pauses the collector while it
starts, then :func:`settle` collects once, moves every survivor to the permanent
generation (:func:`gc.freeze`), where no later collection looks at it, and turns the
collector back on. Reference counting frees most garbage meanwhile; only cycles wait.

An embedding service keeps its own collector settings: :class:`~pipeline.Pipeline` never
touches them.
"""

from __future__ import annotations

import gc

__all__ = ("pause", "settle")

_paused = False


def pause() -> None:
    """Turn the cyclic collector off until :func:`settle` (if it was on)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def settle() -> None:
    """End start-up: collect once, freeze the survivors, turn the collector back on.

    Does nothing unless :func:`pause` turned the collector off, so it runs once.
    """
    global _paused
    if not _paused:
        return
    _paused = False
    gc.collect()
    gc.freeze()
    gc.enable()
