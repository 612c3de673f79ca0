"""Reading YAML specs, and pointing validation errors at the line that caused them.

PyYAML's ``safe_load`` throws away node positions and silently keeps the last of two
equal keys. :func:`parse_yaml` composes the node graph itself instead, so that it can
refuse duplicates and record where each field was written; :class:`YamlDocument` then
answers "which line is ``edges.2.to`` on?", and :func:`validation_to_config_error`
turns pydantic's errors into one :class:`ConfigError` at that line.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ._errors import ConfigError

__all__ = (
    "Loc",
    "YamlDocument",
    "parse_yaml",
    "read_yaml_file",
    "validation_to_config_error",
)

#: A field path as pydantic reports it: mapping keys and list indexes.
Loc = tuple[str | int, ...]

_MERGE_TAG = "tag:yaml.org,2002:merge"

#: The largest spec file read: a pipeline spec is a few KiB, and a device or a huge file
#: given by mistake must not be read whole.
MAX_FILE_BYTES = 4 * 1024 * 1024

#: The most nodes a document may expand to, aliases counted each time they are used: a
#: spec has hundreds, while nested aliases ("billion laughs") can name billions in a few
#: lines, which walking or sending to workers would take for ever.
MAX_NODES = 100_000


_BOOL_TAG = "tag:yaml.org,2002:bool"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"

#: YAML 1.2's core schema, with Python's underscores between digits.
_DIGITS = r"[0-9](?:_?[0-9])*"
_INT = re.compile(rf"^(?:[-+]?{_DIGITS}|0o[0-7](?:_?[0-7])*|0x[0-9a-fA-F](?:_?[0-9a-fA-F])*)$")
_FLOAT = re.compile(
    rf"^(?:[-+]?(?:\.{_DIGITS}|{_DIGITS}(?:\.(?:{_DIGITS})?)?)(?:[eE][-+]?{_DIGITS})?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class _SpecLoader(yaml.SafeLoader):
    """The safe loader, but with YAML 1.2's booleans and numbers.

    YAML 1.1 also reads ``yes``, ``no``, ``on`` and ``off`` as booleans, so a stage named
    ``yes`` (or a key ``on``) became ``True``. They stay strings here; a boolean field given
    ``yes`` still validates, as pydantic reads such strings as booleans. Numbers: ``010`` is
    ten (not eight), ``0o10`` eight, ``0x10`` sixteen, ``1e3`` a float, and ``1:30`` and
    ``2024-01-02`` are strings (not 90 and a date).
    """

    def construct_yaml_int(self, node: yaml.Node) -> int:
        text = str(self.construct_scalar(node))  # type: ignore[arg-type]
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text)

    def construct_yaml_float(self, node: yaml.Node) -> float:
        text = str(self.construct_scalar(node)).lower()  # type: ignore[arg-type]
        return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_SpecLoader.add_constructor(_INT_TAG, _SpecLoader.construct_yaml_int)
_SpecLoader.add_constructor(_FLOAT_TAG, _SpecLoader.construct_yaml_float)
_SpecLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in (_BOOL_TAG, _INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG)
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
# Ints first: a string both patterns match ("10") is an int.
_SpecLoader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
_SpecLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+.0123456789"))


#: Mappings whose keys are the stage's or the transport's own business (``params``,
#: ``options``): a key there may be of any type their models take.
_FREE_FORM = frozenset({"params", "options"})


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


def read_yaml_file(path: str | os.PathLike[str]) -> YamlDocument:
    """Read and parse the YAML file at ``path``.

    Args:
        path: the file to read, as UTF-8 text.

    Returns:
        The parsed document.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, or is not valid YAML.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError as e:
        raise ConfigError("file not found", file=source) from e
    except IsADirectoryError as e:
        raise ConfigError("is a directory, not a YAML file", file=source) from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=source) from e
    except OSError as e:
        raise ConfigError(f"cannot read file: {e.strerror or e}", file=source) from e
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(
            f"larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB: not a pipeline spec",
            file=source,
        )
    return parse_yaml(text, source=source)


def parse_yaml(text: str, *, source: str = "<string>") -> YamlDocument:
    """Parse one YAML document with the safe loader, refusing duplicate keys.

    Args:
        text: the YAML text.
        source: the name to give in error messages.

    Returns:
        The parsed document with its line map.

    Raises:
        ConfigError: the text is not valid YAML, holds several documents, or repeats a
            key within one mapping.
    """
    try:
        loader = _SpecLoader(text)
    except yaml.reader.ReaderError as e:
        # The reader refuses control characters up front; it knows the offset, not the line.
        where = e.position if isinstance(e.position, int) else 0
        raise ConfigError(
            f"invalid YAML: unacceptable character #x{e.character:04x}: {e.reason}",
            file=source,
            line=text.count("\n", 0, where) + 1,
        ) from e
    try:
        node = loader.get_single_node()
        if node is None:
            # An empty document still has a first line, which is where to point.
            return YamlDocument(None, source, {(): 1})
        doc = YamlDocument(None, source)
        _Walker(loader, doc).walk(node, ())
        return YamlDocument(loader.construct_document(node), source, doc.value_lines, doc.key_lines)
    except yaml.MarkedYAMLError as e:
        raise _yaml_error(e, source) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {' '.join(str(e).split())}", file=source) from e
    except RecursionError as e:
        # The parser and the walk recurse once per level of nesting.
        raise ConfigError(
            "nested too deeply (hundreds of levels): not a pipeline spec", file=source
        ) from e
    finally:
        loader.dispose()


