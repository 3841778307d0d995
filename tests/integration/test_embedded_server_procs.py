"""The embedded nats-server runs with GOMAXPROCS a quarter of the cores (at least one)
unless the environment sets it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer, _go_procs


def _server_env(server: EmbeddedNatsServer) -> dict[str, str]:
    assert server.pid is not None
    raw = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
def test_gomaxprocs_is_a_quarter_of_the_cores_unless_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert _go_procs() == str(max(1, cpus // 4))
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    server = EmbeddedNatsServer(tmp_path / "a", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    try:
        assert _server_env(server)["GOMAXPROCS"] == _go_procs()
    finally:
        server.stop()
    monkeypatch.setenv("GOMAXPROCS", "3")
    server = EmbeddedNatsServer(tmp_path / "b", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    try:
        assert _server_env(server)["GOMAXPROCS"] == "3"
    finally:
        server.stop()
