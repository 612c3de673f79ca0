"""Pipeline specs: pydantic models that are both the Python API and the YAML schema.

Every model forbids unknown keys. :meth:`PipelineSpec.from_yaml` and friends turn any
failure into one :class:`~pipeline.ConfigError` whose message reads
``FILE:LINE: field.path: what is wrong``; constructing the models directly raises
pydantic's ``ValidationError`` as usual.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ._cpu_idle import CpuIdle
from ._document import YamlDocument, validation_to_config_error
from ._errors import ConfigError
from ._keys import edge_name
from ._scheduling import Scheduling
from ._units import (
    BUILTIN_TRANSPORTS,
    BindAddress,
    ByteSize,
    Count,
    Device,
    Duration,
    ImportPath,
    PositiveByteSize,
    Replicas,
    StageName,
    Timeout,
    TransportKind,
)

__all__ = (
    "BUILTIN_TRANSPORTS",
    "DefaultsSpec",
    "EdgeSpec",
    "MasterSpec",
    "PipelineSpec",
    "StageSpec",
    "TransportSpec",
)


#: Dumps a free value (a stage param) as the spec's own dump does.
_ANY: TypeAdapter[Any] = TypeAdapter(Any, config=ConfigDict(ser_json_inf_nan="constants"))


class _Spec(BaseModel):
    """The shared configuration of every spec model."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        # The spec travels to the workers as ``to_dict()``: a param of .inf or .nan must
        # arrive as itself, not as null.
        ser_json_inf_nan="constants",
    )


class MasterSpec(_Spec):
    """Where the master listens for workers and clients."""

    bind: BindAddress = "tcp://127.0.0.1:0"
    """A ZeroMQ endpoint, ``tcp://HOST:PORT`` (port 0: any free port) or ``ipc://PATH``
    (``ipc://@NAME``: Linux's abstract namespace, no file; ZeroMQ removes a file named
    ``@NAME`` from the working directory as it binds one)."""
    keys: str | None = None
    """A directory holding the pipeline's CURVE key pair (``stagewire keys DIR``): every
    ZeroMQ socket of the pipeline then authenticates and encrypts, and a peer without the
    pair is refused. Workers and clients need the same directory (``--keys``). Unset:
    ``STAGEWIRE_KEYS`` if set, else no CURVE."""


class TransportSpec(_Spec):
    """How an edge's payloads travel; YAML may give just the kind, as in ``transport: shm``."""

    kind: TransportKind
    """A built-in kind, an entry-point name, or an import path ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options for the transport itself, checked when the pipeline is built. Under ``auto``
    they are keyed by transport: ``{shm: {capacity: 1GiB}, network: {...}}``."""
    fallback: TransportKind | None = None
    """Where a payload goes when this transport stays full past ``full_timeout``; none
    means the request fails with TransportFull. ``auto`` falls back to ``inline`` unless
    told otherwise."""
    full_timeout: Timeout | None = None
    """How long a put waits for a full transport before falling back or failing; by
    default one second when there is a fallback, else the edge's ``chunk_timeout``."""

    @model_validator(mode="before")
    @classmethod
    def _from_kind(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"kind": data}
        if isinstance(data, Mapping | TransportSpec):
            return data
        raise PydanticCustomError(
            "transport_type",
            "expected a transport name such as 'shm', or a mapping with 'kind' and 'options'",
        )


