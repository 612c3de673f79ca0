"""Pipeline specs: the models, the YAML loader, and the errors they raise."""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from pipeline import Pipeline
from pipeline._config import EdgeSpec, PipelineSpec, StageSpec, TransportSpec
from pipeline._errors import ConfigError
from pipeline._units import ByteSize, Duration

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def load(text: str) -> PipelineSpec:
    """Load dedented YAML text under the name ``p.yaml``."""
    return PipelineSpec.from_yaml_text(textwrap.dedent(text).lstrip("\n"), source="p.yaml")


def config_error(text: str) -> ConfigError:
    """Return the ConfigError that loading ``text`` raises."""
    with pytest.raises(ConfigError) as info:
        load(text)
    return info.value


DIAMOND = """
    stages:
      a: {impl: "m:A"}
      b: {impl: "m:B"}
      c: {impl: "m:C"}
      d: {impl: "m:D"}
    edges:
      - {from: a, to: c}
      - {from: a, to: b}
      - {from: b, to: d}
      - {from: c, to: d}
"""


# -- every repository config -------------------------------------------------------


def test_repository_has_configs() -> None:
    """The configs directory holds at least the demo pipeline."""
    assert REPO / "configs" / "demo.yaml" in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_repository_config_is_valid(path: Path) -> None:
    """Every YAML file in configs/ loads, validates and survives a round trip."""
    spec = PipelineSpec.from_yaml(path)
    assert spec.stages
    assert sorted(spec.topological_order()) == sorted(spec.stages)
    assert PipelineSpec.from_dict(spec.to_dict()) == spec


# -- sizes and durations -----------------------------------------------------------


class _Units(BaseModel):
    size: ByteSize = 0
    duration: Duration = 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (512, 512),
        (1024.0, 1024),
        ("512", 512),
        ("512B", 512),
        ("64KiB", 64 * 1024),
        ("64 KiB", 64 * 1024),
        ("1MiB", 1024**2),
        ("1GiB", 1024**3),
        ("64KB", 64_000),
        ("1.5MiB", 1536 * 1024),
        ("2TB", 2 * 10**12),
    ],
)
def test_byte_size_accepts(text: object, expected: int) -> None:
    """A byte size is a non-negative integer or a decimal number with a 1000- or 1024-based unit."""
    value = _Units.model_validate({"size": text}).size
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize(
    "text", ["64 kibibytes", "abc", "", "-1", -1, "1.5B", 1.5, True, "64kib", "1e3", None]
)
def test_byte_size_rejects(text: object) -> None:
    """Negative, fractional, misspelt and non-numeric sizes are refused."""
    with pytest.raises(ValidationError):
        _Units.model_validate({"size": text})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0.0),
        (2, 2.0),
        (0.25, 0.25),
        ("30", 30.0),
        ("30s", 30.0),
        ("1.5s", 1.5),
        ("500ms", 0.5),
        ("250us", 0.00025),
        ("2m", 120.0),
        ("1h", 3600.0),
    ],
)
def test_duration_accepts(text: object, expected: float) -> None:
    """A duration is a non-negative number of seconds or a number with a time unit."""
    assert _Units.model_validate({"duration": text}).duration == pytest.approx(expected)


@pytest.mark.parametrize(
    "text", ["30 sec", "-1s", -0.5, "abc", "1d", True, float("inf"), float("nan"), "s"]
)
def test_duration_rejects(text: object) -> None:
    """Negative, infinite, misspelt and unit-less garbage durations are refused."""
    with pytest.raises(ValidationError):
        _Units.model_validate({"duration": text})


# -- defaults and the Python API -------------------------------------------------------


def test_minimal_spec_gets_defaults() -> None:
    """Only stages are required; everything else takes the documented defaults."""
    spec = load('stages: {only: {impl: "m:Only"}}')
    assert spec.name == "pipeline"
    assert spec.master.bind == "tcp://127.0.0.1:0"
    assert spec.defaults.transport == TransportSpec(kind="auto")
    assert spec.defaults.inline_threshold == 65536
    assert spec.defaults.chunk_timeout == 30.0
    assert spec.defaults.request_timeout is None
    assert (spec.defaults.window, spec.defaults.max_inflight) == (256, 1024)
    assert spec.defaults.window_bytes == 64 * 1024 * 1024
    assert (spec.defaults.heartbeat_interval, spec.defaults.heartbeat_timeout) == (1.0, 5.0)
    assert spec.stages["only"].scheduling == "batch"
    assert spec.defaults.replica_wait == 10.0
    assert spec.defaults.cpu_idle == "default"
    stage = spec.stages["only"]
    assert (stage.replicas, stage.device, stage.max_concurrency) == (1, "cpu", 16)
    assert (stage.max_batch_size, stage.max_wait_ms, stage.env, stage.params) == (1, 0.0, {}, {})
    assert spec.edges == []
    assert spec.sources() == spec.sinks() == ["only"]


