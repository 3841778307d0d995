"""Helpers for unit tests that run the actors' I/O loops on the in-memory transport: a run
whose every ``Bus.connect`` (any URL) opens a connection to one in-memory server, and the
reads the integration tests make with the plain nats client (tests/integration/_util.py)."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from rftstream.bus.memory import MemoryTransport
from rftstream.bus.transport import Delivery, Transport
from rftstream.config import config_from_dict
from rftstream.config.schema import NatsConfig
from rftstream.runtime import PreparedRun, prepare_run
from rftstream.subjects import RunNames
from rftstream.wire import MetricsMsg
from tests.integration._util import small_config

MEMORY_URL = "memory://"


def serve_in_memory(monkeypatch: pytest.MonkeyPatch) -> MemoryTransport:
    """Make ``Bus.connect`` open a new connection (:meth:`MemoryTransport.connection`) to
    the returned in-memory server, whatever URL it is given: the actors under test
    (``run_spliced``, ``provision``) connect and close as they do against nats-server.
    Only the transport is replaced: ``Bus.connect`` itself runs as it is."""
    server = MemoryTransport()

    async def connect_transport(cfg: NatsConfig, url: str | None, **_: object) -> Transport:
        return server.connection()

    monkeypatch.setattr("rftstream.bus.client.connect_transport", connect_transport)
    return server


def memory_run(tmp_path: Path, **over: object) -> PreparedRun:
    """The integration tests' small run, with no model: ``tmp_path`` stands in for it (the
    tests here never load one)."""
    return prepare_run(config_from_dict(small_config(tmp_path, str(tmp_path), **over)))


async def read_subject(transport: Transport, stream: str, subject: str) -> list[Delivery]:
    """Every message of ``stream`` stored on ``subject`` (wildcards allowed), in stream order;
    an ordered read that waits for nothing (the in-memory transport stored them already)."""
    reader = await transport.read(stream, subject)
    out = []
    try:
        while (msg := await reader.next(0)) is not None:
            out.append(msg)
    finally:
        await reader.close()
    return out


async def read_metrics(transport: Transport, names: RunNames, role: str) -> list[MetricsMsg]:
    """Every metrics record ``role`` published (``rft.<run>.metrics.<role>``), decoded."""
    msgs = await read_subject(transport, names.metrics_stream, names.metrics_subject(role))
    return [msgspec.json.decode(m.data, type=MetricsMsg) for m in msgs]


async def wait_drained(
    transport: Transport, stream: str, durable: str, timeout: float = 10
) -> None:
    """Poll every 10 ms until ``durable`` on ``stream`` has nothing pending and nothing unacked
    (every message delivered and acked); ``TimeoutError`` after ``timeout`` s."""
    with anyio.fail_after(timeout):
        while True:
            info = await transport.consumer_state(stream, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
            await anyio.sleep(0.01)
