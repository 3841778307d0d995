"""benchmarks/mix_vs_grpo.py: the figure it reports, on synthetic reward curves.

"Steps to 0.5" is the first step at which the trailing mean of the last
``WINDOW`` reward/mean values (a full window) reaches 0.5; steps without new
rollouts are skipped. References are computed here with numpy.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.unit._util import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(ROOT / "benchmarks" / "mix_vs_grpo.py", "mix_vs_grpo")


def np_trailing(values: list[float], n: int) -> list[float]:
    return [float(np.mean(values[max(0, i - n + 1) : i + 1])) for i in range(len(values))]


def np_first_step(steps: list[int], values: list[float], target: float, n: int) -> int | None:
    means = np_trailing(values, n)
    for i in range(n - 1, len(values)):
        if means[i] >= target:
            return steps[i]
    return None


def test_trailing_mean_on_a_noisy_curve(bench: ModuleType) -> None:
    rng = np.random.default_rng(0)
    values = list(np.clip(np.linspace(0.1, 0.9, 60) + rng.normal(0, 0.1, 60), 0, 1))
    for n in (1, 3, 10):
        np.testing.assert_allclose(bench.trailing_mean(values, n), np_trailing(values, n))
    assert bench.trailing_mean([], 10) == []
    assert bench.trailing_mean([0.2, 0.4], 10) == pytest.approx([0.2, 0.3])  # fewer at the start


def test_steps_to_reach_uses_the_trailing_mean_of_a_full_window(bench: ModuleType) -> None:
    rng = np.random.default_rng(1)
    values = list(np.clip(np.linspace(0.0, 1.0, 80) + rng.normal(0, 0.15, 80), 0, 1))
    steps = [s for s in range(1, 200) if s % 3][:80]  # steps without rollouts are missing
    want = np_first_step(steps, values, 0.5, 10)
    assert want is not None
    assert bench.steps_to_reach(steps, values, 0.5, 10) == want
    # a single value over the target does not count: the mean of the window must be
    i = next(i for i, v in enumerate(values) if v >= 0.5)
    assert steps[i] < want
    # the default target and window are the benchmark's 0.5 and 10
    assert bench.TARGET == 0.5 and bench.WINDOW == 10
    assert bench.steps_to_reach(steps, values) == want


def test_steps_to_reach_needs_a_full_window_and_may_never_reach(bench: ModuleType) -> None:
    assert bench.steps_to_reach([1, 2, 3], [1.0, 1.0, 1.0], 0.5, 5) is None  # window not full
    assert bench.steps_to_reach([1, 2, 3, 4, 5], [1.0] * 5, 0.5, 5) == 5
    flat = [0.49] * 30
    assert bench.steps_to_reach(list(range(1, 31)), flat, 0.5, 10) is None
    # exactly the target counts
    assert bench.steps_to_reach(list(range(1, 11)), [0.5] * 10, 0.5, 10) == 10


def test_result_curve_skips_steps_without_rollouts(bench: ModuleType) -> None:
    records = [
        {"step": 1, "reward/mean": 0.2},
        {"step": 2, "reward/mean": None},
        {"step": 3, "reward/mean": 0.6},
        {"step": 4},
    ]
    res = bench.Result("X", 4, 1.0, records)
    assert res.curve == ([1, 3], [0.2, 0.6])


def test_printed_figure_says_it_is_a_trailing_mean(bench: ModuleType) -> None:
    def result(label: str, values: list[float]) -> object:
        records = [{"step": i + 1, "reward/mean": v} for i, v in enumerate(values)]
        return bench.Result(label, len(values), 1.0, records)

    grpo = result("GRPO", [0.2] * 10 + [0.8] * 10)
    mix = result("MIX", [0.8] * 20)
    assert (grpo.steps_to_target, mix.steps_to_target) == (
        np_first_step(list(range(1, 21)), [0.2] * 10 + [0.8] * 10, 0.5, 10),
        10,
    )
    args = type("Args", (), {"mu": 0.1, "expert_ratio": 0.25, "steps": 20})()
    with bench.console.capture() as cap:
        bench.print_table(grpo, mix, args)
    text = cap.get()
    assert "trailing mean" in text
    assert f"mean of the last {bench.WINDOW} reward/mean values" in text
    assert f"GRPO {grpo.steps_to_target}, MIX 10" in text
