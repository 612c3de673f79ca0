"""Build-time checks: stage classes and edge types are verified before any process starts."""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

import msgspec
import pytest

from pipeline import ConfigError, Context, Outputs, Pipeline, Stage, Stream
from pipeline._signature import build_plan
from stages.text import Text, Token
from tests.pipeline.conftest import spec


class Number(msgspec.Struct):
    """A payload unrelated to Text."""

    n: int


class NoProcess(Stage):
    """Forgets to define process."""


class SyncProcess(Stage):
    """Defines process without async."""

    def process(self, text: Text, ctx: Context) -> Text:
        return text


class SyncSetup(Stage):
    """Defines setup without async (the worker awaited its None, and failed to start)."""

    def setup(self) -> None:  # type: ignore[override]
        pass

    async def process(self, text: Text, ctx: Context) -> Text:
        return text


class SyncTeardown(SyncSetup):
    """Defines teardown without async (its worker logged a TypeError at shutdown)."""

    async def setup(self) -> None:
        pass

    def teardown(self) -> None:  # type: ignore[override]
        pass


class NoCtx(Stage):
    """Leaves out ctx."""

    async def process(self, text: Text) -> Text:
        return text


class Unannotated(Stage):
    """Leaves the input unannotated."""

    async def process(self, text, ctx: Context) -> Text:  # type: ignore[no-untyped-def]
        return Text("")


class NoReturn(Stage):
    """Leaves the return unannotated."""

    async def process(self, text: Text, ctx: Context):  # type: ignore[no-untyped-def]
        return text


class BareIterator(Stage):
    """Streams without saying what (a bare typing.AsyncIterator)."""

    async def process(self, text: Text, ctx: Context) -> typing.AsyncIterator:  # type: ignore[type-arg]
        yield text


T = TypeVar("T")


class Box(msgspec.Struct, Generic[T]):
    """A generic payload."""

    item: T


class MakesBox(Stage):
    """Produces Box[int]."""

    async def process(self, text: Text, ctx: Context) -> Box[int]:
        return Box(len(text.value))


class TakesBox(Stage):
    """Takes Box[int]."""

    async def process(self, a: Box[int], ctx: Context) -> Text:
        return Text(str(a.item))


class MakesNumber(Stage):
    """Produces Number."""

    async def process(self, text: Text, ctx: Context) -> Number:
        return Number(len(text.value))


class StreamsTokens(Stage):
    """Streams tokens."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        yield Token(0, text.value)


class TakesOneToken(Stage):
    """Takes exactly one token."""

    async def process(self, token: Token, ctx: Context) -> Text:
        return Text(token.value)


class TakesTokenStream(Stage):
    """Takes a stream of tokens."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        return Text(" ".join([t.value async for t in tokens]))


class Misnamed(Stage):
    """Has two inputs, not named after its upstream stages."""

    async def process(self, x: Text, y: Text, ctx: Context) -> Text:
        return x


class VarInputs(Stage):
    """Takes its inputs as ``*args``, which cannot be passed by name."""

    async def process(self, *args: Text, ctx: Context) -> Text:
        return args[0]


class PositionalOnly(Stage):
    """Takes its input positional-only, which cannot be passed by name."""

    async def process(self, text: Text, /, ctx: Context) -> Text:
        return text


class StarCtx(Stage):
    """Takes its context as ``**ctx``, which gets no Context."""

    async def process(self, text: Text, **ctx: Context) -> Text:
        return text


class UnresolvedOutputs(Outputs):
    """Names a type that does not exist."""

    to: NoSuchType  # type: ignore[name-defined]  # noqa: F821


class SendsUnresolved(Stage):
    """Returns outputs whose annotations cannot be resolved."""

    async def process(self, text: Text, ctx: Context) -> UnresolvedOutputs:
        return UnresolvedOutputs()


def _build(stages: dict[str, str], edges: list[tuple[str, str]], **kw: object) -> Pipeline:
    full = {name: {"impl": impl, **kw} for name, impl in stages.items()}  # type: ignore[dict-item]
    return Pipeline(spec(full, edges))


