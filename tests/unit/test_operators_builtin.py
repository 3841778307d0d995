"""Built-in filters and mappers: expected values computed in plain Python, on asyncio and trio."""

from __future__ import annotations

import pytest

from operators import (
    DAPODynamicSampling,
    DuplicateFilter,
    ExperiencePipeline,
    LengthFilter,
    MaskResponseTruncated,
    OverlongFilter,
    PassRateCalculator,
    RewardShapingMapper,
    StalenessFilter,
    create_operators,
)
from rftstream.config.schema import OperatorConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience

pytestmark = pytest.mark.anyio

PROMPT = [1, 2]


def mk(reward=1.0, task="t", run=0, response=(3, 4, 5), version=0, finish=None) -> Experience:
    info = {} if finish is None else {"finish_reason": finish}
    return Experience(
        tokens=PROMPT + list(response),
        prompt_length=len(PROMPT),
        reward=reward,
        eid=EID(task=task, run=run),
        model_version=version,
        info=info,
    )


def group(task, rewards):
    return [mk(r, task=task, run=i) for i, r in enumerate(rewards)]


async def run_pipeline(op, exps):
    async with ExperiencePipeline([op]) as pipe:
        return await pipe.process(exps)


# ------------------------------------------------------------------ staleness_filter


async def test_staleness_filter_explicit_version(anyio_backend):
    versions = [0, 1, 2, 3, 5]
    exps = [mk(run=i, version=v) for i, v in enumerate(versions)]
    expected = [v for v in versions if 5 - v <= 2]
    kept, metrics = await run_pipeline(StalenessFilter(max_staleness=2, current_version=5), exps)
    assert [e.model_version for e in kept] == expected == [3, 5]
    assert metrics["staleness_filter/filtered_count"] == 3
    assert metrics["staleness_filter/max_staleness_seen"] == 5
    assert metrics["filtered/staleness_filter"] == 3.0


async def test_staleness_filter_running_max(anyio_backend):
    op = StalenessFilter(max_staleness=1)
    async with ExperiencePipeline([op]) as pipe:
        kept, m = await pipe.process([mk(version=3), mk(run=1, version=1)])
        assert [e.model_version for e in kept] == [3]  # max seen 3: staleness 0 and 2
        assert m["staleness_filter/max_staleness_seen"] == 2
        # a later batch of old experiences is judged against the max seen so far (3)
        kept, m = await pipe.process([mk(version=2), mk(run=1, version=1)])
        assert [e.model_version for e in kept] == [2]
        assert m["staleness_filter/filtered_count"] == 1
        kept, m = await pipe.process([])
        assert kept == [] and m["staleness_filter/max_staleness_seen"] == 0


async def test_staleness_filter_newer_than_current_kept():
    kept, metrics = StalenessFilter(0, current_version=1).process([mk(version=4)])
    assert len(kept) == 1 and metrics == {"filtered_count": 0, "max_staleness_seen": -3}
    with pytest.raises(ValueError):
        StalenessFilter(-1)


# ------------------------------------------------------------------ length / overlong


async def test_length_filter_bounds(anyio_backend):
    lengths = [0, 1, 3, 5, 8]
    exps = [mk(run=i, response=range(10, 10 + n)) for i, n in enumerate(lengths)]
    kept, metrics = await run_pipeline(
        LengthFilter(max_response_tokens=5, min_response_tokens=1), exps
    )
    assert [e.response_length for e in kept] == [n for n in lengths if 1 <= n <= 5]
    assert metrics["length_filter/filtered_count"] == 2
    assert metrics["length_filter/too_long_count"] == 1
    assert metrics["length_filter/too_short_count"] == 1
    assert metrics["length_filter/truncated_count"] == 0


async def test_length_filter_truncated_and_overlong_alias(anyio_backend):
    exps = [mk(run=0, finish="length"), mk(run=1, finish="stop"), mk(run=2)]
    kept, _ = LengthFilter().process(exps)  # drop_truncated off: keeps all
    assert kept == exps
    kept, metrics = LengthFilter(drop_truncated=True).process(exps)
    assert kept == exps[1:] and metrics["truncated_count"] == 1
    kept, metrics = await run_pipeline(OverlongFilter(), exps)
    assert kept == exps[1:]
    assert metrics["overlong_filter/truncated_count"] == 1
    assert OverlongFilter(drop_truncated=False).process(exps)[0] == exps
    assert LengthFilter().process([]) == (
        [],
        {"filtered_count": 0, "truncated_count": 0, "too_long_count": 0, "too_short_count": 0},
    )
    with pytest.raises(ValueError):
        LengthFilter(max_response_tokens=1, min_response_tokens=2)


# ------------------------------------------------------------------ duplicate_filter


