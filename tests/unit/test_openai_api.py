"""OpenAI-compatible API: protocol helpers, multi-turn merge, and the server with a scripted engine.

The scripted engine replies with fixed texts (tokenised by the tiny model's
tokenizer), so tool calls, stop strings, streaming and errors are tested
exactly, on asyncio and trio, over real loopback HTTP with the ``openai``
package. The real tiny model is exercised in tests/integration/test_openai_api.py.
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import openai
import pytest
import torch

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams, TokenScores
from rftstream.engines.model_wrapper import ModelWrapper, merge_history
from rftstream.engines.openai_protocol import (
    ApiError,
    normalize_messages,
    parse_tool_calls,
    sampling_from_request,
    truncate_at_stop,
)
from rftstream.errors import RftError
from rftstream.experience import Experience

# ---------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------


def test_sampling_from_request_defaults_and_fields() -> None:
    p = sampling_from_request({}, default_max_tokens=7, default_temperature=0.5)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop) == (
        1,
        0.5,
        1.0,
        -1,
        7,
        None,
    )
    p = sampling_from_request(
        {
            "n": 3,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 5,
            "max_tokens": 4,
            "max_completion_tokens": 9,
            "stop": "\n",
            "seed": 3,
            "stop_token_ids": [2],
        },
        default_max_tokens=None,
    )
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (3, 0.0, 0.9, 5, 9)
    assert p.stop == ["\n"] and p.seed == 3 and p.stop_token_ids == [2]
    for bad in ({"n": 0}, {"n": 1.5}, {"temperature": "hot"}, {"top_p": 0}, {"stop": [1]}):
        with pytest.raises(ApiError):
            sampling_from_request(bad, default_max_tokens=None)


def test_parse_tool_calls() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["add", "echo"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[1]["function"]["arguments"] == '{"x": 1}'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    content, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert content is None and calls[0]["function"]["arguments"] == "{}"
    for plain in (
        "no calls here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"x": 1}</tool_call>',
    ):
        assert parse_tool_calls(plain) == (plain, [])


def test_normalize_messages_tool_calls_tool_role_and_tools() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2"}],
        },
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    out = normalize_messages(msgs, native_tool_calls=False, tools=tools)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[1]["content"] == "1+2"
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
    }
    assert out[3] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    native = normalize_messages(msgs, native_tool_calls=True, tool_role=False)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert native[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    with pytest.raises(ApiError):
        normalize_messages([], native_tool_calls=False)
    with pytest.raises(ApiError):
        normalize_messages([{"content": "x"}], native_tool_calls=False)


def test_truncate_at_stop() -> None:
    assert truncate_at_stop("a STOP b END", ["END", "STOP"]) == "a "
    assert truncate_at_stop("abc", ["x"]) == "abc" and truncate_at_stop("abc", None) == "abc"


def _turn(prompt: list[int], response: list[int], lp: float, version: int = 0) -> Experience:
    return Experience(
        tokens=prompt + response,
        prompt_length=len(prompt),
        logprobs=[lp] * len(response),
        model_version=version,
        info={"finish_reason": "stop"},
    )


def test_merge_history_chains_turns_and_masks_generated_tokens() -> None:
    t1 = _turn([1, 2], [10, 11], -1.0, version=3)
    t2 = _turn([1, 2, 10, 11, 5, 6], [12], -2.0, version=4)
    other = _turn([7, 8], [13, 14], -3.0)  # an unrelated call
    t3 = _turn([1, 2, 10, 11, 5, 6, 12, 5], [15, 16], -4.0, version=5)
    merged = merge_history([t1, t2, other, t3])
    assert len(merged) == 2
    conv = merged[1]
    assert conv.tokens.tolist() == [1, 2, 10, 11, 5, 6, 12, 5, 15, 16]
    assert conv.prompt_length == 2 and conv.info["num_turns"] == 3
    assert conv.action_mask.int().tolist() == [1, 1, 0, 0, 1, 0, 1, 1]
    assert conv.logprobs.tolist() == [-1.0, -1.0, 0.0, 0.0, -2.0, 0.0, -4.0, -4.0]
    assert conv.info["turn_spans"] == [[2, 4], [6, 7], [8, 10]]
    assert conv.model_version == 3
    assert merged[0].tokens.tolist() == [7, 8, 13, 14] and merged[0].info["num_turns"] == 1
    # n > 1: two samples of turn 1, the conversation continued from the second
    a, b = _turn([1], [2], -1.0), _turn([1], [3], -1.0)
    c = _turn([1, 3, 4], [5], -1.0)
    out = merge_history([a, b, c])
    assert [e.tokens.tolist() for e in out] == [[1, 2], [1, 3, 4, 5]]
    assert out[1].action_mask.int().tolist() == [1, 0, 1]
    assert merge_history([]) == []


def test_merge_history_keeps_the_banned_mass_of_each_turn() -> None:
    """Turns sampled under ``min_tokens`` keep their ``allowed_logprobs`` in place; turns
    that banned different ids, or an inexact turn, make the conversation inexact."""
    t1 = _turn([1, 2], [10, 11], -1.0)
    t1.allowed_logprobs, t1.banned_ids = torch.tensor([-3.0, -0.5]), torch.tensor([0])
    t2 = _turn([1, 2, 10, 11, 5], [12, 13], -2.0)
    t2.allowed_logprobs, t2.banned_ids = torch.tensor([-4.0, 0.0]), torch.tensor([0])
    (conv,) = merge_history([t1, t2])
    assert conv.allowed_logprobs.tolist() == [-3.0, -0.5, 0.0, -4.0, 0.0]
    assert conv.banned_ids.tolist() == [0] and "logprobs_exact" not in conv.info
    (plain,) = merge_history([_turn([1], [2], -1.0), _turn([1, 2, 3], [4], -1.0)])
    assert plain.allowed_logprobs is None and plain.banned_ids is None
    t2.banned_ids = torch.tensor([0, 5])  # another stop id on the second turn
    (mixed,) = merge_history([t1, t2])
    assert mixed.info["logprobs_exact"] is False and mixed.allowed_logprobs is None
    t2.banned_ids = torch.tensor([0])
    t1.info = {"finish_reason": "stop", "logprobs_exact": False}  # e.g. vLLM with top_p
    (inexact,) = merge_history([t1, t2])
    assert inexact.info["logprobs_exact"] is False


# ---------------------------------------------------------------------------
# the server with a scripted engine
# ---------------------------------------------------------------------------


class ScriptedEngine(RolloutEngine):
    """Replies with the next scripted text (+ eos) to every request; records prompts and params."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self._tok = tokenizer
        self.replies = replies
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self._closed = False
        self.max_model_len = 128

    @property
    def tokenizer(self) -> Any:
        return self._tok

    @property
    def model_version(self) -> int:
        return 7

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Completion]:
        if self._closed:
            raise RftError("rollout engine is closed")
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        text = self.replies[(len(self.prompts) - 1) % len(self.replies)]
        ids = self._tok.encode(text, add_special_tokens=False) + [self._tok.eos_token_id]
        return [
            Completion(ids, [-0.25] * len(ids), "stop", model_version=7) for _ in range(params.n)
        ]

    async def score(
        self,
        token_ids: list[int],
        *,
        start: int = 1,
        temperature: float = 1.0,
        top_logprobs: int = 0,
    ) -> TokenScores:
        n = len(token_ids) - max(start, 1)
        top = [[(t, -0.1), (0, -3.0)][:top_logprobs] for t in token_ids[max(start, 1) :]]
        return TokenScores([-0.5] * n, top if top_logprobs else None)

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        self._closed = True

    def prompt_text(self, i: int = -1) -> str:
        return self._tok.decode(self.prompts[i], skip_special_tokens=False)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@asynccontextmanager
