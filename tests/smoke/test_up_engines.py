"""Smoke: ``explorer.rollout_model.engine_num: 2`` makes ``rftstream up`` run two rollout
engines, as two explorer processes (``explorer``, ``explorer-2``) sharing the task queue."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import pytest

from rftstream.bus.server import EmbeddedNatsServer
from rftstream.experience import H_ACTOR
from tests.integration._util import read_stream, run_up

pytestmark = pytest.mark.smoke


def test_up_runs_engine_num_explorers(tmp_path: Path, tiny_model_path: str) -> None:
    run_dir = tmp_path / "run"
    stdout, records = run_up(
        run_dir,
        tiny_model_path,
        *("--steps", "10", "--set", "explorer.rollout_model.engine_num=2"),
        timeout=420,
    )
    assert "2 explorers and operator host run in processes" in " ".join(stdout.split())
    assert [r["step"] for r in records] == list(range(1, 11))  # the run finished
    for name in ("explorer", "explorer-2"):  # two processes, each ran its own explorer
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert f"running explorer of run default (explorers {name})" in log, log[-2000:]
        assert "(exit 0)" in log, log[-2000:]

    # both published experience: the raw stage's messages name their explorer
    server = EmbeddedNatsServer(run_dir / "nats")
    url = server.start()
    try:
        msgs = anyio.run(read_stream, url, "rft.default.exp.raw")
    finally:
        server.stop()
    publishers = Counter((m.headers or {}).get(H_ACTOR) for m in msgs)
    assert publishers["explorer"] > 0 and publishers["explorer-2"] > 0, publishers
    assert set(publishers) == {"explorer", "explorer-2"}, publishers