async def test_duplicate_filter_group_and_batch(anyio_backend):
    exps = [
        mk(task="a", run=0, response=(7, 8)),
        mk(task="a", run=1, response=(7, 8)),  # dup in group a
        mk(task="a", run=2, response=(9,)),
        mk(task="b", run=0, response=(7, 8)),  # dup of a/0 only at batch scope
        mk(task="b", run=1, response=(9,)),  # dup of a/2 only at batch scope
    ]

    def expected(scope):
        seen, out = set(), []
        for e in exps:
            key = (e.eid.tid if scope == "group" else None, tuple(e.tokens[2:].tolist()))
            if key not in seen:
                seen.add(key)
                out.append(e)
        return out

    kept, m = await run_pipeline(DuplicateFilter(), exps)
    assert kept == expected("group") == [exps[0], exps[2], exps[3], exps[4]]
    assert m["duplicate_filter/filtered_count"] == 1
    kept, m = await run_pipeline(DuplicateFilter(scope="batch"), exps)
    assert kept == expected("batch") == [exps[0], exps[2]]
    assert m["duplicate_filter/filtered_count"] == 3


async def test_duplicate_filter_edges():
    assert DuplicateFilter().process([]) == ([], {"filtered_count": 0})
    one = [mk(reward=None)]
    assert DuplicateFilter().process(one) == (one, {"filtered_count": 0})
    with pytest.raises(ValueError):
        DuplicateFilter(scope="global")


# ------------------------------------------------------------------ dapo_dynamic_sampling


async def test_dapo_dynamic_sampling(anyio_backend):
    batch1 = group("flat", [1.0, 1.0]) + group("mixed", [0.0, 1.0]) + group("single", [1.0])
    batch2 = group("none", [None, 1.0]) + group("zeros", [0.0, 0.0, 0.0]) + group("m2", [1, 0])
    op = DAPODynamicSampling(min_groups=2)
    async with ExperiencePipeline([op]) as pipe:
        kept, m = await pipe.process(batch1)
        assert kept == batch1[2:4]
        assert m["dapo_dynamic_sampling/kept_groups"] == 1
        assert m["dapo_dynamic_sampling/dropped_groups"] == 2
        assert m["dapo_dynamic_sampling/filtered_count"] == 3
        assert m["dapo_dynamic_sampling/quota_met"] == 0.0
        kept, m = await pipe.process(batch2)
        assert kept == batch2[-2:]
        assert m["dapo_dynamic_sampling/dropped_groups"] == 2
        assert m["dapo_dynamic_sampling/kept_groups_total"] == 2
        assert m["dapo_dynamic_sampling/quota_met"] == 1.0
    kept, m = DAPODynamicSampling().process([])
    assert kept == [] and m["quota_met"] == 1.0 and m["kept_groups"] == 0


# ------------------------------------------------------------------ mappers


async def test_mask_response_truncated(anyio_backend):
    exps = [mk(run=0, finish="length"), mk(run=1, finish="stop"), mk(run=2)]
    out, m = await run_pipeline(MaskResponseTruncated(), exps)
    assert out == exps
    assert m["mask_response_truncated/masked_count"] == 1
    assert m["filtered/mask_response_truncated"] == 0.0
    assert out[0].action_mask.tolist() == [False] * 3
    assert out[0].action_mask.dtype.is_floating_point is False
    assert out[1].action_mask.tolist() == [True] * 3 and out[2].action_mask.all()
    assert MaskResponseTruncated().process([]) == ([], {"masked_count": 0})


async def test_reward_shaping_mapper(anyio_backend):
    rewards = [1.0, 0.0, None, -2.0]
    lengths = [2, 4, 1, 0]
    exps = [
        mk(r, run=i, response=range(n))
        for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    ]
    scale, offset, pen, lo, hi = 2.0, 0.5, 0.25, -1.0, 1.5

    def shape(r, n):
        return min(max(scale * r + offset - pen * n, lo), hi)

    expected = [None if r is None else shape(r, n) for r, n in zip(rewards, lengths, strict=True)]
    assert expected == [1.5, -0.5, None, -1.0]  # clipped high (2.0) and low (-3.5)
    op = RewardShapingMapper(scale=scale, offset=offset, length_penalty=pen, clip=[lo, hi])
    out, m = await run_pipeline(op, exps)
    assert [e.reward for e in out] == pytest.approx(expected)
    valid_before = [r for r in rewards if r is not None]
    valid_after = [r for r in expected if r is not None]
    assert m["reward_shaping_mapper/reward_mean_before"] == pytest.approx(
        sum(valid_before) / len(valid_before)
    )
    assert m["reward_shaping_mapper/reward_mean_after"] == pytest.approx(
        sum(valid_after) / len(valid_after)
    )
    assert m["reward_shaping_mapper/shaped_count"] == 3