async def scripted(
    tokenizer: Any, replies: list[str], **kw: Any
) -> AsyncIterator[tuple[ModelWrapper, ScriptedEngine]]:
    engine = ScriptedEngine(tokenizer, replies)
    model = ModelWrapper(engine, model_path="scripted", max_response_tokens=16, **kw)
    try:
        yield model, engine
    finally:
        await model.aclose()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.mark.anyio
async def test_tool_calls_over_http_with_the_openai_package(tiny_tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    async with scripted(tiny_tokenizer, [call, "It is 3."], enable_history=True) as (model, engine):

        def agent() -> list[dict[str, Any]]:
            client = model.get_openai_client()
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "1+2?"}]
            r = client.chat.completions.create(model=client.model_path, messages=msgs, tools=TOOLS)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (tc,) = choice.message.tool_calls
            assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "add"
            args = json.loads(tc.function.arguments)
            msgs.append(choice.message.model_dump(exclude_none=True))
            msgs.append(
                {"role": "tool", "tool_call_id": tc.id, "content": str(args["a"] + args["b"])}
            )
            r = client.chat.completions.create(model=client.model_path, messages=msgs, tools=TOOLS)
            assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            return msgs

        msgs = await anyio.to_thread.run_sync(agent)
        assert msgs[-1]["content"] == "It is 3."
        # the tiny template ignores `tools`: they become a Hermes system prompt
        first = engine.prompt_text(0)
        assert first.startswith("<|im_start|>system\n# Tools") and '"name": "add"' in first
        # the tool call re-renders as the model wrote it, the tool result in its own role
        second = engine.prompt_text(1)
        assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n" in second
        hist = model.extract_experience_from_history()
        assert [len(e.messages) for e in hist] == [2, 4]
        assert hist[0].messages[-1]["tool_calls"][0]["function"]["name"] == "add"
        # the call was generated verbatim, so the two calls chain into one conversation
        (conv,) = merge_history(hist)
        assert conv.info["num_turns"] == 2 and int(conv.action_mask.sum()) == sum(
            e.response_length for e in hist
        )