def test_edge_fields_fall_back_to_defaults() -> None:
    """An edge's own transport, threshold, timeout and window win; unset ones inherit."""
    spec = load("""
        defaults: {transport: shm, inline_threshold: 1KiB, chunk_timeout: 2s, window: 4,
                   window_bytes: 2MiB}
        stages: {a: {impl: "m:A"}, b: {impl: "m:B"}, c: {impl: "m:C"}}
        edges:
          - {from: a, to: b}
          - from: b
            to: c
            transport: {kind: "my.pkg:Fast", options: {lanes: 2}}
            inline_threshold: 0
            chunk_timeout: 250ms
            window: 1
            window_bytes: 64KiB
    """)
    ab, bc = spec.edge("a", "b"), spec.edge("b", "c")
    assert spec.edge_transport(ab) == TransportSpec(kind="shm")
    assert (spec.edge_inline_threshold(ab), spec.edge_chunk_timeout(ab)) == (1024, 2.0)
    assert (spec.edge_window(ab), spec.edge_window_bytes(ab)) == (4, 2 * 1024 * 1024)
    assert spec.edge_transport(bc) == TransportSpec(kind="my.pkg:Fast", options={"lanes": 2})
    assert (spec.edge_inline_threshold(bc), spec.edge_chunk_timeout(bc)) == (0, 0.25)
    assert (spec.edge_window(bc), spec.edge_window_bytes(bc)) == (1, 64 * 1024)
    assert bc.name == "b->c"


def test_python_api_uses_src_and_dst() -> None:
    """EdgeSpec takes src/dst in Python and from/to in data, and dumps from/to."""
    by_name = EdgeSpec(src="a", dst="b", transport=TransportSpec(kind="inline"))
    by_alias = EdgeSpec.model_validate({"from": "a", "to": "b", "transport": "inline"})
    assert by_name == by_alias
    assert by_name.model_dump()["from"] == "a"
    assert by_name.model_dump()["to"] == "b"


def test_round_trip_through_json() -> None:
    """to_dict is JSON-able, uses YAML's key names, and from_dict rebuilds an equal spec."""
    spec = load("""
        name: rt
        master: {bind: "ipc:///tmp/rt.sock"}
        defaults: {request_timeout: 1m, inline_threshold: 1.5MiB}
        stages:
          a: {impl: "m:A", params: {k: [1, 2, {x: y}]}, env: {OMP_NUM_THREADS: 4}}
          b: {impl: "m:B", replicas: 3, device: "cuda:1", max_batch_size: 8, max_wait_ms: 2.5}
        edges:
          - {from: a, to: b, transport: {kind: network, options: {compress: true}}, window: 2}
    """)
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["edges"][0]["from"] == "a"
    assert data["defaults"]["request_timeout"] == 60.0
    assert data["stages"]["a"]["env"] == {"OMP_NUM_THREADS": "4"}
    again = PipelineSpec.from_dict(data)
    assert again == spec
    assert again.to_dict() == spec.to_dict()


def test_direct_construction_validates_the_graph() -> None:
    """Building a PipelineSpec in Python runs the same graph checks as loading YAML."""
    with pytest.raises(ValidationError, match=r"edges\.0\.to: stage 'a' feeds itself"):
        PipelineSpec(stages={"a": StageSpec(impl="m:A")}, edges=[EdgeSpec(src="a", dst="a")])


# -- graph helpers -------------------------------------------------------------------------


def test_diamond_graph_helpers() -> None:
    """Sources, sinks, neighbours and topological order follow the edges of a diamond."""
    spec = load(DIAMOND)
    assert spec.sources() == ["a"]
    assert spec.sinks() == ["d"]
    assert spec.downstream("a") == ["c", "b"]
    assert spec.upstream("d") == ["b", "c"]
    assert spec.upstream("a") == []
    # b and c become ready together; declaration order breaks the tie.
    assert spec.topological_order() == ["a", "b", "c", "d"]


