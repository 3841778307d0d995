"""TransformersEngine: batching, logprobs, stopping, weight loading, cancellation (asyncio and trio)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from rftstream.engines import SamplingParams, create_engine
from rftstream.engines.base import Completion
from rftstream.engines.transformers_engine import TransformersEngine, _Request
from rftstream.errors import RftError

pytestmark = pytest.mark.anyio


def chat_ids(engine: TransformersEngine, question: str) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(text, add_special_tokens=False)


@asynccontextmanager
async def serving(path: str, **kwargs: Any) -> AsyncIterator[TransformersEngine]:
    engine = create_engine("transformers", path, **kwargs)
    assert isinstance(engine, TransformersEngine)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        try:
            yield engine
        finally:
            await engine.aclose()
            tg.cancel_scope.cancel()


def recompute_logprobs(
    engine: TransformersEngine, prompt: list[int], comp: Completion, temperature: float
) -> torch.Tensor:
    """Full-sequence forward: log_softmax(logits / T) of each sampled token (the trainer's way)."""
    seq = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return (
        torch.log_softmax(logits / t, -1)
        .gather(-1, torch.tensor(comp.token_ids)[:, None])
        .squeeze(-1)
    )


async def test_concurrent_requests_are_batched(tiny_model_path: str) -> None:
    async with serving(tiny_model_path, batch_wait_ms=50, max_batch_size=64) as engine:
        results: dict[int, list[Completion]] = {}

        async def one(i: int) -> None:
            results[i] = await engine.generate(
                chat_ids(engine, f"{i % 10}+3="), SamplingParams(n=2, max_tokens=4)
            )

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
        assert sorted(results) == list(range(12))
        for comps in results.values():
            assert len(comps) == 2
            for c in comps:
                assert 0 < len(c.token_ids) <= 4 and len(c.logprobs) == len(c.token_ids)
                assert all(lp <= 0 for lp in c.logprobs)
        assert engine.stats["requests"] == 12 and engine.stats["sequences"] == 24
        assert engine.stats["batches"] < 12


async def test_max_batch_size_splits_batches(tiny_model_path: str) -> None:
    async with serving(tiny_model_path, batch_wait_ms=50, max_batch_size=4) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(
                    engine.generate, chat_ids(engine, f"{i}+1="), SamplingParams(n=2, max_tokens=3)
                )
        assert engine.stats["batches"] >= 3  # 12 sequences, at most 4 per batch


async def test_requests_queued_during_a_batch_start_without_the_batch_wait(
    tiny_model_path: str,
) -> None:
    """An engine that finds requests already waiting (they queued while it sampled the batch
    before) starts them at once: a batch wait would hand the event loop to the workflows
    of the batch just finished and leave the sampler idle."""
    engine = create_engine("transformers", tiny_model_path, batch_wait_ms=5000, max_batch_size=8)
    assert isinstance(engine, TransformersEngine)
    for i in range(3):
        await engine._send.send(_Request(chat_ids(engine, f"{i}+1="), SamplingParams(n=2)))
    pending: deque[_Request] = deque()
    t0 = time.perf_counter()
    batch = await engine._collect(pending)
    assert time.perf_counter() - t0 < 1.0  # not the 5 s batch wait
    assert batch is not None and [r.params.n for r in batch] == [2, 2, 2] and not pending
    await engine.aclose()


async def test_an_idle_engine_waits_the_batch_wait_to_gather_requests(tiny_model_path: str) -> None:
    """Requests made together reach an idle engine one after another: the first one's batch
    waits up to batch_wait_ms for the others."""
    engine = create_engine("transformers", tiny_model_path, batch_wait_ms=2000, max_batch_size=8)
    assert isinstance(engine, TransformersEngine)
    prompt = chat_ids(engine, "1+1=")

    async def send_later() -> None:
        for _ in range(3):
            await anyio.sleep(0.05)
            await engine._send.send(_Request(prompt, SamplingParams(n=2)))
        await anyio.sleep(0.05)
        await engine._send.send(_Request(prompt, SamplingParams(n=4)))  # over max_batch_size

    pending: deque[_Request] = deque()
    async with anyio.create_task_group() as tg:
        tg.start_soon(send_later)
        batch = await engine._collect(pending)
    assert batch is not None and [r.params.n for r in batch] == [2, 2, 2]
    assert [r.params.n for r in pending] == [4]  # the next batch's first
    await engine.aclose()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 0.9), (0.0, -1, 1.0)])
async def test_logprobs_match_full_forward(
    tiny_model_path: str, temperature: float, top_k: int, top_p: float
) -> None:
    async with serving(tiny_model_path, batch_wait_ms=30) as engine:
        # prompts of different lengths exercise left padding; garbage prompts give long completions
        prompts = [
            chat_ids(engine, "3+4="),
            chat_ids(engine, "What is 12 plus 9?"),
            chat_ids(engine, "zz"),
        ]
        params = SamplingParams(
            n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10
        )
        out: list[list[Completion]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            out[i] = await engine.generate(prompts[i], params)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        assert engine.stats["batches"] == 1
        for prompt, comps in zip(prompts, out, strict=True):
            for c in comps:
                expected = recompute_logprobs(engine, prompt, c, temperature)
                assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), (
                    c.logprobs,
                    expected,
                )


async def test_logprobs_survive_cache_pruning(tiny_model_path: str) -> None:
    async with serving(tiny_model_path, batch_wait_ms=30) as engine:
        short, long_ = chat_ids(engine, "3+4="), chat_ids(engine, "zz")
        out: dict[str, list[Completion]] = {}

        async def one(name: str, prompt: list[int], params: SamplingParams) -> None:
            out[name] = await engine.generate(prompt, params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "short", short, SamplingParams(n=8, max_tokens=1))
            tg.start_soon(one, "long", long_, SamplingParams(n=2, max_tokens=12, temperature=0.8))
        assert engine.stats["batches"] == 1 and engine.stats["cache_prunes"] >= 1
        for c in out["long"]:
            expected = recompute_logprobs(engine, long_, c, 0.8)
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


async def test_eos_stops_and_max_tokens(tiny_model_path: str) -> None:
    async with serving(tiny_model_path) as engine:
        eos = engine.tokenizer.eos_token_id
        comps = await engine.generate(chat_ids(engine, "5+5="), SamplingParams(n=16, max_tokens=8))
        stopped = [c for c in comps if c.finish_reason == "stop"]
        assert len(stopped) >= 12
        for c in stopped:
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        # greedy "9+9=" starts with "1" then continues: max_tokens=1 cuts it
        (cut,) = await engine.generate(
            chat_ids(engine, "9+9="), SamplingParams(temperature=0, max_tokens=1)
        )
        assert cut.finish_reason == "length" and len(cut.token_ids) == 1 and cut.token_ids[0] != eos
        for c in await engine.generate(chat_ids(engine, "zz"), SamplingParams(n=4, max_tokens=3)):
            assert len(c.token_ids) <= 3
            assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
        (empty,) = await engine.generate(chat_ids(engine, "1+1="), SamplingParams(max_tokens=0))
        assert empty.token_ids == [] and empty.finish_reason == "length"
        with pytest.raises(RftError, match="context"):
            await engine.generate(list(range(5, 5 + engine.max_model_len)), SamplingParams())


async def test_min_tokens_bans_end_tokens_until_reached(tiny_model_path: str) -> None:
    async with serving(tiny_model_path) as engine:
        eos = engine.tokenizer.eos_token_id
        prompt = chat_ids(engine, "5+5=")
        plain = await engine.generate(prompt, SamplingParams(n=16, max_tokens=24, seed=3))
        assert max(len(c.token_ids) for c in plain) < 10  # the model answers and stops
        params = SamplingParams(n=16, max_tokens=24, min_tokens=12, seed=3, stop_token_ids=[5])
        comps = await engine.generate(prompt, params)
        for c in comps:  # no end token before 12; after it the row may stop
            assert len(c.token_ids) >= 12, c.token_ids
            assert eos not in c.token_ids[:12] and 5 not in c.token_ids[:12], c.token_ids
            assert c.finish_reason == ("stop" if len(c.token_ids) < 24 else "length")
        # the logprobs are those of the unbanned distribution (what the trainer recomputes)
        want = recompute_logprobs(engine, prompt, comps[0], 1.0)
        torch.testing.assert_close(torch.tensor(comps[0].logprobs), want, atol=2e-4, rtol=0)
        # and the mass the ban left is recorded: log(1 - p(eos, 5)) for the first 12, then 0
        banned = sorted({*engine.eos_token_ids, 5})
        for c in comps[:4]:
            assert c.banned_ids == banned
            seq = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = engine.model(input_ids=seq).logits[0, len(prompt) - 1 : -1].double()
            p = torch.softmax(logits, -1)
            left = torch.log1p(-p[:, banned].sum(-1))
            left[12:] = 0.0
            assert c.allowed_logprobs is not None and len(c.allowed_logprobs) == len(c.token_ids)
            torch.testing.assert_close(
                torch.tensor(c.allowed_logprobs, dtype=torch.float64), left, atol=2e-3, rtol=2e-4
            )
            assert min(c.allowed_logprobs[:12]) < -1.0  # the model wanted to end: a real ban
        assert all(c.allowed_logprobs is None for c in plain)  # nothing banned, nothing sent
        (greedy,) = await engine.generate(
            prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
        )
        assert len(greedy.token_ids) == 10 and eos not in greedy.token_ids
        assert greedy.allowed_logprobs is not None and greedy.banned_ids is not None
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(min_tokens=-1)


