"""The bus: run-level API (:class:`Bus`, :class:`RunState`) over a transport (NATS or in memory)."""

from rftstream.bus.client import Bus
from rftstream.bus.server import EmbeddedNatsServer, find_nats_server
from rftstream.bus.state import RunState
from rftstream.bus.transport import Delivery, PullSubscription, Transport

__all__ = [
    "Bus",
    "Delivery",
    "EmbeddedNatsServer",
    "PullSubscription",
    "RunState",
    "Transport",
    "find_nats_server",
]
