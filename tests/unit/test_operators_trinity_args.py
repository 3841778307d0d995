"""``dapo_dynamic_sampling``, ``reward_shaping_mapper`` and ``pass_rate_calculator`` built from
Trinity-RFT configs (its argument names and meaning), on hand-made experiences.

Expected values are computed here in plain Python from Trinity-RFT's definitions:
DAPO keeps a group when ``0 < #correct < G`` (correct: ``metrics[metric_key]`` or else the
reward ``> correct_threshold``); reward shaping applies ``{stats_key, op_type, weight}``
in order; the pass rate is the group's mean reward.
"""

from __future__ import annotations

import pytest

from operators import create_operators
from rftstream.config.schema import OperatorConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience


def mk(
    task: str, run: int, reward: float | None, metrics: dict | None = None, info: dict | None = None
) -> Experience:
    return Experience(
        tokens=[1, 2, 3, 4],
        prompt_length=2,
        reward=reward,
        eid=EID(task=task, run=run),
        metrics=dict(metrics or {}),
        info=dict(info or {}),
    )


def build(name: str, args: dict):
    (op,) = create_operators([OperatorConfig(name=name, args=args)])
    return op


# ------------------------------------------------------------------ dapo_dynamic_sampling


def test_dapo_uses_the_accuracy_metric_not_the_shaped_reward() -> None:
    # rewards are length-shaped (all different), accuracy tells correct from wrong
    groups = {
        "all_right": [(0.9, 1.0), (0.7, 1.0)],
        "all_wrong": [(-0.1, 0.0), (-0.3, 0.0), (-0.2, 0.0)],
        "mixed": [(0.8, 1.0), (-0.2, 0.0)],
        "single": [(1.0, 1.0)],
    }
    exps = [
        mk(t, i, r, metrics={"accuracy": a})
        for t, rows in groups.items()
        for i, (r, a) in enumerate(rows)
    ]
    op = build("dapo_dynamic_sampling", {"metric_key": "accuracy", "correct_threshold": 0.0})
    kept, m = op.process(exps)

    def keep(rows: list[tuple[float, float]]) -> bool:
        correct = sum(1 for _, a in rows if a > 0.0)
        return len(rows) >= 2 and 0 < correct < len(rows)

    expected = [e for e in exps if keep(groups[str(e.eid.task)])]
    assert kept == expected and {e.eid.task for e in kept} == {"mixed"}
    assert m["filtered_count"] == len(exps) - len(expected) == 6
    assert m["dropped_all_correct"] == 2 and m["dropped_all_wrong"] == 3
    # the zero-variance rule on the same rewards would keep three groups: not what DAPO does
    assert len({r for r, _ in groups["all_wrong"]}) > 1


def test_dapo_falls_back_to_the_reward_and_honours_the_threshold() -> None:
    exps = [mk("a", 0, 0.4), mk("a", 1, 0.6), mk("b", 0, 0.6), mk("b", 1, 0.9)]
    kept, m = build("dapo_dynamic_sampling", {"correct_threshold": 0.5}).process(exps)
    assert kept == exps[:2]  # a: one of two > 0.5; b: both > 0.5
    assert m["dropped_all_correct"] == 2 and m["dropped_all_wrong"] == 0
    kept, _ = build("dapo_dynamic_sampling", {}).process(exps)  # default: > 0.0
    assert kept == []  # every reward > 0: all groups all correct
    # rftstream's zero-variance rule on demand: any spread of scores keeps the group
    kept, _ = build("dapo_dynamic_sampling", {"correct_threshold": None}).process(exps)
    assert kept == exps


def test_dapo_other_metric_key() -> None:
    exps = [
        mk("a", 0, 1.0, metrics={"pass": 1.0}),
        mk("a", 1, 1.0, metrics={"pass": 0.0}),
    ]
    kept, _ = build("dapo_dynamic_sampling", {"metric_key": "pass"}).process(exps)
    assert kept == exps
    kept, _ = build("dapo_dynamic_sampling", {"metric_key": "accuracy"}).process(exps)
    assert kept == []  # no accuracy metric: rewards 1.0 and 1.0, all correct