class DefaultsSpec(_Spec):
    """Settings every edge and request inherits unless it overrides them."""

    transport: TransportSpec = Field(default_factory=lambda: TransportSpec(kind="auto"))
    """The transport of edges that do not name one."""
    inline_threshold: ByteSize = 64 * 1024
    """Payloads up to this size travel inside the envelope."""
    chunk_timeout: Timeout = 30.0
    """How long a consumer waits for the next chunk before failing with ChunkGap."""
    request_timeout: Timeout | None = None
    """The deadline of a whole request; ``None`` means no deadline."""
    window: Count = 256
    """Chunks in flight per request per edge before the producer waits. A producer faster
    than its consumer sends in bursts of half a window, each a wake-up on both sides, so a
    wider window streams small chunks with fewer wake-ups (256 against 64: 1.04-1.76x the
    chunks/s of one stream, benchmarks/hops.py's chain); memory for large chunks is held
    by ``window_bytes``. A request alone on its edge at the consumer gets four windows."""
    window_bytes: PositiveByteSize = 64 * 1024 * 1024
    """Payload bytes in flight per request per edge before the producer waits; a chunk
    larger than this still goes, alone. Whichever of the two limits comes first holds."""
    max_inflight: Count = 1024
    """Requests the orchestrator admits at once."""
    heartbeat_interval: Annotated[Timeout, Field(ge=0.01)] = 1.0
    """How often workers report that they are alive; at least 10 ms (a beat every few
    microseconds would keep every process busy with beats, and declare them dead)."""
    # Checked against the interval even when left at its default: an interval given alone
    # may exceed it, and every process that reads the spec must refuse that alike.
    heartbeat_timeout: Annotated[Timeout, Field(validate_default=True)] = 5.0
    """Silence after which a replica is declared dead; must exceed the interval."""
    report_interval: Annotated[Timeout, Field(ge=0.01)] = 0.1
    """How soon a worker tells the master which requests ended there and which have all
    of an upstream stage's payloads there, when its next heartbeat is later. A replica
    whose request ended there and whose consumers have all of it no longer counts it
    toward its load; when a replica dies, the master asks its consumers at once what they
    have, whatever this interval (a long decode outlives a crashed prefill). Shorter means
    fresher load figures, at a control message per interval and worker."""
    startup_timeout: Timeout = 60.0
    """How long the master waits for every replica to come up."""
    replica_wait: Duration = 10.0
    """How long a new request waits for a stage that has no ready replica (one restarting
    after a crash) to have one again, before it fails with StageUnavailable; 0 fails it at
    once. The request's ``request_timeout``, if shorter, bounds the wait too."""
    cpu_idle: CpuIdle = "default"
    """How this pipeline's hosts' idle CPUs wait. ``default`` leaves it to the kernel (a
    virtual machine's idle vCPU halts, and waking it for a message takes tens of
    microseconds); ``poll`` has every worker hold a zero wake-up latency request (Linux PM
    QoS, ``/dev/cpu_dma_latency``) while it runs, so idle CPUs spin and a hop wakes its
    stage at once, at the cost of CPUs kept busy while idle (power, a shared host's CPU).
    Needs write access to the device (root); a worker refused it warns and serves anyway."""

    @field_validator("heartbeat_timeout")
    @classmethod
    def _check_heartbeat(cls, value: float, info: ValidationInfo) -> float:
        # Fields validate in declaration order, so the interval is already here when valid.
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value <= interval:
            raise PydanticCustomError(
                "invalid_heartbeat_timeout",
                "heartbeat_timeout ({timeout}s) must exceed heartbeat_interval ({interval}s), "
                "or every replica would be declared dead between two heartbeats",
                {"timeout": f"{value:g}", "interval": f"{interval:g}"},
            )
        return value


class StageSpec(_Spec):
    """One stage: its class, its parameters and how it is deployed."""

    impl: ImportPath
    """The stage class, as ``package.module:Class``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Parameters passed to the stage class, validated by the stage."""
    replicas: Replicas = 1
    """Worker processes running this stage (at most 1024)."""
    device: Device = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    max_concurrency: Count = 16
    """Requests one replica processes at once."""
    max_batch_size: Count = 1
    """Requests grouped into one ``process_batch`` call; 1 turns batching off."""
    max_wait_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """How long a partial batch waits for more requests."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for this stage's worker processes."""
    scheduling: Scheduling = "batch"
    """The CPU scheduling policy of this stage's workers. ``batch`` (Linux SCHED_BATCH, the
    default) lets a worker woken by a message run without preempting the process on its
    CPU; ``normal`` keeps the policy the worker started with."""

    @field_validator("env", mode="before")
    @classmethod
    def _stringify_env(cls, value: Any) -> Any:
        # ``OMP_NUM_THREADS: 4`` is an int in YAML, but the environment only holds strings;
        # refusing it would punish the obvious spelling. Booleans stay errors: "True" or
        # "true" would be a guess.
        if isinstance(value, Mapping):
            return {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                for k, v in value.items()
            }
        return value

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        # What the OS would refuse at spawn, refused here with the line it is on.
        for name, value in env.items():
            if not name or "=" in name or "\0" in name:
                raise PydanticCustomError(
                    "invalid_env_name",
                    "invalid environment variable name {name}: non-empty, no '=' or NUL",
                    {"name": repr(name)},
                )
            if "\0" in value:
                raise PydanticCustomError(
                    "invalid_env_value",
                    "environment variable {name} holds a NUL byte",
                    {"name": name},
                )
        return env


