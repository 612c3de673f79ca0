"""Reading YAML specs: :func:`parse_yaml` and :func:`read_yaml_file`.

PyYAML's ``safe_load`` throws away node positions and silently keeps the last of two
equal keys. :func:`parse_yaml` composes the node graph itself instead, so that it can
refuse duplicates and record where each field was written, in a
:class:`~pipeline._document.YamlDocument`.
"""

from __future__ import annotations

import os
import re

import yaml

from ._document import Loc, YamlDocument
from ._errors import ConfigError

__all__ = ("MAX_FILE_BYTES", "MAX_NODES", "parse_yaml", "read_yaml_file")

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
