"""The explorer's light model (rftstream.engines.light_model): a checkpoint's parameters
without transformers' modeling code.

It must hold exactly what ``from_pretrained`` holds (names, shapes, values, tying, the
rotary frequencies of every static RoPE type), give the HF logits, sample what the HF
model samples, leave to ``from_pretrained`` whatever it does not cover, and keep
``torch._dynamo`` (the start-up cost it exists to avoid) out of the explorer's process.
"""

from __future__ import annotations

import json
import os
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

from rftstream.engines.light_model import (
    JSON_CONFIG_KEYS,
    JsonConfig,
    LightCausalLM,
    json_config,
    load_light_causal_lm,
)
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


def test_checkpoint_files_are_read_as_from_pretrained_reads_them(
    tiny_model_path: str, tmp_path: Path
) -> None:
    """Sharded checkpoints load from their index; other safetensors files beside the
    model (an EMA copy, say) are not read; a name in two shards, or a config that ties
    the head while the file holds another one, is left to ``from_pretrained``."""
    from safetensors.torch import load_file, save_file

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    sharded = Path(_save(base, tmp_path / "sharded", max_shard_size="100KB"))
    assert (sharded / "model.safetensors.index.json").is_file()
    light = load_light_causal_lm(str(sharded), torch.float32)
    assert light is not None
    for key, value in base.state_dict().items():
        assert torch.equal(light.state_dict()[key], value), key

    ema = Path(_save(base, tmp_path / "ema"))
    noisy = {k: v + 1.0 for k, v in load_file(str(ema / "model.safetensors")).items()}
    save_file(noisy, str(ema / "model_ema.safetensors"), metadata={"format": "pt"})
    light = load_light_causal_lm(str(ema), torch.float32)
    assert light is not None
    assert torch.equal(light.model.norm.weight, base.model.norm.weight)

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first, *rest = sorted(set(index["weight_map"].values()))
    twice = next(k for k, f in index["weight_map"].items() if f == rest[0])
    moved = load_file(str(sharded / first))
    moved[twice] = load_file(str(sharded / rest[0]))[twice]
    save_file(moved, str(sharded / first), metadata={"format": "pt"})
    assert load_light_causal_lm(str(sharded), torch.float32) is None

    tied = Path(_save(base, tmp_path / "tied"))
    tensors = load_file(str(tied / "model.safetensors"))
    assert base.config.tie_word_embeddings
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    same = load_light_causal_lm(str(tied), torch.float32)
    assert same is not None and same.lm_head.weight is same.model.embed_tokens.weight
    tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    assert load_light_causal_lm(str(tied), torch.float32) is None


