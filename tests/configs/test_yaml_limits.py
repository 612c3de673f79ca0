"""Spec files that would take a parser for ever or overflow a message: refused at once,
with one line naming the file (and the line where it can)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline._errors import ConfigError
from pipeline._yaml import MAX_FILE_BYTES, parse_yaml, read_yaml_file

STAGES = """\
name: p
stages:
  a: {impl: "stages.text:Split"}
edges: []
"""


def test_nested_aliases_are_refused_at_once() -> None:
    """Nine levels of nine aliases name 9**9 values in a dozen lines ("billion laughs"):
    refused after a bounded walk instead of hanging and taking gigabytes."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    text = "\n".join(lines) + "\n" + STAGES
    started = time.monotonic()
    with pytest.raises(ConfigError, match="expands to more than 100,000 values") as info:
        parse_yaml(text, source="bomb.yaml")
    assert time.monotonic() - started < 10  # it was hours, and gigabytes
    assert info.value.file == "bomb.yaml" and info.value.line is not None


def test_nesting_hundreds_deep_is_refused() -> None:
    text = STAGES.replace("edges: []", "edges: []\nx: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_yaml(text, source="deep.yaml")


def test_an_endless_file_is_not_read_whole(tmp_path: Path) -> None:
    """A device (``/dev/zero``) or a huge file named by mistake: refused past a few MiB."""
    big = tmp_path / "big.yaml"
    big.write_text(STAGES + "#" * MAX_FILE_BYTES)
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        read_yaml_file(big)
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        read_yaml_file("/dev/zero")


@pytest.mark.parametrize(
    "value", ["&p {blob: {self: *p}}", "&p [1, [2, *p]]"], ids=["mapping", "sequence"]
)
def test_a_value_that_contains_itself_is_refused(value: str) -> None:
    """An alias inside the value it names: validate said ok, and every worker then failed
    to take the spec (an endless structure) until start-up timed out a minute later."""
    text = STAGES.replace('"stages.text:Split"}', f'"stages.text:Split", params: {value}}}')
    with pytest.raises(ConfigError, match="contains it") as info:
        parse_yaml(text, source="loop.yaml")
    assert info.value.file == "loop.yaml" and info.value.line == 3
    assert info.value.path is not None and info.value.path.startswith("stages.a.params")


def test_a_spec_with_shared_aliases_well_under_the_limit_still_parses() -> None:
    text = STAGES + "x: &x {k: [1, 2, 3]}\ny: [*x, *x, *x]\n"
    assert parse_yaml(text).data["y"] == [{"k": [1, 2, 3]}] * 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("window", 99999999999999999999999, "less than or equal to 2147483647"),
        ("max_inflight", 2**31, "less than or equal to 2147483647"),
        ("window_bytes", "2000000TiB", "larger than 1 EiB"),
        ("inline_threshold", 2**64, "larger than 1 EiB"),
    ],
)
def test_numbers_no_message_could_carry_are_refused_when_the_spec_loads(
    field: str, value: object, message: str
) -> None:
    """They passed validation before, then every message carrying them failed to encode,
    and the run hung until start-up timed out."""
    from pipeline._config import PipelineSpec

    data = {
        "name": "p",
        "defaults": {field: value},
        "stages": {"a": {"impl": "stages.text:Split"}},
        "edges": [],
    }
    with pytest.raises(ConfigError, match=message) as info:
        PipelineSpec.from_dict(data)
    assert info.value.path == f"defaults.{field}"


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        (
            "the default transport",
            "name: p\ndefaults: {transport: shmm}\n{stages}edges:\n  - {from: a, to: b}\n",
            ("defaults.transport.kind", 2),
        ),
        (
            "an edge's options",
            "name: p\n{stages}edges:\n  - from: a\n    to: b\n    transport:\n"
            "      kind: shm\n      options: {capacity: 2000000TiB}\n",
            ("edges.0.transport.options", 10),
        ),
        (
            "an edge's fallback",
            "name: p\n{stages}edges:\n  - from: a\n    to: b\n"
            "    transport: {kind: shm, fallback: bogus}\n",
            ("edges.0.transport.fallback", 8),
        ),
    ],
)
def test_a_transport_error_names_its_field_and_line(
    tmp_path: Path, name: str, text: str, where: tuple[str, int]
) -> None:
    """A transport refused when the plan is built names where the spec set it; an unknown
    default used to be blamed on the first edge, with no field or line."""
    from pipeline import Pipeline

    stages = 'stages:\n  a: {impl: "stages.text:Split"}\n  b: {impl: "stages.text:Upper"}\n'
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("{stages}", stages))
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(path)
    assert (info.value.path, info.value.line) == where, name


def test_a_heartbeat_faster_than_ten_milliseconds_is_refused() -> None:
    """``heartbeat_interval: 1ns`` (with a timeout of 2ns) passed, and every request then
    failed: no replica was ever ready."""
    from pipeline._config import PipelineSpec

    data = {
        "name": "p",
        "defaults": {"heartbeat_interval": "1ns", "heartbeat_timeout": "2ns"},
        "stages": {"a": {"impl": "stages.text:Split"}},
        "edges": [],
    }
    with pytest.raises(ConfigError) as info:
        PipelineSpec.from_dict(data)
    assert info.value.path == "defaults.heartbeat_interval"
