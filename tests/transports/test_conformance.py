"""The conformance suite over every transport, and the ways a plug-in transport is found.

The suite runs over the built-in inline transport and over :class:`EchoTransport`, a plug-in
defined in this test package and named by import path, exactly as a third party's would be.
The plug-in also carries a real pipeline edge between worker processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import pipeline
import transports._registry as registry
from pipeline import ChunkKey, ConfigError, TransportError
from pipeline.testing import TransportConformance, TransportRecipe
from stages.text import Text
from tests.transports.plugin_transport import EchoTransport
from transports import (
    EdgeContext,
    Encoded,
    Transport,
    create_transport,
    resolve_transport,
)

PLUGIN = "tests.transports.plugin_transport:EchoTransport"


def _files(root: Path) -> list[Path]:
    """Every path under ``root``."""
    return sorted(root.rglob("*"))


class TestInline(TransportConformance):
    """The inline transport passes the conformance suite."""

    @pytest.fixture
    def transport(self) -> Transport:
        """The built-in inline transport, by name."""
        return create_transport("inline")


class TestPlugin(TransportConformance):
    """A plug-in transport named by import path passes the same suite."""

    @pytest.fixture
    def transport_recipe(self, tmp_path: Path) -> TransportRecipe:
        """The echo transport by import path, with room for a round-trip payload and little
        more; named outright, since its ``directory`` option is kept as ``root``."""
        return TransportRecipe(PLUGIN, {"directory": str(tmp_path), "capacity": 2 * 2**20})

    @pytest.fixture
    def transport(self, transport_recipe: TransportRecipe) -> Transport:
        """The echo transport, made from its recipe as the runtime makes it."""
        return create_transport(transport_recipe.name, transport_recipe.options)

    async def test_nothing_is_left_behind(self, transport: Transport, tmp_path: Path) -> None:
        """Closing both ends deletes every file, released or not."""
        edge = EdgeContext("a->b", "here")
        sender, receiver = transport.open_sender(edge), transport.open_receiver(edge)
        descs = [
            await sender.put(ChunkKey("r", "a->b", i), Encoded(b"x" * 100), timeout=5)
            for i in range(3)
        ]
        await receiver.get(descs[0])
        assert len([p for p in _files(tmp_path) if p.is_file()]) == 3
        await receiver.aclose()
        await sender.aclose()
        assert _files(tmp_path) == []

    async def test_oversized_payload_fails_at_once(self, transport: Transport) -> None:
        """A payload larger than the whole capacity fails without waiting for its deadline."""
        sender = transport.open_sender(EdgeContext("a->b", "here"))
        try:
            with pytest.raises(TransportError, match="exceed the capacity"):
                await asyncio.wait_for(
                    sender.put(ChunkKey("r", "a->b", 0), Encoded(bytes(3 * 2**20)), timeout=60),
                    timeout=5,
                )
        finally:
            await sender.aclose()


async def test_plugin_carries_a_pipeline_edge(tmp_path: Path) -> None:
    """A real edge between worker processes runs over the plug-in and reports it as used."""
    # Room for about ten token chunks: producers wait on the consumer's releases, across
    # processes. Upper takes every request at once, so whatever is stored gets consumed.
    options = {"directory": str(tmp_path), "capacity": 64}
    spec = pipeline.PipelineSpec.from_dict(
        {
            "name": "plugin-edge",
            "stages": {
                "split": {"impl": "stages.text:Split"},
                "upper": {"impl": "stages.text:Upper", "max_concurrency": 64},
                "join": {"impl": "stages.text:Join"},
            },
            "edges": [
                {"from": "split", "to": "upper", "transport": {"kind": PLUGIN, "options": options}},
                {"from": "upper", "to": "join", "transport": "inline"},
            ],
        }
    )
    async with pipeline.Pipeline(spec) as pipe:
        inputs = [Text(f"a{i} b c") for i in range(20)]
        outputs = await asyncio.gather(*(pipe.submit(x) for x in inputs))
        assert outputs == [Text(f"A{i} B C") for i in range(20)]
        stats = await pipe.statistics()
        # Each consumed chunk was released before its request completed.
        assert [p for p in _files(tmp_path) if p.is_file()] == []
    used = [
        out["used"]
        for replica in stats["replicas"]
        for out in replica["outputs"]
        if out["edge"] == "split->upper"
    ]
    # Statistics name the transport by its own name, not the import path it was given by.
    assert used == [{"echo": 60}], f"split->upper used {used}"
    # Closing the pipeline closed the sender, which removed its folder.
    assert _files(tmp_path) == []


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """An empty resolve_transport cache, emptied again afterwards."""
    resolve_transport.cache_clear()
    yield
    resolve_transport.cache_clear()


@pytest.mark.usefixtures("fresh_registry")
def test_entry_point_name_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transport registered under the stagewire.transports entry-point group is found by
    its name."""
    echo = EntryPoint(name="echo", value=PLUGIN, group=registry.ENTRY_POINT_GROUP)

    def entry_points(*, group: str) -> list[EntryPoint]:
        return [echo] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry, "entry_points", entry_points)
    assert resolve_transport("echo") is EchoTransport
    made = create_transport("echo", {"capacity": 1024})
    assert isinstance(made, EchoTransport)
    assert made.capacity == 1024


@pytest.mark.usefixtures("fresh_registry")
def test_unknown_name_lists_known_transports() -> None:
    """An unknown transport name is a ConfigError that lists the names that exist."""
    with pytest.raises(ConfigError, match="unknown transport 'no-such-transport'") as info:
        create_transport("no-such-transport")
    assert "inline" in str(info.value)


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("tests.transports.plugin_transport:EchoDescriptor", "not a Transport"),
        ("tests.transports.plugin_transport:_decoder", "not a Transport"),
        ("tests.transports.plugin_transport:NoSuchClass", "has no 'NoSuchClass'"),
        ("tests.transports.no_such_module:EchoTransport", "cannot import"),
    ],
)
def test_bad_import_path_is_config_error(path: str, reason: str) -> None:
    """An import path to something that is not a transport is a ConfigError saying why."""
    with pytest.raises(ConfigError, match=reason):
        create_transport(path)


@pytest.mark.usefixtures("fresh_registry")
def test_rejected_options_are_config_error() -> None:
    """Options a plug-in does not take are a ConfigError naming the transport."""
    with pytest.raises(ConfigError, match="rejected its options"):
        create_transport(PLUGIN, {"colour": "blue"})
