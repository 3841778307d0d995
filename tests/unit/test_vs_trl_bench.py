"""benchmarks/vs_trl.py and its long-tail workload, on synthetic curves (no TRL needed).

"Steps to 0.7" is the first step at which the mean of the last 20 rewards
reaches 0.7, with the seconds of that step; rftstream's ``metrics.jsonl``
records without new rollouts are skipped; the long-tail verifier waits
20-200 ms per task row, the same for a row every time, then scores as
``math_workflow`` does. References are computed here with numpy.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import ModuleType

import anyio
import numpy as np
import pytest

from rftstream.plugins.loader import load_plugins
from tests.unit._util import ScriptedModel, load_script, task_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(ROOT / "benchmarks" / "vs_trl.py", "vs_trl")


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
    from rftstream.plugins.loader import plugin_module_name

    load_plugins([ROOT / "benchmarks" / "plugins"])
    return sys.modules[plugin_module_name(ROOT / "benchmarks" / "plugins" / "longtail.py")]


def test_verifier_delay_is_per_row_and_in_range(longtail: ModuleType) -> None:
    delays = [longtail.verifier_delay(i) for i in range(100)]
    assert all(0.02 <= d <= 0.2 for d in delays)
    assert delays == [longtail.verifier_delay(i) for i in range(100)]
    assert max(delays) - min(delays) > 0.1  # a real spread, not a constant


def test_longtail_workflow_waits_then_scores_like_math(longtail: ModuleType, monkeypatch) -> None:
    slept: list[float] = []
    threads: list[int] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        threads.append(threading.get_ident())

    monkeypatch.setattr(longtail.time, "sleep", sleep)
    task = task_for(
        {"question": "3+4=", "answer": "7"}, "longtail_math_workflow", repeat=3, task_id=5
    )
    model = ScriptedModel(["7", "8", "the answer is 7"])
    wf = longtail.LongTailMathWorkflow(task=task, model=model)
    exps = anyio.run(wf.run_async)
    assert slept == [longtail.verifier_delay(5)]  # once per task
    assert threads != [threading.get_ident()]  # in a worker thread: the explorer goes on
    assert [e.reward for e in exps] == [1.0, 0.0, 1.0]


def test_stop_rule_threshold_after_and_budget(bench: ModuleType) -> None:
    low = [(i, float(i), 0.5) for i in range(1, 40)]
    assert not bench.should_stop(low, 39.0, after_s=15, budget_s=240)
    assert bench.should_stop(low, 240.0, after_s=15, budget_s=240)  # the budget
    at7 = low + [(i, float(i), 0.7) for i in range(40, 60)]  # trailing 0.7 at step 59
    assert bench.steps_to_threshold(at7, 0.7) == (59, 59.0)
    assert not bench.should_stop(at7, 70.0, after_s=15, budget_s=240)
    assert bench.should_stop(at7, 74.0, after_s=15, budget_s=240)  # 15 s after 0.7
    at9 = [(i, float(i), 0.95) for i in range(1, 21)]
    assert bench.should_stop(at9, 20.0, after_s=15, budget_s=240)  # trailing 0.9


def test_quartiles_match_numpy_and_verdicts(bench: ModuleType) -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 5, 8):
        xs = list(rng.normal(size=n))
        want = tuple(np.percentile(xs, [25, 50, 75]))
        assert bench.quartiles(xs) == pytest.approx(want)
    assert bench.quartiles([]) is None
    assert bench.verdict(0.6, 0.6) == "PASS" and bench.verdict(0.61, 0.6) == "MISS"
    assert bench.verdict(None, 0.6) == "MISS"
    assert bench.verdict(0.8, 0.8, at_least=True) == "PASS"


def test_rftstream_ms_per_step_skips_the_first_step(bench: ModuleType) -> None:
    records = [
        {
            "step": 1,
            "time/trainer_step_period": 5.0,
            "explorer/idle_share": 0.0,
            "time/train_step": 1.0,
        },
        {
            "step": 2,
            "time/trainer_step_period": 0.1,
            "explorer/idle_share": 0.5,
            "time/train_step": 0.03,
        },
        {
            "step": 3,
            "time/trainer_step_period": 0.1,
            "explorer/idle_share": 0.3,
            "time/train_step": 0.05,
        },
        {
            "step": 4,
            "time/trainer_step_period": 0.2,
            "explorer/idle_share": 0.5,
            "time/train_step": 0.04,
        },
    ]
    rollout, train = bench.rftstream_ms_per_step(records)
    assert rollout == pytest.approx(70.0) and train == pytest.approx(40.0)
    assert bench.rftstream_ms_per_step(records[:1]) == (None, None)


def test_report_fails_a_miss_and_a_run_that_never_got_there(bench: ModuleType) -> None:
    from rich.console import Console

    def curve(label: str, secs: float | None, n: int = 30) -> object:
        c = bench.Curve(label)
        reward = 1.0 if secs is not None else 0.0
        c.points = [(i, (secs or 100.0) * i / n, reward) for i in range(1, n + 1)]
        return c

    w = bench.WORKLOADS["longtail"]  # target: seconds <= 0.35x
    console = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    lines, ok = bench.report(w, [curve("TRL", 100.0)] * 3, [curve("rftstream", 30.0)] * 3, console)
    assert ok and "0.30x" in lines[0] and lines[0].endswith("PASS")
    assert "95% bootstrap interval over seeds 0.30-0.30x" in lines[0]
    lines, ok = bench.report(w, [curve("TRL", 100.0)] * 3, [curve("rftstream", 40.0)] * 3, console)
    assert not ok and lines[0].endswith("MISS")
    never = [curve("rftstream", None)] * 2 + [curve("rftstream", 10.0)]
    lines, ok = bench.report(w, [curve("TRL", 100.0)] * 3, never, console)
    assert not ok and "—x" in lines[0]  # most seeds never reached 0.7: no ratio, a MISS


def test_median_at_least_counts_a_run_that_never_got_there_where_it_stopped(
    bench: ModuleType,
) -> None:
    f = bench.median_at_least
    assert f([3.0, 1.0, 2.0], [None] * 3) == (2.0, True)
    assert f([], []) == (None, True)
    # bounds above the middle cannot move it: exact
    assert f([10.0, None, 20.0, None, 5.0], [0, 240.0, 0, 240.0, 0]) == (20.0, True)
    assert f([10.0, None, 20.0], [0, 20.0, 0]) == (20.0, True)  # its true value is >= 20
    # a bound in the middle: the true median is at least it, not it
    assert f([10.0, None, 30.0], [0, 20.0, 0]) == (20.0, False)
    assert f([202.7, None, None, 140.4, None], [0, 242.0, 242.0, 0, 242.0]) == (242.0, False)


def test_ratio_interval_is_a_bootstrap_of_the_ratio_of_medians(bench: ModuleType) -> None:
    f = bench.ratio_interval
    # no spread: the interval is the ratio itself
    assert f([30.0] * 5, [100.0] * 5, [None] * 5) == (0.3, 0.3)
    # the sixteenth session's generation-heavy seconds to 0.7, seeds 1-9
    ours = [65.0, 45.6, 38.2, 65.2, 24.3, 39.5, 36.4, 24.2, 25.9]
    trl = [108.4, 61.3, 73.2, 91.2, 57.3, 175.5, 112.2, 80.0, 156.1]
    lo, hi = f(ours, trl, [None] * 9)
    point = bench.median_or_none(ours) / bench.median_or_none(trl)  # 0.42
    assert lo < point < hi and hi < 1.0
    assert f(ours, trl, [None] * 9) == (lo, hi)  # a fixed generator: the same interval
    lo5, hi5 = f(ours[:5], trl[:5], [None] * 5)
    assert hi5 - lo5 > hi - lo  # five seeds: wider
    assert lo5 < 0.5 < hi5  # and straddling the target: decided by which seeds ran
    # a run of ours that never got there is infinitely slow; TRL's counts where it stopped
    lo, hi = f([None, None, 30.0], [100.0] * 3, [None] * 3)
    assert lo == 0.3 and hi == float("inf")
    assert f([30.0, 40.0], [None, None], [200.0, 200.0]) == (0.15, 0.2)
    assert f([], [100.0], [None]) is None


def test_report_bounds_the_ratio_when_trl_never_got_there(bench: ModuleType) -> None:
    """TRL seeds that never reach 0.7 within the budget count as reaching it where they
    stopped: the ratio is then an upper bound, a PASS only when the bound passes, and
    never the 0.00x an infinite median would give."""
    from rich.console import Console

    def curve(label: str, secs: float | None, ran_s: float = 100.0, n: int = 30) -> object:
        c = bench.Curve(label)
        reward = 1.0 if secs is not None else 0.0
        c.points = [(i, (secs or ran_s) * i / n, reward) for i in range(1, n + 1)]
        return c

    w = bench.WORKLOADS["genheavy"]  # target: seconds <= 0.5x
    console = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    trl = [curve("TRL", 150.0), curve("TRL", None, 240.0), curve("TRL", None, 240.0)]
    lines, ok = bench.report(w, trl, [curve("rftstream", 90.0)] * 3, console)
    # rftstream reaches it at 60 s (20 of 30 points); TRL's median is at least 240 s
    assert ok and "<= 0.25x" in lines[0] and "2 TRL run(s) never" in lines[0]
    assert lines[0].endswith("PASS")
    lines, ok = bench.report(w, trl, [curve("rftstream", 270.0)] * 3, console)  # 180 / 240
    assert not ok and "<= 0.75x" in lines[0] and lines[0].endswith("UNDECIDED (raise --budget-s)")


def test_each_workload_has_its_own_budget_unless_one_is_given(bench: ModuleType) -> None:
    own = bench.Settings(Path("."), 10, 5.0, 15.0, None, 1)
    assert own.budget_for(bench.WORKLOADS["default"]) == 240.0
    assert own.budget_for(bench.WORKLOADS["genheavy"]) == 480.0
    given = bench.Settings(Path("."), 10, 5.0, 15.0, 100.0, 1)
    assert given.budget_for(bench.WORKLOADS["genheavy"]) == 100.0


def test_each_workload_runs_its_own_seeds_unless_they_are_named(bench: ModuleType) -> None:
    w = bench.WORKLOADS
    assert w["default"].seed_list() == w["longtail"].seed_list() == [1, 2, 3, 4, 5]
    assert w["genheavy"].seed_list() == list(range(1, 10))
    assert w["genheavy"].seed_list([3, 1]) == w["default"].seed_list([3, 1]) == [3, 1]
    assert bench.seed_range(list(range(1, 10))) == "1-9"
    assert bench.seed_range([1, 3, 7]) == "1,3,7"
    assert bench.seed_range([4, 5]) == "4,5"


def test_workload_overrides_name_the_keys_rftstream_up_takes(bench: ModuleType) -> None:
    import copy

    from rftstream.config import apply_overrides, config_from_dict
    from rftstream.default_run import DEFAULT_CONFIG

    load_plugins([ROOT / "benchmarks" / "plugins"])
    for w in bench.WORKLOADS.values():  # the embedded default with the overrides, as `up`
        data = apply_overrides(copy.deepcopy(DEFAULT_CONFIG), w.overrides())
        cfg = config_from_dict(data, source="<embedded default>")  # a wrong key fails here
        ts = cfg.buffer.explorer_input.taskset
        assert ts.rollout_args.min_tokens == w.min_tokens
        assert cfg.model.max_response_tokens == w.max_tokens
    heavy = bench.WORKLOADS["genheavy"]
    assert heavy.min_tokens == 32 and heavy.max_tokens == 48


def test_letter_share_reward_counts_ascii_letters() -> None:
    from rftstream.plugins.loader import plugin_module_name

    load_plugins([ROOT / "benchmarks" / "plugins"])
    genheavy = sys.modules[plugin_module_name(ROOT / "benchmarks" / "plugins" / "genheavy.py")]
    assert genheavy.letter_share("ab12") == 0.5
    assert genheavy.letter_share("") == 0.0 and genheavy.letter_share("é1") == 0.0
    task = task_for({"question": "5+7=", "answer": "12"}, "math_workflow", repeat=2)
    task.reward_fn = "letter_share_reward"
    wf = __import__("workflows").MathWorkflow(task=task, model=ScriptedModel(["abcd", "a123"]))
    assert [e.reward for e in anyio.run(wf.run_async)] == [1.0, 0.25]


def test_startup_reads_the_first_trainer_step(tmp_path: Path) -> None:
    startup = load_script(ROOT / "benchmarks" / "startup.py", "startup")
    metrics = tmp_path / "metrics.jsonl"
    assert startup.first_step_s(metrics, 100.0) is None  # no file yet
    metrics.write_text("")
    assert startup.first_step_s(metrics, 100.0) is None
    metrics.write_text('{"step": 1, "ts": 104.5}\n{"step": 2, "ts": 104.6}\n')
    assert startup.first_step_s(metrics, 100.0) == 4.5
    metrics.write_text('{"step": 1, "ts": 1')  # a line being written
    assert startup.first_step_s(metrics, 100.0) is None
    metrics.write_text('{"step": 1, "ts": 99.0}\n')  # an earlier run's
    assert startup.first_step_s(metrics, 100.0) is None
    # the benchmark runs the README's first quick-start command
    readme = (ROOT / "README.md").read_text()
    assert startup.README_COMMAND in readme