# ------------------------------------------------------------------ reward_shaping_mapper


def test_reward_shaping_configs_as_trinity() -> None:
    configs = [
        {"stats_key": "quality", "op_type": "ADD", "weight": 0.5},
        {"stats_key": "len_ratio", "op_type": "MUL", "weight": 2.0},
        {"stats_key": "penalty", "op_type": "SUB"},  # weight defaults to 1.0
        {"stats_key": "scale", "op_type": "DIV", "weight": 4.0},
    ]
    infos = [
        {"quality": 0.6, "len_ratio": 0.5, "penalty": 0.1, "scale": 0.5},
        {"quality": 1.0},  # the other stats are missing: those entries are skipped
        {"quality": 0.2, "len_ratio": 1.0, "penalty": 0.0, "scale": 0.0},  # DIV by 0: skipped
    ]
    rewards = [1.0, 0.0, -1.0]
    exps = [mk("t", i, r, info=inf) for i, (r, inf) in enumerate(zip(rewards, infos, strict=True))]

    def shaped(r: float, info: dict) -> float:
        if "quality" in info:
            r = r + 0.5 * info["quality"]
        if "len_ratio" in info:
            r = r * (2.0 * info["len_ratio"])
        if "penalty" in info:
            r = r - 1.0 * info["penalty"]
        if "scale" in info and 4.0 * info["scale"] != 0:
            r = r / (4.0 * info["scale"])
        return r

    expected = [shaped(r, inf) for r, inf in zip(rewards, infos, strict=True)]
    assert expected == pytest.approx([((1.0 + 0.3) * 1.0 - 0.1) / 2.0, 0.5, -1.8])
    out, m = build("reward_shaping_mapper", {"reward_shaping_configs": configs}).process(exps)
    assert [e.reward for e in out] == pytest.approx(expected)
    diffs = [a - b for a, b in zip(expected, rewards, strict=True)]
    assert m["reward_diff/mean"] == pytest.approx(sum(diffs) / 3)
    assert m["reward_diff/min"] == pytest.approx(min(diffs))
    assert m["reward_diff/max"] == pytest.approx(max(diffs))


def test_reward_shaping_configs_then_rftstream_rescaling() -> None:
    exps = [mk("t", 0, 1.0, info={"bonus": 2.0})]
    args = {"reward_shaping_configs": [{"stats_key": "bonus", "op_type": "add"}], "scale": 0.5}
    out, _ = build("reward_shaping_mapper", args).process(exps)
    assert out[0].reward == pytest.approx(0.5 * (1.0 + 2.0))


@pytest.mark.parametrize(
    "configs,fragment",
    [
        ([{"stats_key": "q", "op_type": "POW"}], "reward_shaping_configs[0].op_type"),
        ([{"op_type": "ADD"}], "reward_shaping_configs[0].stats_key"),
        ([{"stats_key": "q"}, {"stats_key": "q", "wieght": 2}], "reward_shaping_configs[1]"),
    ],
)
def test_bad_reward_shaping_configs_name_the_entry(configs: list, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build("reward_shaping_mapper", {"reward_shaping_configs": configs})
    assert fragment in str(info.value)


# ------------------------------------------------------------------ pass_rate_calculator


def test_pass_rate_calculator_with_trinity_args() -> None:
    rewards = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.5, 1.0], "c": [0.0, 0.0]}
    exps = [mk(t, i, r) for t, rs in rewards.items() for i, r in enumerate(rs)]
    op = build("pass_rate_calculator", {"reward_shaping_configs": None})
    out, m = op.process(exps)
    means = {t: sum(rs) / len(rs) for t, rs in rewards.items()}
    assert out == exps
    assert [e.info["pass_rate"] for e in out] == pytest.approx(
        [means[str(e.eid.task)] for e in exps]
    )
    assert m["pass_rate_mean"] == pytest.approx(sum(means.values()) / 3)