def test_topological_order_respects_every_edge() -> None:
    """Each stage comes after all of its upstream stages, whatever the declaration order."""
    spec = load("""
        stages: {z: {impl: "m:Z"}, y: {impl: "m:Y"}, x: {impl: "m:X"}, w: {impl: "m:W"}}
        edges: [{from: x, to: y}, {from: y, to: z}, {from: w, to: z}]
    """)
    order = spec.topological_order()
    assert order == ["x", "y", "w", "z"]
    for e in spec.edges:
        assert order.index(e.src) < order.index(e.dst)


def test_helpers_refuse_unknown_names() -> None:
    """Asking about a stage or edge that does not exist is a KeyError naming it."""
    spec = load(DIAMOND)
    with pytest.raises(KeyError, match="nope"):
        spec.upstream("nope")
    with pytest.raises(KeyError, match="d->a"):
        spec.edge("d", "a")


# -- ConfigError: one line naming file, line and field ---------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "stages:\n  a: {impl: x\n",
            "p.yaml:2: invalid YAML: while parsing a flow mapping, expected ',' or '}'",
            id="malformed-yaml",
        ),
        pytest.param(
            'name: p\nstages:\n  a: {impl: "x:Y}\n\n',
            "p.yaml:3: invalid YAML: while scanning a quoted scalar, found unexpected end of "
            "stream (on line 5)",
            id="unclosed-quote",
        ),
        pytest.param(
            "name: x\nstages:\n  a:\n    impl: m:A\n    replicas 2\n    other: 1\n",
            "p.yaml:5: invalid YAML: while scanning a simple key, could not find expected ':' "
            "(on line 6)",
            id="key-without-colon",
        ),
        pytest.param(
            "name: x\nstages:\n  a:\n    impl: m:A\n  b:\n    impl: m:B\n   oops: 1\n",
            "p.yaml:7: invalid YAML: while parsing a block mapping, expected <block end>",
            id="bad-indentation",
        ),
        pytest.param("stages:\n\ta: 1\n", "p.yaml:2: invalid YAML:", id="tab"),
        pytest.param(
            "stages: {a: {impl: 'm:A'}}\n---\nx: 1\n",
            "p.yaml:2: invalid YAML: expected a single document",
            id="two-documents",
        ),
        pytest.param(
            "name: x\nstages: \x00\n",
            "p.yaml:2: invalid YAML: unacceptable character #x0000",
            id="control-character",
        ),
        pytest.param("- a\n- b\n", "p.yaml:1: expected a mapping", id="top-level-list"),
        pytest.param("", "p.yaml:1: expected a mapping", id="empty"),
        pytest.param(
            "stages:\n  a:\n    impl: m:A\n    replica: 2\n",
            "p.yaml:4: stages.a.replica: unknown key 'replica'; allowed keys: impl, params, "
            "replicas, device, max_concurrency, max_batch_size, max_wait_ms, env",
            id="unknown-stage-key",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}}\nedge: []\n",
            "p.yaml:2: edge: unknown key 'edge'; allowed keys: name, master, defaults, "
            "stages, edges",
            id="unknown-top-key",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}, b: {impl: 'm:B'}}\nedges:\n  - from: a\n"
            "    to: b\n    transport: {kind: shm, option: {}}\n",
            "p.yaml:5: edges.0.transport.option: unknown key 'option'; allowed keys: kind, options",
            id="unknown-transport-key",
        ),
        pytest.param(
            "name: x\nedges: []\n", "p.yaml:1: stages: required key is missing", id="no-stages"
        ),
        pytest.param(
            "stages:\n  a:\n    replicas: 1\n",
            "p.yaml:2: stages.a.impl: required key is missing",
            id="no-impl",
        ),
        pytest.param("stages: {}\n", "p.yaml:1: stages: at least one stage", id="zero-stages"),
        pytest.param(
            "stages:\n  a: {impl: 'm:A'}\n  b: {impl: 'm:B'}\nedges:\n  - {from: a, to: b}\n"
            "  - from: b\n    to: c\n",
            "p.yaml:7: edges.1.to: unknown stage 'c'; known stages: a, b",
            id="unknown-stage",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}}\nedges:\n  - {from: a, to: a}\n",
            "p.yaml:3: edges.0.to: stage 'a' feeds itself",
            id="self-loop",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}, b: {impl: 'm:B'}}\nedges:\n  - {from: a, to: b}\n"
            "  - {from: a, to: b}\n",
            "p.yaml:4: edges.1: duplicate edge a->b (already declared as edges.0)",
            id="duplicate-edge",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}, b: {impl: 'm:B'}, c: {impl: 'm:C'}}\nedges:\n"
            "  - {from: a, to: b}\n  - {from: b, to: c}\n  - {from: c, to: b}\n",
            "p.yaml:5: edges.2: cycle b -> c -> b",
            id="cycle",
        ),
        pytest.param(
            "defaults:\n  inline_threshold: 64 kibibytes\nstages: {a: {impl: 'm:A'}}\n",
            "p.yaml:2: defaults.inline_threshold: invalid byte size '64 kibibytes'",
            id="bad-size",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}, b: {impl: 'm:B'}}\nedges:\n"
            "  - {from: a, to: b, chunk_timeout: 30 sec}\n",
            "p.yaml:3: edges.0.chunk_timeout: invalid duration '30 sec'",
            id="bad-duration",
        ),
        pytest.param(
            "stages:\n  a:\n    impl: m:A\n    replicas: two\n",
            "p.yaml:4: stages.a.replicas: input should be a valid integer (got 'two')",
            id="wrong-type",
        ),
        pytest.param(
            "stages:\n  a:\n    impl: m:A\n    replicas: 0\n",
            "p.yaml:4: stages.a.replicas: input should be greater than or equal to 1 (got 0)",
            id="zero-replicas",
        ),
        pytest.param(
            "stages:\n  a:\n    impl: m:A\n    replicas: 2147483647\n",
            "p.yaml:4: stages.a.replicas: input should be less than or equal to 1024 "
            "(got 2147483647)",
            id="replicas-past-the-cap",
        ),
        pytest.param(
            "stages:\n  a:\n    impl: m:A\n    impl: m:B\n",
            "p.yaml:4: stages.a.impl: duplicate key 'impl' (first written on line 3)",
            id="duplicate-key",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}}\nname: x\nname: y\n",
            "p.yaml:3: name: duplicate key 'name' (first written on line 2)",
            id="duplicate-top-key",
        ),
        pytest.param(
            "stages:\n  a: {impl: 'm:A'}\n  '@b': {impl: 'm:B'}\n",
            "p.yaml:3: stages.@b: invalid stage name '@b'",
            id="bad-stage-name",
        ),
        pytest.param(
            # Part of each worker's socket identity, which ZeroMQ caps at 255 bytes: a longer
            # name validated, and every worker then failed with a false --bind-host error.
            f"stages:\n  a: {{impl: 'm:A'}}\n  {'b' * 101}: {{impl: 'm:B'}}\n",
            f"p.yaml:3: stages.{'b' * 101}: invalid stage name '{'b' * 101}': expected letters, "
            "digits, '_' and '-', starting with a letter or '_', at most 100 of them",
            id="long-stage-name",
        ),
        pytest.param(
            "stages:\n  a:\n    impl: just_a_module\n",
            "p.yaml:3: stages.a.impl: invalid import path 'just_a_module'",
            id="bad-impl",
        ),
        pytest.param(
            "stages:\n  a: {impl: 'm:A', device: gpu}\n",
            "p.yaml:2: stages.a.device: invalid device 'gpu'",
            id="bad-device",
        ),
        pytest.param(
            "master:\n  bind: tcp://host\nstages: {a: {impl: 'm:A'}}\n",
            "p.yaml:2: master.bind: invalid bind address 'tcp://host'",
            id="bad-bind",
        ),
        pytest.param(
            "master:\n  bind: ipc://*\nstages: {a: {impl: 'm:A'}}\n",
            "p.yaml:2: master.bind: invalid bind address 'ipc://*'",
            id="ipc-wildcard",
        ),
        pytest.param(
            "stages:\n  a: {impl: 'm:A'}\n  true: {impl: 'm:B'}\n",
            "p.yaml:3: stages.true: key true is read as bool, not a string: quote it ('true')",
            id="bool-stage-name",
        ),
        pytest.param(
            "stages:\n  7: {impl: 'm:B'}\n",
            "p.yaml:2: stages.7: key 7 is read as int, not a string: quote it ('7')",
            id="int-stage-name",
        ),
        pytest.param(
            "stages:\n  a: {impl: 'm:A'}\n  ~: {impl: 'm:B'}\n",
            "p.yaml:3: stages.~: key ~ is read as null, not a string: quote it ('~')",
            id="null-stage-name",
        ),
        pytest.param(
            "defaults:\n  True: 1\nstages: {a: {impl: 'm:A'}}\n",
            "p.yaml:2: defaults.True: key True is read as bool, not a string: quote it ('True')",
            id="bool-field-name",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}, b: {impl: 'm:B'}}\nedges:\n- from: a\n  to: b\n"
            "  transport: 'not/a kind'\n",
            "p.yaml:5: edges.0.transport.kind: invalid transport 'not/a kind'",
            id="bad-transport",
        ),
        pytest.param(
            "defaults: {heartbeat_interval: 5s, heartbeat_timeout: 2s}\n"
            "stages: {a: {impl: 'm:A'}}\n",
            "p.yaml:1: defaults.heartbeat_timeout: heartbeat_timeout (2s) must exceed "
            "heartbeat_interval (5s)",
            id="heartbeat",
        ),
        pytest.param(
            "defaults: {heartbeat_interval: 10s}\nstages: {a: {impl: 'm:A'}}\n",
            "p.yaml:1: defaults.heartbeat_timeout: heartbeat_timeout (5s) must exceed "
            "heartbeat_interval (10s)",
            id="heartbeat-interval-past-the-default-timeout",
        ),
        pytest.param(
            f"defaults: {{chunk_timeout: {'9' * 400}}}\nstages: {{a: {{impl: 'm:A'}}}}\n",
            "p.yaml:1: defaults.chunk_timeout: invalid duration 9999",
            id="duration-too-large-for-a-float",
        ),
        pytest.param(
            f"defaults: {{chunk_timeout: '{'9' * 400}s'}}\nstages: {{a: {{impl: 'm:A'}}}}\n",
            "p.yaml:1: defaults.chunk_timeout: invalid duration '9999",
            id="duration-that-is-infinite",
        ),
        pytest.param(
            "stages:\n  a: {impl: 'm:A', env: {'A=B': x}}\n",
            "p.yaml:2: stages.a.env: invalid environment variable name 'A=B'",
            id="env-name-with-equals",
        ),
        pytest.param(
            "stages:\n  a: {impl: 'm:A', scheduling: fifo}\n",
            "p.yaml:2: stages.a.scheduling: input should be 'normal' or 'batch' (got 'fifo')",
            id="unknown-scheduling-policy",
        ),
        pytest.param(
            "defaults: {cpu_idle: spin}\nstages:\n  a: {impl: 'm:A'}\n",
            "p.yaml:1: defaults.cpu_idle: input should be 'default' or 'poll' (got 'spin')",
            id="unknown-cpu-idle-policy",
        ),
        pytest.param(
            "stages: {a: {impl: 'm:A'}}\nedges: {a: b}\n",
            "p.yaml:2: edges: expected a list, got a mapping",
            id="edges-not-a-list",
        ),
    ],
)
def test_config_error_names_line_and_path(text: str, expected: str) -> None:
    """Each kind of mistake is one ConfigError line starting with file, line and path."""
    message = str(config_error(text))
    assert "\n" not in message
    assert message.startswith(expected), message


