"""Gradient checkpointing and bf16 mixed precision in the policy trainer (real DeepSpeed, CPU).

* ``trainer.gradient_checkpointing``: the decoder layers really recompute in the
  backward pass (a hook counts their forward calls), and loss and gradients of
  the same batch equal those without it (fp32 tolerance); a train step reports
  the same loss.
* ``trainer.mixed_precision: bf16``: the module computes in bfloat16 while the
  optimizer keeps float32 master weights; after steps every bf16 weight is its
  master rounded to bf16, and the masters hold more than bf16 precision. An
  accelerator without bf16 is a ConfigError naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rftstream.config import config_from_dict
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError
from rftstream.training.memory import check_bf16_supported, mixed_precision_config
from rftstream.training.policy_trainer import PolicyTrainer
from tests.integration._util import small_config
from tests.unit.test_trainer_steps import exp, trainer_for

LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8]


def make(tmp_path: Path, tiny_model_path: str, **trainer: object) -> PolicyTrainer:
    return trainer_for(
        tmp_path,
        tiny_model_path,
        algorithm={"algorithm_type": "grpo", "kl_loss_fn": "none"},
        buffer={"train_batch_size": 8},
        trainer={"ppo_micro_batch_size_per_gpu": 4, "share_prompts": False, **trainer},
    )


def loss_and_grads(trainer: PolicyTrainer) -> tuple[float, dict[str, torch.Tensor], int]:
    """Next-token cross-entropy of a fixed batch through the DeepSpeed engine in training
    mode, its gradients, and how often the MLP of decoder layer 0 ran (transformers
    checkpoints a layer's ``forward``: its submodules run again in the backward pass)."""
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    mlp = trainer.engine.module.model.layers[0].mlp
    # a pre-hook: torch stops a recompute as soon as it has the tensors it needs
    handle = mlp.register_forward_pre_hook(count)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (4, 12), generator=g)
    trainer.engine.train()
    out = trainer.engine(input_ids=ids, labels=ids, use_cache=False)
    trainer.engine.backward(out.loss)
    handle.remove()
    grads = {
        n: p.grad.detach().clone()
        for n, p in trainer.engine.module.named_parameters()
        if p.grad is not None
    }
    trainer.engine.zero_grad()
    return float(out.loss.detach()), grads, calls


def test_gradient_checkpointing_keeps_loss_and_gradients(
    tmp_path: Path, tiny_model_path: str
) -> None:
    # both through HF's forward (the lean forward, which checkpointing turns off, is
    # compared with it in test_lean_forward)
    plain = make(tmp_path, tiny_model_path, lean_forward=False)
    ckpt = make(tmp_path, tiny_model_path, gradient_checkpointing=True)
    loss0, grads0, calls0 = loss_and_grads(plain)
    loss1, grads1, calls1 = loss_and_grads(ckpt)
    assert (calls0, calls1) == (1, 2)  # checkpointed: recomputed in the backward pass
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert grads0.keys() == grads1.keys() and len(grads0) > 10
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=1e-5, atol=1e-7, msg=name)
    # a whole trainer step: the same loss
    batch = [exp(r, i) for i, r in enumerate(LENGTHS)]
    out0, out1 = plain.train_step(batch), ckpt.train_step(batch)
    assert out1["actor/loss"] == pytest.approx(out0["actor/loss"], rel=1e-5, abs=1e-7)


def test_bf16_mixed_precision_keeps_fp32_master_weights(
    tmp_path: Path, tiny_model_path: str
) -> None:
    trainer = make(tmp_path, tiny_model_path, mixed_precision="bf16")
    module = trainer.engine.module
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert module(input_ids=ids).logits.dtype == torch.bfloat16
    batch = [exp(r, i) for i, r in enumerate(LENGTHS)]
    for _ in range(2):
        trainer.train_step(batch)
    masters = [p for group in trainer.optimizer.fp32_groups for p in group]
    weights = [p for p in module.parameters() if p.requires_grad]
    assert len(masters) == len(weights) and {m.dtype for m in masters} == {torch.float32}
    finer = 0
    for master, weight in zip(masters, weights, strict=True):
        assert torch.equal(master.to(torch.bfloat16), weight.detach())
        finer += int((master != weight.detach().float()).sum())
    assert finer > 0  # the masters hold bits bf16 cannot: the update is not lost to rounding
    assert {t.dtype for t in trainer.state_dict().values()} == {torch.bfloat16}


def test_bf16_without_hardware_support_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.mixed_precision.*bf16 is not supported"):
        check_bf16_supported(lambda: False)
    check_bf16_supported(lambda: True)
    assert mixed_precision_config("bf16")["bf16"] == {"enabled": True}
    assert mixed_precision_config("fp32")["bf16"] == {"enabled": False}


def test_unknown_mixed_precision_names_the_key(tmp_path: Path, tiny_model_path: str) -> None:
    data = small_config(tmp_path, tiny_model_path)
    data["trainer"]["mixed_precision"] = "fp8"
    with pytest.raises(ConfigError, match=r"trainer\.mixed_precision.*fp32, bf16"):
        validate_config(config_from_dict(data))
