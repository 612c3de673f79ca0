"""Where each field of a spec was written, and the validation errors that point there.

A :class:`YamlDocument` answers "which line is ``edges.2.to`` on?" (:func:`parse_yaml` of
``pipeline._yaml`` records the lines as it reads), and :func:`validation_to_config_error`
turns pydantic's errors into one :class:`ConfigError` at that line. Apart from the YAML
reader, so that a worker, which validates the spec its master sends as plain data, does
not load PyYAML.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ._errors import ConfigError

__all__ = ("Loc", "YamlDocument", "validation_to_config_error")

#: A field path as pydantic reports it: mapping keys and list indexes.
Loc = tuple[str | int, ...]


@dataclass(slots=True, frozen=True)
class YamlDocument:
    """A parsed YAML document and the 1-based line of each of its fields.

    Attributes:
        data: the document as plain Python objects (``None`` for an empty document).
        source: the file name used in error messages.
        value_lines: the line where the value at each path starts.
        key_lines: the line of the mapping key that introduces each path.
    """

    data: Any
    source: str
    value_lines: dict[Loc, int] = field(default_factory=dict)
    key_lines: dict[Loc, int] = field(default_factory=dict)

    def line_of(self, loc: Sequence[str | int], *, key: bool = False) -> int | None:
        """Return the line of the field at ``loc``, or of its nearest written ancestor.

        Args:
            loc: the path of the field.
            key: prefer the line of the field's key to the line of its value; for a
                block mapping written under its key, the two differ.

        Returns:
            A 1-based line, or ``None`` when no part of the path was written in YAML.
        """
        path = tuple(loc)
        # A value made by a validator (``transport: shm`` becoming ``{kind: shm}``) has
        # no node of its own, so the closest enclosing node is the best answer.
        while True:
            if key and path in self.key_lines:
                return self.key_lines[path]
            if path in self.value_lines:
                return self.value_lines[path]
            if not path:
                return None
            path = path[:-1]


# -- validation errors -------------------------------------------------------------


def validation_to_config_error(
    exc: ValidationError, model: type[BaseModel], doc: YamlDocument
) -> ConfigError:
    """Turn a pydantic error into one :class:`ConfigError` at its place in ``doc``.

    The first error in document order is reported; the others are counted.

    Args:
        exc: the validation error raised for ``doc.data``.
        model: the model ``doc.data`` was validated as, to list allowed keys.
        doc: the document, for the source name and line numbers.

    Returns:
        The error to raise, chained by the caller to ``exc``.
    """
    errors = exc.errors(include_url=False)
    found = [_describe(err, model, doc) for err in errors]

    def position(i: int) -> tuple[float, bool]:
        # A missing key has no line of its own, only its parent's, so on the same line
        # an error about something actually written comes first. Errors without a line
        # (a dict input) keep pydantic's order, which follows the fields.
        line = found[i][0]
        return (float("inf") if line is None else line, errors[i]["type"] == "missing")

    line, path, message = found[min(range(len(found)), key=position)]
    if len(found) > 1:
        message = f"{message} (and {len(found) - 1} more)"
    return ConfigError(message, file=doc.source, path=path or None, line=line)


def _describe(
    err: ErrorDetails, model: type[BaseModel], doc: YamlDocument
) -> tuple[int | None, str, str]:
    """Return the line, dotted path and message of one pydantic error."""
    loc: Loc = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}
    message = err["msg"]
    line: int | None
    if "loc" in ctx:
        # A model validator can only fail at the model itself; graph errors carry the
        # path of the edge field at fault in their context instead.
        loc = tuple(ctx["loc"])
        message = str(ctx["detail"])
        line = doc.line_of(loc)
    elif loc and loc[-1] == "[key]":
        # A bad mapping key (a stage name): point at the key itself.
        loc = loc[:-1]
        line = doc.line_of(loc, key=True)
        key = err["input"]
        if not isinstance(key, str):
            # (YAML's are refused as read, as written: this is a mapping built in Python.)
            where = ".".join(str(p) for p in (*loc[:-1], repr(key)))
            return line, where, f"key {key!r} is {type(key).__name__}, not a string"
    elif kind == "missing":
        message = "required key is missing"
        line = doc.line_of(loc[:-1], key=True)
    elif kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        message = f"unknown key {loc[-1]!r}" + (f"; allowed keys: {allowed}" if allowed else "")
        line = doc.line_of(loc, key=True)
    else:
        line = doc.line_of(loc)
    if kind in {"model_type", "dict_type", "model_attributes_type"}:
        message = f"expected a mapping, got {_shown(err['input'])}"
    elif kind == "list_type":
        message = f"expected a list, got {_shown(err['input'])}"
    elif not kind.startswith("invalid_") and kind not in {"missing", "extra_forbidden"}:
        # Our own errors (types starting with "invalid_") already quote the value.
        message = message.removeprefix("Value error, ")
        message = f"{message[:1].lower()}{message[1:]} (got {_shown(err['input'])})"
    return line, ".".join(str(p) for p in loc), message


def _shown(value: object) -> str:
    """Show a bad input briefly: scalars by value, containers by kind."""
    if value is None or isinstance(value, str | int | float | bool):
        text = repr(value)
        return text if len(text) <= 60 else f"{text[:57]}..."
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def _allowed_keys(model: type[BaseModel], loc: Loc) -> str:
    """List the keys allowed in the mapping at ``loc``, or "" if it is not a model."""
    target = _model_at(model, loc)
    if target is None:
        return ""
    return ", ".join(_key_of(name, info) for name, info in target.model_fields.items())


def _model_at(model: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """Follow ``loc`` through field annotations to the model validating that mapping."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = {_key_of(n, f): f for n, f in tp.model_fields.items()}
            if part not in fields:
                return None
            tp = fields[part].annotation
        elif get_origin(tp) in {dict, list, Mapping}:
            tp = get_args(tp)[-1]
        else:
            return None
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _key_of(name: str, info: FieldInfo) -> str:
    """The key a field is written under in a document."""
    alias = info.validation_alias
    return alias if isinstance(alias, str) else info.alias or name


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``| None`` from an annotation."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in {Union, types.UnionType}:
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp
