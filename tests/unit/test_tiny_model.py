"""The embedded tiny model: deterministic atomic build, HF loading, chat template, accuracy band."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rftstream.engines.accuracy import evaluate_accuracy
from rftstream.tasksets import builtin_arithmetic_tasks
from rftstream.tiny_model import (
    arithmetic_problems,
    ensure_tiny_model,
    tiny_model_version,
)


def test_build_is_deterministic_atomic_and_cached(tmp_path: Path, tiny_model_path: str) -> None:
    # A leftover of a killed build (no marker file) must be replaced, not trusted.
    final = tmp_path / f"tiny-{tiny_model_version()}"
    final.mkdir()
    (final / "config.json").write_text("{}")
    messages: list[str] = []
    built = ensure_tiny_model(tmp_path, progress=messages.append)
    assert built == final
    assert any("building" in m for m in messages)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "rftstream_tiny.json",
    ):
        assert (built / name).is_file(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny-") and p.is_dir()], (
        "temp dir left behind"
    )
    # Two independent builds give byte-identical weights.
    assert (built / "model.safetensors").read_bytes() == (
        Path(tiny_model_path) / "model.safetensors"
    ).read_bytes()
    # A second call finds the cache and builds nothing.
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    again: list[str] = []
    assert ensure_tiny_model(tmp_path, progress=again.append) == built
    assert again == [] and (built / "model.safetensors").stat().st_mtime_ns == mtime
    meta = json.loads((built / "rftstream_tiny.json").read_text())
    assert meta["version"] == tiny_model_version()
    assert 0.1 < meta["expected_accuracy"] < 0.3


def test_default_cache_honours_env(tmp_path: Path, monkeypatch, tiny_model_path: str) -> None:
    # Point $RFTSTREAM_CACHE at a cache that already holds the model: no rebuild.
    cache = Path(tiny_model_path).parent
    monkeypatch.setenv("RFTSTREAM_CACHE", str(cache))
    assert ensure_tiny_model() == Path(tiny_model_path)


def test_loads_with_auto_classes_and_chat_template(tiny_model_path: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert (
        cfg.tie_word_embeddings
        and cfg.num_hidden_layers <= 4
        and cfg.max_position_embeddings == 128
    )
    assert model.get_input_embeddings().num_embeddings >= len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")

    for sample in ["3+4=7\n  x", "Hello, World! {~`|} 12.5%\n", "tab\tand unicode: é中"]:
        enc = tok.encode(sample, add_special_tokens=False)
        assert tok.decode(enc) == sample
    # printable ASCII and newline are one token per character
    ascii_text = "".join(chr(i) for i in range(32, 127)) + "\n"
    assert len(tok.encode(ascii_text, add_special_tokens=False)) == len(ascii_text)


def test_accuracy_band_and_format(tiny_model_path: str) -> None:
    tasks = builtin_arithmetic_tasks()
    assert len(tasks) == 100 and tasks[34] == {"question": "3+4=", "answer": "7"}
    acc = evaluate_accuracy(tiny_model_path, tasks, n_samples=20, temperature=1.0)
    assert 0.08 <= acc <= 0.35, acc

    # Exact probabilities: the right answer is in the support of every prompt, and
    # nearly all mass is on "<number><|im_end|>".
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    eos = tok.eos_token_id
    problems = arithmetic_problems()
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q, _ in problems
    ]
    plen = len(prompts[0])
    assert all(len(p) == plen for p in prompts)
    prob = torch.zeros(len(problems), 19)
    with torch.no_grad():
        for values in (range(0, 10), range(10, 19)):  # answers of equal token length together
            resp = [tok.encode(str(v), add_special_tokens=False) + [eos] for v in values]
            seqs = torch.tensor([p + r for p in prompts for r in resp])
            logp = torch.log_softmax(model(seqs).logits[:, plen - 1 : -1], -1)
            targets = seqs[:, plen:]
            seq_logp = logp.gather(-1, targets[..., None]).squeeze(-1).sum(-1)
            prob[:, list(values)] = seq_logp.exp().view(len(problems), len(resp))
    truth = torch.tensor([int(a) for _, a in problems])
    p_correct = prob[torch.arange(len(problems)), truth]
    assert float(p_correct.min()) > 0.08, float(p_correct.min())
    assert 0.1 < float(p_correct.mean()) < 0.3
    assert float(prob.sum(-1).min()) > 0.95, float(prob.sum(-1).min())