@pytest.mark.parametrize(
    ("impl", "match"),
    [
        ("tests.pipeline.test_plan:NoProcess", "has no process"),
        ("tests.pipeline.test_plan:SyncProcess", "must be 'async def'"),
        ("tests.pipeline.test_plan:SyncSetup", "SyncSetup.setup must be 'async def setup"),
        ("tests.pipeline.test_plan:SyncTeardown", "teardown must be 'async def teardown"),
        ("tests.pipeline.test_plan:NoCtx", "ctx: Context"),
        ("tests.pipeline.test_plan:Unannotated", "'text' has no type annotation"),
        ("tests.pipeline.test_plan:NoReturn", "no return annotation"),
        ("tests.pipeline.test_plan:BareIterator", r"annotate what the stream yields"),
        ("tests.pipeline.test_plan:VarInputs", r"parameter '\*args' cannot take an input"),
        ("tests.pipeline.test_plan:PositionalOnly", r"'text' \(positional-only\) cannot take"),
        ("tests.pipeline.test_plan:SendsUnresolved", "annotations of UnresolvedOutputs"),
        ("tests.pipeline.test_plan:StarCtx", "then 'ctx: Context'"),
        ("no_such_module_xyz:Stage", "cannot import 'no_such_module_xyz'"),
        ("stages.text:Nope", "has no attribute 'Nope'"),
        ("tests.pipeline.test_plan:Holder.Nope", "has no attribute 'Holder.Nope'"),
        ("stages.text:Text", "not a subclass of pipeline.Stage"),
    ],
)
def test_bad_stage_classes_are_config_errors(impl: str, match: str) -> None:
    """Each malformed stage class is a one-line ConfigError naming the stage."""
    with pytest.raises(ConfigError, match=match) as info:
        _build({"only": impl}, [])
    assert "stages.only" in str(info.value)
    assert "\n" not in str(info.value)


class Holder:
    """Stage classes nested in another class."""

    class Echo(Stage):
        async def process(self, text: Text, ctx: Context) -> Text:
            return text


async def test_a_stage_class_nested_in_another_loads() -> None:
    """``module:Outer.Inner``, which the schema accepts, loads (it was looked up as one
    attribute named "Outer.Inner", and refused) and runs in a worker."""
    async with _build({"only": "tests.pipeline.test_plan:Holder.Echo"}, []) as pipe:
        assert await pipe.submit(Text("nested")) == Text("nested")


def test_a_generic_struct_payload_is_refused_saying_how_to_name_it() -> None:
    """A generic Struct (Box[int]) cannot be a payload type; the error says to name it as a
    class of its own, where it used to claim it was no Struct at all."""
    with pytest.raises(ConfigError, match=r"a generic Struct such as Box\[int\] cannot be"):
        _build(
            {"a": "tests.pipeline.test_plan:MakesBox", "b": "tests.pipeline.test_plan:TakesBox"},
            [("a", "b")],
        )


def test_edge_type_mismatch_names_the_edge() -> None:
    """A producer type that does not match its consumer is a ConfigError naming the edge."""
    with pytest.raises(ConfigError, match=r"edge a->b: 'a' produces Number but 'b' expects Text"):
        _build(
            {"a": "tests.pipeline.test_plan:MakesNumber", "b": "stages.text:Split"}, [("a", "b")]
        )


def test_streaming_producer_into_single_chunk_consumer_is_refused() -> None:
    """A stream feeding a parameter that takes one chunk must be declared Stream[T]."""
    with pytest.raises(ConfigError, match=r"a->b: 'a' streams .* Stream\[Token\]"):
        _build(
            {
                "a": "tests.pipeline.test_plan:StreamsTokens",
                "b": "tests.pipeline.test_plan:TakesOneToken",
            },
            [("a", "b")],
        )
    _build(
        {
            "a": "tests.pipeline.test_plan:StreamsTokens",
            "b": "tests.pipeline.test_plan:TakesTokenStream",
        },
        [("a", "b")],
    )


def test_multi_input_parameters_must_name_upstream_stages() -> None:
    """With two upstream stages, process() names a parameter after each of them."""
    with pytest.raises(ConfigError, match=r"name one parameter after each"):
        _build(
            {
                "a": "stages.text:Join",
                "b": "stages.text:Join",
                "c": "tests.pipeline.test_plan:Misnamed",
            },
            [("a", "c"), ("b", "c")],
        )


def test_params_are_validated_with_the_field_path() -> None:
    """Params failing the stage's Params model name stages.<stage>.params.<field>."""
    with pytest.raises(ConfigError, match=r"stages\.u\.params\.repeat"):
        Pipeline(spec({"u": {"impl": "stages.text:Upper", "params": {"repeat": 99}}}, []))
    with pytest.raises(ConfigError, match=r"declares no Params model"):
        Pipeline(spec({"j": {"impl": "stages.text:Join", "params": {"x": 1}}}, []))