def test_config_error_attributes() -> None:
    """The file, path and line are also available as attributes of the error."""
    error = config_error("stages:\n  a:\n    impl: m:A\n    replicas: two\n")
    assert (error.file, error.path, error.line) == ("p.yaml", "stages.a.replicas", 4)
    assert isinstance(error.__cause__, ValidationError)


def test_several_errors_report_the_first_in_document_order() -> None:
    """With several mistakes, the earliest line is reported and the rest are counted."""
    message = str(
        config_error("""
        stages:
          b:
            impl: m:B
            max_concurrency: lots
          a:
            impl: 5
            bogus: 1
    """)
    )
    assert message.startswith("p.yaml:4: stages.b.max_concurrency: input should be")
    assert message.endswith("(and 2 more)")


def test_unknown_key_wins_over_missing_key_on_the_same_line() -> None:
    """A misspelt key is reported before the missing key it was meant to be."""
    message = str(config_error("stagez: {a: {impl: 'm:A'}}\n"))
    assert message.startswith("p.yaml:1: stagez: unknown key 'stagez'")
    assert message.endswith("(and 1 more)")


def test_merge_keys_point_at_the_anchor() -> None:
    """A value brought in by a YAML merge is reported at the line where it was written."""
    message = str(
        config_error("""
        stages:
          a: &base
            impl: m:A
            replicas: -1
          b:
            <<: *base
            device: cpu
    """)
    )
    assert message.startswith("p.yaml:4: stages.a.replicas:")
    assert "(and 1 more)" in message


