"""Payload types named across processes by import path, ``module:QualName``.

A master tells its remote clients the types its source takes and its sinks produce this way
(:class:`~pipeline._messages.Welcome`), so that a client with the stages' code installed
decodes outputs typed, and one without decodes them untyped.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ("import_type", "type_path")


def type_path(tp: Any) -> str:
    """``module:QualName`` of a payload type that can be imported by that name, else ``""``.

    ``""`` stands for ``Any`` and for types with no importable name (generics, classes
    defined inside a function or in a script run as ``__main__``): they decode untyped.
    """
    if tp is Any or not isinstance(tp, type):
        return ""
    module, qualname = getattr(tp, "__module__", ""), getattr(tp, "__qualname__", "")
    if not module or not qualname or "<" in qualname or module == "__main__":
        return ""
    return f"{module}:{qualname}"


def import_type(path: str) -> tuple[Any, str]:
    """The class ``path`` names, and ``""``; or ``Any`` and why it cannot be had.

    ``""`` names ``Any``. Importing runs the module, as a YAML file's ``impl`` does.
    """
    if not path:
        return Any, ""
    module, _, qualname = path.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    # Importing runs the module, which may fail in any way; the caller then goes untyped.
    except Exception as exc:
        return Any, f"{type(exc).__name__}: {exc}"
    if not isinstance(found, type):
        return Any, f"{path} is not a class"
    return found, ""
