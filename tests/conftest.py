"""Shared fixtures: a real nats-server per test, the tiny model once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer
from rftstream.plugins.registry import Registry


@pytest.fixture(autouse=True)
def _isolated_registries() -> Iterator[None]:
    """Whatever a test (or a plugin it loads) registers is gone after it, and so are the
    plugin modules it loaded (``rftstream_plugins.*``): a later test that loads the same
    plugin directory imports them again, so they register again."""
    import sys

    import algorithms  # noqa: F401 - built-ins registered before the snapshot
    import operators  # noqa: F401
    import workflows  # noqa: F401
    from rftstream.plugins.loader import PLUGIN_PACKAGE

    snapshot = Registry.snapshot_all()
    modules = {name for name in sys.modules if name.startswith(PLUGIN_PACKAGE)}
    try:
        yield
    finally:
        Registry.restore_all(snapshot)
        for name in [n for n in sys.modules if n.startswith(PLUGIN_PACKAGE)]:
            if name not in modules:
                del sys.modules[name]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNatsServer]:
    """A private JetStream nats-server on a free loopback port, stopped after the test.

    Its store is set to 1 TiB: each stream reserves its ``max_bytes`` (3.5 GiB a run by
    default) and the server's own default, 75% of the free disk, would make a test with
    several runs pass or fail with the disk's fill. What is written is small.
    test_bounded_streams checks the refusal on a store that is really too small."""
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: EmbeddedNatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded tiny model, built once per test session (shared cache if RFTSTREAM_CACHE is set)."""
    from rftstream.tiny_model import ensure_tiny_model

    cache = os.environ.get("RFTSTREAM_CACHE")
    return str(ensure_tiny_model(cache or tmp_path_factory.mktemp("tiny-model")))