def test_merge_keys_are_not_duplicates() -> None:
    """An explicit key overriding a merged one is allowed, as YAML intends."""
    spec = load("""
        stages:
          a: &base {impl: "m:A", replicas: 2}
          b:
            <<: *base
            impl: "m:B"
    """)
    assert (spec.stages["b"].impl, spec.stages["b"].replicas) == ("m:B", 2)


def test_from_dict_errors_name_the_source() -> None:
    """from_dict reports the path under the given source name, with no line to give."""
    with pytest.raises(ConfigError) as info:
        PipelineSpec.from_dict({"stages": {"a": {"impl": "m:A", "replicas": 0}}}, source="api")
    assert str(info.value).startswith("api: stages.a.replicas: input should be greater")
    assert info.value.line is None
    with pytest.raises(ConfigError, match=r"^<dict>: expected a mapping .* got a list$"):
        PipelineSpec.from_dict([1, 2])  # type: ignore[arg-type]  # the check under test


def test_missing_file(tmp_path: Path) -> None:
    """A file that does not exist is a ConfigError naming it."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        PipelineSpec.from_yaml(path)
    assert str(info.value) == f"{path}: file not found"
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_unreadable_file(tmp_path: Path) -> None:
    """A directory or a file that is not UTF-8 is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="is a directory"):
        PipelineSpec.from_yaml(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"stages: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary\.yaml: not UTF-8 text"):
        PipelineSpec.from_yaml(binary)


