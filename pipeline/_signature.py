"""Reading stage classes and checking a pipeline's types before any process starts.

:func:`build_plan` imports every stage's class, reads the annotations of its ``process``
method, validates its params, and checks that every edge's producer type matches its
consumer's input type. Every problem is a :class:`ConfigError` naming the stage or edge.
"""

from __future__ import annotations

import collections.abc
import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import AliasChoices, AliasPath, BaseModel, RootModel, ValidationError

from pipeline._codec import codec_for, type_name
from pipeline._config import PipelineSpec, StageSpec, TransportSpec
from pipeline._document import YamlDocument
from pipeline._edge_transport import EdgeTransports, resolve_edge_transports
from pipeline._errors import ConfigError, PayloadError
from pipeline._keys import CLIENT, edge_name
from pipeline._stage import Context, Outputs, Stage, Stream

__all__ = (
    "EdgePlan",
    "InputSpec",
    "PipelinePlan",
    "StagePlan",
    "StageSignature",
    "build_plan",
    "inspect_stage",
    "load_stage_class",
)

_STREAM_ORIGINS = (
    collections.abc.AsyncIterator,
    collections.abc.AsyncGenerator,
    collections.abc.AsyncIterable,
)


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One parameter of ``process``: its name, payload type and whether it streams."""

    name: str
    type: Any
    streaming: bool


@dataclass(frozen=True, slots=True)
class StageSignature:
    """What a stage class consumes and produces."""

    cls: type[Stage]
    inputs: tuple[InputSpec, ...]
    output_type: Any
    streaming_output: bool
    per_destination: dict[str, Any] | None
    batched: bool


@dataclass(frozen=True, slots=True)
class EdgePlan:
    """One edge, resolved: its payload type and transport settings."""

    name: str
    src: str
    dst: str
    payload_type: Any
    streaming: bool
    transport: TransportSpec
    window: int
    chunk_timeout: float
    inline_threshold: int
    transports: EdgeTransports
    window_bytes: int
    #: The consumer joins this edge with other inputs: its handler may start on another
    #: input and then wait for this edge's first chunk.
    joined: bool = False


@dataclass(slots=True)
class StagePlan:
    """One stage, resolved: its class, params and edges keyed by parameter / destination."""

    name: str
    spec: StageSpec
    signature: StageSignature
    params: Any
    inputs: dict[str, EdgePlan] = field(default_factory=dict)
    outputs: dict[str, EdgePlan] = field(default_factory=dict)


@dataclass(slots=True)
class PipelinePlan:
    """Every stage and edge of a checked pipeline."""

    spec: PipelineSpec
    stages: dict[str, StagePlan]

    @property
    def sources(self) -> list[str]:
        """Stages fed by the client."""
        return self.spec.sources()

    @property
    def sinks(self) -> list[str]:
        """Stages whose outputs go to the client."""
        return self.spec.sinks()


def load_stage_class(impl: str, *, stage: str = "?") -> type[Stage]:
    """Import ``module:Class`` and check that it is a Stage with a ``process`` method.

    Raises:
        ConfigError: the module or class cannot be imported, or is not a usable stage.
    """
    path = f"stages.{stage}.impl"
    module_name, sep, attr = impl.partition(":")
    if not sep:
        raise ConfigError(f"impl {impl!r} must be 'module:Class'", path=path)
    try:
        module = importlib.import_module(module_name)
    # A module that calls sys.exit() as it imports would end the command without a word.
    except (Exception, SystemExit) as exc:
        raise ConfigError(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}", path=path
        ) from exc
    cls: Any = module
    for part in attr.split("."):  # a class nested in another: Outer.Inner
        cls = getattr(cls, part, None)
        if cls is None:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}", path=path)
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ConfigError(f"{impl!r} is not a subclass of pipeline.Stage", path=path)
    if not callable(getattr(cls, "process", None)):
        raise ConfigError(f"stage class {impl!r} has no process() method", path=path)
    return cls


def _unwrap_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def inspect_stage(cls: type[Stage], stage: str) -> StageSignature:
    """Read the inputs and output of ``cls.process``.

    Raises:
        ConfigError: ``process``, ``setup`` or ``teardown`` is not async, ``process`` lacks
            annotations, or mixes input kinds.
    """
    path = f"stages.{stage}"
    process = cls.process  # type: ignore[attr-defined]  # checked by load_stage_class
    if not (inspect.iscoroutinefunction(process) or inspect.isasyncgenfunction(process)):
        raise ConfigError(f"{cls.__name__}.process must be 'async def'", path=path)
    for hook in ("setup", "teardown"):
        # Awaited by the worker: a plain def would fail its start-up (or its shutdown) with
        # a TypeError about awaiting None, long after this check could have said so.
        if not inspect.iscoroutinefunction(getattr(cls, hook)):
            raise ConfigError(
                f"{cls.__name__}.{hook} must be 'async def {hook}(self) -> None'", path=path
            )
    try:
        hints = typing.get_type_hints(process)
    except Exception as exc:
        raise ConfigError(
            f"cannot resolve the annotations of {cls.__name__}.process: {exc}", path=path
        ) from exc
    params = list(inspect.signature(process).parameters.values())[1:]
    if (
        not params
        or params[-1].name != "ctx"
        or params[-1].kind not in (params[-1].POSITIONAL_OR_KEYWORD, params[-1].KEYWORD_ONLY)
    ):
        raise ConfigError(
            f"{cls.__name__}.process must take its inputs then 'ctx: Context'", path=path
        )
    inputs: list[InputSpec] = []
    for p in params[:-1]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            # Inputs are passed by name, one per upstream stage: '*args', '**kwargs' and
            # positional-only parameters cannot take them.
            stars: dict[inspect._ParameterKind, str] = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}
            shown = stars.get(p.kind, "") + p.name
            kind = "" if shown != p.name else " (positional-only)"
            raise ConfigError(
                f"{cls.__name__}.process parameter {shown!r}{kind} cannot take an input: "
                "name one parameter per upstream stage (plain or keyword-only)",
                path=path,
            )
        if p.name not in hints:
            raise ConfigError(
                f"{cls.__name__}.process parameter {p.name!r} has no type annotation", path=path
            )
        tp = hints[p.name]
        streaming = typing.get_origin(tp) is Stream
        inputs.append(InputSpec(p.name, typing.get_args(tp)[0] if streaming else tp, streaming))
    if not inputs:
        raise ConfigError(f"{cls.__name__}.process takes no input parameter", path=path)
    if hints.get("ctx", Context) is not Context:
        raise ConfigError(f"{cls.__name__}.process 'ctx' must be annotated Context", path=path)
    if "return" not in hints:
        raise ConfigError(f"{cls.__name__}.process has no return annotation", path=path)
    ret = hints["return"]
    streaming_out = typing.get_origin(ret) in _STREAM_ORIGINS
    if inspect.isasyncgenfunction(process) != streaming_out:
        raise ConfigError(
            f"{cls.__name__}.process: an async generator must be annotated "
            "AsyncIterator[T], and only an async generator may be",
            path=path,
        )
    if streaming_out and not typing.get_args(ret):
        raise ConfigError(
            f"{cls.__name__}.process: annotate what the stream yields, as AsyncIterator[T]",
            path=path,
        )
    out = typing.get_args(ret)[0] if streaming_out else ret
    per_dest = None
    if isinstance(out, type) and issubclass(out, Outputs):
        try:
            fields = typing.get_type_hints(out)
        except Exception as exc:
            raise ConfigError(
                f"cannot resolve the annotations of {out.__name__}, the outputs of "
                f"{cls.__name__}.process: {exc}",
                path=path,
            ) from exc
        per_dest = {name: _unwrap_optional(tp) for name, tp in fields.items()}
    process_batch = getattr(cls, "process_batch", None)
    batched = callable(process_batch)
    if batched and (len(inputs) != 1 or inputs[0].streaming or streaming_out):
        raise ConfigError(
            f"{cls.__name__}.process_batch needs one plain input and a plain output", path=path
        )
    if batched and not inspect.iscoroutinefunction(process_batch):
        raise ConfigError(
            f"{cls.__name__}.process_batch must be 'async def process_batch(self, items, "
            "ctxs) -> list'",
            path=path,
        )
    return StageSignature(cls, tuple(inputs), out, streaming_out, per_dest, batched)


def _compatible(produced: Any, consumed: Any) -> bool:
    return consumed is Any or produced == consumed or _is_subclass(produced, consumed)


def _is_subclass(produced: Any, consumed: Any) -> bool:
    """Whether ``produced`` is a class strictly derived from the class ``consumed``."""
    return (
        isinstance(produced, type)
        and isinstance(consumed, type)
        and produced is not consumed
        and issubclass(produced, consumed)
    )


def _check_codecs(stages: dict[str, StagePlan]) -> None:
    """Refuse an edge whose payload type the wire codec cannot carry, before any process
    starts: a union of untagged Structs, a field no payload can hold, a name that does not
    resolve. The processes would fail at start-up or at every request otherwise."""
    for name, plan in stages.items():
        for edge in (*plan.outputs.values(), *plan.inputs.values()):
            try:
                codec_for(edge.payload_type)
            except PayloadError as exc:
                raise ConfigError(
                    f"edge {edge.name}: its payload type {type_name(edge.payload_type)} "
                    f"cannot travel between processes: {exc}",
                    path=f"stages.{name}",
                ) from None


#: The value kinds YAML may give a field of each plain type: pydantic's lax mode would
#: also take text or ``true`` for a number, and a number for text.
_PLAIN_KINDS: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (int, float),
    bool: (bool,),
    str: (str,),
}


def _plain_kinds(annotation: Any) -> tuple[tuple[type, ...], bool] | None:
    """The kinds a field of a plain type (``int``, ``float | None``, ...) takes, and
    whether None is one; None for any other field."""
    kinds = _PLAIN_KINDS.get(annotation)
    if kinds is not None:
        return kinds, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2:
        (other,) = [a for a in args if a is not type(None)] or [None]
        if type(None) in args and other in _PLAIN_KINDS:
            return _PLAIN_KINDS[other], True
    return None


def _own_reading(meta: Any) -> bool:
    """Whether a field's metadata says how it reads its value: its own strictness, or a
    validator in its ``Annotated`` type (``BeforeValidator`` and the like: a size given as
    "64KiB", a duration as "30s")."""
    name = type(meta).__name__
    return (
        name == "Strict"
        or name.endswith("Validator")
        or bool(getattr(meta, "coerce_numbers_to_str", None))
    )


def _refuse_coerced(params: dict[str, Any], model: type[BaseModel], stage: str) -> None:
    """Refuse a value of another kind than its field's plain type: ``max_new_tokens: "10"``
    or ``true`` passed (pydantic's lax mode read them as 10 and 1), where validation is
    strict. A model or field that names its own strictness, and a field a validator reads
    first (it may turn text into a number on purpose), are left to pydantic.

    Raises:
        ConfigError: naming the param, the kind it wants and the value given.
    """
    config = model.model_config
    if config.get("strict") is not None or config.get("coerce_numbers_to_str"):
        return
    decorators = model.__pydantic_decorators__
    if any(d.info.mode in ("before", "wrap") for d in decorators.model_validators.values()):
        return
    read_first: set[str] = set()
    for d in decorators.field_validators.values():
        if d.info.mode in ("before", "wrap", "plain"):
            read_first.update(d.info.fields)
    if "*" in read_first:
        return
    for name, info in model.model_fields.items():
        plain = _plain_kinds(info.annotation)
        if plain is None or name in read_first:
            continue
        if any(_own_reading(m) for m in info.metadata):
            continue
        key = name if name in params else info.alias
        if key is None or key not in params:
            continue
        value = params[key]
        kinds, optional = plain
        if value is None and optional:
            continue
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            hint = " (quoted: write it without quotes)" if isinstance(value, str) else ""
            raise ConfigError(
                f"expected {type_name(info.annotation)}, got {value!r}{hint}",
                path=f"stages.{stage}.params.{key}",
            )


def _validate_params(spec: StageSpec, cls: type[Stage], stage: str) -> Any:
    model = cls.Params
    if model is None:
        if spec.params:
            raise ConfigError(
                f"{cls.__name__} declares no Params model but params were given",
                path=f"stages.{stage}.params",
            )
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ConfigError(f"{cls.__name__}.Params must be a pydantic model", path=f"stages.{stage}")
    _refuse_unknown_params(spec.params, model, cls.__name__, stage)
    _refuse_coerced(spec.params, model, stage)
    try:
        return model.model_validate(spec.params)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        more = exc.error_count() - 1
        got = f", got {first['input']!r}" if first["type"] != "missing" else ""
        raise ConfigError(
            first["msg"] + got + (f" (and {more} more)" if more else ""),
            path=f"stages.{stage}.params" + (f".{loc}" if loc else ""),
        ) from exc
    # The stage's own validators may raise anything.
    except Exception as exc:
        raise ConfigError(
            f"{cls.__name__}.Params raised {type(exc).__name__} validating the params: {exc}",
            path=f"stages.{stage}.params",
        ) from exc


def _refuse_unknown_params(
    params: Mapping[str, Any], model: type[BaseModel], cls: str, stage: str
) -> None:
    """A param the stage's model takes under no name is a typo: pydantic ignores it unless
    the model says ``extra="forbid"``, so a misspelt param silently kept its default. So
    is a field's own name where the model takes it by its alias only. Only a model that
    names its ``extra`` policy itself (``allow``, ``ignore``) keeps unknown keys, and a
    root model is left to pydantic.

    Raises:
        ConfigError: naming the first unknown param, and the closest known one.
    """
    config = model.model_config
    if config.get("extra") is not None or issubclass(model, RootModel):
        return
    by_name = bool(config.get("validate_by_name") or config.get("populate_by_name"))
    by_alias = config.get("validate_by_alias", True) is not False
    known: set[str] = set()
    for name, info in model.model_fields.items():
        aliases = _alias_names(info.validation_alias if info.validation_alias else info.alias)
        if by_alias:
            known |= aliases
        if by_name or not aliases or not by_alias:
            known.add(name)
    unknown = [key for key in params if key not in known]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(sorted(known))}"
    if not known:
        hint = "it takes none"
    raise ConfigError(
        f"{cls}.Params has no param {key!r}: {hint}", path=f"stages.{stage}.params.{key}"
    )


def _alias_names(alias: object) -> set[str]:
    """The top-level keys an alias (a name, ``AliasPath``, ``AliasChoices``) reads."""
    if isinstance(alias, str):
        return {alias}
    if isinstance(alias, AliasPath):
        first = alias.path[0] if alias.path else None
        return {first} if isinstance(first, str) else set()
    if isinstance(alias, AliasChoices):
        return {n for choice in alias.choices for n in _alias_names(choice)}
    return set()


def _edge_plan(spec: PipelineSpec, src: str, dst: str, tp: Any, streaming: bool) -> EdgePlan:
    name = edge_name(src, dst)
    path: str | None = None
    if CLIENT in (src, dst):
        transport = TransportSpec(kind="inline")
        window, chunk_timeout = spec.defaults.window, spec.defaults.chunk_timeout
        window_bytes = spec.defaults.window_bytes
        threshold = spec.defaults.inline_threshold
    else:
        e = spec.edge(src, dst)
        transport = spec.edge_transport(e)
        path = (
            f"edges.{spec.edges.index(e)}.transport"
            if e.transport is not None
            else "defaults.transport"
        )
        window, chunk_timeout = spec.edge_window(e), spec.edge_chunk_timeout(e)
        window_bytes = spec.edge_window_bytes(e)
        threshold = spec.edge_inline_threshold(e)
    transports = _resolve(name, transport, chunk_timeout, threshold, path)
    return EdgePlan(
        name,
        src,
        dst,
        tp,
        streaming,
        transport,
        window,
        chunk_timeout,
        threshold,
        transports,
        window_bytes,
        joined=dst != CLIENT and len(spec.upstream(dst)) > 1,
    )


def build_plan(
    spec: PipelineSpec, *, source: str | None = None, document: YamlDocument | None = None
) -> PipelinePlan:
    """Import every stage and check every edge's types, before any process starts.

    ``document``, the YAML the spec came from, lets errors name the line of the field.

    Raises:
        ConfigError: a stage cannot be loaded, its params do not validate, or an edge's
            producer type does not match its consumer, naming the edge.
    """
    try:
        return _build(spec)
    except ConfigError as exc:
        if source is not None and exc.file is None:
            line = exc.line
            if line is None and document is not None and exc.path:
                loc = tuple(int(p) if p.isdigit() else p for p in exc.path.split("."))
                line = document.line_of(loc, key=True)
            raise ConfigError(exc.message, file=source, path=exc.path, line=line) from exc
        raise


def _build(spec: PipelineSpec) -> PipelinePlan:
    spec.check_sendable()
    sigs: dict[str, StageSignature] = {}
    stages: dict[str, StagePlan] = {}
    for name, sspec in spec.stages.items():
        cls = load_stage_class(sspec.impl, stage=name)
        sig = inspect_stage(cls, name)
        sigs[name] = sig
        if not sig.batched and sspec.max_batch_size > 1:
            raise ConfigError(
                f"stage {name!r} sets max_batch_size {sspec.max_batch_size}, but "
                f"{cls.__name__} defines no process_batch to take a batch; define "
                "'async def process_batch(self, items, ctxs)' or remove max_batch_size",
                path=f"stages.{name}.max_batch_size",
            )
        stages[name] = StagePlan(name, sspec, sig, _validate_params(sspec, cls, name))
    for name, sig in sigs.items():
        downstream = spec.downstream(name) or [CLIENT]
        if sig.per_destination is not None and set(sig.per_destination) != set(downstream):
            raise ConfigError(
                f"{sig.output_type.__name__} has fields {sorted(sig.per_destination)} but "
                f"stage {name!r} sends to {sorted(downstream)}; name one field per "
                "downstream stage",
                path=f"stages.{name}",
            )
        for dst in downstream:
            out_tp = sig.per_destination[dst] if sig.per_destination else sig.output_type
            stages[name].outputs[dst] = _edge_plan(spec, name, dst, out_tp, sig.streaming_output)
        upstream = spec.upstream(name) or [CLIENT]
        _bind_inputs(spec, stages, sigs, name, upstream)
    _check_codecs(stages)
    if all(e.transport is not None for e in spec.edges):
        # No edge takes the default: it is checked all the same, since the next edge added
        # would (and a typo there was accepted until then).
        _check_default_transport(spec)
    return PipelinePlan(spec, stages)


def _check_default_transport(spec: PipelineSpec) -> None:
    """Check ``defaults.transport`` as an edge that takes it is checked.

    Raises:
        ConfigError: ``defaults.transport`` names an unknown transport or bad options.
    """
    defaults = spec.defaults
    _resolve(
        "(the default)",
        defaults.transport,
        defaults.chunk_timeout,
        defaults.inline_threshold,
        "defaults.transport",
    )


def _resolve(
    edge: str, transport: TransportSpec, chunk_timeout: float, threshold: int, path: str | None
) -> EdgeTransports:
    """:func:`resolve_edge_transports` for what ``transport`` says.

    Raises:
        ConfigError: as resolve_edge_transports.
    """
    return resolve_edge_transports(
        edge,
        transport.kind,
        transport.options,
        fallback=transport.fallback,
        full_timeout=transport.full_timeout,
        chunk_timeout=chunk_timeout,
        inline_threshold=threshold,
        path=path,
    )


def _bind_inputs(
    spec: PipelineSpec,
    stages: dict[str, StagePlan],
    sigs: dict[str, StageSignature],
    name: str,
    upstream: list[str],
) -> None:
    sig = sigs[name]
    path = f"stages.{name}"
    if len(upstream) == 1 and len(sig.inputs) == 1:
        pairs = [(upstream[0], sig.inputs[0])]
    else:
        by_name = {i.name: i for i in sig.inputs}
        if set(by_name) != set(upstream):
            raise ConfigError(
                f"stage {name!r} has inputs from {sorted(upstream)}, so process() must "
                f"name one parameter after each; it has {sorted(by_name)}",
                path=path,
            )
        pairs = [(up, by_name[up]) for up in upstream]
    for up, inp in pairs:
        if up == CLIENT:
            produced, streaming = inp.type, False
        else:
            sup = sigs[up]
            produced = sup.per_destination[name] if sup.per_destination else sup.output_type
            streaming = sup.streaming_output
        ename = edge_name(up, name)
        if not _compatible(produced, inp.type):
            raise ConfigError(
                f"edge {ename}: {up!r} produces {type_name(produced)} but {name!r} "
                f"expects {type_name(inp.type)} (parameter {inp.name!r})",
                path=path,
            )
        if streaming and not inp.streaming:
            raise ConfigError(
                f"edge {ename}: {up!r} streams but {name!r} takes exactly one chunk; "
                f"annotate parameter {inp.name!r} as Stream[{type_name(inp.type)}]",
                path=path,
            )
        is_struct = isinstance(inp.type, type) and issubclass(inp.type, msgspec.Struct)
        if not is_struct and inp.type is not Any:
            origin = typing.get_origin(inp.type)
            if isinstance(origin, type) and issubclass(origin, msgspec.Struct):
                raise ConfigError(
                    f"parameter {inp.name!r} of {name!r}: a generic Struct such as "
                    f"{type_name(inp.type)} cannot be a payload type; name it as a class "
                    f"(class My{origin.__name__}({type_name(inp.type)}): pass) and use that",
                    path=path,
                )
            raise ConfigError(
                f"parameter {inp.name!r} of {name!r} must be a msgspec.Struct payload, "
                f"not {type_name(inp.type)}",
                path=path,
            )
        # A producer of a subclass sends instances of it, which decode as it: as the
        # consumer's class they would not, should that be tagged or forbid unknown fields.
        wire = produced if _is_subclass(produced, inp.type) else inp.type
        stages[name].inputs[inp.name] = _edge_plan(spec, up, name, wire, streaming)
