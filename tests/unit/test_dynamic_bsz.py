"""``trainer.use_dynamic_bsz``: micro-batches formed per step by a token budget.

* :func:`token_budget_partitions` against brute force: every row once, every
  micro-batch within the budget (rows x (longest prompt + longest response),
  computed here), the count minimal where the docstring says so and within its
  bound elsewhere.
* :meth:`TrainBatch.trimmed` keeps each row's tokens and positions.
* A real DeepSpeed step (tiny model, CPU) with ``use_dynamic_bsz`` has the same
  loss, gradient and weights as the fixed micro-batch path on the same batch,
  for every ZeRO stage; short rows share micro-batches, long ones do not.
* The config errors, and MIX's verl weighting with dynamic micro-batches.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from algorithms import POLICY_LOSS_FN
from algorithms.policy_loss_fn import PPOPolicyLossFn
from rftstream.config import config_from_dict, validate_config
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.batch import collate, token_budget_partitions
from rftstream.training.policy_trainer import PolicyTrainer
from tests.integration._util import small_config
from tests.unit._trainer import capture_gradients

# ------------------------------------------------------------------ pure partitioning


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def _size(rows: list[int], p: list[int], r: list[int]) -> int:
    return len(rows) * (max(p[i] for i in rows) + max(r[i] for i in rows))


def _fewest(p: list[int], r: list[int], budget: float) -> float:
    """The fewest micro-batches of any split within ``budget`` (inf: none exists)."""
    best = float("inf")
    for part in _set_partitions(list(range(len(p)))):
        if all(_size(b, p, r) <= budget for b in part):
            best = min(best, len(part))
    return best


def _fewest_in_order(p: list[int], r: list[int], budget: int) -> int:
    n = len(p)
    best = n
    for cuts in itertools.product([False, True], repeat=n - 1):
        runs, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                runs.append(list(range(start, i)))
                start = i
        runs.append(list(range(start, n)))
        if all(_size(b, p, r) <= budget for b in runs):
            best = min(best, len(runs))
    return best


def _check_cover(parts: list[list[int]], n: int, p: list[int], r: list[int], budget: int) -> None:
    assert sorted(i for part in parts for i in part) == list(range(n))
    assert all(part == sorted(part) and part for part in parts)
    assert all(_size(part, p, r) <= budget for part in parts)


@pytest.mark.parametrize("seed", range(40))
def test_partitions_cover_fit_and_meet_their_bound(seed: int) -> None:
    rnd = random.Random(seed)
    n = rnd.randint(1, 7)
    p = [rnd.randint(1, 6) for _ in range(n)]
    r = [rnd.randint(1, 12) for _ in range(n)]
    budget = rnd.randint(max(a + b for a, b in zip(p, r, strict=True)), 60)
    parts = token_budget_partitions(p, r, budget)
    _check_cover(parts, n, p, r, budget)
    assert len(parts) >= _fewest(p, r, budget)
    # documented bound: at most the fewest possible for half the budget
    assert len(parts) <= _fewest(p, r, budget / 2)
    # in order: the fewest of any split into consecutive runs
    ordered = token_budget_partitions(p, r, budget, reorder=False)
    _check_cover(ordered, n, p, r, budget)
    assert all(part == list(range(part[0], part[-1] + 1)) for part in ordered)
    assert len(ordered) == _fewest_in_order(p, r, budget)


@pytest.mark.parametrize("seed", range(30))
def test_partitions_are_minimal_when_prompts_are_equal(seed: int) -> None:
    rnd = random.Random(1000 + seed)
    n = rnd.randint(1, 7)
    p = [3] * n
    r = [rnd.randint(1, 12) for _ in range(n)]
    budget = rnd.randint(3 + max(r), 70)
    parts = token_budget_partitions(p, r, budget)
    _check_cover(parts, n, p, r, budget)
    assert len(parts) == _fewest(p, r, budget)


def test_partitions_keep_pairs_together() -> None:
    p = [2] * 8
    r = [9, 1, 8, 2, 7, 3, 1, 1]
    for reorder in (True, False):
        parts = token_budget_partitions(p, r, 44, unit=2, reorder=reorder)
        _check_cover(parts, 8, p, r, 44)
        for part in parts:
            assert all(i + 1 in part for i in part if i % 2 == 0)
            assert all(i - 1 in part for i in part if i % 2 == 1)


def test_a_row_over_the_budget_trains_alone() -> None:
    """Trinity-RFT's examples set budgets below their maxima: the rare row longer than the
    budget gets a micro-batch of its own (verl would fail the step)."""
    assert token_budget_partitions([2, 4, 1], [3, 8, 2], 10) == [[1], [0, 2]]
    assert token_budget_partitions([2, 4, 1], [3, 8, 2], 10, reorder=False) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="1 prompt lengths but 2 response lengths"):
        token_budget_partitions([2], [3, 4], 10)


# ------------------------------------------------------------------ trimming


def exp(prompt: int, resp: int, i: int) -> Experience:
    """``prompt`` prompt tokens, ``resp`` response tokens (ids from the tiny vocabulary)."""
    tokens = [5 + ((i + j) % 7) for j in range(prompt)] + [7 + ((i + j) % 9) for j in range(resp)]
    return Experience(
        tokens=tokens,
        prompt_length=prompt,
        reward=0.0,
        logprobs=[-0.5] * resp,
        advantages=[1.0 - 0.25 * i] * resp,
        eid=EID(0, f"t{i}", 0),
    )


def test_trimmed_keeps_every_rows_tokens_and_positions() -> None:
    exps = [exp(4, 1, 0), exp(1, 9, 1), exp(2, 3, 2), exp(3, 2, 3)]
    batch = collate(exps, 0)
    assert (batch.prompt_width, batch.response_width) == (4, 9)
    sub = batch.rows(torch.tensor([2, 3])).trimmed()
    assert (sub.prompt_width, sub.response_width) == (3, 3)
    assert sub.input_ids.shape == (2, 6) and sub.advantages.shape == (2, 3)
    kept = batch.rows(torch.tensor([2, 3])).trimmed(responses=False)
    assert (kept.prompt_width, kept.response_width) == (3, 9)
    for row, e in zip(range(2), exps[2:], strict=True):
        real = sub.attention_mask[row].bool()
        assert sub.input_ids[row][real].tolist() == e.tokens.tolist()
        assert sub.position_ids[row][real].tolist() == list(range(len(e.tokens)))
        assert sub.response_mask[row].sum() == e.response_length
        assert sub.advantages[row, : e.response_length].tolist() == e.advantages.tolist()


# ------------------------------------------------------------------ real DeepSpeed steps

SEEN: list[tuple[int, int]] = []  # per micro-batch: (rows, padded response width)


class WidthSpyPPO(PPOPolicyLossFn):
    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):  # type: ignore[override]
        SEEN.append((int(action_mask.shape[0]), int(action_mask.shape[1])))
        return super().__call__(logprob, old_logprob, action_mask, advantages, **kwargs)


@pytest.fixture(autouse=True)
def spy() -> None:
    SEEN.clear()
    POLICY_LOSS_FN.register_module("width_spy_ppo")(WidthSpyPPO)


def trainer_for(tmp_path: Path, tiny_model_path: str, **trainer: Any) -> PolicyTrainer:
    data = small_config(tmp_path, tiny_model_path)
    data["model"].update(max_prompt_tokens=4, max_response_tokens=12)
    data["buffer"]["train_batch_size"] = 8
    data["algorithm"].update(
        policy_loss_fn="width_spy_ppo",
        kl_loss_fn="none",
        entropy_loss_fn="none",
        # per-row means: a rows-weighted mean over any micro-batches is the batch mean
        loss_agg_mode="seq-mean-token-mean",
        # eps 1: Adam's first step scales with the gradient, not only its sign
        optimizer={"lr": 0.05, "eps": 1.0},
    )
    data["trainer"].update(trainer)
    run = prepare_run(config_from_dict(data))
    return PolicyTrainer(run.cfg, run.model_path, run.algorithm)


# prompt and response lengths of 8 rows: 3 short, 5 of mixed length
BATCH = [(2, 1), (4, 12), (3, 2), (1, 10), (2, 2), (4, 6), (3, 11), (1, 3)]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_dynamic_step_equals_the_fixed_step(
    tmp_path: Path, tiny_model_path: str, zero_stage: int
) -> None:
    exps = [exp(p, r, i) for i, (p, r) in enumerate(BATCH)]
    fixed = trainer_for(
        tmp_path / "fixed", tiny_model_path, zero_stage=zero_stage, ppo_micro_batch_size_per_gpu=2
    )
    grads_fixed = capture_gradients(fixed) if zero_stage == 0 else {}
    out_fixed = fixed.train_step(exps)
    assert len(SEEN) == 4
    SEEN.clear()
    dynamic = trainer_for(
        tmp_path / "dyn",
        tiny_model_path,
        zero_stage=zero_stage,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=32,
    )
    grads_dyn = capture_gradients(dynamic) if zero_stage == 0 else {}
    out_dyn = dynamic.train_step(exps)
    # longest first (prompt + response): 4+12, 3+11 | 1+10, 4+6 | 3+2, 2+2, 1+3, 2+1
    assert sorted(SEEN) == [(2, 10), (2, 12), (4, 3)]
    assert out_dyn["actor/micro_batches"] == len(SEEN) != 4
    assert out_dyn["actor/micro_batch_max_tokens"] <= 32
    assert out_fixed["actor/micro_batches"] == 4
    assert out_dyn["actor/loss"] == pytest.approx(out_fixed["actor/loss"], abs=1e-6)
    if zero_stage == 0:
        assert grads_fixed.keys() == grads_dyn.keys() and grads_fixed
        for name, g in grads_fixed.items():
            torch.testing.assert_close(grads_dyn[name], g, atol=1e-6, rtol=1e-5, msg=name)
    w_fixed, w_dyn = fixed.state_dict(), dynamic.state_dict()
    moved = 0
    for name, w in w_fixed.items():
        torch.testing.assert_close(w_dyn[name], w, atol=1e-6, rtol=1e-5, msg=name)
        moved += int(name in w_dyn)
    assert moved == len(w_fixed)


def test_short_rows_share_micro_batches(tmp_path: Path, tiny_model_path: str) -> None:
    budget = 32
    trainer = trainer_for(
        tmp_path, tiny_model_path, use_dynamic_bsz=True, max_token_len_per_gpu=budget
    )
    lengths = [(2, 12), (2, 1), (2, 11), (2, 2), (2, 1), (2, 10), (2, 2), (2, 1)]
    out = trainer.train_step([exp(p, r, i) for i, (p, r) in enumerate(lengths)])
    assert out["actor/micro_batches"] == len(SEEN)
    rows_by_width = dict((w, rows) for rows, w in SEEN)
    # the widest micro-batch holds fewer rows than the narrowest
    assert rows_by_width[max(rows_by_width)] < rows_by_width[min(rows_by_width)]
    assert all(rows * (2 + width) <= budget for rows, width in SEEN)
    assert sum(rows for rows, _ in SEEN) == 8
    assert out["actor/micro_batch_max_tokens"] == max(rows * (2 + w) for rows, w in SEEN)
    # longest first: 2+12, 2+11 (2 x 14) | 2+10, 2+2 (2 x 12) | four short rows (4 x 4)
    assert sorted(SEEN) == [(2, 10), (2, 12), (4, 2)]


# ------------------------------------------------------------------ config errors


def test_a_budget_below_the_longest_row_is_a_warning(tmp_path: Path, tiny_model_path: str) -> None:
    from rftstream.config.validate import ConfigWarning

    data = small_config(tmp_path, tiny_model_path)
    data["model"].update(max_prompt_tokens=4, max_response_tokens=12)
    data["trainer"].update(use_dynamic_bsz=True, max_token_len_per_gpu=15)
    with pytest.warns(ConfigWarning, match="trains in a micro-batch of its own"):
        validate_config(config_from_dict(data))
    data["trainer"]["max_token_len_per_gpu"] = 16
    cfg = config_from_dict(data)
    validate_config(cfg)
    assert cfg.trainer.token_budget(cfg.model) == 16
    data["trainer"]["max_token_len_per_gpu"] = None
    cfg = config_from_dict(data)
    validate_config(cfg)
    assert cfg.trainer.token_budget(cfg.model) == 2 * (4 + 12)
    data["trainer"].update(use_dynamic_bsz=False, max_token_len_per_gpu=15)
    validate_config(config_from_dict(data))  # the budget is not used without use_dynamic_bsz
    data["trainer"]["max_token_len_per_gpu"] = 0
    with pytest.raises(ConfigError) as ei:
        validate_config(config_from_dict(data))
    assert ei.value.key_path == "trainer.max_token_len_per_gpu"


def test_a_dpo_pair_over_the_budget_is_said_and_trains_alone(
    tmp_path: Path, tiny_model_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    rows = tmp_path / "dpo.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    data = small_config(tmp_path, tiny_model_path)
    data["mode"] = "train"
    data["model"].update(max_prompt_tokens=4, max_response_tokens=12)
    data["algorithm"] = {"algorithm_type": "dpo"}
    data["buffer"].update(
        train_batch_size=4, trainer_input={"experience_buffer": {"path": str(rows)}}
    )
    data["buffer"]["trainer_input"]["experience_buffer"]["format"] = {"prompt_key": "prompt"}
    data["trainer"].update(use_dynamic_bsz=True, max_token_len_per_gpu=20)
    run = prepare_run(config_from_dict(data))
    trainer = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    assert "cannot hold a DPO pair (2 rows)" in caplog.text
    from rftstream.training.datasets import load_dataset_experiences

    pairs = load_dataset_experiences(
        run.cfg.buffer.trainer_input.experience_buffer,
        trainer.tokenizer,
        schema="dpo",
        key_path="buffer.trainer_input.experience_buffer",
    )
    out = trainer.train_step(pairs * 2)  # 2 pairs: each over the budget, each alone
    assert out["actor/micro_batches"] == 2
