"""The OpenAI-compatible API on the real tiny model (loopback only, no NATS).

Covers /v1/models, chat with n and logprobs, completions, batching of
concurrent HTTP requests, history through the ``openai`` package inside a
workflow run by the WorkflowRunner, the 3-turn action mask, the ``openai``
rollout engine against our own server, and auxiliary models.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from rftstream.config.schema import AuxiliaryModelConfig
from rftstream.engines import SamplingParams, create_engine
from rftstream.engines.auxiliary_models import serve_auxiliary_models
from rftstream.engines.model_wrapper import ModelWrapper
from rftstream.engines.openai_engine import OpenAIEngine
from rftstream.engines.transformers_engine import TransformersEngine
from rftstream.errors import RftError
from rftstream.experience import Experience
from rftstream.workflow_runner import WorkflowRunner
from workflows import Task, Workflow

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@asynccontextmanager
async def served(
    path: str, **wrapper_kw: Any
) -> AsyncIterator[tuple[ModelWrapper, TransformersEngine]]:
    engine = create_engine("transformers", path, batch_wait_ms=30)
    assert isinstance(engine, TransformersEngine)
    model = ModelWrapper(engine, model_path=path, max_response_tokens=8, **wrapper_kw)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        try:
            yield model, engine
        finally:
            await model.aclose()
            await engine.aclose()
            tg.cancel_scope.cancel()


def template_ids(tok: Any, messages: list[dict[str, Any]], gen: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    return tok.encode(text, add_special_tokens=False)


async def test_models_chat_n_logprobs_and_scoring(tiny_model_path: str) -> None:
    async with served(tiny_model_path, enable_history=True) as (model, engine):
        tok = engine.tokenizer
        messages = [{"role": "user", "content": "3+4="}]

        def calls() -> Any:
            client = model.get_openai_client()
            ids = [m.id for m in client.models.list().data]
            assert ids == [client.model_path] == [tiny_model_path]
            return client.chat.completions.create(
                model=client.model_path,
                messages=messages,
                n=3,
                temperature=0.8,
                logprobs=True,
                top_logprobs=3,
            )

        r = await anyio.to_thread.run_sync(calls)
        prompt = template_ids(tok, messages, gen=True)
        hist = model.extract_experience_from_history()
        assert len(r.choices) == 3 == len(hist)
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == sum(e.response_length for e in hist)
        for choice, exp in zip(r.choices, hist, strict=True):
            assert exp.tokens[: exp.prompt_length].tolist() == prompt
            assert choice.finish_reason in ("stop", "length")
            assert choice.message.content == exp.response_text
            content = choice.logprobs.content
            assert [c.logprob for c in content] == pytest.approx(exp.logprobs.tolist())
            # the engine's sampling logprobs agree with a full forward at the same temperature
            scored = await engine.score(
                exp.tokens.tolist(), start=exp.prompt_length, temperature=0.8
            )
            assert scored.logprobs == pytest.approx(exp.logprobs.tolist(), abs=1e-4)
            for c in content:
                tops = [t.logprob for t in c.top_logprobs]
                assert len(tops) == 3 and tops == sorted(tops, reverse=True)
                assert c.logprob <= tops[0] + 1e-5
        # ModelWrapper.logprobs: Trinity's shape (len - 1), temperature 1
        full = hist[0].tokens
        lp = await anyio.to_thread.run_sync(model.logprobs, full)
        with torch.no_grad():
            logits = engine.model(input_ids=full[None].long()).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, full[1:, None].long()).squeeze(-1)
        assert lp.shape == (len(full) - 1,) and torch.allclose(lp, expected, atol=1e-4)


async def test_completions_text_and_token_prompts(tiny_model_path: str) -> None:
    async with served(tiny_model_path) as (model, engine):
        tok = engine.tokenizer
        prompt_ids = template_ids(tok, [{"role": "user", "content": "2+2="}], gen=True)

        def calls() -> tuple[Any, Any]:
            client = model.get_openai_client()
            a = client.completions.create(
                model=client.model_path,
                prompt=prompt_ids,
                max_tokens=1,
                temperature=0,
                logprobs=2,
                echo=True,
                extra_body={"return_token_ids": True},
            )
            b = client.completions.create(
                model=client.model_path, prompt=["1+1=", "ab"], n=2, max_tokens=3
            )
            return a, b

        a, b = await anyio.to_thread.run_sync(calls)
        (choice,) = a.choices
        assert choice.finish_reason == "length" and a.usage.completion_tokens == 1
        assert a.usage.prompt_tokens == len(prompt_ids)
        gen = choice.model_extra["token_ids"]
        assert choice.model_extra["prompt_token_ids"] == prompt_ids and len(gen) == 1
        lps = choice.logprobs
        assert len(lps.tokens) == len(prompt_ids) + 1 and lps.token_logprobs[0] is None
        scored = await engine.score(prompt_ids + gen, start=1)
        assert lps.token_logprobs[1:] == pytest.approx(scored.logprobs, abs=1e-4)
        # greedy: the generated token is the top alternative
        assert max(lps.top_logprobs[-1].values()) == pytest.approx(lps.token_logprobs[-1], abs=1e-5)
        assert len(b.choices) == 4 and [c.index for c in b.choices] == [0, 1, 2, 3]
        assert b.usage.prompt_tokens == len("1+1=") + len("ab")  # one token per character


async def test_concurrent_http_requests_are_batched(tiny_model_path: str) -> None:
    async with served(tiny_model_path) as (model, engine):
        client = await anyio.to_thread.run_sync(model.get_openai_client)
        replies: list[str] = []

        def ask(i: int) -> None:
            r = client.chat.completions.create(
                model=client.model_path,
                messages=[{"role": "user", "content": f"{i}+1="}],
                max_tokens=4,
            )
            replies.append(r.choices[0].message.content)

        before = dict(engine.stats)
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(anyio.to_thread.run_sync, ask, i)
        assert len(replies) == 8
        assert engine.stats["requests"] - before["requests"] == 8
        assert engine.stats["batches"] - before["batches"] < 8  # some batch served > 1 request


class OpenAIAgent(Workflow):
    """A 3-turn agent written against the ``openai`` package (the guide's get_openai_client())."""

    def __init__(self, *, task: Task, model: Any, auxiliary_models: Any = None) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        self.client = model.get_openai_client()

    def run(self) -> list[Experience]:
        messages: list[dict[str, Any]] = []
        for q in self.task.raw_task["turns"]:
            messages.append({"role": "user", "content": q})
            r = self.client.chat.completions.create(
                model=self.client.models.list().data[0].id,
                messages=messages,
                temperature=0,
                max_tokens=6,
            )
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        per_call = self.model.extract_experience_from_history(clear_history=False)
        exps = self.model.extract_experience_from_history(merge_turns=True)
        for e in exps:
            e.reward = 1.0
            e.info["conversation"] = messages
            e.info["finishes"] = [c.info["finish_reason"] for c in per_call]
        return exps


def expected_mask(
    tok: Any, messages: list[dict[str, Any]], finishes: list[str]
) -> tuple[list[int], list[int], int]:
    """(tokens, mask over tokens[prompt_length:], prompt_length) computed from the chat template alone."""
    full = template_ids(tok, messages, gen=False)
    first_prompt = template_ids(tok, messages[:1], gen=True)
    mask = [0] * len(full)
    turn = 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(template_ids(tok, messages[:k], gen=True))
        n = len(tok.encode(m["content"], add_special_tokens=False))
        n += finishes[turn] == "stop"  # the model's own <|im_end|>
        mask[start : start + n] = [1] * n
        turn += 1
    end = (
        len(full) - 1 if finishes[-1] == "stop" else len(full) - 2
    )  # drop the template's "\n" (and <|im_end|>)
    return full[:end], mask[len(first_prompt) : end], len(first_prompt)


async def test_history_via_openai_package_and_three_turn_mask(tiny_model_path: str) -> None:
    async with served(tiny_model_path, enable_history=True) as (model, engine):
        tok = engine.tokenizer
        runner = WorkflowRunner(model, max_timeout=60, max_retry_times=0)
        convs = [["1+2=", "3+4=", "5+1="], ["2+2=", "9+9=", "0+7="]]
        results = []

        async def one(i: int) -> None:
            results.append(
                await runner.run_task(
                    Task(workflow=OpenAIAgent, raw_task={"turns": convs[i]}, task_id=i)
                )
            )

        async with anyio.create_task_group() as tg:  # two agents at once: histories must not mix
            for i in range(2):
                tg.start_soon(one, i)
        assert model.extract_experience_from_history() == []  # workflows used their own clones
        for res in results:
            assert res.ok, res.error
            (exp,) = res.experiences
            messages = exp.info["conversation"]
            assert [m["content"] for m in messages if m["role"] == "user"] == convs[
                int(exp.eid.task)
            ]
            assert exp.info["num_turns"] == 3 and exp.messages == messages
            # recompute independently: the template's rendering of the final conversation
            tokens, mask, prompt_length = expected_mask(tok, messages, exp.info["finishes"])
            assert exp.tokens.tolist() == tokens
            assert exp.prompt_length == prompt_length
            assert exp.action_mask.int().tolist() == mask
            # logprobs aligned with the mask: recomputed by a full forward at temperature 1
            # (greedy sampling reports log_softmax(logits), the same convention)
            scored = await engine.score(exp.tokens.tolist(), start=exp.prompt_length)
            expected = torch.tensor(scored.logprobs) * exp.action_mask
            assert torch.allclose(exp.logprobs, expected, atol=1e-4)
            assert bool((exp.logprobs[~exp.action_mask] == 0).all())


async def test_openai_agent_yields_a_full_group(tiny_model_path: str) -> None:
    """OpenAIAgent cannot repeat itself: repeat_times 3 runs it three times, one conversation
    (one merged experience) per run, each with its own history."""
    async with served(tiny_model_path, enable_history=True) as (model, engine):
        runner = WorkflowRunner(model, max_timeout=60, max_retry_times=0)
        task = Task(
            workflow=OpenAIAgent,
            raw_task={"turns": ["1+2=", "3+4=", "5+1="]},
            repeat_times=3,
            batch_id=4,
            task_id=9,
        )
        res = await runner.run_task(task)
        assert res.ok, res.error
        exps = res.experiences
        assert [e.eid.run for e in exps] == [0, 1, 2]
        assert {(e.eid.batch, e.eid.task) for e in exps} == {(4, 9)}
        for exp in exps:  # three turns each, masks exactly on the assistant tokens
            assert exp.info["num_turns"] == 3
            tokens, mask, prompt_length = expected_mask(
                engine.tokenizer, exp.info["conversation"], exp.info["finishes"]
            )
            assert exp.tokens.tolist() == tokens and exp.prompt_length == prompt_length
            assert exp.action_mask.int().tolist() == mask
        assert model.extract_experience_from_history() == []


async def test_runner_starts_the_api_when_enabled(tiny_model_path: str) -> None:
    class Noop(Workflow):
        def run(self) -> list[Experience]:
            return [Experience(tokens=[1, 2], prompt_length=1)]

    async with served(tiny_model_path, enable_openai_api=True) as (model, _):
        assert model._shared.server is None
        res = await WorkflowRunner(model, max_timeout=10, max_retry_times=0).run_task(
            Task(workflow=Noop)
        )
        assert res.ok and model._shared.server is not None and model._shared.server.started


async def test_openai_engine_against_our_server(tiny_model_path: str) -> None:
    async with served(tiny_model_path) as (model, engine):
        base_url = await model.start_openai_server()
        remote = create_engine(
            "openai", tiny_model_path, base_url=base_url, max_batch_size=8, dtype="float32"
        )
        assert isinstance(remote, OpenAIEngine)
        async with anyio.create_task_group() as tg:
            await tg.start(remote.run)
            assert remote.served_model_name == tiny_model_path
            client_side = ModelWrapper(remote, model_path=tiny_model_path, max_response_tokens=6)
            exps = await client_side.chat_async(
                [{"role": "user", "content": "4+4="}], n=3, temperature=0.9
            )
            assert len(exps) == 3
            for e in exps:
                assert e.info["finish_reason"] in ("stop", "length") and 0 < e.response_length <= 6
                scored = await engine.score(
                    e.tokens.tolist(), start=e.prompt_length, temperature=0.9
                )
                assert e.logprobs.tolist() == pytest.approx(scored.logprobs, abs=1e-4)
                assert e.response_text == engine.tokenizer.decode(
                    e.tokens[e.prompt_length :], skip_special_tokens=True
                )
            assert remote.stats["requests"] == 1 and remote.stats["sequences"] == 3
            # min_tokens goes to the server (vLLM's extension); the logprobs cannot carry the
            # banned mass, so the trainer must not weight by them: flagged inexact
            prompt = exps[0].tokens[: exps[0].prompt_length].tolist()
            banned = await remote.generate(prompt, SamplingParams(n=2, max_tokens=8, min_tokens=6))
            for c in banned:
                assert len(c.token_ids) >= 6 and c.info["logprobs_exact"] is False
            # scoring through echo + logprobs
            seq = exps[0].tokens.tolist()
            theirs = await remote.score(seq, start=3, top_logprobs=2)
            ours = await engine.score(seq, start=3, top_logprobs=2)
            assert theirs.logprobs == pytest.approx(ours.logprobs, abs=1e-4)
            assert [[t for t, _ in alts] for alts in theirs.top_logprobs] == [
                [t for t, _ in alts] for alts in ours.top_logprobs
            ]
            assert not remote.can_load_weights  # the explorer never syncs into it
            with pytest.raises(RftError, match="cannot load new weights"):
                await remote.load_weights({}, 1)
            await remote.aclose()
        with pytest.raises(RftError, match="closed"):
            await remote.generate([1, 2], SamplingParams())


class UsesJudges(Workflow):
    def run(self) -> list[Experience]:
        out = []
        for client in self.auxiliary_models:
            r = client.chat.completions.create(
                model=client.model_path, messages=[{"role": "user", "content": "1+1="}]
            )
            out.append(
                Experience(
                    tokens=[1, 2],
                    prompt_length=1,
                    info={"judge": client.model_path, "len": r.usage.completion_tokens},
                )
            )
        return out


async def test_auxiliary_models_local_and_base_url(tiny_model_path: str) -> None:
    async with served(tiny_model_path) as (model, _):
        external = await model.start_openai_server()
        configs = [
            AuxiliaryModelConfig(
                name="judge", model_path=tiny_model_path, max_response_tokens=3, temperature=0.5
            ),
            AuxiliaryModelConfig(name="ext", base_url=external),
        ]
        async with serve_auxiliary_models(configs) as clients:
            assert [c.model_path for c in clients] == ["judge", "ext"]
            local_url = str(clients[0].base_url)
            assert local_url.startswith("http://127.0.0.1:") and local_url != external + "/"
            runner = WorkflowRunner(
                model, max_timeout=30, max_retry_times=0, auxiliary_models=clients
            )
            res = await runner.run_task(Task(workflow=UsesJudges))
            assert res.ok, res.error
            assert [e.info["judge"] for e in res.experiences] == ["judge", "ext"]
            assert 0 < res.experiences[0].info["len"] <= 3  # the entry's max_response_tokens
        with pytest.raises(RftError, match="model_path"):
            async with serve_auxiliary_models([AuxiliaryModelConfig(name="x")]):
                pass
