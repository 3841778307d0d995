"""Smoke: a run that dead-letters (nearly) everything fails loudly; a few dead letters do not
stop it (``monitor.dead_letter_window``, ``monitor.max_dead_letter_share``).

Each test runs ``rftstream up`` (embedded nats-server, explorer and operator
host in their own processes) as a user would and reads its exit code and output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._util import user_env

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]

# An operator that shifts the token ids of every `every`-th group it sees (the first one
# included) past any vocabulary: the trainer dead-letters those groups (dlq.train).
POISON = """
from operators import EXPERIENCE_OPERATORS, ExperienceOperator


@EXPERIENCE_OPERATORS.register_module("poison_tokens")
class PoisonTokens(ExperienceOperator):
    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.groups = {}  # task id -> its index in the order seen

    def process(self, exps):
        for e in exps:
            index = self.groups.setdefault(e.eid.tid, len(self.groups))
            if index % self.every == 0:
                e.tokens = e.tokens + 100000
        return exps, {}
"""


def _up(
    tmp_path: Path, tiny_model_path: str, steps: int, *sets: str
) -> subprocess.CompletedProcess:
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "poison.py").write_text(POISON)
    return subprocess.run(
        [
            *RFTSTREAM,
            "up",
            "--steps",
            str(steps),
            "--run-dir",
            str(tmp_path / "run"),
            "--plugin-dir",
            str(plugins),
            *(a for s in sets for a in ("--set", s)),
        ],
        capture_output=True,
        text=True,
        timeout=420,
        env=user_env(tiny_model_path),
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.startswith("error: run failed")]
    assert lines, out[-3000:]
    return lines[-1]


def _status(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_every_task_failing_fails_the_run_at_stage_tasks(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """Every prompt is longer than model.max_prompt_tokens: every task is dead-lettered."""
    proc = _up(tmp_path, tiny_model_path, 3, "model.max_prompt_tokens=2")
    assert proc.returncode != 0 and proc.returncode != 130
    line = _error_line(proc)
    assert re.search(r"the last 64 groups were all dead-lettered at stage tasks;", line), line
    assert re.search(r"most common reason \(\d+x\): .*more than model\.max_prompt_tokens=2", line)
    assert _status(tmp_path) == []  # no trainer step


def test_trainer_side_poison_fails_the_run_at_stage_train(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """Every group reaches the trainer with token ids outside the vocabulary. A window of 16
    keeps the test short (the share stays the default 1.0)."""
    proc = _up(
        tmp_path,
        tiny_model_path,
        3,
        "data_processor.experience_pipeline.operators=[{name: poison_tokens}]",
        "monitor.dead_letter_window=16",
    )
    assert proc.returncode != 0 and proc.returncode != 130
    line = _error_line(proc)
    assert "the last 16 groups were all dead-lettered at stage train;" in line, line
    assert re.search(
        r"most common reason \(16x\): trainer: .*token ids outside the model's vocabulary "
        r"\(0\.\.259\)",
        line,
    ), line
    assert _status(tmp_path) == []


def test_a_few_dead_letters_do_not_stop_the_run(tmp_path: Path, tiny_model_path: str) -> None:
    """About one group in 4 is dead-lettered by the trainer: under the threshold (the same
    window of 16, share 0.9), the run trains its steps and exits 0."""
    proc = _up(
        tmp_path,
        tiny_model_path,
        4,
        "data_processor.experience_pipeline.operators=[{name: poison_tokens, args: {every: 4}}]",
        "monitor.dead_letter_window=16",
        "monitor.max_dead_letter_share=0.9",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _status(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["experience/dead_lettered"] >= 1  # some were dead-lettered
