"""The lean inference forward (rftstream.engines.fast_decoder) and the sampling loop around it.

The decoder must give the HF module's logits (prefill of left-padded prompts,
decode steps with finished rows masked, rows dropped or repeated), refuse what
it does not cover exactly, and follow weight loads; the sampling loop must give
the same samples with and without it, prefill each distinct prompt once, and
draw tokens with the right distribution.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rftstream.engines.fast_decoder import FastDecoder, fast_decoder_for, unsupported_reason
from rftstream.engines.transformers_engine import SequenceSpec, _draw, sample_sequences
from rftstream.model_loading import forward_kwargs, output_cache


def _models(tiny_model_path: str) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "tiny qwen2 (GQA, tied, biases)": AutoModelForCausalLM.from_pretrained(tiny_model_path),
        "llama GQA": LlamaForCausalLM(
            LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=128,
            )
        ),
        "qwen2 MHA untied": Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=300,
                hidden_size=48,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=128,
                tie_word_embeddings=False,
            )
        ),
    }


def _padded_batch(pads: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (len(pads), width), generator=g)
    attn = torch.ones(len(pads), width, dtype=torch.long)
    for b, pad in enumerate(pads):
        attn[b, :pad] = 0
        ids[b, :pad] = 0
    return ids, attn


def test_logits_match_the_hf_forward(tiny_model_path: str) -> None:
    for name, model in _models(tiny_model_path).items():
        model.eval()
        decoder = FastDecoder(model)
        cache_arg, _ = forward_kwargs(model)  # `cache` on transformers 5 (no FutureWarning)
        ids, attn = _padded_batch([0, 2, 4, 1, 8], 9)
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        with torch.inference_mode():
            out = model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
            )
            past, ref = output_cache(out), out.logits[:, -1].float()
            decoder.start(ids[:, -2:], attn[:, -2:], 1)  # a short session first: the
            short = decoder._cos.shape[0]  # rotary tables must grow for the next one
            session, logits = decoder.start(ids, attn, 6)
            assert short < 9 + 6 <= decoder._cos.shape[0], name
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5, msg=name)
            next_pos = pos[:, -1] + 1
            active = torch.tensor([True, True, False, True, True])
            g = torch.Generator().manual_seed(2)
            for step in range(4):
                if step == 2:  # drop row 2 and repeat row 0, in both caches
                    keep = torch.tensor([0, 0, 1, 3, 4])
                    past.batch_select_indices(keep)
                    session.select(keep)
                    attn, next_pos, active = attn[keep], next_pos[keep], active[keep]
                tok = torch.randint(3, 250, (attn.shape[0],), generator=g)
                feed = torch.where(active, tok, torch.zeros_like(tok))
                attn = torch.cat([attn, active.long()[:, None]], 1)
                out = model(
                    input_ids=feed[:, None],
                    attention_mask=attn,
                    position_ids=next_pos[:, None],
                    **{cache_arg: past},
                    use_cache=True,
                    logits_to_keep=1,
                )
                past, next_pos = output_cache(out), next_pos + 1
                logits = session.step(feed, active)
                torch.testing.assert_close(
                    logits[active], out.logits[active, -1].float(), atol=1e-5, rtol=1e-5, msg=name
                )


def test_refuses_what_it_does_not_cover(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert unsupported_reason(model) is None
    model.train()
    assert unsupported_reason(model) == "model in training mode"
    assert fast_decoder_for(model) is None
    with pytest.raises(ValueError, match="training mode"):
        FastDecoder(model)
    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
        )
    ).eval()
    assert unsupported_reason(mistral) == "sliding-window attention"
    gelu = copy.deepcopy(model.config)
    gelu.hidden_act = "gelu"
    assert unsupported_reason(Qwen2ForCausalLM(gelu).eval()) == "hidden_act 'gelu' (only silu)"

    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    assert "not one of" in (unsupported_reason(Other()) or "")


def test_refresh_follows_a_weight_load(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    decoder = FastDecoder(model)
    ids, attn = _padded_batch([0, 3], 8)
    before = decoder.start(ids, attn, 2)[1]
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    stale = decoder.start(ids, attn, 2)[1]
    decoder.refresh()
    fresh = decoder.start(ids, attn, 2)[1]
    with torch.inference_mode():
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        ref = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].float()
    torch.testing.assert_close(fresh, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(stale, ref, atol=1e-4)  # fused q/k/v were copies: stale until refresh
    assert not torch.allclose(before, fresh, atol=1e-4)


def _seqs(prompts: list[list[int]], n: int, seed: int) -> list[SequenceSpec]:
    return [
        SequenceSpec(
            prompt=p, max_new_tokens=5, generator=torch.Generator().manual_seed(seed + 7 * i)
        )
        for i, p in enumerate(p for p in prompts for _ in range(n))
    ]


def test_same_samples_with_and_without_the_decoder(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    decoder = FastDecoder(model)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]
    kwargs = {"eos_token_ids": {2}, "pad_token_id": 0}
    hf = sample_sequences(model, _seqs(prompts, 4, 11), **kwargs)
    fast = sample_sequences(model, _seqs(prompts, 4, 11), decoder=decoder, **kwargs)
    assert [c.token_ids for c in hf] == [c.token_ids for c in fast]
    for a, b in zip(hf, fast, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
        assert a.finish_reason == b.finish_reason


def test_each_distinct_prompt_is_prefilled_once(tiny_model_path: str, monkeypatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    decoder = FastDecoder(model)
    prompts = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54]]
    widths: list[int] = []
    start = FastDecoder.start

    def spy(self, input_ids, attention_mask, max_new_tokens):  # noqa: ANN001
        widths.append(int(input_ids.shape[0]))
        return start(self, input_ids, attention_mask, max_new_tokens)

    monkeypatch.setattr(FastDecoder, "start", spy)
    kwargs = {"eos_token_ids": {2}, "pad_token_id": 0, "decoder": decoder}
    batched = sample_sequences(model, _seqs(prompts, 8, 3), **kwargs)
    assert widths == [2]  # 16 sequences, 2 prompts: 2 prefill rows
    # every sequence is what it would be alone (its own generator, same weights)
    alone = [sample_sequences(model, [s], **kwargs)[0] for s in _seqs(prompts, 8, 3)]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]


def test_draw_follows_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tokens = _draw(probs, g)
    counts = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert counts[1] == 0 and counts[4] == 0  # zero-probability tokens are never drawn
    torch.testing.assert_close(counts, probs[0], atol=0.015, rtol=0)
    one_hot = torch.zeros(3, 7)
    one_hot[torch.arange(3), torch.tensor([6, 0, 3])] = 1.0
    assert _draw(one_hot, g).tolist() == [6, 0, 3]
