"""Helpers for unit tests that run the actors' I/O loops on the in-memory transport: a run
whose every ``Bus.connect`` (any URL) opens a connection to one in-memory server."""

from __future__ import annotations

from pathlib import Path

import pytest

from rftstream.bus.client import Bus
from rftstream.bus.memory import MemoryTransport
from rftstream.config import config_from_dict
from rftstream.config.schema import NatsConfig
from rftstream.runtime import PreparedRun, prepare_run
from rftstream.subjects import RunNames
from tests.integration._util import small_config

MEMORY_URL = "memory://"


def serve_in_memory(monkeypatch: pytest.MonkeyPatch) -> MemoryTransport:
    """Make ``Bus.connect`` open a new connection (:meth:`MemoryTransport.connection`) to
    the returned in-memory server, whatever URL it is given: the actors under test
    (``run_spliced``, ``provision``) connect and close as they do against nats-server."""
    server = MemoryTransport()

    async def connect(
        cls: type[Bus], url: str | None, names: RunNames, cfg: NatsConfig, actor: str
    ) -> Bus:
        return cls(server.connection(), names, cfg, actor)

    monkeypatch.setattr(Bus, "connect", classmethod(connect))
    return server


def memory_run(tmp_path: Path, **over: object) -> PreparedRun:
    """The integration tests' small run, with no model: ``tmp_path`` stands in for it (the
    tests here never load one)."""
    return prepare_run(config_from_dict(small_config(tmp_path, str(tmp_path), **over)))
