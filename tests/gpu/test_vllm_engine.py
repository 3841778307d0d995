"""The vLLM rollout engine (``explorer.rollout_model.engine_type: vllm``).

``test_create_engine_vllm_without_vllm_names_the_extra`` runs everywhere. Every
other test needs a CUDA GPU and an importable ``vllm`` (``pip install
'rftstream[vllm]'``) and is skipped otherwise; they share one engine, started
once for the module, on a model built here (a random Qwen2 with head size 64
and the embedded tiny model's tokenizer, saved in float16) or on the local
Hugging Face model directory named by ``RFTSTREAM_VLLM_TEST_MODEL``.
Logprobs are compared with a float32 ``transformers`` forward pass of the same
weights on the CPU.

Environment: ``RFTSTREAM_VLLM_TEST_MODEL`` (a model directory),
``RFTSTREAM_VLLM_TEST_GPU_MEM`` (vLLM's gpu_memory_utilization, default 0.3),
``RFTSTREAM_VLLM_TEST_EAGER`` (``0``: CUDA graphs and torch.compile as in
production; default ``1``, a faster start). On a GPU machine::

    pytest tests/gpu -v -rs
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch

from rftstream.engines import SamplingParams, create_engine
from rftstream.errors import RftError

MEAN_TOL = 0.03  # mean |logprob difference| between vLLM (fp16/bf16 on GPU) and the fp32 reference
MAX_TOL = 0.25  # worst single token


def _gpu_skip_reason() -> str | None:
    try:
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed (pip install 'rftstream[vllm]')"
    except (ImportError, ValueError):
        return "vllm cannot be imported"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


_SKIP = _gpu_skip_reason()
gpu = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


# ----------------------------------------------------------------- always runs


def test_create_engine_vllm_without_vllm_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(
        sys.modules, "vllm", None
    )  # `import vllm` raises ImportError, installed or not
    with pytest.raises(RftError, match=r"pip install 'rftstream\[vllm\]'") as info:
        create_engine("vllm", str(tmp_path))
    assert "CUDA GPU" in str(info.value)


# ----------------------------------------------------------------- fixtures


def _build_model(out: Path) -> Path:
    """A random Qwen2 vLLM's GPU kernels support (head size 64), with peaky next-token distributions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rftstream.tiny_model import IM_START, SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()
    tok.model_max_length = 2048
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.05,
        bos_token_id=tok.convert_tokens_to_ids(IM_START),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            # logits with a std of ~3: temperature and truncation matter
            model.lm_head.weight.normal_(0.0, 0.2)
            # special tokens (eos among them) get logit 0: almost never sampled, so
            # generations run to max_tokens (the abort test needs long ones)
            model.lm_head.weight[[tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]] = 0.0
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(torch.float16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    env = os.environ.get("RFTSTREAM_VLLM_TEST_MODEL")
    if env:
        return env
    return str(_build_model(tmp_path_factory.mktemp("vllm-test-model")))


@pytest.fixture(scope="module")
def portal() -> Iterator[anyio.from_thread.BlockingPortal]:
    """One asyncio event loop (in a thread) for the whole module: vLLM's client binds to its loop."""
    with anyio.from_thread.start_blocking_portal("asyncio") as p:
        yield p


@pytest.fixture(scope="module")
def engine(portal: anyio.from_thread.BlockingPortal, model_dir: str) -> Iterator[Any]:
    pytest.importorskip("vllm")
    eng = create_engine(
        "vllm",
        model_dir,
        dtype="auto",
        seed=0,
        gpu_memory_utilization=float(os.environ.get("RFTSTREAM_VLLM_TEST_GPU_MEM", "0.3")),
        max_model_len=2048,
        enforce_eager=os.environ.get("RFTSTREAM_VLLM_TEST_EAGER", "1") != "0",
        default_max_tokens=32,
    )
    running = portal.start_task_soon(eng.run)
    try:
        yield eng
    finally:
        portal.call(eng.aclose)
        running.result(timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> Any:
    from rftstream.model_loading import load_causal_lm

    return load_causal_lm(model_dir, "float32").eval()


@pytest.fixture(scope="module")
def prompt(engine: Any) -> list[int]:
    return list(engine.tokenizer.encode("Count with me: 1 2 3 4 5", add_special_tokens=False))


def _ref_logprobs(model: Any, ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of ``ids[start:]`` (the engine convention), float32 on CPU."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(-1, torch.tensor(ids[start:])[:, None]).squeeze(-1)


def _assert_close(got: list[float], want: torch.Tensor, what: str) -> None:
    diff = (torch.tensor(got, dtype=torch.float32) - want).abs()
    assert len(got) == len(want), what
    assert float(diff.mean()) < MEAN_TOL and float(diff.max()) < MAX_TOL, (
        f"{what}: mean |diff| {float(diff.mean()):.4f}, max {float(diff.max()):.4f}"
    )


def _generate(portal: Any, engine: Any, prompt: list[int], **kw: Any) -> list[Any]:
    return portal.call(engine.generate, prompt, SamplingParams(**kw))


def _score(portal: Any, engine: Any, ids: list[int], **kw: Any) -> Any:
    return portal.call(functools.partial(engine.score, ids, **kw))


# ----------------------------------------------------------------- GPU tests


@gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_generate_logprobs_match_transformers(
    portal: Any, engine: Any, reference: Any, prompt: list[int], temperature: float
) -> None:
    comps = _generate(portal, engine, prompt, n=4, temperature=temperature, max_tokens=24, seed=123)
    assert len(comps) == 4
    for c in comps:
        assert 1 <= len(c.token_ids) <= 24 and len(c.logprobs) == len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert c.model_version == engine.model_version
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in engine.eos_token_ids  # eos kept, with its logprob
        if not engine.logprobs_processed and temperature not in (0.0, 1.0):
            assert c.info.get("logprobs_exact") is False  # old vLLM: raw logprobs, flagged
            continue
        assert "logprobs_exact" not in c.info
        want = _ref_logprobs(reference, prompt + c.token_ids, len(prompt), temperature)
        _assert_close(c.logprobs, want, f"sampled-token logprobs at temperature {temperature}")
    if temperature == 0.0:
        assert all(c.token_ids == comps[0].token_ids for c in comps)
    else:
        assert len({tuple(c.token_ids) for c in comps}) > 1


@gpu
def test_truncated_sampling_flags_inexact_logprobs(
    portal: Any, engine: Any, prompt: list[int]
) -> None:
    for kw in ({"top_k": 5}, {"top_p": 0.8}):
        comps = _generate(portal, engine, prompt, n=2, temperature=0.9, max_tokens=8, seed=5, **kw)
        assert all(c.info.get("logprobs_exact") is False for c in comps), kw
        assert all(len(c.logprobs) == len(c.token_ids) for c in comps)


@gpu
def test_seeded_samples_are_reproducible(portal: Any, engine: Any, prompt: list[int]) -> None:
    a = _generate(portal, engine, prompt, n=3, temperature=1.0, max_tokens=16, seed=7)
    b = _generate(portal, engine, prompt, n=3, temperature=1.0, max_tokens=16, seed=7)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1  # seed + i per sample


@gpu
def test_max_tokens_and_stop_token_ids(portal: Any, engine: Any, prompt: list[int]) -> None:
    empty = _generate(portal, engine, prompt, n=2, max_tokens=0)
    assert [(c.token_ids, c.finish_reason) for c in empty] == [([], "length"), ([], "length")]
    first = _generate(portal, engine, prompt, temperature=0.0, max_tokens=3)[0]
    assert len(first.token_ids) == 3 and first.finish_reason == "length"
    t = first.token_ids[0]
    stopped = _generate(portal, engine, prompt, temperature=0.0, max_tokens=3, stop_token_ids=[t])
    assert stopped[0].token_ids == [t] and stopped[0].finish_reason == "stop"
    with pytest.raises(RftError, match="no room"):
        _generate(portal, engine, [t] * engine.max_model_len)


@gpu
def test_score_matches_transformers(
    portal: Any, engine: Any, reference: Any, prompt: list[int]
) -> None:
    comp = _generate(portal, engine, prompt, temperature=1.0, max_tokens=16, seed=3)[0]
    ids = prompt + comp.token_ids
    scores = _score(portal, engine, ids, start=len(prompt), top_logprobs=3)
    want = _ref_logprobs(reference, ids, len(prompt))
    _assert_close(scores.logprobs, want, "score vs transformers")
    _assert_close(comp.logprobs, torch.tensor(scores.logprobs), "sampled vs scored logprobs")
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()
    full = torch.log_softmax(logits, dim=-1)
    assert scores.top_logprobs is not None and len(scores.top_logprobs) == len(comp.token_ids)
    for pos, alts in enumerate(scores.top_logprobs):
        assert len(alts) == 3
        values = [v for _, v in alts]
        assert values == sorted(values, reverse=True)
        for tid, v in alts:
            assert abs(v - float(full[pos, tid])) < MAX_TOL
    whole = _score(portal, engine, ids)
    assert len(whole.logprobs) == len(ids) - 1 and whole.top_logprobs is None
    greedy_t = _score(portal, engine, ids, start=len(prompt), temperature=0.0)  # 0 means 1
    _assert_close(greedy_t.logprobs, torch.tensor(scores.logprobs), "temperature 0 vs 1")
    assert _score(portal, engine, ids, start=len(ids)).logprobs == []
    with pytest.raises(RftError, match="temperature"):
        _score(portal, engine, ids, temperature=0.7)
    with pytest.raises(RftError, match="max_logprobs"):
        _score(portal, engine, ids, top_logprobs=engine.max_logprobs + 1)


@gpu
def test_load_weights_updates_in_place(
    portal: Any, engine: Any, reference: Any, prompt: list[int], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    tied = bool(getattr(reference.config, "tie_word_embeddings", False))
    base = {k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}
    if tied:
        base.pop("lm_head.weight", None)
    probe = _generate(portal, engine, prompt, temperature=0.0, max_tokens=12)[0]
    ids = prompt + probe.token_ids
    before = _score(portal, engine, ids, start=len(prompt)).logprobs

    gen = torch.Generator().manual_seed(1)
    noisy = {}
    for k, v in base.items():
        scale = float(v.float().std()) if v.numel() > 1 else 0.0
        noisy[k] = v + 0.2 * (scale or 0.1) * torch.randn(v.shape, generator=gen)
    v0 = engine.model_version
    portal.call(engine.load_weights, noisy, v0 + 1)
    assert engine.model_version == v0 + 1
    perturbed = copy.deepcopy(reference)
    perturbed.load_state_dict(noisy, strict=False)
    after = _score(portal, engine, ids, start=len(prompt)).logprobs
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 0.1
    _assert_close(after, _ref_logprobs(perturbed, ids, len(prompt)), "score after load_weights")
    # the prompt's KV blocks were cached under the old weights: the reset must drop them
    greedy = _generate(portal, engine, prompt, n=2, temperature=0.0, max_tokens=8)
    assert all(c.model_version == v0 + 1 for c in greedy)
    want = _ref_logprobs(perturbed, prompt + greedy[0].token_ids, len(prompt), 0.0)
    _assert_close(greedy[0].logprobs, want, "generation after load_weights (prefix cache reset)")

    path = tmp_path / "original.safetensors"
    save_file(base, str(path))
    portal.call(engine.load_weights, str(path), v0 + 2)  # a file path: the workers read it
    assert engine.model_version == v0 + 2
    restored = _score(portal, engine, ids, start=len(prompt)).logprobs
    assert max(abs(a - b) for a, b in zip(restored, before, strict=True)) < 1e-3

    some = {"model.norm.weight": base["model.norm.weight"]}
    with pytest.raises(RftError, match="do not cover"):
        portal.call(engine.load_weights, some, v0 + 3)
    assert engine.model_version == v0 + 2


@gpu
def test_cancelled_generate_aborts_its_requests(
    portal: Any, engine: Any, prompt: list[int]
) -> None:
    processor = getattr(engine.vllm_engine, "output_processor", None)
    count = getattr(processor, "get_num_unfinished_requests", None)
    if not callable(count):
        pytest.fail(
            "cannot read vLLM's unfinished requests (AsyncLLM.output_processor."
            "get_num_unfinished_requests is missing in this vLLM version): this test needs "
            "the count to see the requests submitted, then gone after the cancel"
        )

    def unfinished() -> int:
        return int(count())

    async def scenario() -> tuple[int, int, int, int, float]:
        idle = unfinished()  # 0: every earlier generate/score ran to its final output
        aborted_before = engine.stats["aborted"]
        long = SamplingParams(
            n=4, temperature=1.0, max_tokens=engine.max_model_len - len(prompt) - 1
        )
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.generate, prompt, long)
            # TimeoutError here: generate never submitted a request to vLLM
            with anyio.fail_after(60):
                while (busy := unfinished()) < 1:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        took = anyio.current_time() - t0
        with anyio.move_on_after(10):
            while unfinished():
                await anyio.sleep(0.01)
        return idle, busy, unfinished(), engine.stats["aborted"] - aborted_before, took

    idle, busy, left, aborted, took = portal.call(scenario)
    assert idle == 0
    assert took < 5.0
    assert aborted == 4
    assert busy >= 1 and left == 0
    after = _generate(portal, engine, prompt, n=2, temperature=1.0, max_tokens=4, seed=1)
    assert len(after) == 2 and all(1 <= len(c.token_ids) <= 4 for c in after)  # still serving