async def test_reward_shaping_defaults_and_edges():
    exps = [mk(0.3), mk(None, run=1)]
    out, m = RewardShapingMapper().process(exps)
    assert [e.reward for e in out] == [0.3, None]
    assert m == {
        "shaped_count": 1,
        "reward_mean_before": 0.3,
        "reward_mean_after": 0.3,
        "reward_diff/mean": 0.0,
        "reward_diff/min": 0.0,
        "reward_diff/max": 0.0,
    }
    assert RewardShapingMapper().process([mk(None)])[1] == {"shaped_count": 0}
    assert RewardShapingMapper().process([]) == ([], {"shaped_count": 0})
    with pytest.raises(ValueError):
        RewardShapingMapper(clip=[1.0, 0.0])


async def test_pass_rate_calculator(anyio_backend):
    groups = {"a": [1.0, 0.0, 1.0, 0.5], "b": [None, 1.0], "c": [0.0]}
    exps = [e for task, rs in groups.items() for e in group(task, rs)]
    expected = {
        t: sum(1 for r in rs if r is not None and r >= 1.0) / len(rs) for t, rs in groups.items()
    }
    out, m = await run_pipeline(PassRateCalculator(threshold=1.0), exps)
    assert out == exps
    for e in out:
        assert e.info["pass_rate"] == pytest.approx(expected[e.eid.task])
    assert m["pass_rate_calculator/pass_rate_mean"] == pytest.approx(
        sum(expected.values()) / len(expected)
    )
    out, m = PassRateCalculator(threshold=0.5).process(group("a", [1.0, 0.0, 1.0, 0.5]))
    assert out[0].info["pass_rate"] == 0.75 and m == {"pass_rate_mean": 0.75}
    assert PassRateCalculator().process([]) == ([], {})
    # unset threshold: Trinity-RFT's pass rate, the group's mean reward (None counts 0)
    out, m = PassRateCalculator().process(group("a", [1.0, 0.0, 1.0, 0.5]) + group("b", [None, 1]))
    assert [e.info["pass_rate"] for e in out] == pytest.approx([0.625] * 4 + [0.5] * 2)
    assert m["pass_rate_mean"] == pytest.approx((0.625 + 0.5) / 2)


# ------------------------------------------------------------------ config resolution


@pytest.mark.parametrize(
    ("name", "args", "cls"),
    [
        ("staleness_filter", {"max_staleness": 2}, StalenessFilter),
        ("length_filter", {"max_response_tokens": 16, "drop_truncated": True}, LengthFilter),
        ("overlong_filter", {}, OverlongFilter),
        ("duplicate_filter", {"scope": "batch"}, DuplicateFilter),
        ("dapo_dynamic_sampling", {"min_groups": 4}, DAPODynamicSampling),
        ("mask_response_truncated", {}, MaskResponseTruncated),
        ("reward_shaping_mapper", {"scale": 2.0, "clip": [-1, 1]}, RewardShapingMapper),
        ("pass_rate_calculator", {"threshold": 0.5}, PassRateCalculator),
    ],
)
async def test_create_operators_resolves(name, args, cls):
    (op,) = create_operators([OperatorConfig(name=name, args=args)])
    assert type(op) is cls
    pipe = ExperiencePipeline.from_config([OperatorConfig(name=name, args=args)])
    assert pipe.names == [name]


async def test_create_operators_bad_args():
    with pytest.raises(ConfigError):
        create_operators([OperatorConfig(name="duplicate_filter", args={"scope": "x"})])
    with pytest.raises(ConfigError):
        create_operators([OperatorConfig(name="staleness_filter", args={})])


async def test_chain_through_pipeline(anyio_backend):
    exps = (
        [mk(1.0, task="a", run=0, finish="length"), mk(0.0, task="a", run=1, response=(6,))]
        + [mk(1.0, task="b", run=i, response=(i,)) for i in range(2)]
        + [mk(1.0, task="c", run=0, version=-5), mk(0.0, task="c", run=1, response=(6,))]
    )
    pipe = ExperiencePipeline.from_config(
        [
            OperatorConfig(name="staleness_filter", args={"max_staleness": 1}),
            OperatorConfig(name="overlong_filter"),
            OperatorConfig(name="duplicate_filter"),
            OperatorConfig(name="pass_rate_calculator"),
            OperatorConfig(name="dapo_dynamic_sampling"),
        ]
    )
    async with pipe:
        out, m = await pipe.process(exps)
    # c/0 stale, a/0 truncated -> a and c become groups of one; b has equal rewards
    assert out == []
    assert m["pipeline/in"] == 6.0 and m["pipeline/out"] == 0.0
    assert m["filtered/staleness_filter"] == 1.0
    assert m["filtered/overlong_filter"] == 1.0
    assert m["dapo_dynamic_sampling/dropped_groups"] == 3