def test_outputs_fields_must_match_downstream_stages() -> None:
    """An Outputs return type whose fields do not name the downstream stages is refused."""
    with pytest.raises(ConfigError, match=r"name one field per downstream stage"):
        Pipeline(
            spec(
                {"pre": ":Pre", "encode": ":Encode", "other": ":Encode"},
                [("pre", "encode"), ("pre", "other")],
            )
        )


def test_yaml_errors_carry_file_and_line(tmp_path: object) -> None:
    """A type error in a YAML pipeline names the file."""
    from pathlib import Path

    path = Path(str(tmp_path)) / "bad.yaml"
    path.write_text(
        "stages:\n"
        "  a: {impl: 'tests.pipeline.test_plan:MakesNumber'}\n"
        "  b: {impl: 'stages.text:Split'}\n"
        "edges:\n  - {from: a, to: b}\n"
    )
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(path)
    assert str(info.value).startswith(str(path))
    assert "edge a->b" in str(info.value)


def test_a_params_validator_that_raises_anything_is_a_config_error() -> None:
    s = spec({"x": {"impl": ":ExplodingParams", "params": {"size": 2}}}, [])
    with pytest.raises(ConfigError, match=r"ExplodingParams\.Params raised RuntimeError") as info:
        build_plan(s)
    assert info.value.path == "stages.x.params"


class Left(msgspec.Struct):
    """One of two untagged Structs, which no union can tell apart on the wire."""

    n: int


class Right(msgspec.Struct):
    """The other."""

    s: str


class MakesEither(Stage):
    """Returns a union msgspec cannot decode."""

    async def process(self, text: Text, ctx: Context) -> Left | Right:
        return Left(1)


class Dangling(msgspec.Struct):
    """A field whose annotation names nothing that exists."""

    child: Missing | None = None  # type: ignore[name-defined]  # noqa: F821  # on purpose


class MakesDangling(Stage):
    """Returns a Struct whose annotations do not resolve."""

    async def process(self, text: Text, ctx: Context) -> Dangling:
        return Dangling()


class Tagged(msgspec.Struct, tag=True):
    """A tagged base: its decoder takes its own tag only."""

    n: int


class TaggedChild(Tagged, tag=True):
    """A tagged subclass."""

    extra: int = 0


class MakesTaggedChild(Stage):
    """Produces the subclass."""

    async def process(self, text: Text, ctx: Context) -> TaggedChild:
        return TaggedChild(len(text.value), 7)


class TakesTagged(Stage):
    """Consumes the base class."""

    async def process(self, x: Tagged, ctx: Context) -> Text:
        return Text(f"{type(x).__name__} {x.n}")


@pytest.mark.parametrize(
    ("impl", "match"),
    [
        ("MakesEither", r"edge only->@client: its payload type Left \| Right cannot travel"),
        ("MakesDangling", r"payload type Dangling cannot travel .* 'Missing' is not defined"),
    ],
)
def test_a_payload_type_the_codec_cannot_carry_is_a_config_error(impl: str, match: str) -> None:
    """A type msgspec cannot decode passed the build and `validate`, then failed the start
    with a worker's traceback, or every request (a NameError escaped the start itself)."""
    with pytest.raises(ConfigError, match=match) as info:
        _build({"only": f"tests.pipeline.test_plan:{impl}"}, [])
    assert "stages.only" in str(info.value) and "\n" not in str(info.value)


def test_a_consumer_of_a_base_class_decodes_its_producers_subclass() -> None:
    """A subclass of the consumer's class passes the check; it must also decode. As the
    consumer's (tagged) class, a subclass's tag did not, and every request failed."""
    plan = build_plan(
        spec(
            {
                "a": "tests.pipeline.test_plan:MakesTaggedChild",
                "b": "tests.pipeline.test_plan:TakesTagged",
            },
            [("a", "b")],
        )
    )
    assert plan.stages["b"].inputs["x"].payload_type is TaggedChild


async def test_a_subclass_travels_to_a_consumer_of_its_base_class() -> None:
    """End to end, in real processes: the consumer gets the producer's subclass."""
    here = "tests.pipeline.test_plan"
    s = spec({"a": f"{here}:MakesTaggedChild", "b": f"{here}:TakesTagged"}, [("a", "b")])
    async with Pipeline(s) as pipe:
        assert await pipe.submit(Text("four")) == Text("TaggedChild 4")