@pytest.mark.anyio
async def test_native_tools_template_and_tool_role_fallback(tiny_tokenizer: Any) -> None:
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}{{ '\\n' }}{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }}({{ c['function']['arguments']['a'] }})]{% endfor %}{{ '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    async with scripted(tok, ["ok"]) as (model, engine):
        calls = [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}
        ]
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c", "content": "6"},
        ]
        exps = await model.chat_async(msgs, tools=TOOLS)
        assert engine.prompt_text() == (
            "TOOLS=add\nuser: hi\nassistant: [add(5)]\nuser: <tool_response>\n6\n</tool_response>\nassistant: "
        )
        assert exps[0].messages[-1] == {"role": "assistant", "content": "ok"}


@pytest.mark.anyio
async def test_chat_template_per_request(tiny_tokenizer: Any) -> None:
    """vLLM's ``chat_template`` request field renders that request (the tool workflow sends
    ``format.chat_template`` this way); a non-string is a 400 naming the field."""
    async with scripted(tiny_tokenizer, ["ok"]) as (model, engine):

        def calls() -> None:
            client = model.get_openai_client()
            msgs = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(
                model=client.model_path,
                messages=msgs,
                extra_body={
                    "chat_template": "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
                },
            )
            client.chat.completions.create(model=client.model_path, messages=msgs)
            with pytest.raises(openai.BadRequestError, match="chat_template"):
                client.chat.completions.create(
                    model=client.model_path, messages=msgs, extra_body={"chat_template": 3}
                )

        await anyio.to_thread.run_sync(calls)
        assert engine.prompt_text(0) == "<hi>"
        assert engine.prompt_text(1) == tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )


@pytest.mark.anyio
async def test_chat_completions_fields_stop_stream_and_errors(tiny_tokenizer: Any) -> None:
    async with scripted(tiny_tokenizer, ["hello STOP world"]) as (model, engine):

        def calls() -> None:
            client = model.get_openai_client()
            assert client.models.list().data[0].id == "scripted" == client.model_path
            r = client.chat.completions.create(
                model="anything",
                messages=[{"role": "user", "content": "x"}],
                n=2,
                stop=["STOP"],
                temperature=0.3,
                max_tokens=5,
                logprobs=True,
                top_logprobs=2,
                seed=11,
                extra_body={"top_k": 4, "return_token_ids": True},
            )
            p = engine.params[-1]
            assert (p.n, p.temperature, p.max_tokens, p.stop, p.seed, p.top_k) == (
                2,
                0.3,
                5,
                ["STOP"],
                11,
                4,
            )
            assert [c.message.content for c in r.choices] == ["hello ", "hello "]
            assert [c.index for c in r.choices] == [0, 1]
            n_resp = len(tiny_tokenizer.encode("hello STOP world")) + 1
            assert r.usage.prompt_tokens == len(engine.prompts[-1])
            assert r.usage.completion_tokens == 2 * n_resp
            assert r.usage.total_tokens == r.usage.prompt_tokens + 2 * n_resp
            lp = r.choices[0].logprobs.content
            assert len(lp) == n_resp and lp[0].token == "h" and lp[0].logprob == -0.25
            assert lp[-1].token == "<|im_end|>" and len(lp[0].top_logprobs) == 2
            extra = r.model_extra or {}
            assert extra["prompt_token_ids"] == engine.prompts[-1]
            assert r.choices[0].model_extra["token_ids"][-1] == tiny_tokenizer.eos_token_id
            # default max_tokens: the wrapper's max_response_tokens
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            assert engine.params[-1].max_tokens == 16 and engine.params[-1].temperature == 1.0
            # streaming: the whole reply, then finish_reason, then usage
            stream = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "hello STOP world"
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            assert chunks[-1].usage.completion_tokens == n_resp
            # errors are OpenAI-shaped and not retried
            with pytest.raises(openai.BadRequestError, match="n"):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], n=0
                )
            with pytest.raises(openai.BadRequestError, match="messages"):
                client.chat.completions.create(model="m", messages=[])
            r = client.completions.create(
                model="m", prompt=["ab", "cd"], n=2, echo=True, logprobs=1
            )
            assert [c.index for c in r.choices] == [0, 1, 2, 3]
            assert r.choices[2].text == "cdhello STOP world"
            lps = r.choices[0].logprobs
            assert lps.tokens[:2] == ["a", "b"] and lps.token_logprobs[0] is None
            assert lps.top_logprobs[0] is None and len(lps.top_logprobs[1]) == 1
            assert lps.text_offset[:3] == [0, 1, 2]
            assert engine.params[-1].max_tokens == 16  # the OpenAI default for completions

        await anyio.to_thread.run_sync(calls)