class _Walker:
    """Records the line of every node and refuses duplicate keys, before construction."""

    __slots__ = ("_active", "_doc", "_loader", "_walked")

    def __init__(self, loader: yaml.SafeLoader, doc: YamlDocument) -> None:
        self._loader = loader
        self._doc = doc
        # Anchors can make a node its own descendant: refused, see walk().
        self._active: set[int] = set()
        self._walked = 0

    def walk(self, node: yaml.Node, path: Loc) -> None:
        """Record ``node`` at ``path`` and everything beneath it.

        Raises:
            ConfigError: a duplicate key, or more than :data:`MAX_NODES` nodes in all.
        """
        self._walked += 1
        if self._walked > MAX_NODES:
            raise ConfigError(
                f"the document expands to more than {MAX_NODES:,} values (aliases of "
                "aliases?): not a pipeline spec",
                file=self._doc.source,
                path=".".join(str(p) for p in path) or None,
                line=node.start_mark.line + 1,
            )
        self._doc.value_lines.setdefault(path, node.start_mark.line + 1)
        if id(node) in self._active:
            # An alias inside the node it names: a value that contains itself, which no
            # spec field can hold (its workers got it as an endless structure).
            raise ConfigError(
                "an alias refers to a value that contains it (a recursive structure): a "
                "spec's values must be plain data",
                file=self._doc.source,
                path=".".join(str(p) for p in path) or None,
                line=node.start_mark.line + 1,
            )
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                self._walk_mapping(node, path)
            elif isinstance(node, yaml.SequenceNode):
                for index, item in enumerate(node.value):
                    self.walk(item, (*path, index))
        finally:
            self._active.discard(id(node))

    def _walk_mapping(self, node: yaml.MappingNode, path: Loc) -> None:
        """Record a mapping's keys, explicit ones first so that they win over merged ones."""
        seen: dict[object, int] = {}
        merged: list[yaml.Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merged.append(value_node)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                # A complex key cannot name a field; construction reports it if it matters.
                continue
            key = self._loader.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str) and not _FREE_FORM.intersection(path):
                # Every key of a spec (but in a stage's params or a transport's options)
                # names a field, a stage or a variable: YAML read this one as another type
                # (true, ~, 0x10). Said as it was written.
                written = key_node.value
                read_as = "null" if key is None else type(key).__name__
                raise ConfigError(
                    f"key {written} is read as {read_as}, not a string: quote it ('{written}')",
                    file=self._doc.source,
                    path=".".join(str(p) for p in (*path, written)),
                    line=line,
                )
            try:
                first = seen.get(key)
            except TypeError:  # An unhashable key; construction refuses it with a mark.
                continue
            if first is not None:
                raise ConfigError(
                    f"duplicate key {key!r} (first written on line {first}); "
                    "YAML would silently keep only the last one",
                    file=self._doc.source,
                    path=".".join(str(p) for p in (*path, key)),
                    line=line,
                )
            seen[key] = line
            self._doc.key_lines.setdefault((*path, key), line)
            self.walk(value_node, (*path, key))
        for value_node in merged:
            self._walk_merged(value_node, path)

    def _walk_merged(self, node: yaml.Node, path: Loc) -> None:
        """Record the keys a merge (``<<: *defaults``) brings in, at the anchor's lines.

        Keys already recorded win, as they do when PyYAML flattens the mapping.
        """
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self._walk_merged(item, path)
            return
        if not isinstance(node, yaml.MappingNode) or id(node) in self._active:
            return
        self._active.add(id(node))
        try:
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    self._walk_merged(value_node, path)
                elif isinstance(key_node, yaml.ScalarNode):
                    key = self._loader.construct_object(key_node)
                    if (*path, key) not in self._doc.key_lines:
                        self._doc.key_lines[(*path, key)] = key_node.start_mark.line + 1
                        self.walk(value_node, (*path, key))
        finally:
            self._active.discard(id(node))


#: The contexts of PyYAML errors about a construct left open: reported where it began.
_UNCLOSED = (
    "while parsing a flow",
    "while scanning a quoted scalar",
    "while scanning a simple key",
)


def _yaml_error(e: yaml.MarkedYAMLError, source: str) -> ConfigError:
    """Describe a PyYAML error in one line, at the line of the problem: where the construct
    it was reading began (an unclosed ``{`` or quote), saying where it found the problem."""
    # An unclosed construct ("while parsing a flow mapping", "while scanning a quoted
    # scalar") is at the line it began; anything else (a block mapping's indentation) where
    # the problem is.
    opened = str(e.context or "").startswith(_UNCLOSED)
    mark = (e.context_mark if opened else None) or e.problem_mark or e.context_mark
    # PyYAML's own text can span lines; a ConfigError is one line.
    parts = [" ".join(p.split()) for p in (e.context, e.problem) if p]
    what = ", ".join(parts) if parts else "syntax error"
    found = e.problem_mark
    if mark is not None and found is not None and found.line != mark.line:
        what += f" (on line {found.line + 1})"
    return ConfigError(
        f"invalid YAML: {what}", file=source, line=mark.line + 1 if mark is not None else None
    )


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
