"""Smoke: ``rftstream up`` with 2 trainer ranks (``trainer.n_gpus_per_node``) on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration._util import run_up

pytestmark = pytest.mark.smoke


def test_up_with_two_trainer_ranks(tmp_path: Path, tiny_model_path: str) -> None:
    run_dir = tmp_path / "run"
    _, records = run_up(
        run_dir,
        tiny_model_path,
        *("--steps", "3", "--set", "trainer.n_gpus_per_node=2"),
        timeout=480,
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    total = 0
    for r in records:
        # rank 0 read the batch once; the ranks' shards partition it
        rows = [r["trainer/rank_rows/0"], r["trainer/rank_rows/1"]]
        assert sum(rows) == r["experience/trained"] > 0
        assert rows[1] > 0  # rank 1 really trained
        total += r["experience/trained"]
        assert r["experience/trained_total"] == total
        assert r["experience/duplicates_dropped"] == 0
    rank_log = (run_dir / "logs" / "trainer-rank-1.log").read_text()
    assert "trainer rank 1: 3 steps" in rank_log and "(exit 0)" in rank_log
    assert (run_dir / "checkpoints" / "global_step_3" / "model.safetensors").is_file()
