"""The NATS JetStream transport: the only code of rftstream that imports ``nats``.

:func:`connect_transport` opens a connection (credentials, TLS, reconnect
window of ``nats.*``) and returns a :class:`JetStreamTransport` on it.
"""

from __future__ import annotations

from rftstream.bus.jetstream.connect import open_connection
from rftstream.bus.jetstream.transport import JetStreamTransport
from rftstream.config.schema import NatsConfig

__all__ = ["JetStreamTransport", "connect_transport"]


async def connect_transport(
    cfg: NatsConfig, url: str | None, *, name: str, actor: str
) -> JetStreamTransport:
    """Connect to ``url`` (``None``/empty: the servers of ``cfg``); see
    :func:`~rftstream.bus.jetstream.connect.open_connection` for what blocks and what
    a failed connect raises."""
    nc, watch = await open_connection(cfg, url, name=name, actor=actor)
    return JetStreamTransport(
        nc,
        retry_window=cfg.retry_window,
        max_inflight_bytes=cfg.max_inflight_bytes,
        watch=watch,
        actor=actor,
    )
