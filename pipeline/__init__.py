"""stagewire: an asyncio actor framework for staged multimodal inference pipelines.

The public names are imported on first use (PEP 562): ``import pipeline`` alone costs
next to nothing, so that the ``stagewire`` command can catch a Ctrl-C that comes while its
modules (pydantic, ZMQ, torch's codec) still load, and say one line instead of a
traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._api import Pipeline as Pipeline
    from ._api import ResponseStream as ResponseStream
    from ._api import SinkOutput as SinkOutput
    from ._config import EdgeSpec as EdgeSpec
    from ._config import PipelineSpec as PipelineSpec
    from ._config import StageSpec as StageSpec
    from ._errors import ChunkGap as ChunkGap
    from ._errors import ConfigError as ConfigError
    from ._errors import EndOfChannel as EndOfChannel
    from ._errors import MasterUnavailable as MasterUnavailable
    from ._errors import PayloadError as PayloadError
    from ._errors import PipelineError as PipelineError
    from ._errors import ProducerLost as ProducerLost
    from ._errors import RequestAborted as RequestAborted
    from ._errors import RequestTimeout as RequestTimeout
    from ._errors import StageError as StageError
    from ._errors import StageUnavailable as StageUnavailable
    from ._errors import TransportError as TransportError
    from ._errors import TransportFull as TransportFull
    from ._keys import ChunkKey as ChunkKey
    from ._remote import RemotePipeline as RemotePipeline
    from ._stage import Context as Context
    from ._stage import Outputs as Outputs
    from ._stage import Stage as Stage
    from ._stage import Stream as Stream

#: The module each public name lives in.
_HOMES = {
    "Pipeline": "_api",
    "ResponseStream": "_api",
    "SinkOutput": "_api",
    "EdgeSpec": "_config",
    "PipelineSpec": "_config",
    "StageSpec": "_config",
    "ChunkGap": "_errors",
    "ConfigError": "_errors",
    "EndOfChannel": "_errors",
    "MasterUnavailable": "_errors",
    "PayloadError": "_errors",
    "PipelineError": "_errors",
    "ProducerLost": "_errors",
    "RequestAborted": "_errors",
    "RequestTimeout": "_errors",
    "StageError": "_errors",
    "StageUnavailable": "_errors",
    "TransportError": "_errors",
    "TransportFull": "_errors",
    "ChunkKey": "_keys",
    "RemotePipeline": "_remote",
    "Context": "_stage",
    "Outputs": "_stage",
    "Stage": "_stage",
    "Stream": "_stage",
}

__all__ = (
    "ChunkGap",
    "ChunkKey",
    "ConfigError",
    "Context",
    "EdgeSpec",
    "EndOfChannel",
    "MasterUnavailable",
    "Outputs",
    "PayloadError",
    "Pipeline",
    "PipelineError",
    "PipelineSpec",
    "ProducerLost",
    "RemotePipeline",
    "RequestAborted",
    "RequestTimeout",
    "ResponseStream",
    "SinkOutput",
    "Stage",
    "StageError",
    "StageSpec",
    "StageUnavailable",
    "Stream",
    "TransportError",
    "TransportFull",
)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pipeline.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
