"""Every ZeRO stage (0-3) trains, saves and syncs the same whole weights (real DeepSpeed, CPU).

For each stage a :class:`PolicyTrainer` on the tiny model trains 3 steps on one
fixed batch (groups of rows sharing a prompt, so ``trainer.share_prompts`` and
the response-only LM head are on the path), with a KL loss against a reference
model and an entropy bonus, so each step's loss depends on the weights the
previous steps left. ``stage3_param_persistence_threshold: 0`` makes ZeRO-3
partition every parameter of the tiny model (by default DeepSpeed keeps
parameters under 100k elements whole, which would hide a missing gather).

Checked per stage:

* the losses of the 3 steps and the final weights equal stage 0's (up to fp32
  reduction order);
* :meth:`PolicyTrainer.state_dict` has every tensor whole (the shapes of the
  model as ``transformers`` loads it) and differs from the initial weights;
* the HF checkpoint of :meth:`PolicyTrainer.save_hf_checkpoint` loads in
  ``transformers`` with exactly the values of ``state_dict()``;
* the weights published through ``rftstream.weights`` (checkpoint method) and
  loaded by the explorer's transformers engine equal them exactly.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.policy_trainer import PolicyTrainer
from rftstream.weights import load_weights, save_weights
from tests.integration._ranks_worker import release
from tests.integration._util import kl_entropy_config

STAGES = (0, 1, 2, 3)


def batch() -> list[Experience]:
    """4 groups of 2 rows; the rows of a group share their 3-token prompt."""
    out = []
    for g in range(4):
        prompt = [10 + g, 20 + g, 30]
        for r in range(2):
            resp = [40 + (g * 7 + r * 3 + j) % 50 for j in range(3 + g + r)]
            adv = 1.0 if r == 0 else -1.0
            out.append(
                Experience(
                    tokens=prompt + resp,
                    prompt_length=len(prompt),
                    reward=adv,
                    logprobs=[0.0] * len(resp),
                    advantages=[adv] * len(resp),
                    eid=EID(0, f"t{g}", r),
                )
            )
    return out


def build(
    tmp_path: Path, model_path: str, stage: int, lean: bool = True, **algorithm: Any
) -> PolicyTrainer:
    data = kl_entropy_config(tmp_path, model_path, optimizer={"lr": 1e-2}, **algorithm)
    data["trainer"] = {
        "ppo_micro_batch_size_per_gpu": 4,
        "share_prompts": True,
        "lean_forward": lean,
        "zero_stage": stage,
        "deepspeed_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    }
    run = prepare_run(config_from_dict(data))
    return PolicyTrainer(run.cfg, run.model_path, run.algorithm)


@functools.cache
def trained(stage: int, model_path: str, tmp: str, lean: bool) -> dict[str, Any]:
    """Train 3 steps at ``stage``, with the lean forward where ``lean`` and it applies
    (never at ZeRO-3); the losses, state dict and checkpoint path (cached per stage and
    forward, so stage 0's serves as every other stage's reference)."""
    root = Path(tmp) / f"stage{stage}{'-lean' if lean else ''}"
    trainer = build(root, model_path, stage, lean)
    assert trainer.share_prompts and trainer.keep_kwarg is not None  # the fast paths run
    assert bool(trainer._lean) == (lean and stage < 3)
    partitioned = [p for p in trainer.engine.module.parameters() if p.data.numel() == 0]
    assert bool(partitioned) == (stage == 3)  # ZeRO-3 really partitions the tiny model
    losses = [trainer.train_step(batch())["actor/loss"] for _ in range(3)]
    state = trainer.state_dict()
    checkpoint = trainer.save_hf_checkpoint(root / "hf")
    vocab = trainer.vocab_size
    release(trainer)  # a ZeRO-3 engine's buckets: gigabytes of address space in this process
    return {"losses": losses, "state": state, "checkpoint": checkpoint, "vocab": vocab}


@pytest.fixture(scope="module")
def zero_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("zero"))


@pytest.mark.parametrize("stage", STAGES)
def test_stage_trains_saves_and_syncs_whole_weights(
    stage: int, tiny_model_path: str, zero_tmp: str, tmp_path: Path
) -> None:
    # stage 0 with the same forward: ZeRO-3 keeps the HF one (the lean one rounds
    # differently, and Adam can magnify a rounding of a near-zero gradient up to lr)
    lean = stage < 3
    ref = trained(0, tiny_model_path, zero_tmp, lean)
    got = trained(stage, tiny_model_path, zero_tmp, lean)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert got["vocab"] == initial["model.embed_tokens.weight"].shape[0] == 260

    # losses and weights as stage 0's (fp32, another reduction order)
    assert len(set(ref["losses"])) == 3  # each step's loss depends on the previous steps
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-6)
    state = got["state"]
    assert set(state) == set(ref["state"])
    for key, value in state.items():
        assert value.shape == initial[key].shape, key
        # Adam divides each gradient by its own running RMS: an element whose gradient is
        # near zero moves by up to lr per step whatever its rounding, so a few elements may
        # differ by more than the gradients do; 1e-4 is 1/300 of the 3 * lr they can move
        torch.testing.assert_close(value, ref["state"][key], rtol=1e-4, atol=1e-4)
    moved = max(float((state[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # training changed the weights

    # the HF checkpoint loads with exactly the trainer's values
    loaded = AutoModelForCausalLM.from_pretrained(got["checkpoint"]).state_dict()
    assert set(loaded) == set(initial)
    for key, value in loaded.items():
        assert torch.equal(value, state[key]), key

    # weight sync: published by checkpoint, loaded by the explorer's engine
    from rftstream.engines.transformers_engine import TransformersEngine

    ptr = save_weights("checkpoint", "zt", 3, state, tmp_path / "weights", step=3)
    engine = TransformersEngine(tiny_model_path)

    async def sync() -> None:
        await engine.load_weights(load_weights(ptr, "zt"), ptr.version)

    anyio.run(sync)
    synced = engine._model.state_dict()
    for key, value in synced.items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("stage", [0, 3])
def test_critic_weights_are_whole(stage: int, tiny_model_path: str, tmp_path: Path) -> None:
    """PPO's critic under ZeRO-3 gathers like the actor: every tensor of the backbone and
    value head has the shape of the unsharded module (the head ``(1, hidden)``, ``(1,)``)."""
    trainer = build(tmp_path, tiny_model_path, stage, algorithm_type="ppo")
    assert trainer.critic is not None
    exps = batch()
    for e in exps:
        e.advantages = None
    trainer.train_step(exps)
    critic = trainer.critic_state_dict()
    release(trainer)
    assert critic is not None
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert critic["value_head.weight"].shape == (1, 64)
    assert critic["value_head.bias"].shape == (1,)
    for key, value in initial.items():
        assert critic[f"backbone.{key}"].shape == value.shape, key
    assert float(critic["value_head.weight"].abs().max()) > 0  # the head trained from zero


def test_empty_tensors_are_never_published(tmp_path: Path) -> None:
    """A state dict holding ZeRO-3 partitions ((0,)-shaped) is refused, naming the key."""
    from rftstream.weights import WeightSyncError

    state = {"a.weight": torch.ones(2, 2), "model.embed_tokens.weight": torch.empty(0)}
    for method in ("checkpoint", "memory"):
        with pytest.raises(WeightSyncError, match=r"model\.embed_tokens\.weight.*ZeRO-3"):
            save_weights(method, "zt", 1, state, tmp_path, step=1)
    assert not list(tmp_path.iterdir())  # nothing written