class EdgeSpec(_Spec):
    """A directed edge from one stage to another; unset fields inherit the defaults.

    In YAML and in :meth:`PipelineSpec.to_dict` the ends are ``from`` and ``to``; in
    Python they are ``src`` and ``dst``, since ``from`` is a keyword.
    """

    # validation_alias/serialization_alias rather than alias: type checkers then see the
    # constructor as EdgeSpec(src=..., dst=...), which is how Python code spells it.
    src: str = Field(validation_alias="from", serialization_alias="from")
    """The producing stage."""
    dst: str = Field(validation_alias="to", serialization_alias="to")
    """The consuming stage."""
    transport: TransportSpec | None = None
    """This edge's transport, instead of the default."""
    inline_threshold: ByteSize | None = None
    """This edge's inline threshold, instead of the default."""
    chunk_timeout: Timeout | None = None
    """This edge's chunk timeout, instead of the default."""
    window: Count | None = None
    """This edge's window, instead of the default."""
    window_bytes: PositiveByteSize | None = None
    """This edge's byte window, instead of the default."""

    @property
    def name(self) -> str:
        """The edge's name in keys, logs and statistics: ``src->dst``."""
        return edge_name(self.src, self.dst)


class PipelineSpec(_Spec):
    """A whole pipeline: stages, the edges between them, and shared settings.

    Validation checks the graph as well as the fields: edges join known stages, there are
    no self loops, duplicate edges or cycles, so there is always a source and a sink.
    """

    name: str = Field(default="pipeline", min_length=1)
    """A name for logs and statistics."""
    master: MasterSpec = Field(default_factory=MasterSpec)
    """Where the master listens."""
    defaults: DefaultsSpec = Field(default_factory=DefaultsSpec)
    """Settings edges and requests inherit."""
    stages: dict[StageName, StageSpec]
    """The stages by name, in the order they were declared."""
    edges: list[EdgeSpec] = Field(default_factory=list)
    """The edges; a pipeline of one stage needs none."""

    @field_validator("stages")
    @classmethod
    def _check_not_empty(cls, value: dict[str, StageSpec]) -> dict[str, StageSpec]:
        if not value:
            raise PydanticCustomError("invalid_stages", "at least one stage is required")
        return value

    @model_validator(mode="after")
    def _check_graph(self) -> PipelineSpec:
        known = ", ".join(self.stages)
        seen: dict[tuple[str, str], int] = {}
        for index, e in enumerate(self.edges):
            for key, stage in (("from", e.src), ("to", e.dst)):
                if stage not in self.stages:
                    detail = f"unknown stage {stage!r}; known stages: {known}"
                    raise _graph_error(("edges", index, key), detail)
            if e.src == e.dst:
                raise _graph_error(("edges", index, "to"), f"stage {e.src!r} feeds itself")
            first = seen.setdefault((e.src, e.dst), index)
            if first != index:
                detail = f"duplicate edge {e.name} (already declared as edges.{first})"
                raise _graph_error(("edges", index), detail)
        cycle = self._find_cycle()
        if cycle is not None:
            index, stages = cycle
            detail = f"cycle {' -> '.join(stages)}; a pipeline must be acyclic"
            raise _graph_error(("edges", index), detail)
        return self

    def _find_cycle(self) -> tuple[int, list[str]] | None:
        """Return the index of an edge closing a cycle and the cycle's stages, if any."""
        out: dict[str, list[tuple[int, str]]] = {s: [] for s in self.stages}
        for index, e in enumerate(self.edges):
            out[e.src].append((index, e.dst))
        done: set[str] = set()
        for root in self.stages:
            if root in done:
                continue
            # An explicit stack keeps deep chains of stages clear of the recursion limit.
            path: list[str] = [root]
            on_path = {root}
            todo = [iter(out[root])]
            while todo:
                step = next(todo[-1], None)
                if step is None:
                    done.add(path[-1])
                    on_path.discard(path.pop())
                    todo.pop()
                    continue
                index, nxt = step
                if nxt in on_path:
                    return index, [*path[path.index(nxt) :], nxt]
                if nxt not in done:
                    path.append(nxt)
                    on_path.add(nxt)
                    todo.append(iter(out[nxt]))
        return None

    # -- graph helpers --------------------------------------------------------------

    def edge(self, src: str, dst: str) -> EdgeSpec:
        """Return the edge from ``src`` to ``dst``.

        Raises:
            KeyError: there is no such edge.
        """
        for e in self.edges:
            if e.src == src and e.dst == dst:
                return e
        raise KeyError(f"no edge {edge_name(src, dst)} in pipeline {self.name!r}")

    def upstream(self, stage: str) -> list[str]:
        """Return the stages feeding ``stage``, in edge order.

        Raises:
            KeyError: ``stage`` is not a stage of this pipeline.
        """
        self._require(stage)
        return [e.src for e in self.edges if e.dst == stage]

    def downstream(self, stage: str) -> list[str]:
        """Return the stages ``stage`` feeds, in edge order.

        Raises:
            KeyError: ``stage`` is not a stage of this pipeline.
        """
        self._require(stage)
        return [e.dst for e in self.edges if e.src == stage]

    def sources(self) -> list[str]:
        """Return the stages with no upstream, which receive the client's input."""
        fed = {e.dst for e in self.edges}
        return [s for s in self.stages if s not in fed]

    def sinks(self) -> list[str]:
        """Return the stages with no downstream, whose outputs go back to the client."""
        feeding = {e.src for e in self.edges}
        return [s for s in self.stages if s not in feeding]

    def topological_order(self) -> list[str]:
        """Return every stage after all of its upstream stages.

        Among stages that are ready together, declaration order decides, so the order is
        the same on every run and on every host.
        """
        rank = {s: i for i, s in enumerate(self.stages)}
        waiting = dict.fromkeys(self.stages, 0)
        for e in self.edges:
            waiting[e.dst] += 1
        ready = [rank[s] for s, n in waiting.items() if n == 0]
        heapq.heapify(ready)
        names = list(self.stages)
        order: list[str] = []
        while ready:
            stage = names[heapq.heappop(ready)]
            order.append(stage)
            for e in self.edges:
                if e.src == stage:
                    waiting[e.dst] -= 1
                    if waiting[e.dst] == 0:
                        heapq.heappush(ready, rank[e.dst])
        return order

    def edge_transport(self, e: EdgeSpec) -> TransportSpec:
        """Return the transport of ``e``: its own, or the default."""
        return e.transport if e.transport is not None else self.defaults.transport

    def edge_inline_threshold(self, e: EdgeSpec) -> int:
        """Return the inline threshold of ``e`` in bytes: its own, or the default."""
        if e.inline_threshold is not None:
            return e.inline_threshold
        return self.defaults.inline_threshold

    def edge_chunk_timeout(self, e: EdgeSpec) -> float:
        """Return the chunk timeout of ``e`` in seconds: its own, or the default."""
        return e.chunk_timeout if e.chunk_timeout is not None else self.defaults.chunk_timeout

    def edge_window(self, e: EdgeSpec) -> int:
        """Return the window of ``e`` in chunks: its own, or the default."""
        return e.window if e.window is not None else self.defaults.window

    def edge_window_bytes(self, e: EdgeSpec) -> int:
        """Return the byte window of ``e``: its own, or the default."""
        return e.window_bytes if e.window_bytes is not None else self.defaults.window_bytes

    def _require(self, stage: str) -> None:
        if stage not in self.stages:
            raise KeyError(f"no stage {stage!r} in pipeline {self.name!r}")

    # -- loading and shipping --------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> PipelineSpec:
        """Load and validate the pipeline in the YAML file at ``path``.

        Raises:
            ConfigError: the file cannot be read, is not valid YAML, or is not a valid
                pipeline; the message names the file, the field and the line.
        """
        from ._yaml import read_yaml_file  # a worker, validating data, never loads PyYAML

        return cls._validate(read_yaml_file(path))

    @classmethod
    def from_document(cls, document: YamlDocument) -> PipelineSpec:
        """Validate a parsed YAML document (from ``read_yaml_file`` or ``parse_yaml``).

        Raises:
            ConfigError: the document is not a valid pipeline; the message names its
                source, the field and the line.
        """
        return cls._validate(document)

    @classmethod
    def from_yaml_text(cls, text: str, *, source: str = "<string>") -> PipelineSpec:
        """Load and validate a pipeline from YAML text; ``source`` names it in errors.

        Raises:
            ConfigError: the text is not valid YAML or not a valid pipeline.
        """
        from ._yaml import parse_yaml

        return cls._validate(parse_yaml(text, source=source))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> PipelineSpec:
        """Validate a pipeline given as plain data, such as the output of :meth:`to_dict`.

        Raises:
            ConfigError: ``data`` is not a valid pipeline; ``source`` names it.
        """
        # A dict has no lines; the document only lends its source name to errors.
        return cls._validate(YamlDocument(data, source))

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as JSON-able data, with YAML's key names.

        ``PipelineSpec.from_dict(spec.to_dict()) == spec`` for any spec loaded from YAML,
        which is how the spec travels to worker processes.
        """
        return self.model_dump(mode="json", by_alias=True)

    def check_sendable(self) -> None:
        """Check that the spec can travel to worker processes (``to_dict``, then msgpack).

        Raises:
            ConfigError: a value cannot (an integer past 64 bits, bytes that are not UTF-8
                text), naming where; the master could not have told a worker its stage.
        """
        import msgspec

        try:
            msgspec.msgpack.encode(self.to_dict())
            return
        except Exception as exc:  # OverflowError, UnicodeDecodeError, TypeError, ...
            first = exc
        # The values written as they are: stage params and transport options.
        free: list[tuple[str, dict[str, Any]]] = [
            (f"stages.{name}.params", stage.params) for name, stage in self.stages.items()
        ]
        free.append(("defaults.transport.options", self.defaults.transport.options))
        free += [
            (f"edges.{i}.transport.options", e.transport.options)
            for i, e in enumerate(self.edges)
            if e.transport is not None
        ]
        for where, values in free:
            for key, value in values.items():
                try:
                    msgspec.msgpack.encode(_ANY.dump_python(value, mode="json"))
                except Exception as exc:
                    raise ConfigError(
                        f"cannot be sent to the worker processes ({type(exc).__name__}: "
                        f"{exc}); use a string, a number within 64 bits, or lists and "
                        "mappings of those",
                        path=f"{where}.{key}",
                    ) from exc
        raise ConfigError(
            f"the pipeline cannot be sent to the worker processes: {first}"
        ) from first

    @classmethod
    def _validate(cls, doc: YamlDocument) -> PipelineSpec:
        """Validate ``doc.data``, reporting failures at their place in ``doc``."""
        data = doc.data
        if not isinstance(data, Mapping):
            what = "an empty document" if data is None else f"a {type(data).__name__}"
            raise ConfigError(
                f"expected a mapping with 'stages' (and usually 'edges') at the top level, "
                f"got {what}",
                file=doc.source,
                line=doc.line_of(()),
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise validation_to_config_error(e, cls, doc) from e


def _graph_error(loc: tuple[str | int, ...], detail: str) -> PydanticCustomError:
    """An error about the graph, carrying the path of the edge field at fault.

    A model validator can only fail at the model's own location, so the field path
    travels in the context, where :func:`validation_to_config_error` looks for it.
    """
    path = ".".join(str(p) for p in loc)
    return PydanticCustomError(
        "invalid_graph", "{path}: {detail}", {"path": path, "detail": detail, "loc": loc}
    )
