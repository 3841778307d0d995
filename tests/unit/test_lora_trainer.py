"""LoRA in the policy trainer (peft, real DeepSpeed on the tiny model).

* Training changes the adapter only: after 3 steps every base weight is bitwise
  what the model file holds, and the optimizer holds the adapter's parameters only.
* The weights explorers get are ``W + (alpha / r) * B @ A``, computed here with
  numpy from the adapter's matrices, and a plain ``transformers`` model loaded
  with them computes the policy's logits.
* The reference model for KL is the base model (adapter disabled).
* The HF checkpoint holds the merged weights; its ``lora_adapter`` directory
  the adapter, which peft itself merges into the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rftstream.errors import ConfigError
from rftstream.model_loading import load_causal_lm
from rftstream.training.policy_trainer import PolicyTrainer
from tests.unit.test_trainer_steps import exp, trainer_for

peft = pytest.importorskip("peft")  # the optional extra rftstream[lora]; CI installs it

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]
LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8]


def lora_trainer(tmp_path: Path, tiny_model_path: str, **lora: object) -> PolicyTrainer:
    entry = {"lora_rank": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS, **lora}
    return trainer_for(
        tmp_path,
        tiny_model_path,
        model={"lora_configs": [entry]},
        algorithm={"algorithm_type": "grpo", "kl_loss_fn": "k2", "optimizer": {"lr": 1e-2}},
        buffer={"train_batch_size": 8},
        trainer={"ppo_micro_batch_size_per_gpu": 4},
    )


def plain_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def batch() -> list:
    return [exp(r, i) for i, r in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str) -> PolicyTrainer:
    trainer = lora_trainer(tmp_path_factory.mktemp("lora"), tiny_model_path)
    for _ in range(3):
        trainer.train_step(batch())
    return trainer


def test_only_the_adapter_trains(trained: PolicyTrainer, tiny_model_path: str) -> None:
    base = dict(load_causal_lm(tiny_model_path).named_parameters())
    module = trained.engine.module
    adapter = {n: p for n, p in module.named_parameters() if ".lora_" in n}
    # 3 target modules x 2 layers, A and B each
    assert len(adapter) == len(TARGETS) * 2 * 2
    assert all(p.requires_grad for p in adapter.values())
    for name, p in module.named_parameters():
        if ".lora_" in name:
            continue
        assert not p.requires_grad, name
        assert torch.equal(p.detach(), base[plain_name(name)].detach()), name
    # B starts at zero (the adapter starts as the identity); 3 steps moved both matrices
    assert all(float(p.detach().abs().max()) > 0 for n, p in adapter.items() if "lora_B" in n)
    optimized = {id(p) for g in trained.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in adapter.values()}


def test_explorers_get_base_plus_scaled_adapter(
    trained: PolicyTrainer, tiny_model_path: str
) -> None:
    base = {k: v.numpy() for k, v in load_causal_lm(tiny_model_path).state_dict().items()}
    params = {n: p.detach().numpy() for n, p in trained.engine.module.named_parameters()}
    sent = trained.state_dict()
    assert set(sent) == set(base)  # the plain model's keys: no peft names, no lora tensors
    adapted = set()
    for name in base:
        layer = name.removesuffix(".weight")
        a = params.get(f"base_model.model.{layer}.lora_A.default.weight")
        if a is None:
            np.testing.assert_array_equal(sent[name].numpy(), base[name], err_msg=name)
            continue
        b = params[f"base_model.model.{layer}.lora_B.default.weight"]
        expected = base[name] + (ALPHA / RANK) * (b.astype(np.float64) @ a.astype(np.float64))
        np.testing.assert_allclose(sent[name].numpy(), expected, rtol=0, atol=1e-6, err_msg=name)
        assert not np.array_equal(sent[name].numpy(), base[name]), name
        adapted.add(layer.rsplit(".", 1)[-1])
    assert adapted == set(TARGETS)
    # an explorer's plain transformers model with these weights computes the policy
    plain = load_causal_lm(tiny_model_path)
    plain.load_state_dict(sent, strict=True)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    trained.engine.module.eval()
    with torch.no_grad():
        policy = trained.engine.module(input_ids=ids).logits
        torch.testing.assert_close(plain.eval()(input_ids=ids).logits, policy)


def test_reference_is_the_base_model(trained: PolicyTrainer, tiny_model_path: str) -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    base = load_causal_lm(tiny_model_path).eval()
    assert trained.ref_model is not None
    assert not list(trained.ref_model.parameters())  # no copy of the weights
    trained.engine.module.eval()
    with torch.no_grad():
        ref = trained.ref_model(input_ids=ids).logits
        torch.testing.assert_close(ref, base(input_ids=ids).logits)
        policy = trained.engine.module(input_ids=ids).logits
    assert float((policy - ref).abs().max()) > 1e-4  # the adapter is back on afterwards


def test_checkpoint_holds_merged_weights_and_the_adapter(
    trained: PolicyTrainer, tiny_model_path: str, tmp_path: Path
) -> None:
    path = trained.save_hf_checkpoint(tmp_path / "global_step_3")
    loaded = load_causal_lm(str(path)).state_dict()
    sent = trained.state_dict()
    for name, tensor in sent.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    adapter_dir = path / "lora_adapter"
    assert (adapter_dir / "adapter_config.json").is_file()
    merged_by_peft = (
        peft.PeftModel.from_pretrained(load_causal_lm(tiny_model_path), str(adapter_dir))
        .merge_and_unload()
        .state_dict()
    )
    for name, tensor in merged_by_peft.items():
        torch.testing.assert_close(tensor, loaded[name], rtol=0, atol=1e-6, msg=name)


def test_unknown_target_module_names_the_key(tmp_path: Path, tiny_model_path: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.lora_configs\[0\]\.target_modules"):
        lora_trainer(tmp_path, tiny_model_path, target_modules=["attn_qkv"])


def test_adapter_path_continues_training(
    trained: PolicyTrainer, tiny_model_path: str, tmp_path: Path
) -> None:
    path = trained.save_hf_checkpoint(tmp_path / "ck")
    again = lora_trainer(tmp_path, tiny_model_path, path=str(path / "lora_adapter"))
    sent = trained.state_dict()
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, sent[name], rtol=0, atol=1e-6, msg=name)
    with pytest.raises(ConfigError, match=r"model\.lora_configs\[0\]\.path"):
        lora_trainer(tmp_path, tiny_model_path, path=str(tmp_path))


def test_the_wire_carries_the_adapter_alone_and_explorers_merge_it_exactly(
    trained: PolicyTrainer, tiny_model_path: str
) -> None:
    """``sync_method: jetstream`` sends the adapter only; the explorer's merge onto the
    base weights it reads from ``model_path`` is bitwise the trainer's merged weights."""
    from rftstream.weights.fetcher import merge_lora, read_base_weights

    adapter = trained.wire_state_dict(torch.bfloat16)  # the adapter stays float32
    lora = trained.lora_wire()
    assert lora is not None and set(lora.layers) == {
        n.removesuffix(".lora_A.weight") for n in adapter if n.endswith(".lora_A.weight")
    }
    assert len(adapter) == len(TARGETS) * 2 * 2 and all(".lora_" in n for n in adapter)
    assert all(t.dtype == torch.float32 for t in adapter.values())
    full = sum(t.numel() for t in load_causal_lm(tiny_model_path).parameters())
    assert sum(t.numel() for t in adapter.values()) < 0.25 * full
    base = read_base_weights(tiny_model_path, [f"{layer}.weight" for layer in lora.layers])
    merged = merge_lora(base, lora, adapter)
    sent = trained.state_dict()
    assert set(merged) == {f"{layer}.weight" for layer in lora.layers}
    for name, value in merged.items():
        assert torch.equal(value, sent[name]), name