async def test_seed_makes_a_request_reproducible(tiny_model_path: str) -> None:
    async with serving(tiny_model_path) as engine:
        prompt = chat_ids(engine, "zz")
        a = await engine.generate(prompt, SamplingParams(n=3, max_tokens=12, seed=7))
        b = await engine.generate(prompt, SamplingParams(n=3, max_tokens=12, seed=7))
        assert [c.token_ids for c in a] == [c.token_ids for c in b]


async def test_load_weights_bumps_version_and_changes_outputs(tiny_model_path: str) -> None:
    async with serving(tiny_model_path) as engine:
        prompt = chat_ids(engine, "zz")
        greedy = SamplingParams(temperature=0, max_tokens=12)
        (before,) = await engine.generate(prompt, greedy)
        assert engine.model_version == 0 and before.model_version == 0

        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        gen = torch.Generator().manual_seed(0)
        for k in state:
            if k.endswith("weight") and state[k].dim() == 2:
                state[k] = torch.randn(state[k].shape, generator=gen) * 0.5
        state = {
            f"module.{k}": v for k, v in state.items() if k != "lm_head.weight"
        }  # DeepSpeed-style keys
        await engine.load_weights(state, 3)
        assert engine.model_version == 3
        (after,) = await engine.generate(prompt, greedy)
        assert after.model_version == 3
        assert after.token_ids != before.token_ids

        with pytest.raises(RftError, match="missing"):
            await engine.load_weights(
                {"model.embed_tokens.weight": state["module.model.embed_tokens.weight"]}, 4
            )
        assert engine.model_version == 3


async def test_cancelled_caller_does_not_break_the_batch(tiny_model_path: str) -> None:
    async with serving(tiny_model_path, batch_wait_ms=40) as engine:
        prompt = chat_ids(engine, "zz")
        done: list[int] = []

        async def survivor(i: int) -> None:
            comps = await engine.generate(prompt, SamplingParams(n=2, max_tokens=60))
            assert len(comps) == 2
            done.append(i)

        async def victim(delay: float) -> None:
            with anyio.move_on_after(delay) as scope:
                await engine.generate(prompt, SamplingParams(n=2, max_tokens=60))
            assert scope.cancelled_caught

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim, 0.01)  # cancelled while the batch is still being collected
            for i in range(3):
                tg.start_soon(survivor, i)
        assert sorted(done) == [0, 1, 2]

        # cancelled while its batch runs in the worker thread (slowed down to make that certain)
        fast = engine._generate_batch

        def slow(reqs: Any) -> Any:
            time.sleep(0.3)
            return fast(reqs)

        engine._generate_batch = slow  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(victim, 0.15)
            for i in range(3, 5):
                tg.start_soon(survivor, i)
        assert sorted(done) == [0, 1, 2, 3, 4]
        assert engine.stats["cancelled"] >= 2
        engine._generate_batch = fast  # type: ignore[method-assign]
        # the engine still serves
        assert len(await engine.generate(prompt, SamplingParams(max_tokens=2))) == 1


async def test_stopped_engine_fails_waiting_requests(tiny_model_path: str) -> None:
    engine = create_engine("transformers", tiny_model_path, max_batch_size=1, batch_wait_ms=0)
    assert isinstance(engine, TransformersEngine)
    prompt = chat_ids(engine, "1+1=")
    fast = engine._generate_batch

    def slow(reqs: Any) -> Any:
        time.sleep(0.2)
        return fast(reqs)

    engine._generate_batch = slow  # type: ignore[method-assign]
    outcome: dict[str, Any] = {}

    async def call(name: str) -> None:
        try:
            outcome[name] = await engine.generate(prompt, SamplingParams(max_tokens=2))
        except RftError as exc:
            outcome[name] = str(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "a")
        tg.start_soon(call, "b")
        await anyio.sleep(0.02)  # both wait: nothing serves yet
        assert outcome == {}
        with anyio.move_on_after(0.1):
            await engine.run()  # one batch of one request in flight when cancelled
    served = [v for v in outcome.values() if isinstance(v, list)]
    failed = [v for v in outcome.values() if isinstance(v, str)]
    assert len(served) == 1 and len(failed) == 1 and "stopped" in failed[0]
    await engine.aclose()
    with pytest.raises(RftError, match="closed"):
        await engine.generate(prompt, SamplingParams())


def test_create_engine_rejects_unknown_engine_types(tiny_model_path: str) -> None:
    with pytest.raises(RftError, match="unknown engine 'nope'.*'transformers', 'vllm', 'openai'"):
        create_engine("nope", tiny_model_path)
    engine = create_engine("transformers", tiny_model_path)
    assert engine.can_load_weights  # the explorer syncs weights into it