def test_file_errors_name_the_file_and_line(tmp_path: Path) -> None:
    """Errors in a file name the file's path and the line of the bad field."""
    path = tmp_path / "bad.yaml"
    path.write_text("# comment\nstages:\n  a:\n    impl: m:A\n    device: tpu\n")
    with pytest.raises(ConfigError) as info:
        PipelineSpec.from_yaml(path)
    assert str(info.value).startswith(f"{path}:5: stages.a.device: invalid device 'tpu'")


def test_loader_is_safe() -> None:
    """Python-specific YAML tags are refused rather than executed."""
    error = config_error("stages: !!python/object/apply:os.system ['true']\n")
    assert str(error).startswith("p.yaml:1: invalid YAML:")


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ("impl: 'stages.text:Nope'", "p.yaml:4: stages.b.impl: module 'stages.text' has no"),
        ("impl: 'stages.text:Upper'\n    params: {repeat: 99}", "p.yaml:5: stages.b.params"),
        # A misspelt param kept its default silently: pydantic ignores unknown keys.
        ("impl: 'stages.text:Upper'\n    params: {repet: 2}",
         "p.yaml:5: stages.b.params.repet: Upper.Params has no param 'repet': did you mean "
         "'repeat'?"),
        ("impl: 'tests.configs.exiting_stage:Exits'",
         "p.yaml:4: stages.b.impl: cannot import 'tests.configs.exiting_stage': SystemExit: 5"),
    ],
    ids=["impl-without-the-class", "params-that-do-not-validate", "a-misspelt-param",
         "a-module-that-exits-as-it-imports"],
)  # fmt: skip
def test_errors_found_building_the_plan_name_their_line(
    tmp_path: Path, stage: str, expected: str
) -> None:
    """A stage that does not load, or whose params do not validate, is reported at the
    line of the field in the YAML file, like the errors of the spec itself."""
    path = tmp_path / "p.yaml"
    path.write_text(f"stages:\n  a: {{impl: 'stages.text:Split'}}\n  b:\n    {stage}\n")
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(path)
    assert str(info.value).startswith(str(tmp_path / expected)), str(info.value)


def test_numbers_are_read_as_in_yaml_1_2() -> None:
    """YAML 1.1 read ``010`` as eight, ``1:30`` as ninety and ``2024-01-02`` as a date; here
    ``010`` is ten, the others stay strings, ``0o``/``0x`` are octal and hex, and ``1e3`` is
    a float."""
    spec = load("""
        stages:
          a:
            impl: "m:A"
            replicas: 010
            max_concurrency: 0x10
            params: {octal: 0o17, big: 1_000, sci: 1e3, neg: -2.5e-1, inf: -.inf,
                     clock: 1:30, day: 2024-01-02, word: 12abc}
        edges: []
    """)
    stage = spec.stages["a"]
    assert (stage.replicas, stage.max_concurrency) == (10, 16)
    assert stage.params == {
        "octal": 15,
        "big": 1000,
        "sci": 1000.0,
        "neg": -0.25,
        "inf": -math.inf,
        "clock": "1:30",
        "day": "2024-01-02",
        "word": "12abc",
    }
    assert isinstance(stage.params["sci"], float)


