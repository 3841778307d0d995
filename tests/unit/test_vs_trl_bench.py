"""benchmarks/vs_trl.py and its long-tail workload, on synthetic curves (no TRL needed).

"Steps to 0.7" is the first step at which the mean of the last 20 rewards
reaches 0.7, with the seconds of that step; rftstream's ``metrics.jsonl``
records without new rollouts are skipped; the long-tail verifier waits
20-200 ms per task row, the same for a row every time, then scores as
``math_workflow`` does. References are computed here with numpy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import anyio
import numpy as np
import pytest

from rftstream.plugin_loader import load_plugins
from tests.unit._util import ScriptedModel, task_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = module
    spec.loader.exec_module(module)
    return module


def np_first(
    points: list[tuple[int, float, float]], target: float, n: int
) -> tuple[int, float] | None:
    rewards = np.array([p[2] for p in points])
    for i in range(n - 1, len(points)):
        if rewards[i - n + 1 : i + 1].mean() >= target:
            return points[i][0], points[i][1]
    return None


def test_steps_to_threshold_matches_numpy(bench: ModuleType) -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(5, 120))
        rewards = np.clip(np.linspace(0.2, 0.9, n) + rng.normal(0, 0.1, n), 0, 1)
        points = [(i + 1, 0.1 * (i + 1) + trial, float(r)) for i, r in enumerate(rewards)]
        for target in (0.5, 0.6, 0.7):
            assert bench.steps_to_threshold(points, target, 20) == np_first(points, target, 20)
    assert bench.steps_to_threshold([(1, 0.0, 1.0)] * 19, 0.1, 20) is None  # no full window


def test_rftstream_points_skip_steps_without_rollouts(bench: ModuleType) -> None:
    records = [
        {"step": 1, "ts": 100.5, "reward/mean": 0.25},
        {"step": 2, "ts": 101.0, "reward/mean": None},
        {"step": 3, "ts": 101.5, "reward/mean": 0.5},
    ]
    assert bench.rftstream_points(records, 100.0) == [(1, 0.5, 0.25), (3, 1.5, 0.5)]
    curve = bench.Curve("x", points=bench.rftstream_points(records, 100.0))
    assert curve.first_step_s() == 0.5 and curve.steps_per_s() == 2.0
    assert bench.ratio(3.0, 4.0) == 0.75 and bench.ratio(None, 4.0) is None


@pytest.fixture(scope="module")
def longtail() -> ModuleType:
    from rftstream.plugin_loader import plugin_module_name

    load_plugins([ROOT / "benchmarks" / "plugins"])
    return sys.modules[plugin_module_name(ROOT / "benchmarks" / "plugins" / "longtail.py")]


def test_verifier_delay_is_per_row_and_in_range(longtail: ModuleType) -> None:
    delays = [longtail.verifier_delay(i) for i in range(100)]
    assert all(0.02 <= d <= 0.2 for d in delays)
    assert delays == [longtail.verifier_delay(i) for i in range(100)]
    assert max(delays) - min(delays) > 0.1  # a real spread, not a constant


def test_longtail_workflow_waits_then_scores_like_math(longtail: ModuleType, monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(longtail.time, "sleep", slept.append)
    task = task_for(
        {"question": "3+4=", "answer": "7"}, "longtail_math_workflow", repeat=3, task_id=5
    )
    model = ScriptedModel(["7", "8", "the answer is 7"])
    wf = longtail.LongTailMathWorkflow(task=task, model=model)
    exps = anyio.run(wf.run_async)
    assert slept == [longtail.verifier_delay(5)]  # once per task
    assert [e.reward for e in exps] == [1.0, 0.0, 1.0]
