"""The explorer's :class:`Evaluator` above a fake run state, bus and workflow runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from rftstream.actors.evaluation import Evaluator
from rftstream.config.schema import Config, TasksetConfig
from rftstream.experience import Experience
from rftstream.wire import Key
from rftstream.workflow_runner import TaskResult

pytestmark = pytest.mark.anyio


class FakeState:
    """The KV claims the evaluator takes and gives back."""

    def __init__(self) -> None:
        self.claims: dict[str, dict[str, Any]] = {}

    async def create(self, key: Key[Any], value: Any) -> bool:
        if key.name in self.claims:
            return False
        self.claims[key.name] = msgspec.to_builtins(value)
        return True

    async def delete(self, key: Key[Any]) -> None:
        self.claims.pop(key.name, None)


class FakeBus:
    def __init__(self) -> None:
        self.metrics: list[tuple[str, int, dict[str, float]]] = []

    async def publish_metrics(self, role: str, step: int, values: dict[str, float]) -> None:
        self.metrics.append((role, step, values))


class Runner:
    """Row ``i`` answers ``i`` correct out of ``repeat`` (reward 1.0 or 0.0); row 2 fails."""

    def __init__(self, gate: anyio.Event | None = None) -> None:
        self.gate = gate
        self.ran: list[Any] = []

    async def run_task(self, task: Any) -> TaskResult:
        self.ran.append(task)
        if self.gate is not None:
            await self.gate.wait()
        index = task.raw_task["i"]
        if index == 2:
            return TaskResult(task=task, error="ValueError: no answer", attempts=1)
        exps = [
            Experience(tokens=[1, 2, 3], prompt_length=1, reward=1.0 if k < index else 0.0)
            for k in range(task.repeat_times)
        ]
        return TaskResult(task=task, experiences=exps, attempts=1)


def _evaluator(tmp_path: Path, records: list[dict[str, Any]]) -> tuple[Evaluator, FakeBus]:
    cfg = Config(run_dir=str(tmp_path))
    rows = tmp_path / "arith.jsonl"
    rows.write_text(
        "".join(json.dumps({"i": i, "question": "q", "answer": "a"}) + "\n" for i in range(4))
    )
    ts = TasksetConfig(name="arith", path=str(rows), repeat_times=3, is_eval=True)
    bus = FakeBus()
    evaluator = Evaluator(
        cfg,
        bus,
        "e0",
        "explorer",
        [("eval_tasksets[0]", ts)],
        on_eval=records.append,  # type: ignore[arg-type]
    )
    return evaluator, bus


async def test_an_evaluation_publishes_and_records_its_metrics(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    evaluator, bus = _evaluator(tmp_path, records)
    await evaluator.load_tasksets()
    assert evaluator.has_tasksets and evaluator.taskset_count == 1
    state = FakeState()
    await evaluator.evaluate(state, Runner(), step=5, version=4, final=False)  # type: ignore[arg-type]
    assert state.claims["eval.step.5"]["by"] == "e0"
    ((role, step, values),) = bus.metrics
    assert (role, step) == ("explorer", 5)
    assert values["eval/arith/tasks"] == 4 and values["eval/arith/failed_tasks"] == 1
    # rows 0, 1, 3: 0/3, 1/3 and 3/3 correct; best@3: 0, 1, 1
    assert values["eval/arith/accuracy/mean"] == pytest.approx(4 / 9)
    assert values["eval/arith/accuracy/best@3"] == pytest.approx(2 / 3)
    assert values["eval/model_version"] == 4 and values["eval/final"] == 0
    (line,) = (tmp_path / "eval.jsonl").read_text().splitlines()
    assert json.loads(line)["step"] == 5 and records[0]["explorer"] == "e0"
    assert evaluator.evaluations == 1


async def test_one_explorer_per_step_and_no_final_of_what_was_just_evaluated(
    tmp_path: Path,
) -> None:
    evaluator, bus = _evaluator(tmp_path, [])
    await evaluator.load_tasksets()
    state = FakeState()
    state.claims["eval.step.5"] = {"by": "e1"}  # another explorer evaluates step 5
    await evaluator.evaluate(state, Runner(), step=5, version=4, final=False)  # type: ignore[arg-type]
    assert bus.metrics == []
    await evaluator.evaluate(state, Runner(), step=6, version=4, final=False)  # type: ignore[arg-type]
    await evaluator.evaluate(state, Runner(), step=6, version=4, final=True)  # type: ignore[arg-type]
    assert [s for _, s, _ in bus.metrics] == [6] and "eval.final" not in state.claims
    await evaluator.evaluate(state, Runner(), step=6, version=5, final=True)  # type: ignore[arg-type]
    assert (
        bus.metrics[-1][2]["eval/final"] == 1.0 and state.claims["eval.final"]["model_version"] == 5
    )


async def test_a_cancelled_evaluation_gives_its_claim_back(tmp_path: Path) -> None:
    evaluator, bus = _evaluator(tmp_path, [])
    await evaluator.load_tasksets()
    state = FakeState()
    runner = Runner(gate=anyio.Event())  # never opens
    with anyio.move_on_after(0.2) as scope:
        await evaluator.evaluate(state, runner, step=3, version=1, final=False)  # type: ignore[arg-type]
    assert scope.cancelled_caught and runner.ran
    assert state.claims == {} and bus.metrics == [] and evaluator.evaluations == 0
