"""The bus: run-level API (:class:`Bus`, :class:`RunState`) over a transport (NATS or in memory)."""

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import Delivery, PullSubscription, Transport
from rftstream.nats_server.embedded import EmbeddedNatsServer, find_nats_server

__all__ = [
    "Bus",
    "Delivery",
    "EmbeddedNatsServer",
    "PullSubscription",
    "RunState",
    "Transport",
    "find_nats_server",
]