def test_a_half_precision_checkpoint_loads_as_float32(tiny_model_path: str, tmp_path: Path) -> None:
    half = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16)
    path = _save(half, tmp_path / "fp16")
    light = load_light_causal_lm(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert light is not None
    for key, value in hf.state_dict().items():
        got = light.state_dict()[key]
        assert got.dtype == torch.float32 and torch.equal(got, value), key


def test_a_weight_sync_into_the_light_model(tiny_model_path: str) -> None:
    """The trainer's whole state dict (tied head included) loads into the light model
    and the engine then samples from exactly the trainer's weights."""
    import anyio

    engine = TransformersEngine(tiny_model_path)
    assert isinstance(engine.model, LightCausalLM)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    anyio.run(lambda: engine.load_weights(trained.state_dict(), 7))
    light = engine.model
    assert light.lm_head.weight is light.model.embed_tokens.weight
    for key, value in trained.state_dict().items():
        assert torch.equal(light.state_dict()[key], value), key
    ids = torch.tensor([[4, 9, 17, 33, 80]])
    with torch.no_grad():
        assert torch.allclose(light(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5)
    from rftstream.engines.base import SamplingParams
    from rftstream.engines.transformers_engine import _Request

    scores = anyio.run(lambda: engine.score([4, 9, 17, 33, 80], start=2))
    with torch.no_grad():
        lp = torch.log_softmax(trained(input_ids=ids).logits[0, :-1], -1)
    assert scores.logprobs == pytest.approx(
        [lp[i - 1, t].item() for i, t in [(2, 17), (3, 33), (4, 80)]], abs=1e-5
    )
    out = engine._generate_batch([_Request([5, 6, 7], SamplingParams(n=2, max_tokens=4))])
    assert [len(c.token_ids) for c in out[0]] and engine.model_version == 7


def test_score_runs_on_the_engines_decoder(tiny_model_path: str, monkeypatch) -> None:
    """``score`` uses the engine's own decoder (whose fused weights follow every load),
    not a new one a call; the light model's forward refuses what it does not do."""
    import anyio

    engine = TransformersEngine(tiny_model_path)

    def no_forward(*_: object, **__: object) -> None:
        raise AssertionError("score must not run the model's forward")

    monkeypatch.setattr(LightCausalLM, "forward", no_forward)
    assert len(anyio.run(lambda: engine.score([4, 9, 17, 33], start=1)).logprobs) == 3
    monkeypatch.undo()
    ids = torch.tensor([[4, 9, 17]])
    with pytest.raises(TypeError, match="past_key_values"):
        engine.model(input_ids=ids, past_key_values=object())
    with pytest.raises(TypeError, match="use_cache"):
        engine.model(input_ids=ids, use_cache=True)
    assert engine.model(input_ids=ids, use_cache=False, position_ids=None).logits.shape[:2] == (
        1,
        3,
    )


# ------------------------------------------------------------ the trainer's policy


def test_json_config_gives_the_model_autoconfig_gives(tiny_model_path: str, tmp_path: Path) -> None:
    """``without_transformers``: where ``config.json`` names every key (transformers 5
    writes them all) and the RoPE is the default one, the config is read as a JsonConfig
    and the model is the one ``AutoConfig`` gives (same parameters, same logits);
    other RoPE types are read by ``AutoConfig``."""
    torch.manual_seed(1)
    plain_llama = LlamaConfig(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    paths = {
        **_checkpoints(tiny_model_path, tmp_path),
        "llama, default RoPE": _save(LlamaForCausalLM(plain_llama), tmp_path / "pl"),
    }
    read_as_json = {"tiny qwen2 (GQA, tied, biases)", "mistral", "llama, default RoPE"}
    ids = torch.tensor([[3, 17, 9, 44, 2, 8, 11]])
    for which, path in paths.items():
        light = load_light_causal_lm(path, torch.float32, without_transformers=True)
        hf_config = load_light_causal_lm(path, torch.float32)
        assert light is not None and hf_config is not None, which
        assert isinstance(light.config, JsonConfig) == (which in read_as_json), which
        assert isinstance(hf_config.config, JsonConfig) is False
        want = hf_config.state_dict()
        got = light.state_dict()
        assert sorted(got) == sorted(want), which
        for key in want:
            assert torch.equal(got[key], want[key]), (which, key)
        with torch.no_grad():
            torch.testing.assert_close(
                light(input_ids=ids).logits, hf_config(input_ids=ids).logits, rtol=0, atol=0
            )
        assert (light.generation_config is None) == (which in read_as_json)


@pytest.mark.parametrize(
    "edit",
    [
        *({"drop": key} for key in JSON_CONFIG_KEYS),
        {"drop": "use_sliding_window"},  # qwen2's own
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
        {"partial_rotary_factor": 0.5},
    ],
)
def test_json_config_leaves_to_autoconfig_what_the_file_does_not_settle(
    tiny_model_path: str, edit: dict
) -> None:
    declared = json.loads((Path(tiny_model_path) / "config.json").read_text())
    if "drop" in edit:
        declared.pop(edit["drop"])
    else:
        declared.update(edit)
    assert json_config(Path(tiny_model_path), declared) is None


@pytest.mark.parametrize("without_transformers", [False, True])
@pytest.mark.parametrize(
    "which", ["tiny qwen2 (GQA, tied, biases)", "llama3 RoPE, attention bias, untied"]
)
def test_save_pretrained_writes_what_transformers_writes(
    tiny_model_path: str, tmp_path: Path, which: str, without_transformers: bool
) -> None:
    """The trainer's HF checkpoint of a light policy: the same files, config, generation
    config and tensors as transformers' ``save_pretrained`` of the same weights, a config
    attribute set after loading included (the trainer sets ``use_cache``), whether the
    config was read by ``AutoConfig`` or as a JsonConfig."""
    from safetensors.torch import load_file

    path = _checkpoints(tiny_model_path, tmp_path)[which]
    light = load_light_causal_lm(path, torch.float32, without_transformers=without_transformers)
    assert light is not None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    light.config.use_cache = False
    hf.config.use_cache = False
    light.save_pretrained(tmp_path / "light")
    hf.save_pretrained(str(tmp_path / "hf"))
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.name for p in (tmp_path / "light").iterdir()) == files
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "light" / name).read_text()) == json.loads(
            (tmp_path / "hf" / name).read_text()
        ), name
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("light", "hf"))
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_save_pretrained_shards_and_loads_back(
    tiny_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the shard size the state dict is split with an index, as transformers does,
    and both loaders read it back to the same weights."""
    import rftstream.engines.light_model as light_model

    light = load_light_causal_lm(tiny_model_path, torch.float32)
    assert light is not None
    monkeypatch.setattr(light_model, "MAX_SHARD_BYTES", 40_000)
    light.save_pretrained(tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "sharded" / "model.safetensors").exists()
    again = load_light_causal_lm(str(tmp_path / "sharded"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"), dtype=torch.float32)
    assert again is not None
    want = light.state_dict()
    for other in (again, hf):
        got = other.state_dict()
        assert sorted(got) == sorted(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
    with pytest.raises(ValueError, match="safetensors only"):
        light.save_pretrained(tmp_path / "bin", safe_serialization=False)


def test_the_trainer_trains_a_light_policy_and_saves_a_loadable_checkpoint(
    tiny_model_path: str, tmp_path: Path
) -> None:
    """Where the lean forward trains (the default on the CPU), the trainer's policy is a
    LightCausalLM; after a step its HF checkpoint loads with ``from_pretrained`` to the
    trained weights."""
    from tests.unit.test_trainer_fast_paths import batch, grpo, params

    trainer = grpo(tmp_path / "run", tiny_model_path)
    assert isinstance(trainer.engine.module, LightCausalLM)
    before = params(trainer)
    trainer.train_step(batch())
    after = params(trainer)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    saved = trainer.save_hf_checkpoint(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    got = dict(loaded.named_parameters())
    assert sorted(got) == sorted(after)
    for key, value in after.items():
        assert torch.equal(got[key].detach(), value), key


def test_the_trainer_process_imports_neither_transformers_nor_dynamo(
    tiny_model_path: str, tmp_path: Path
) -> None:
    """What the light policy is for in the trainer: through construction and two trainer
    steps, transformers is never imported (its modeling code about 1.5 s of CPU before
    the first step, the library itself, ``AutoConfig`` and the tokenizer about 1.2 s
    more: the config is read as a JsonConfig, the pad id from the tokenizer's files), nor
    ``torch._dynamo`` (1.2 s: the optimizer is
    :class:`~rftstream.training.eager_adamw.EagerAdamW`)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.unit.test_trainer_fast_paths import batch, grpo\n"
        f"trainer = grpo(Path({str(tmp_path)!r}), {tiny_model_path!r})\n"
        "for _ in range(2):\n"
        "    trainer.train_step(batch())\n"
        "heavy = sorted(m for m in sys.modules if m in ('transformers', 'torch._dynamo'))\n"
        "print(type(trainer.engine.module).__name__, type(trainer.optimizer).__name__, heavy)\n"
    )
    # a process group of its own: not this process's (its port is taken here)
    dist = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    want = "LightCausalLM EagerAdamW []"
    assert out.stdout.strip().splitlines()[-1] == want, out.stdout + out.stderr
