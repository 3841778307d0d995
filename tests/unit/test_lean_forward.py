"""The trainer's lean forward (rftstream.training.lean_forward) against the HF forward.

Logits and gradients must be the HF module's (float32, to rounding), in both of the
trainer's shapes: every row on its own with the LM head on the kept positions, and
rows sharing their prompt's pass (its keys and values repeated per row); prompts
left-padded to several lengths, responses right-padded. What it does not cover keeps
the HF path; a trainer step with it leaves the same weights as one without.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rftstream.engines.light_model import LightCausalLM
from rftstream.model_loading import output_cache
from rftstream.training.batch import response_logprobs
from rftstream.training.lean_forward import LeanForward, lean_forward_reason
from rftstream.training.policy_trainer import PolicyTrainer, _shared_prompts
from tests.unit.test_fast_decoder import _models as fast_decoder_models
from tests.unit.test_trainer_fast_paths import batch, grpo, params


def _models(tiny_model_path: str) -> dict[str, torch.nn.Module]:
    """The sampler's lean pass's test models, and Llama with attention biases (o_proj's too)."""
    models = fast_decoder_models(tiny_model_path)
    config = copy.deepcopy(models["llama GQA"].config)
    config.attention_bias = True
    models["llama GQA with attention biases"] = LlamaForCausalLM(config)
    with torch.no_grad():  # biases start at zero: give them values that show
        for model in models.values():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return models


P, R, GROUP = 7, 5, 3


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four groups of three rows: prompts left-padded by 0-3, responses right-padded to
    1-5 tokens; and the mask of the logits that predict a real response token."""
    g = torch.Generator().manual_seed(3)
    groups = 4
    prompts = torch.randint(3, vocab, (groups, P), generator=g).repeat_interleave(GROUP, 0)
    ids = torch.cat([prompts, torch.randint(3, vocab, (groups * GROUP, R), generator=g)], 1)
    attn = torch.ones_like(ids)
    for row in range(ids.shape[0]):
        attn[row, : row // GROUP] = 0  # the group's left padding
        attn[row, P + 1 + row % R :] = 0  # 1..5 response tokens
    ids = ids * attn  # pads are token 0, as the trainer's batches
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids, attn, pos, attn[:, P:].bool()


def _hf_shared(model: torch.nn.Module, ids, attn, pos, first, inverse) -> torch.Tensor:  # type: ignore[no-untyped-def]
    prompt = model(
        input_ids=ids[first, :P],
        attention_mask=attn[first, :P],
        position_ids=pos[first, :P],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = output_cache(prompt)
    cache.batch_select_indices(inverse)
    rest = model(
        input_ids=ids[:, P:],
        attention_mask=attn,
        position_ids=pos[:, P:],
        use_cache=True,
        past_key_values=cache,
        logits_to_keep=R,
    )
    return torch.cat([prompt.logits[inverse], rest.logits[:, : R - 1]], 1)


def _grads(
    model: torch.nn.Module, logits: torch.Tensor, real: torch.Tensor
) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits[real].logsumexp(-1).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shared", [False, True], ids=["rows on their own", "shared prompts"])
def test_logits_and_gradients_are_the_hf_forwards(tiny_model_path: str, shared: bool) -> None:
    for name, model in _models(tiny_model_path).items():
        model.train()
        assert (
            lean_forward_reason(
                model, zero_stage=2, checkpointing=False, adapters=False, dropout=False
            )
            is None
        ), name
        lean = LeanForward(model)
        ids, attn, pos, real = _batch(model.config.vocab_size)
        if shared:
            shares = _shared_prompts(type("Mb", (), {"input_ids": ids, "prompt_width": P})())
            assert shares is not None
            first, inverse = shares
            assert len(first) == 4
            hf = _hf_shared(model, ids, attn, pos, first, inverse)
            mine = lean.shared_logits(ids, attn, pos, P, first, inverse)
        else:
            out = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=R + 1)
            hf, mine = out.logits[:, :R], lean.logits(ids, attn, pos, R + 1)[:, :R]
        assert hf.shape == mine.shape == (ids.shape[0], R, model.config.vocab_size), name
        torch.testing.assert_close(mine[real], hf[real], atol=1e-5, rtol=1e-5, msg=name)
        expected, got = _grads(model, hf, real), _grads(model, mine, real)
        assert expected.keys() == got.keys() and len(got) == len(list(model.parameters())), name
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-4, msg=key)


def _loss_grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_response_log_probs_are_the_padded_passes(tiny_model_path: str) -> None:
    """``shared_token_logprobs`` skips the response padding: at every real response
    token it gives the log-prob and entropy of the HF shared pass's logits (at a
    temperature), zeros where a row has no token, and the same gradients."""
    temperature = 0.7
    for name, model in _models(tiny_model_path).items():
        model.train()
        lean = LeanForward(model)
        ids, attn, pos, real = _batch(model.config.vocab_size)
        shares = _shared_prompts(type("Mb", (), {"input_ids": ids, "prompt_width": P})())
        assert shares is not None
        hf = _hf_shared(model, ids, attn, pos, *shares)
        hf_logp, hf_entropy, _ = response_logprobs(
            hf, ids, P, temperature, with_entropy=True, logits_start=P - 1
        )
        logp, entropy, _ = lean.shared_token_logprobs(
            ids, attn, pos, P, *shares, temperature, with_entropy=True
        )
        assert entropy is not None and logp.shape == entropy.shape == (ids.shape[0], R), name
        assert int(real.sum()) < real.numel()  # the batch has response padding to skip
        torch.testing.assert_close(logp[real], hf_logp[real], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(entropy[real], hf_entropy[real], atol=1e-5, rtol=1e-5)
        assert not logp[~real].any() and not entropy[~real].any(), name

        expected = _loss_grads(model, (hf_logp * real).sum() + (hf_entropy * real).sum() * 0.1)
        logp, entropy, _ = lean.shared_token_logprobs(
            ids, attn, pos, P, *shares, temperature, with_entropy=True
        )
        assert entropy is not None
        got = _loss_grads(model, (logp * real).sum() + (entropy * real).sum() * 0.1)
        assert expected.keys() == got.keys() and len(got) == len(list(model.parameters())), name
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-4, msg=key)
        without, none, _ = lean.shared_token_logprobs(
            ids, attn, pos, P, *shares, temperature, with_entropy=False
        )
        assert none is None
        torch.testing.assert_close(without, logp.detach(), atol=0, rtol=0)


def test_what_it_does_not_cover_keeps_the_hf_forward(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)

    def reason(**kw: object) -> str | None:
        args: dict[str, object] = {
            "zero_stage": 2,
            "checkpointing": False,
            "adapters": False,
            "dropout": False,
        }
        return lean_forward_reason(model, **{**args, **kw})  # type: ignore[arg-type]

    assert reason() is None
    assert reason(zero_stage=3) == "ZeRO-3 partitions the parameters"
    assert reason(checkpointing=True) == "gradient checkpointing"
    assert reason(adapters=True) == "adapters (LoRA) wrap the projections"
    assert reason(dropout=True) == "dropout is active"
    model.to(torch.bfloat16)
    assert reason() == "not float32 on the CPU"
    model.to(torch.float32)
    model.config.hidden_act = "gelu"
    assert reason() == "hidden_act 'gelu' (only silu)"


def test_a_trainer_step_with_it_is_the_step_without_it(
    tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers_run: list[int] = []
    forward = LeanForward._layer

    def counted(self: LeanForward, *a: object, **k: object) -> object:
        layers_run.append(1)
        return forward(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(LeanForward, "_layer", counted)
    for share in (True, False):
        lean = grpo(tmp_path / f"lean{share}", tiny_model_path, share_prompts=share)
        hf = grpo(tmp_path / f"hf{share}", tiny_model_path, share_prompts=share, lean_forward=False)
        assert lean._lean and not hf._lean
        # where the lean forward trains, the policy is loaded without transformers' model
        assert isinstance(lean.engine.module, LightCausalLM)
        assert not isinstance(hf.engine.module, LightCausalLM)
        before = params(lean)
        layers_run.clear()
        m_lean = lean.train_step(batch())
        assert layers_run  # the lean forward ran
        layers_run.clear()
        m_hf = hf.train_step(batch())
        assert not layers_run
        after_lean, after_hf = params(lean), params(hf)
        assert any(not torch.equal(after_lean[k], before[k]) for k in before)  # it trained
        for k in after_lean:
            torch.testing.assert_close(after_lean[k], after_hf[k], atol=1e-6, rtol=1e-5, msg=k)
        for key in ("actor/pg_loss", "actor/entropy", "actor/loss"):
            assert abs(m_lean[key] - m_hf[key]) < 1e-5, key


def test_the_trainer_keeps_the_hf_forward_where_it_must(
    tmp_path: Path, tiny_model_path: str
) -> None:
    checkpointed: PolicyTrainer = grpo(tmp_path, tiny_model_path, gradient_checkpointing=True)
    assert not checkpointed._lean
    assert not isinstance(checkpointed.engine.module, LightCausalLM)  # HF's, checkpointed
