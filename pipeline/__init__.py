"""stagewire: an asyncio actor framework for staged multimodal inference pipelines."""

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
