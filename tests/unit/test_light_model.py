"""The explorer's light model (rftstream.engines.light_model): a checkpoint's parameters
without transformers' modeling code.

It must hold exactly what ``from_pretrained`` holds (names, shapes, values, tying, the
rotary frequencies of every static RoPE type), give the HF logits, sample what the HF
model samples, leave to ``from_pretrained`` whatever it does not cover, and keep
``torch._dynamo`` (the start-up cost it exists to avoid) out of the explorer's process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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

from rftstream.engines.light_model import LightCausalLM, load_light_causal_lm
from rftstream.engines.transformers_engine import TransformersEngine


def _save(model: torch.nn.Module, path: Path, **kwargs: object) -> str:
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def _checkpoints(tiny_model_path: str, tmp_path: Path) -> dict[str, str]:
    torch.manual_seed(0)
    llama3 = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    linear = Qwen2Config(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    )
    mistral = MistralConfig(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
    )
    return {
        "tiny qwen2 (GQA, tied, biases)": tiny_model_path,
        "llama3 RoPE, attention bias, untied": _save(LlamaForCausalLM(llama3), tmp_path / "l"),
        "qwen2 linear RoPE, MHA, untied": _save(Qwen2ForCausalLM(linear), tmp_path / "q"),
        "mistral": _save(MistralForCausalLM(mistral), tmp_path / "m"),
    }


def test_holds_what_from_pretrained_holds_and_gives_its_logits(
    tiny_model_path: str, tmp_path: Path
) -> None:
    for name, path in _checkpoints(tiny_model_path, tmp_path).items():
        light = load_light_causal_lm(path, torch.float32)
        assert isinstance(light, LightCausalLM), name
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ours, theirs = light.state_dict(), hf.state_dict()
        assert set(ours) == set(theirs), name
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), (name, key)
        tied = hf.config.tie_word_embeddings
        assert (light.lm_head.weight is light.model.embed_tokens.weight) == tied, name
        rotary = hf.model.rotary_emb
        assert torch.allclose(light.model.rotary_emb.inv_freq, rotary.inv_freq), name
        assert light.model.rotary_emb.attention_scaling == rotary.attention_scaling, name
        assert light.model.rotary_emb.rope_type == rotary.rope_type, name
        assert not light.training
        ids = torch.randint(3, light.config.vocab_size, (3, 19), generator=torch.Generator())
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # left padding
        with torch.no_grad():
            want = hf(input_ids=ids, attention_mask=mask).logits
            got = light(input_ids=ids, attention_mask=mask).logits
            last = light(input_ids=ids, attention_mask=mask, logits_to_keep=4).logits
        keep = mask.bool()
        assert torch.allclose(got[keep], want[keep], atol=1e-5), name
        assert torch.allclose(last, got[:, -4:], atol=1e-6), name


def test_bfloat16_and_the_generation_config(tiny_model_path: str) -> None:
    light = load_light_causal_lm(tiny_model_path, torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    assert light is not None
    assert all(p.dtype == torch.bfloat16 for p in light.parameters())
    assert light.model.rotary_emb.inv_freq.dtype == torch.float32  # as HF keeps it
    for key, value in hf.state_dict().items():
        assert torch.equal(light.state_dict()[key], value), key
    assert light.generation_config.eos_token_id == hf.generation_config.eos_token_id


def test_what_it_does_not_cover_goes_to_from_pretrained(
    tiny_model_path: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    pickled = Path(_save(base, tmp_path / "bin"))  # the same checkpoint as pytorch_model.bin
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert load_light_causal_lm(str(pickled), torch.float32) is None
    windowed = MistralForCausalLM(
        MistralConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
        )
    )
    assert load_light_causal_lm(_save(windowed, tmp_path / "sw"), torch.float32) is None
    dynamic = Qwen2Config.from_pretrained(tiny_model_path)
    dynamic.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert (
        load_light_causal_lm(_save(Qwen2ForCausalLM(dynamic), tmp_path / "dyn"), torch.float32)
        is None
    )
    # a tensor the config does not imply (here: a stray one) is not dropped silently
    extra = Path(_save(base, tmp_path / "extra"))
    tensors = load_file(str(extra / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary.extra"] = torch.zeros(2)
    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    assert load_light_causal_lm(str(extra), torch.float32) is None
    assert load_light_causal_lm(str(tmp_path / "missing"), torch.float32) is None


def test_the_engine_samples_the_same_with_the_light_model(tiny_model_path: str) -> None:
    light = TransformersEngine(tiny_model_path, seed=3)
    heavy = TransformersEngine(tiny_model_path, seed=3)
    assert isinstance(light.model, LightCausalLM)
    # the HF model under the same fast decoder: what the engine loaded before
    heavy._model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    from rftstream.engines.fast_decoder import fast_decoder_for

    heavy._decoder = fast_decoder_for(heavy._model)
    from rftstream.engines.base import SamplingParams

    reqs = [([5, 6, 7, 8], SamplingParams(n=4, temperature=1.0, max_tokens=12, min_tokens=6))]

    def sample(engine: TransformersEngine) -> list[list[int]]:
        from rftstream.engines.transformers_engine import _Request

        out = engine._generate_batch([_Request(list(p), sp) for p, sp in reqs])
        return [c.token_ids for group in out for c in group]

    assert sample(light) == sample(heavy)
    hf_only = TransformersEngine(tiny_model_path, fast_decoder=False)
    assert not isinstance(hf_only.model, LightCausalLM)


def test_the_explorer_process_never_imports_dynamo(tiny_model_path: str) -> None:
    """What the light model is for: the engine's process loads no transformers modeling
    code, so torch._dynamo and sympy (which ``masking_utils`` brings) stay out of it."""
    code = (
        "import sys\n"
        "from rftstream.engines.transformers_engine import TransformersEngine\n"
        f"engine = TransformersEngine({tiny_model_path!r})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'sympy' or m in "
        "('torch._dynamo', 'transformers.masking_utils', "
        "'transformers.modeling_utils'))\n"
        "print(type(engine.model).__name__, heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "LightCausalLM []", out.stdout + out.stderr


@pytest.mark.parametrize("fast", [True, False])
def test_score_matches_between_light_and_hf(tiny_model_path: str, fast: bool) -> None:
    """``score`` (a full forward, no cache) gives the HF model's logprobs either way."""
    import anyio

    engine = TransformersEngine(tiny_model_path, fast_decoder=fast)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = [4, 9, 17, 33, 80, 41, 7]
    scores = anyio.run(lambda: engine.score(ids, start=3))
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    want = [lp[i - 1, ids[i]].item() for i in range(3, len(ids))]
    assert scores.logprobs == pytest.approx(want, abs=1e-5)
