"""Pure logic of the runtime: sync policy, names, batch collation, the raw-reward monitor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rftstream.actors.raw_monitor import RawMonitor
from rftstream.config.schema import SynchronizerConfig
from rftstream.config.sync_policy import SyncPolicy
from rftstream.errors import ConfigError
from rftstream.experience import Experience, pack_group
from rftstream.subjects import RunNames
from rftstream.training.batch import collate, response_logprobs
from rftstream.wire import MetricsMsg, encode_json


def policy(**kw: object) -> SyncPolicy:
    return SyncPolicy.from_config(SynchronizerConfig(**kw))  # type: ignore[arg-type]


def test_dynamic_by_explorer_checks_every_interval_and_never_waits() -> None:
    p = policy(sync_style="dynamic_by_explorer", sync_interval=2)
    assert [s for s in range(1, 9) if p.explorer_checks_before(s)] == [3, 5, 7]
    assert all(p.explorer_waits_for_version(s) is None for s in range(1, 9))
    assert [s for s in range(1, 7) if p.trainer_publishes_after(s)] == [2, 4, 6]


def test_aliases_and_fixed_style_meeting_points() -> None:
    assert policy(sync_style="explorer_driven").style == "dynamic_by_explorer"
    assert policy(sync_style="trainer_driven").style == "dynamic_by_trainer"
    p = policy(sync_style="fixed", sync_interval=1)
    # strictly on-policy: explorer step k+1 needs weights version k
    assert [p.explorer_waits_for_version(s) for s in range(1, 5)] == [None, 1, 2, 3]
    p2 = policy(sync_style="fixed", sync_interval=3, sync_offset=1)
    assert [s for s in range(1, 12) if p2.explorer_waits_for_version(s) is not None] == [5, 8, 11]
    assert p2.explorer_waits_for_version(8) == 6
    with pytest.raises(ConfigError, match=r"synchronizer\.sync_style.*got 'sometimes'"):
        policy(sync_style="sometimes")


def test_max_staleness_bounds_backlog_plus_version_lag() -> None:
    p = policy(max_staleness=1)
    assert p.explorer_may_run(
        backlog_experiences=64, train_batch_size=64
    )  # trained one version later
    assert not p.explorer_may_run(backlog_experiences=65, train_batch_size=64)
    assert not p.explorer_may_run(backlog_experiences=64, train_batch_size=64, version_lag=1)
    p2 = policy(max_staleness=2)
    assert p2.explorer_may_run(backlog_experiences=64, train_batch_size=64, version_lag=1)
    assert not p2.explorer_may_run(backlog_experiences=128, train_batch_size=64, version_lag=1)
    # weights past the bound: nothing fits, however little waits (a starving trainer is
    # served by starving_trainer_overrides, which sees what the count cannot)
    assert not policy(max_staleness=0).explorer_may_run(
        backlog_experiences=0, train_batch_size=64, version_lag=1
    )
    assert policy(max_staleness=0).explorer_may_run(backlog_experiences=0, train_batch_size=64)
    assert not policy(max_staleness=0).explorer_may_run(backlog_experiences=64, train_batch_size=64)
    assert policy().explorer_may_run(backlog_experiences=10**9, train_batch_size=1, version_lag=99)


def test_run_names() -> None:
    n = RunNames("my_run")
    assert n.streams == (
        "RFT_MY_RUN_TASKS",
        "RFT_MY_RUN_EXP",
        "RFT_MY_RUN_DLQ",
        "RFT_MY_RUN_METRICS",
        "RFT_MY_RUN_WEIGHTS",
    )
    assert all(len(s) < 32 for s in RunNames("a" * 16).streams)
    assert n.exp_subject("train") == "rft.my_run.exp.train"
    assert n.dlq_subject("raw") == "rft.my_run.dlq.raw"
    assert n.metrics_subject("explorer 1") == "rft.my_run.metrics.explorer_1"
    assert n.stage_consumer("raw", "my-stage") == "op_raw_to_my_stage"
    assert n.kv_bucket == "rft_my_run_state"
    with pytest.raises(ValueError):
        RunNames("Bad-Name")
    with pytest.raises(ValueError):
        n.exp_subject("a.b")


def test_collate_layout_and_masks() -> None:
    a = Experience(
        tokens=[1, 2, 3, 10, 11],
        prompt_length=3,
        advantages=[0.5, 0.5],
        logprobs=[-1.0, -2.0],
        reward=1.0,
    )
    b = Experience(
        tokens=[4, 12, 13, 14],
        prompt_length=1,
        advantages=[-1.0, -1.0, -1.0],
        action_mask=[1, 0, 1],
        reward=0.0,
    )
    batch = collate([a, b], pad_token_id=0)
    assert batch.prompt_width == 3 and batch.response_width == 3
    assert batch.input_ids.tolist() == [[1, 2, 3, 10, 11, 0], [0, 0, 4, 12, 13, 14]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert batch.advantages.tolist() == [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]
    assert batch.rollout_logprobs.tolist() == [[-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError):
        collate([], 0)


def test_response_logprobs_against_numpy() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    ids = rng.integers(0, 7, size=(2, 5))
    P, T = 3, 0.7
    lp, ent, _ = response_logprobs(torch.tensor(logits), torch.tensor(ids), P, T, with_entropy=True)
    assert ent is not None
    for i in range(2):
        for j in range(2):
            row = logits[i, P - 1 + j] / T
            logz = math.log(np.exp(row - row.max()).sum()) + row.max()
            assert lp[i, j].item() == pytest.approx(row[ids[i, P + j]] - logz, abs=1e-5)
            probs = np.exp(row - logz)
            assert ent[i, j].item() == pytest.approx(-(probs * (row - logz)).sum(), abs=1e-5)


def test_raw_monitor_counts_raw_rewards_from_headers_and_resets() -> None:
    m = RawMonitor()
    g1 = [Experience(tokens=[1, 2], prompt_length=1, reward=r) for r in (1.0, 0.0, 0.0, 1.0)]
    g2 = [Experience(tokens=[1, 2], prompt_length=1, reward=1.0) for _ in range(2)]
    for g in (g1, g2):
        for part in pack_group(g, actor="e", msg_id_prefix="x", max_payload=1 << 20):
            m.on_raw_headers(part.headers)
    m.on_metrics(
        encode_json(
            MetricsMsg(
                actor="op",
                role="operator",
                ts=0,
                step=1,
                values={"operator/experiences_filtered": 3.0},
            )
        )
    )
    m.on_metrics(b"not json")
    out = m.take()
    assert out["reward/mean"] == pytest.approx(4 / 6)
    assert out["reward/raw_count"] == 6
    assert out["experience/filtered"] == 3
    again = m.take()
    assert again["reward/mean"] is None and again["reward/raw_count"] == 0


def test_raw_monitor_folds_the_latest_explorer_evals_into_the_next_record_once() -> None:
    m = RawMonitor()

    def explorer_metrics(step: int, values: dict[str, float]) -> bytes:
        return encode_json(MetricsMsg(actor="e", role="explorer", ts=0, step=step, values=values))

    m.on_metrics(explorer_metrics(1, {"eval/held/reward/mean": 0.25, "rollout/failed_tasks": 1}))
    m.on_metrics(explorer_metrics(2, {"eval/held/reward/mean": 0.5, "eval/held/tasks": 8}))
    # an operator's eval-looking key is not an eval result
    m.on_metrics(
        encode_json(MetricsMsg(actor="o", role="operator", ts=0, step=1, values={"eval/x": 9.0}))
    )
    out = m.take()
    assert out["eval/held/reward/mean"] == 0.5 and out["eval/held/tasks"] == 8
    assert "eval/x" not in out
    assert not any(k.startswith("eval/") for k in m.take())


def test_step_lines_first_steps_last_step_and_at_most_two_a_second() -> None:
    from rftstream.presentation.step_lines import StepLines

    lines = StepLines(total=100, first=3, per_second=2.0)
    t = 1000.0
    printed = []
    for step in range(1, 101):
        t += 0.0625  # 16 steps a second
        if lines.due(step, now=t):
            printed.append(step)
    assert printed[:3] == [1, 2, 3] and printed[-1] == 100
    gaps = [b - a for a, b in zip(printed[3:-1], printed[4:-1], strict=False)]
    assert gaps and all(g == 8 for g in gaps)  # every 0.5 s = every 8th step
    slow = StepLines(total=None, first=0, per_second=2.0)
    assert all(slow.due(s, now=1000.0 + s) for s in range(1, 20))  # slow runs: every step


def test_explorer_quota_counts_positions_not_whole_batches() -> None:
    p = policy(max_staleness=1)
    # a trainer batch in training (64) and 56 waiting: room for one more group of 8
    assert p.explorer_quota(120, 64) == 8
    assert p.explorer_quota(128, 64) == 0
    # a trainer waiting for one group (56 held): nine groups fit (one completes its batch)
    assert p.explorer_quota(56, 64) == 72
    assert p.explorer_quota(64, 64, version_lag=1) == 0
    # weights one version behind, half a batch on its way: only the other half fits (a
    # whole batch would put its last 32 a version past the bound)
    assert p.explorer_quota(32, 64, version_lag=1) == 32
    assert p.explorer_quota(0, 64, version_lag=3) == 0  # past the bound: nothing
    assert policy(max_staleness=None).explorer_quota(10**6, 64) is None
    # the whole-batch rule is the room for a whole batch
    for backlog in range(0, 200, 8):
        for lag in range(3):
            assert p.explorer_may_run(backlog, 64, lag) == (
                p.explorer_quota(backlog, 64, lag) >= 64
            )
