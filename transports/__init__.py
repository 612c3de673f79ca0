"""Transports: how each edge's payloads travel: inline, shm, cuda_ipc, network, or auto,
which picks one per payload.

Each transport is one module of the same shape. Third-party transports implement the
:class:`Transport` protocol and are named by import path or entry point.
"""

# The pipeline package must finish importing first: its runtime imports this package's
# submodules, and this package's modules import pipeline's errors and keys.
import pipeline as _pipeline  # noqa: F401
from pipeline._encoded import Encoded as Encoded

from ._protocol import Descriptor as Descriptor
from ._protocol import EdgeContext as EdgeContext
from ._protocol import Transport as Transport
from ._protocol import TransportCapabilities as TransportCapabilities
from ._protocol import TransportReceiver as TransportReceiver
from ._protocol import TransportSender as TransportSender
from ._protocol import TransportStatistics as TransportStatistics
from ._registry import create_transport as create_transport
from ._registry import resolve_transport as resolve_transport

__all__ = (
    "Descriptor",
    "EdgeContext",
    "Encoded",
    "Transport",
    "TransportCapabilities",
    "TransportReceiver",
    "TransportSender",
    "TransportStatistics",
    "create_transport",
    "resolve_transport",
)