def test_yes_no_on_off_are_strings_as_in_yaml_1_2() -> None:
    """YAML 1.1 read ``yes``/``no``/``on``/``off`` as booleans: a stage named ``yes`` became
    ``True`` and failed as "stages.1: input should be a valid string"; ``true`` and
    ``false`` stay booleans, and a boolean option given ``yes`` says what it wants."""
    spec = load("""
        stages:
          yes: {impl: "m:A", env: {FLAG: on}}
          no: {impl: "m:B"}
        edges:
          - {from: yes, to: no, transport: {kind: network, options: {copy_on_put: false}}}
    """)
    assert list(spec.stages) == ["yes", "no"]
    assert spec.stages["yes"].env == {"FLAG": "on"}
    assert spec.edges[0].transport is not None
    assert spec.edges[0].transport.options == {"copy_on_put": False}
    with pytest.raises(ConfigError, match="copy_on_put must be true or false, got 'yes'"):
        Pipeline(  # builds the plan, which checks each edge's transport options
            load("""
                stages:
                  a: {impl: "tests.pipeline.sample_stages:Echo"}
                  b: {impl: "tests.pipeline.sample_stages:Echo"}
                edges:
                  - {from: a, to: b, transport: {kind: network, options: {copy_on_put: yes}}}
            """)
        )


@pytest.mark.parametrize(
    "edges",
    ["edges: []", "edges:\n  - {from: a, to: b, transport: inline}"],
    ids=["no-edge", "every-edge-overrides-it"],
)
@pytest.mark.parametrize(
    ("transport", "expected"),
    [("carrier_pigeon", "p.yaml:1: defaults.transport"),
     ("{kind: shm, options: {bogus: 1}}", "p.yaml:1: defaults.transport.options")],
    ids=["unknown", "bad-options"],
)  # fmt: skip
def test_a_default_transport_no_edge_takes_is_checked_all_the_same(
    tmp_path: Path, edges: str, transport: str, expected: str
) -> None:
    """A typo in ``defaults.transport`` was accepted while no edge took the default (none,
    or each naming its own), until the next edge added failed on it."""
    path = tmp_path / "p.yaml"
    path.write_text(
        f"defaults: {{transport: {transport}}}\n"
        "stages:\n  a: {impl: 'stages.text:Split'}\n  b: {impl: 'stages.text:Upper'}\n"
        f"{edges}\n"
    )
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(path)
    assert str(info.value).startswith(str(tmp_path / expected)), str(info.value)


@pytest.mark.parametrize(
    ("fallback", "expected"),
    [("shm", "a fallback must be another transport than 'shm' itself"),
     ("auto", "a fallback must be a transport, not 'auto'")],
)  # fmt: skip
def test_a_fallback_that_cannot_take_what_its_transport_refused_is_refused(
    tmp_path: Path, fallback: str, expected: str
) -> None:
    """An edge pinned to shm with shm as its fallback was accepted: what the arena cannot
    take would have gone to the same arena."""
    path = tmp_path / "p.yaml"
    path.write_text(
        "stages:\n  a: {impl: 'stages.text:Split'}\n  b: {impl: 'stages.text:Upper'}\n"
        f"edges:\n  - {{from: a, to: b, transport: {{kind: shm, fallback: {fallback}}}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(path)
    assert str(info.value).startswith(str(tmp_path / "p.yaml:5: edges.0.transport.fallback"))
    assert expected in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("stage", "params", "refused"),
    [("Choices", "{max_new: 64}", None),
     ("Nested", "{image: {size: 3}}", None),
     ("Camel", "{maxTokens: 64, max_tokens: 64}", None),
     ("Mapping", "{a: 1, b: 2}", None),
     ("AliasOnly", "{maxTokens: 64}", None),
     # pydantic ignores a field's own name where it takes the alias only: a silent default.
     ("AliasOnly", "{max_tokens: 64}", "has no param 'max_tokens': did you mean 'maxTokens'?")],
)  # fmt: skip
def test_every_key_a_params_model_takes_passes_the_misspelling_check(
    tmp_path: Path, stage: str, params: str, refused: str | None
) -> None:
    """The check for misspelt params takes what pydantic takes (aliases among choices, the
    first key of an alias path, generated aliases, a root model's keys), which a first
    version of it refused, and refuses a field's own name where the model reads its alias
    only, which it let through."""
    _load_params(tmp_path, stage, params, refused)


