"""The NATS adapter: embedded server, connection, provisioning, KV state."""

from rftstream.bus.client import Bus, PullConsumer
from rftstream.bus.server import EmbeddedNatsServer, find_nats_server
from rftstream.bus.state import RunState

__all__ = ["Bus", "EmbeddedNatsServer", "PullConsumer", "RunState", "find_nats_server"]
