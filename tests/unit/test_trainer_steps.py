"""PolicyTrainer steps on the tiny model (real DeepSpeed): micro-batch partitioning and
the gradient of a MIX step, against references computed here.

* With ``can_balance_batch`` (and ``trainer.balance_batch``) the micro-batches of
  a step hold equal token counts; otherwise they keep the batch order; DPO
  (chosen, rejected) pairs are never split. A spy loss records what each
  micro-batch holds (rows are told apart by their response lengths).
* The gradient of one MIX step is ``(1 - mu) * usual-mean + mu * expert-mean``
  as seed 000 defines it, whatever the micro-batches' row counts: computed
  here with a fresh copy of the model, one row at a time, no padding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from algorithms import ALGORITHM_TYPE, POLICY_LOSS_FN
from algorithms.algorithm import GRPOAlgorithm
from algorithms.policy_loss_fn import DPOLossFn, PPOPolicyLossFn
from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.policy_trainer import PolicyTrainer
from tests.integration._util import small_config
from tests.unit._trainer import assert_gradients_match, capture_gradients, row_logprobs

SEEN: list[list[int]] = []  # per micro-batch: the response lengths of its rows, in order


class SpyPPO(PPOPolicyLossFn):
    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):  # type: ignore[override]
        SEEN.append([int(x) for x in action_mask.sum(-1).tolist()])
        return super().__call__(logprob, old_logprob, action_mask, advantages, **kwargs)


class SpyDPO(DPOLossFn):
    def __call__(self, logprob, ref_logprob, action_mask, **kwargs):  # type: ignore[override]
        SEEN.append([int(x) for x in action_mask.sum(-1).tolist()])
        return super().__call__(logprob, ref_logprob, action_mask, **kwargs)


class NoBalanceGRPO(GRPOAlgorithm):  # type: ignore[misc, valid-type]
    can_balance_batch = False


@pytest.fixture(autouse=True)
def spies() -> None:
    SEEN.clear()
    POLICY_LOSS_FN.register_module("spy_ppo")(SpyPPO)
    POLICY_LOSS_FN.register_module("spy_dpo")(SpyDPO)
    ALGORITHM_TYPE.register_module("grpo_no_balance")(NoBalanceGRPO)


def exp(resp: int, i: int, reward: float = 0.0, info: dict | None = None) -> Experience:
    """Prompt of 2 tokens, ``resp`` response tokens (ids from the tiny vocabulary)."""
    tokens = [5 + (i % 7), 6] + [7 + ((i + j) % 9) for j in range(resp)]
    return Experience(
        tokens=tokens,
        prompt_length=2,
        reward=reward,
        logprobs=[0.0] * resp,
        advantages=[1.0 - 0.25 * i] * resp,
        eid=EID(0, f"t{i}", 0),
        info=dict(info or {}),
    )


def trainer_for(tmp_path: Path, tiny_model_path: str, **sections: Any) -> PolicyTrainer:
    data = small_config(tmp_path, tiny_model_path)
    data["model"]["max_response_tokens"] = 16  # responses here are up to 9 tokens: none cut
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    run = prepare_run(config_from_dict(data))
    return PolicyTrainer(run.cfg, run.model_path, run.algorithm)


# ------------------------------------------------------------------ balanced micro-batches


def spy_trainer_of_4_micro_batches_of_2(tmp_path: Path, tiny_model_path: str) -> PolicyTrainer:
    """GRPO with the spying loss, batches of 8 in balanced micro-batches of 2."""
    trainer = trainer_for(
        tmp_path,
        tiny_model_path,
        algorithm={"algorithm_type": "grpo", "policy_loss_fn": "spy_ppo", "kl_loss_fn": "none"},
        buffer={"train_batch_size": 8},
        trainer={"ppo_micro_batch_size_per_gpu": 2, "balance_batch": True},
    )
    assert trainer.gas == 4
    return trainer


LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8]  # 2 + r tokens per row: 3 .. 10, best split 4 x 13


def test_balanced_micro_batches_hold_equal_token_counts(
    tmp_path: Path, tiny_model_path: str
) -> None:
    trainer = spy_trainer_of_4_micro_batches_of_2(tmp_path, tiny_model_path)
    out = trainer.train_step([exp(r, i) for i, r in enumerate(LENGTHS)])
    assert len(SEEN) == 4 and sorted(r for mb in SEEN for r in mb) == LENGTHS
    # each micro-batch: 2 rows of 2 prompt tokens + responses summing to 9 -> 13 tokens
    assert [2 * len(mb) + sum(mb) for mb in SEEN] == [13, 13, 13, 13]
    assert out["actor/micro_batch_token_spread"] == 0.0


@pytest.mark.parametrize(
    "algorithm_type,balance_batch", [("grpo", False), ("grpo_no_balance", True)]
)
def test_without_balancing_the_order_is_kept(
    tmp_path: Path, tiny_model_path: str, algorithm_type: str, balance_batch: bool
) -> None:
    trainer = trainer_for(
        tmp_path,
        tiny_model_path,
        algorithm={
            "algorithm_type": algorithm_type,
            "policy_loss_fn": "spy_ppo",
            "kl_loss_fn": "none",
        },
        buffer={"train_batch_size": 8},
        trainer={"ppo_micro_batch_size_per_gpu": 2, "balance_batch": balance_batch},
    )
    order = [8, 1, 7, 2, 6, 3, 5, 4]
    out = trainer.train_step([exp(r, i) for i, r in enumerate(order)])
    assert SEEN == [[8, 1], [7, 2], [6, 3], [5, 4]]
    assert "actor/micro_batch_token_spread" not in out


def test_a_batch_larger_than_train_batch_size_keeps_micro_batches_at_their_size(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """12 rows where train_batch_size says 8 (a rank's shard of whole groups can exceed
    its even share): 6 micro-batches of 2 rows, not DeepSpeed's 4 of 3, and still one
    optimizer step."""
    trainer = spy_trainer_of_4_micro_batches_of_2(tmp_path, tiny_model_path)
    steps = trainer.engine.global_steps
    out = trainer.train_step([exp(1 + i % 8, i) for i in range(12)])
    assert [len(mb) for mb in SEEN] == [2] * 6 and out["actor/micro_batches"] == 6
    assert trainer.engine.global_steps == steps + 1
    SEEN.clear()
    trainer.train_step([exp(1 + i % 8, i) for i in range(8)])  # back to gas: one step more
    assert [len(mb) for mb in SEEN] == [2] * 4
    assert trainer.engine.global_steps == steps + 2


def test_dpo_pairs_are_never_split(tmp_path: Path, tiny_model_path: str) -> None:
    data = tmp_path / "dpo.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    trainer = trainer_for(
        tmp_path,
        tiny_model_path,
        mode="train",
        algorithm={"algorithm_type": "dpo", "policy_loss_fn": "spy_dpo"},
        buffer={
            "train_batch_size": 6,
            "trainer_input": {"experience_buffer": {"path": str(data)}},
        },
        # balance_batch is on, but DPO's can_balance_batch is False
        trainer={"ppo_micro_batch_size_per_gpu": 4, "balance_batch": True},
    )
    assert trainer.gas == 2
    # pairs (chosen, rejected): (9, 1), (8, 2), (7, 3): a token-balanced split would pair 9 with 1s
    lengths = [9, 1, 8, 2, 7, 3]
    out = trainer.train_step([exp(r, i) for i, r in enumerate(lengths)])
    # 3 pairs in 2 micro-batches: 2 pairs, then 1; never 3 + 3 rows
    assert SEEN == [[9, 1, 8, 2], [7, 3]]
    assert "actor/dpo_loss" in out


# ------------------------------------------------------------------ MIX: gradient of a step


def _expert_file(tmp_path: Path) -> str:
    path = tmp_path / "expert.jsonl"
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    path.write_text(json.dumps(row) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "case",
    [
        # 5 rows, micro 2: DeepSpeed runs 3 micro-batches of 2, 2 and 1 rows
        {"rows": 5, "micro": 2, "balance": True, "explicit": True},
        {"rows": 5, "micro": 2, "balance": False, "explicit": True},
        {"rows": 5, "micro": 2, "balance": True, "explicit": True, "dynamic": True},
        # 6 rows, micro 3, batch args filled by prepare_run: 2 equal micro-batches
        {"rows": 6, "micro": 3, "balance": True, "explicit": False},
        # a short last batch: 4 of 6 rows, so the micro-batches are uneven (2 + 2 + 0 ...)
        {"rows": 6, "micro": 2, "balance": False, "explicit": False, "short": 4},
        # trainer.use_dynamic_bsz: micro-batches of 2 and 4 rows (token budget 20); the
        # loss gets use_dynamic_bsz filled in and weighs each by its rows
        {"rows": 6, "micro": 2, "balance": True, "explicit": False, "trainer_dynamic": True},
    ],
)
def test_mix_step_gradient_is_the_seed_objective(
    tmp_path: Path, tiny_model_path: str, case: dict
) -> None:
    from transformers import AutoModelForCausalLM

    mu, n_rows = 0.3, case["rows"]
    n_expert = 2
    loss_args: dict[str, Any] = {"mu": mu, "use_token_level_loss_in_sft": False}
    if case["explicit"]:
        loss_args.update(
            ppo_mini_batch_size=n_rows,
            ppo_micro_batch_size_per_gpu=case["micro"],
            train_batch_size_usual=n_rows - n_expert,
            train_batch_size_expert=n_expert,
            use_dynamic_bsz=case.get("dynamic", False),
        )
    trainer = trainer_for(
        tmp_path,
        tiny_model_path,
        algorithm={
            "algorithm_type": "mix",
            "kl_loss_fn": "none",
            "loss_agg_mode": "seq-mean-token-mean",
            "sample_strategy_args": {"expert_data_ratio": n_expert / n_rows},
            "policy_loss_fn_args": loss_args,
        },
        buffer={
            "train_batch_size": n_rows,
            "trainer_input": {
                "auxiliary_buffers": {"sft_dataset": {"path": _expert_file(tmp_path)}}
            },
        },
        trainer={
            "ppo_micro_batch_size_per_gpu": case["micro"],
            "balance_batch": case["balance"],
            "grad_clip": 0.0,
            "use_dynamic_bsz": case.get("trainer_dynamic", False),
            "max_token_len_per_gpu": 20,
        },
        model={"max_prompt_tokens": 4},
    )
    args = trainer.algorithm.config.policy_loss_fn_args
    assert bool(args.get("use_dynamic_bsz")) == bool(
        case.get("trainer_dynamic") or case.get("dynamic")
    )
    tbs_u, tbs_e = args["train_batch_size_usual"], args["train_batch_size_expert"]
    assert (tbs_u, tbs_e) == (n_rows - n_expert, n_expert)
    batch_rows = case.get("short", n_rows)
    lengths = [3, 1, 4, 2, 5, 3][:batch_rows]
    expert_rows = set(range(batch_rows - n_expert, batch_rows))
    exps = [
        exp(r, i, info={"is_expert": i in expert_rows, "step": 1}) for i, r in enumerate(lengths)
    ]
    for i in expert_rows:
        exps[i].advantages = torch.zeros(lengths[i])
    grads = capture_gradients(trainer)
    out = trainer.train_step(exps)
    assert grads
    if case.get("trainer_dynamic"):
        # 2 + (5, 4) tokens: 2 x 7 | 2 + (3, 3, 2, 1): 4 x 5 (4 x 7 > 20)
        assert out["actor/micro_batches"] == 2

    # the seed's objective, one row at a time on a fresh copy of the initial model
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    model.train()
    usual_sum = torch.zeros(())
    expert_sum = torch.zeros(())
    for i, e in enumerate(exps):
        lp = row_logprobs(model, e)
        if i in expert_rows:
            expert_sum = expert_sum + (-lp).mean()  # SFT, sequence level
        else:
            ratio = torch.exp(lp - lp.detach())  # the first pass: ratio 1, gradient d lp
            adv = e.advantages.to(torch.float32)
            usual_sum = usual_sum + (-adv * ratio).mean()  # PPO, seq-mean-token-mean
    objective = (1 - mu) * usual_sum / tbs_u + mu * expert_sum / tbs_e
    objective.backward()
    assert_gradients_match(grads, model)


def test_mix_with_a_fixed_count_and_dynamic_micro_batches_is_refused(
    tmp_path: Path, tiny_model_path: str
) -> None:
    from rftstream.errors import ConfigError

    with pytest.raises(ConfigError, match="fixed gradient accumulation count") as ei:
        trainer_for(
            tmp_path,
            tiny_model_path,
            algorithm={
                "algorithm_type": "mix",
                "kl_loss_fn": "none",
                "policy_loss_fn_args": {"use_dynamic_bsz": False},
            },
            buffer={
                "train_batch_size": 4,
                "trainer_input": {
                    "auxiliary_buffers": {"sft_dataset": {"path": _expert_file(tmp_path)}}
                },
            },
            trainer={"use_dynamic_bsz": True},
        )
    assert ei.value.key_path == "algorithm.policy_loss_fn_args.use_dynamic_bsz"


# ------------------------------------------------------------------ a declared field that never comes


class NeedsWeight(PPOPolicyLossFn):
    def __call__(self, logprob, old_logprob, action_mask, advantages, row_weight, **kwargs):  # type: ignore[override]
        return super().__call__(logprob, old_logprob, action_mask, advantages)


def test_a_declared_field_missing_from_the_batch_is_named(
    tmp_path: Path, tiny_model_path: str
) -> None:
    from algorithms import SAMPLE_STRATEGY
    from algorithms.sample_strategy import SampleStrategy

    class Declares(SampleStrategy):  # Trinity style: the field is named where it gathers
        async def sample(self, step: int) -> tuple[list, dict, list]:
            from algorithms import CustomField

            return [], {"f": [CustomField("w", "row_weight", torch.float32)]}, []

    POLICY_LOSS_FN.register_module("needs_weight")(NeedsWeight)
    SAMPLE_STRATEGY.register_module("declares_weight")(Declares)
    trainer = trainer_for(
        tmp_path,
        tiny_model_path,
        algorithm={
            "algorithm_type": "grpo",
            "policy_loss_fn": "needs_weight",
            "sample_strategy": "declares_weight",
            "kl_loss_fn": "none",
        },
        buffer={"train_batch_size": 2},
    )
    # config time passed (declared); a batch without it (a plain list) fails by name
    with pytest.raises(RuntimeError, match="NeedsWeight needs field 'row_weight'"):
        trainer.train_step([exp(2, 0), exp(3, 1)])


@pytest.mark.parametrize("dynamic", [False, True])
def test_clipping_done_by_the_trainer_matches_deepspeeds_and_reports_the_norm(
    tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch, dynamic: bool
) -> None:
    """One rank at ZeRO 0 in fp32: the trainer clips with torch's multi-tensor
    ``clip_grad_norm_`` instead of DeepSpeed; the weights after two steps are DeepSpeed's,
    and ``actor/grad_norm`` (DeepSpeed reported none there) is the norm before the clip."""
    trainer = {"grad_clip": 1e-4, "ppo_micro_batch_size_per_gpu": 2, "use_dynamic_bsz": dynamic}
    ours = trainer_for(tmp_path / "ours", tiny_model_path, trainer=trainer)
    assert ours._own_clipping, "one fp32 rank at ZeRO 0: clipping is the trainer's"
    monkeypatch.setattr(PolicyTrainer, "_clipping_outside_deepspeed", lambda *_: None)
    theirs = trainer_for(tmp_path / "theirs", tiny_model_path, trainer=trainer)
    assert not theirs._own_clipping
    batch = [exp(2 + i % 3, i, reward=float(i % 2)) for i in range(6)]
    for _ in range(2):
        mine = ours.train_step(batch)
        ds = theirs.train_step(batch)
    assert mine["actor/grad_norm"] > 1e-3  # the clip acted
    assert "actor/grad_norm" not in ds
    assert mine["actor/micro_batches"] == ds["actor/micro_batches"]
    assert dynamic or mine["actor/micro_batches"] > 1  # clipped once, at the boundary
    for (name, a), b in zip(
        ours.engine.module.named_parameters(), theirs.engine.module.parameters(), strict=True
    ):
        assert torch.allclose(a, b, rtol=0, atol=1e-7), name