@pytest.mark.parametrize(
    ("stage", "params", "refused"),
    [("Kinds", "{count: '10'}", "count: expected int, got '10' (quoted: write it without"),
     ("Kinds", "{count: true}", "count: expected int, got True"),
     ("Kinds", "{count: 2.5}", "count: expected int, got 2.5"),
     ("Kinds", "{name: 7}", "name: expected str, got 7"),
     ("Kinds", "{on: 1}", "on: expected bool, got 1"),
     ("Kinds", "{maybe: 'x'}", "maybe: expected int | None, got 'x'"),
     ("Kinds", "{count: 3, ratio: 1, name: x, where: a/b, on: true, maybe: null}", None),
     # What lax pydantic does on purpose: a model or field that names its own strictness,
     # a field a validator reads first, a duration in seconds.
     ("Lax", "{count: '10'}", None),
     ("Loose", "{loose: '10', size: 4k, timeout: 30, budget: 4k}", None)],
)  # fmt: skip
def test_params_are_read_strictly_as_json_is(
    tmp_path: Path, stage: str, params: str, refused: str | None
) -> None:
    """`max_new_tokens: "10"` or `true` passed as 10 and 1 (pydantic's lax mode), where
    validation is strict; a number still reads as a float, text as a path, and what a
    model takes loosely on purpose it still takes."""
    _load_params(tmp_path, stage, params, refused)


def _load_params(tmp_path: Path, stage: str, params: str, refused: str | None) -> None:
    """Load a one-stage pipeline of ``params_stages:stage`` given ``params`` (YAML): it
    loads if ``refused`` is None, else fails with a ConfigError saying ``refused``."""
    path = tmp_path / "p.yaml"
    path.write_text(
        f"stages:\n  s: {{impl: 'tests.configs.params_stages:{stage}', params: {params}}}\n"
    )
    if refused is None:
        Pipeline.from_yaml(path)
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        Pipeline.from_yaml(path)


def test_a_spec_built_in_python_with_a_key_that_is_no_string_names_it() -> None:
    """A mapping built in Python (not read from YAML) with a stage named True or None: the
    error names the key as Python writes it, not as ``stages.1`` or ``stages.None``."""
    for key, shown in ((True, "True is bool"), (None, "None is NoneType")):
        with pytest.raises(ConfigError, match=rf"stages\.{shown.split()[0]}: key {shown}, not"):
            PipelineSpec.from_dict({"stages": {key: {"impl": "m:A"}}})


def test_an_infinite_or_nan_param_reaches_the_workers_as_itself() -> None:
    """The spec travels to the workers as ``to_dict()``, which turned .inf and .nan into
    null: a stage whose params took a float then failed to start, blaming a None nobody
    wrote."""
    spec = PipelineSpec.from_yaml_text(
        "stages:\n  a: {impl: 'stages.text:Split', params: {limit: .inf, gap: .nan}}\n"
    )
    params = PipelineSpec.from_dict(spec.to_dict()).stages["a"].params
    assert params["limit"] == math.inf and math.isnan(params["gap"])


@pytest.mark.parametrize(
    ("value", "says"),
    [("123456789012345678901234567890", "OverflowError"), ('!!binary "/w=="', "UnicodeDecode")],
    ids=["int past 64 bits", "bytes not UTF-8"],
)
def test_a_param_that_cannot_travel_to_the_workers_is_refused_at_its_line(
    tmp_path: Path, value: str, says: str
) -> None:
    """A param no message to a worker can carry is a ConfigError naming it and its line,
    before anything starts. The master failed to encode each worker's assignment and
    never answered: the run hung until ``startup_timeout``, blaming the stage."""
    config = tmp_path / "p.yaml"
    config.write_text(f"stages:\n  a: {{impl: 'stages.text:Split', params: {{n: {value}}}}}\n")
    with pytest.raises(ConfigError, match=says) as refused:
        Pipeline.from_yaml(config)
    assert refused.value.path == "stages.a.params.n" and refused.value.line == 2
