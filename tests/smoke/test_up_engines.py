"""Smoke: ``explorer.rollout_model.engine_num: 2`` makes ``rftstream up`` run two rollout
engines, as two explorer processes (``explorer``, ``explorer-2``) sharing the task queue.

The run is short, so an explorer that starts a few seconds after the other (a loaded CI
machine) could find every task taken. The workflow, loaded with ``--plugin-dir``, therefore
holds its first task until both explorer processes have run one: the one that started first
keeps at most ``explorer.runner_num`` tasks while it waits, so the other gets the rest. Each
explorer's staleness gate counts the other's tasks in flight against the window of
``max_staleness: 3`` (four batches of 8 tasks), so ``runner_num`` is 8 here: with the
embedded default's 32, the first explorer's tasks held at the barrier would fill the window,
and the second would rightly wait for them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import pytest

from rftstream.experience import H_ACTOR
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer
from tests.integration._util import read_stream, run_up

pytestmark = pytest.mark.smoke


BOTH_EXPLORERS_WORKFLOW = """
import os, time
from pathlib import Path

import anyio
from workflows import WORKFLOWS, MathWorkflow

BARRIER = Path({barrier!r})


@WORKFLOWS.register_module("math_after_both_explorers")
class MathAfterBothExplorers(MathWorkflow):
    \"\"\"The math workflow; each process's first task waits (at most 120 s) until a task
    has run in two explorer processes.\"\"\"

    async def run_async(self):
        (BARRIER / str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while len(list(BARRIER.iterdir())) < 2 and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        return await super().run_async()
"""


def test_up_runs_engine_num_explorers(tmp_path: Path, tiny_model_path: str) -> None:
    run_dir = tmp_path / "run"
    plugins, barrier = tmp_path / "plugins", tmp_path / "barrier"
    plugins.mkdir()
    barrier.mkdir()
    (plugins / "both_explorers.py").write_text(BOTH_EXPLORERS_WORKFLOW.format(barrier=str(barrier)))
    stdout, records = run_up(
        run_dir,
        tiny_model_path,
        *("--steps", "10", "--set", "explorer.rollout_model.engine_num=2"),
        *("--set", "explorer.runner_num=8"),
        *("--plugin-dir", str(plugins)),
        *("--set", "buffer.explorer_input.taskset.default_workflow_type=math_after_both_explorers"),
        timeout=420,
    )
    assert len(list(barrier.iterdir())) == 2  # the workflow ran in both explorer processes
    assert "2 explorers and operator host run in processes" in " ".join(stdout.split())
    assert [r["step"] for r in records] == list(range(1, 11))  # the run finished
    worst = [(r["step"], r["staleness/max"]) for r in records]
    assert all(s <= 3 for _, s in worst), worst  # max_staleness over both explorers
    for name in ("explorer", "explorer-2"):  # two processes, each ran its own explorer
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert f"running explorer of run default (explorers {name})" in log, log[-2000:]
        assert "(exit 0)" in log, log[-2000:]

    # both published experience: the raw stage's messages name their explorer
    server = EmbeddedNatsServer(run_dir / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    url = server.start()
    try:
        msgs = anyio.run(read_stream, url, "rft.default.exp.raw")
    finally:
        server.stop()
    publishers = Counter((m.headers or {}).get(H_ACTOR) for m in msgs)
    assert publishers["explorer"] > 0 and publishers["explorer-2"] > 0, publishers
    assert set(publishers) == {"explorer", "explorer-2"}, publishers
