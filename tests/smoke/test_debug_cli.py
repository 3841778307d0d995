"""Smoke: ``rftstream debug workflow`` as a user runs it: one task, locally, no NATS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._util import user_env

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]

CONFIG = """\
model:
  model_path: builtin:tiny
  max_response_tokens: 8
algorithm:
  algorithm_type: grpo
  repeat_times: 2
buffer:
  batch_size: 2
  explorer_input:
    taskset:
      path: {path}
      format:
        workflow_key: workflow
"""

# Seed 004's workflow style (older positional constructor, resettable()), plus two that fail.
PLUGIN = """
from typing import List

import anyio

from workflows import WORKFLOWS, Experience, ModelWrapper, Task, Workflow


@WORKFLOWS.register_module("debug_seed_workflow")
class SeedWorkflow(Workflow):
    def __init__(self, model: ModelWrapper, task: Task, auxiliary_models: List):
        super().__init__(model, task, auxiliary_models)
        self.question = task.raw_task.get("question")
        self.answer = task.raw_task.get("answer")
        self.rollout_args = task.rollout_args

    def run(self) -> List[Experience]:
        responses = self.model.chat(
            [{"role": "user", "content": f"Question:\\n{self.question}"}],
            n=self.rollout_args.n,
            temperature=self.rollout_args.temperature,
        )
        return [
            Experience(
                tokens=r.tokens,
                prompt_length=r.prompt_length,
                reward=float(r.response_text == self.answer),
                logprobs=r.logprobs,
            )
            for r in responses
        ]

    def resettable(self):
        return True

    def reset(self, task: Task):
        self.question = task.raw_task.get("question")


@WORKFLOWS.register_module("debug_raises")
class Raises(Workflow):
    def run(self):
        raise ValueError(f"no tool for {self.task.raw_task['question']!r}")


@WORKFLOWS.register_module("debug_hangs")
class Hangs(Workflow):
    async def run_async(self):
        await anyio.sleep_forever()
"""

ROWS = [
    {"question": "3+4=", "answer": "7"},
    {"question": "1+1=", "answer": "2", "workflow": "debug_seed_workflow"},
    {"question": "2+5=", "answer": "7", "workflow": "debug_raises"},
    {"question": "2+2=", "answer": "4", "workflow": "debug_hangs"},
]


@pytest.fixture
def setup(tmp_path: Path, tiny_model_path: str) -> tuple[Path, Path, dict[str, str]]:
    taskset = tmp_path / "tasks.jsonl"
    taskset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tmp_path / "debug.yaml"
    cfg.write_text(CONFIG.format(path=taskset))
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "debug_workflows.py").write_text(PLUGIN)
    env = user_env(tiny_model_path)
    env["COLUMNS"] = "200"
    return cfg, plugins, env


def _debug(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RFTSTREAM, "debug", "workflow", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_debug_workflow_prints_the_experiences(setup: tuple[Path, Path, dict[str, str]]) -> None:
    cfg, plugins, env = setup
    proc = _debug(env, "--config", str(cfg))  # task 0: the default math_workflow
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for text in (
        "rftstream debug workflow",
        "buffer.explorer_input.taskset (row 0 of 4, task id 0)",
        "math_workflow",
        "'question': '3+4='",
        "experience 0",
        "experience 1",
        "reward",
        "= prompt",
        "response tokens trained",
        "logprobs",
        "finish_reason",
        "3+4=",  # the prompt text
        "2 experiences",
    ):
        assert text in out, (text, out[-3000:])
    assert "experience 2" not in out
    assert "Traceback" not in out + proc.stderr

    # the seed's workflow, picked by the row (format.workflow_key), loaded from --plugin-dir; JSON
    proc = _debug(env, "-c", str(cfg), "--task", "1", "--plugin-dir", str(plugins), "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["task_index"] == 1 and doc["workflow"] == "debug_seed_workflow"
    assert doc["workflow_class"] == "SeedWorkflow" and doc["repeat_times"] == 2
    assert doc["raw_task"]["question"] == "1+1="
    assert len(doc["experiences"]) == 2
    for e in doc["experiences"]:
        assert e["eid"].startswith("0/1/")
        assert "Question:\n1+1=" in e["prompt_text"]  # decoded from the tokens
        assert e["reward"] == float(e["response_text"] == "2")
        n = e["response_length"]
        assert n > 0 and e["tokens"] == e["prompt_length"] + n == e["prompt_length"] + len(
            e["response_ids"]
        )
        assert e["action_mask"] == {"length": n, "trained": n}
        assert e["logprobs"]["count"] == n and e["logprobs"]["max"] <= 0.0


def test_debug_workflow_errors_are_one_clear_line(
    setup: tuple[Path, Path, dict[str, str]], tmp_path: Path
) -> None:
    cfg, plugins, env = setup

    def one_line_error(proc: subprocess.CompletedProcess[str], *parts: str) -> None:
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [x for x in proc.stdout.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stdout
        for part in parts:
            assert part in lines[0], (part, lines[0])
        assert "Traceback" not in proc.stdout + proc.stderr

    one_line_error(
        _debug(env, "-c", str(cfg), "--task", "9"),
        "--task 9",
        "`buffer.explorer_input.taskset`",
        "has 4 rows",
        "0..3",
    )
    one_line_error(
        _debug(env, "-c", str(cfg), "--task", "2", "--plugin-dir", str(plugins)),
        "task 2 of `buffer.explorer_input.taskset`",
        "debug_raises",
        "ValueError: no tool for '2+5='",
    )
    one_line_error(
        _debug(
            env,
            *("-c", str(cfg), "--task", "3", "--plugin-dir", str(plugins)),
            *("--set", "explorer.max_timeout=1"),
        ),
        "task 3",
        "debug_hangs",
        "TimeoutError",
        "explorer.max_timeout",
    )
    # a row naming a workflow nobody registered (no --plugin-dir): the row's key is named
    one_line_error(
        _debug(env, "-c", str(cfg), "--task", "2"),
        "raw_task['workflow']",
        "format.workflow_key",
        "debug_raises",
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("buffer:\n  explorer_input:\n    taskset:\n      prompt_kye: q\n")
    one_line_error(
        _debug(env, "-c", str(bad)), "bad.yaml", "buffer.explorer_input.taskset.prompt_kye"
    )