@pytest.mark.anyio
async def test_async_client_on_the_loop_and_sync_client_misuse(tiny_tokenizer: Any) -> None:
    async with scripted(tiny_tokenizer, ["fine"], enable_history=True) as (model, engine):
        client = model.get_openai_async_client()
        assert model._shared.server is not None and not model._shared.server.started  # lazy
        r = await client.chat.completions.create(
            model=client.model_path, messages=[{"role": "user", "content": "x"}]
        )
        assert r.choices[0].message.content == "fine" and model._shared.server.started
        sync = model.get_openai_client()
        with pytest.raises(RftError, match="block forever"):
            sync.models.list()  # on the loop that serves it
        assert len(model.extract_experience_from_history()) == 1


@pytest.mark.anyio
async def test_clone_sessions_keep_separate_histories(tiny_tokenizer: Any) -> None:
    async with scripted(tiny_tokenizer, ["a", "b"], enable_history=True) as (model, engine):
        one, two = model.clone(), model.clone()

        def use(m: ModelWrapper, q: str) -> str:
            c = m.get_openai_client()
            return (
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])
                .choices[0]
                .message.content
            )

        await anyio.to_thread.run_sync(use, one, "q1")
        await anyio.to_thread.run_sync(use, two, "q2")
        await anyio.to_thread.run_sync(use, two, "q3")
        assert "/s/" in str(one.get_openai_client().base_url)
        assert [e.messages[0]["content"] for e in one.extract_experience_from_history()] == ["q1"]
        assert [e.messages[0]["content"] for e in two.extract_experience_from_history()] == [
            "q2",
            "q3",
        ]
        assert model.extract_experience_from_history() == []
        base = model.openai_base_url

        def post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
            req = urllib.request.Request(
                url, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read())

        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
        url = base.replace("/v1", "/s/nope/v1") + "/chat/completions"
        status, payload = await anyio.to_thread.run_sync(post, url, body)
        assert status == 404 and "unknown session" in payload["error"]["message"]
        status, payload = await anyio.to_thread.run_sync(post, base + "/chat/completions", b"{nope")
        assert status == 400 and "JSON" in payload["error"]["message"]


@pytest.mark.anyio
async def test_closing_the_root_wrapper_closes_every_clones_clients(tiny_tokenizer: Any) -> None:
    async with scripted(tiny_tokenizer, ["4"]) as (model, _):
        clones = [model.clone(enable_history=True) for _ in range(2)]
        clients = [c.get_openai_async_client() for c in clones] + [model.get_openai_async_client()]
        reply = await clients[0].chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "2+2="}]
        )
        assert reply.choices[0].message.content == "4"
        assert not any(c.is_closed() for c in clients)
        await clones[1].aclose()  # a clone closes only its own clients
        assert [c.is_closed() for c in clients] == [False, True, False]
    assert all(c.is_closed() for c in clients)  # the root closed the rest
