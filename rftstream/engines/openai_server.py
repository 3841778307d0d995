"""An OpenAI-compatible HTTP API for a :class:`~rftstream.engines.model_wrapper.ModelWrapper`.

:class:`OpenAIServer` serves ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` and ``/health`` on a free loopback port with ``aiohttp``. Every
request goes to the wrapper's rollout engine, so concurrent HTTP requests are
batched together with the workflows' ``model.chat()`` calls, and (with
``enable_history``) every completion it serves is recorded as an
:class:`~rftstream.experience.Experience`.

Where it runs: on an asyncio event loop the server lives ON the engine's loop
(no extra thread; a workflow's worker thread that blocks on a synchronous
``openai.OpenAI`` request never blocks the loop, which serves it). Under any
other anyio backend (trio) aiohttp runs on its own asyncio loop in a daemon
thread, and each request is handed to the engine's loop with
``anyio.from_thread.run``. Either way all engine work happens on the engine's
loop.

Sessions: ``/v1/...`` is served by the wrapper that created the server;
``/s/<session>/v1/...`` by one of its :meth:`ModelWrapper.clone` views, so the
history of each workflow stays its own (the runner gives every workflow a
clone when history is on).

The protocol helpers (request parsing, message normalisation, tool-call
parsing, response bodies) are pure functions, usable without a server.
:func:`serve_auxiliary_models` starts ``explorer.auxiliary_models``.

Request fields understood, beyond the usual ``n``, ``temperature``,
``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``:
chat ``logprobs`` + ``top_logprobs``, ``tools`` / ``tool_choice`` (``"none"``
disables them), ``stream`` (the whole completion is generated, then sent as
server-sent events), ``stream_options.include_usage``; completions
``logprobs: int``, ``echo``, prompts as text, token ids or lists of either;
vLLM's extensions ``top_k``, ``stop_token_ids``, ``chat_template`` (a Jinja
template for this request), ``chat_template_kwargs``,
``return_token_ids`` (adds ``prompt_token_ids`` / ``token_ids``) and
``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:<id>"``). Other
fields (penalties, ``user``, ...) are ignored. Defaults: ``max_tokens`` is the
wrapper's ``max_response_tokens`` for chat and 16 for completions (as
OpenAI); ``temperature`` is the wrapper's ``default_temperature`` (1.0).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from rftstream.engines.base import SamplingParams
from rftstream.errors import RftError

if TYPE_CHECKING:
    from rftstream.engines.model_wrapper import ModelWrapper

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "ApiError",
    "OpenAIServer",
    "normalize_messages",
    "parse_tool_calls",
    "render_tool_call",
    "sampling_from_request",
    "serve_auxiliary_models",
    "tools_system_prompt",
]

MAX_N = 128
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ApiError(RftError):
    """A request the API rejects: becomes an OpenAI-style error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field name
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


# ---------------------------------------------------------------------------
# Protocol helpers (pure)
# ---------------------------------------------------------------------------


def _number(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"`{key}` must be a number, got {value!r}", param=key)
    if kind is int:
        if float(value) != int(value):
            raise ApiError(f"`{key}` must be an integer, got {value!r}", param=key)
        return int(value)
    return float(value)


def sampling_from_request(
    body: dict[str, Any],
    *,
    default_max_tokens: int | None,
    default_temperature: float = 1.0,
) -> SamplingParams:
    """The :class:`SamplingParams` of a chat or completions request body (raises :class:`ApiError`)."""
    n = _number(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(f"`n` must be in [1, {MAX_N}], got {n}", param="n")
    max_tokens = _number(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, default_max_tokens)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError("`stop` must be a string or a list of strings", param="stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(isinstance(t, int) for t in stop_ids)
    ):
        raise ApiError("`stop_token_ids` must be a list of integers", param="stop_token_ids")
    top_k = _number(body, "top_k", int, -1)
    try:
        return SamplingParams(
            n=n,
            temperature=_number(body, "temperature", float, default_temperature),
            top_p=_number(body, "top_p", float, 1.0),
            top_k=top_k if top_k > 0 else -1,
            max_tokens=max_tokens,
            stop=([s for s in stop if s] or None) if stop else None,
            stop_token_ids=stop_ids,
            seed=_number(body, "seed", int, None),
        )
    except ValueError as exc:
        raise ApiError(str(exc).replace("SamplingParams.", "")) from exc


def _text_of(content: Any) -> str:
    """Message content as text: ``None`` is empty, a list of parts is joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                parts.append(str(part.get("text", "")))
            else:
                raise ApiError(
                    f"unsupported message content part {part!r}: only text parts are supported",
                    param="messages",
                )
        return "".join(parts)
    return str(content)


def _arguments_of(call: dict[str, Any]) -> tuple[str, Any]:
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"malformed tool call {call!r}", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the string: the template renders it as is
    return fn["name"], args


def render_tool_call(name: str, arguments: Any) -> str:
    """A tool call as Qwen / Hermes models write it: ``<tool_call>\\n{json}\\n</tool_call>``."""
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """Qwen2.5's (Hermes-style) tool instructions, for chat templates that ignore ``tools``."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def normalize_messages(
    messages: Any,
    *,
    native_tool_calls: bool,
    tool_role: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI chat messages made renderable by a Hugging Face chat template.

    Content becomes text (``None`` -> ``""``, text parts joined). An assistant
    message's ``tool_calls`` keep their OpenAI shape with ``arguments`` parsed
    into objects when the template renders ``tool_calls``
    (``native_tool_calls``); otherwise they are appended to the content as
    ``<tool_call>`` blocks. With ``tool_role=False``, ``tool`` messages become
    ``user`` messages wrapping the result in ``<tool_response>`` tags. ``tools``
    (given only when the template ignores them) become a system prompt,
    merged into a leading system message. Raises :class:`ApiError`.
    """
    if not isinstance(messages, list) or not messages:
        raise ApiError("`messages` must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"malformed message {m!r}", param="messages")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _text_of(m.get("content"))
        calls = m.get("tool_calls") or []
        if calls:
            parsed = [_arguments_of(c) for c in calls]
            if native_tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c.get("id", ""),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                    for c, (name, args) in zip(calls, parsed, strict=True)
                ]
            else:
                msg.pop("tool_calls", None)
                blocks = [render_tool_call(name, args) for name, args in parsed]
                msg["content"] = "\n".join([msg["content"], *blocks] if msg["content"] else blocks)
        if msg["role"] == "tool" and not tool_role:
            msg = {
                "role": "user",
                "content": f"<tool_response>\n{msg['content']}\n</tool_response>",
            }
        out.append(msg)
    if tools:
        prompt = tools_system_prompt(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a reply into its text and its ``<tool_call>{json}</tool_call>`` calls (Qwen / Hermes).

    Returns ``(content, tool_calls)`` with OpenAI-shaped calls (``id``,
    ``type: "function"``, ``function.name``, ``function.arguments`` as a JSON
    string); ``content`` is the text outside the blocks, stripped, or ``None``
    if empty. A reply with no block, or with any block that is not a JSON
    object with a string ``name``, is returned unchanged with no calls.
    """
    blocks = list(_TOOL_CALL_RE.finditer(text))
    if not blocks:
        return text, []
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args
                    if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    rest = _TOOL_CALL_RE.sub("", text).strip()
    return rest or None, calls


def truncate_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """``text`` up to the first occurrence of any stop string (OpenAI leaves it out)."""
    if not stop:
        return text
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _token_text(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([int(token_id)], skip_special_tokens=False))


def chat_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    *,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The ``choices[i].logprobs`` object of a chat completion."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = _token_text(tokenizer, tid, as_ids)
        alts = []
        for alt_id, alt_lp in top[i] if top is not None else ():
            alt = _token_text(tokenizer, alt_id, as_ids)
            alts.append({"token": alt, "logprob": alt_lp, "bytes": list(alt.encode())})
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alts}
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    top: Sequence[Sequence[tuple[int, float]] | None] | None,
    *,
    as_ids: bool = False,
    offset: int = 0,
) -> dict[str, Any]:
    """The ``choices[i].logprobs`` object of a (legacy) completion."""
    tokens, offsets, tops = [], [], []
    pos = offset
    for i, tid in enumerate(token_ids):
        text = _token_text(tokenizer, tid, as_ids)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        alts = top[i] if top is not None else None
        tops.append(
            None if alts is None else {_token_text(tokenizer, a, as_ids): lp for a, lp in alts}
        )
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _sse_chat_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A finished chat completion as ``chat.completion.chunk`` objects (one per choice part)."""
    base = {k: body[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    chunks = []
    for ch in body["choices"]:
        msg = ch["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        chunks.append(
            {
                **base,
                "choices": [
                    {
                        "index": ch["index"],
                        "delta": delta,
                        "logprobs": ch.get("logprobs"),
                        "finish_reason": None,
                    }
                ],
            }
        )
        chunks.append(
            {
                **base,
                "choices": [
                    {
                        "index": ch["index"],
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": ch["finish_reason"],
                    }
                ],
            }
        )
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks


def _sse_completion_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    base = {k: body[k] for k in ("id", "object", "created", "model")}
    chunks = [{**base, "choices": [ch]} for ch in body["choices"]]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks


# ---------------------------------------------------------------------------
# Request handling (runs on the engine's event loop)
# ---------------------------------------------------------------------------


async def _tokenizing(
    wrapper: ModelWrapper, size: int, fn: Callable[..., T], *args: Any, **kw: Any
) -> T:
    """``fn(*args, **kw)`` under the wrapper's tokenizer lock; in a worker thread when large."""

    def call() -> T:
        with wrapper._tok_lock:
            return fn(*args, **kw)

    if size > 2048:
        return await anyio.to_thread.run_sync(call)
    return call()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top_count(value: Any, param: str) -> int:
    if value is None or value is False:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(f"`{param}` must be a non-negative integer, got {value!r}", param=param)
    if value > MAX_TOP_LOGPROBS:
        raise ApiError(f"`{param}` must be at most {MAX_TOP_LOGPROBS}", param=param)
    return int(value)


async def handle_chat(wrapper: ModelWrapper, body: dict[str, Any]) -> dict[str, Any]:
    """Serve one ``/v1/chat/completions`` body with ``wrapper``; returns the response body."""
    params = sampling_from_request(
        body,
        default_max_tokens=wrapper.max_response_tokens,
        default_temperature=wrapper.default_temperature,
    )
    tools = body.get("tools") or None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError("`tools` must be a list of objects", param="tools")
    if body.get("tool_choice") == "none":
        tools = None
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise ApiError("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    chat_template = body.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ApiError("`chat_template` must be a string", param="chat_template")
    want_logprobs = bool(body.get("logprobs"))
    top = _top_count(body.get("top_logprobs"), "top_logprobs") if want_logprobs else 0
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    prompt_ids, exps = await wrapper._chat_for_api(
        body.get("messages"),
        params,
        tools=tools,
        template_kwargs=template_kwargs,
        chat_template=chat_template or None,
    )
    choices = []
    completion_tokens = 0
    for i, exp in enumerate(exps):
        resp_ids = exp.tokens[exp.prompt_length :].tolist()
        completion_tokens += len(resp_ids)
        reply = exp.messages[-1] if exp.messages else {"content": exp.response_text}
        message: dict[str, Any] = {
            "role": "assistant",
            "content": exp.response_text,
            "refusal": None,
        }
        finish = exp.info.get("finish_reason", "stop")
        if reply.get("tool_calls"):
            message["content"] = reply.get("content")
            message["tool_calls"] = reply["tool_calls"]
            finish = "tool_calls" if finish == "stop" else finish
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish}
        choice["logprobs"] = None
        if want_logprobs:
            alts = None
            if top > 0:
                scores = await wrapper.engine.score(
                    exp.tokens.tolist(),
                    start=exp.prompt_length,
                    temperature=params.temperature,
                    top_logprobs=top,
                )
                alts = scores.top_logprobs
            choice["logprobs"] = await _tokenizing(
                wrapper,
                len(resp_ids) * (1 + top),
                chat_logprobs,
                wrapper.tokenizer,
                resp_ids,
                exp.logprobs.tolist(),
                alts,
                as_ids=as_ids,
            )
        if body.get("return_token_ids"):
            choice["token_ids"] = resp_ids
        choices.append(choice)
    out: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": wrapper.served_model_name,
        "choices": choices,
        "usage": _usage(len(prompt_ids), completion_tokens),
    }
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def _prompts_of(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of those",
        param="prompt",
    )


async def handle_completion(wrapper: ModelWrapper, body: dict[str, Any]) -> dict[str, Any]:
    """Serve one ``/v1/completions`` body with ``wrapper``; returns the response body."""
    params = sampling_from_request(
        body,
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        default_temperature=wrapper.default_temperature,
    )
    prompts = _prompts_of(body.get("prompt"))
    k = _top_count(body.get("logprobs"), "logprobs")
    want_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
    echo = bool(body.get("echo"))
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    tok = wrapper.tokenizer
    results = await wrapper._complete_for_api(prompts, params)
    choices = []
    prompt_total = completion_total = 0
    for p_index, (prompt_text, prompt_ids, exps) in enumerate(results):
        prompt_total += len(prompt_ids)
        prompt_scores = None
        if echo and want_logprobs:
            prompt_scores = await wrapper.engine.score(
                prompt_ids, start=1, temperature=params.temperature, top_logprobs=k
            )
        for j, exp in enumerate(exps):
            resp_ids = exp.tokens[exp.prompt_length :].tolist()
            completion_total += len(resp_ids)
            text = exp.response_text or ""
            choice: dict[str, Any] = {
                "index": p_index * params.n + j,
                "text": (prompt_text + text) if echo else text,
                "logprobs": None,
                "finish_reason": exp.info.get("finish_reason", "stop"),
            }
            if want_logprobs:
                ids = list(resp_ids)
                lps: list[float | None] = list(exp.logprobs.tolist())
                alts: list[Any] | None = None
                if k > 0:
                    scores = await wrapper.engine.score(
                        exp.tokens.tolist(),
                        start=exp.prompt_length,
                        temperature=params.temperature,
                        top_logprobs=k,
                    )
                    alts = list(scores.top_logprobs or [])
                if echo and prompt_scores is not None:
                    ids = list(prompt_ids) + ids
                    lps = [None, *prompt_scores.logprobs, *lps]
                    if alts is not None:
                        alts = [None, *(prompt_scores.top_logprobs or []), *alts]
                choice["logprobs"] = await _tokenizing(
                    wrapper,
                    len(ids) * (1 + k),
                    completion_logprobs,
                    tok,
                    ids,
                    lps,
                    alts,
                    as_ids=as_ids,
                )
            if body.get("return_token_ids"):
                choice["token_ids"] = resp_ids
                choice["prompt_token_ids"] = list(prompt_ids)
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": wrapper.served_model_name,
        "choices": choices,
        "usage": _usage(prompt_total, completion_total),
    }


def models_body(wrapper: ModelWrapper) -> dict[str, Any]:
    """The ``/v1/models`` body: the one served model (``id`` = its served name)."""
    entry: dict[str, Any] = {
        "id": wrapper.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "rftstream",
        "root": wrapper.model_path,
        "parent": None,
    }
    max_len = getattr(wrapper.engine, "max_model_len", None)
    if isinstance(max_len, int) and max_len < 1 << 30:
        entry["max_model_len"] = max_len
    return {"object": "list", "data": [entry]}


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class OpenAIServer:
    """The HTTP server of one model (a root wrapper and its session clones). See the module docstring.

    :meth:`bind` (sync, idempotent) reserves the loopback port, so clients can
    be built before :meth:`start` (async, idempotent, must run on the
    engine's event loop) begins to serve it; connections made in between wait
    in the listen backlog. :meth:`aclose` stops serving.
    """

    def __init__(self, root: ModelWrapper, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.root = root
        self.host = host
        self._port = int(port)
        self._sock: socket.socket | None = None
        self._sessions: weakref.WeakValueDictionary[str, ModelWrapper] = (
            weakref.WeakValueDictionary()
        )
        self._bind_lock = threading.Lock()
        self._ready: anyio.Event | None = None
        self._start_error: BaseException | None = None
        self.started = False
        self.closed = False
        self._mode = ""  # "loop" (aiohttp on the engine's asyncio loop) or "thread"
        self._runner: Any = None
        self._token: Any = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._thread_stop: asyncio.Future[None] | None = None
        self._bridge: concurrent.futures.ThreadPoolExecutor | None = None
        self.requests = 0

    # ------------------------------------------------------------ addresses
    @property
    def port(self) -> int:
        self.bind()
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI ``base_url`` of the root wrapper: ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def register(self, wrapper: ModelWrapper) -> str:
        """The ``base_url`` of ``wrapper``: ``/v1`` for the root, ``/s/<session>/v1`` for a clone."""
        if wrapper is self.root:
            return self.base_url
        self._sessions[wrapper.session_id] = wrapper
        return f"{self.url}/s/{wrapper.session_id}/v1"

    def bind(self) -> None:
        """Bind and listen on the port (blocking but instant; idempotent)."""
        with self._bind_lock:
            if self._sock is not None:
                return
            if self.closed:
                raise RftError("the OpenAI API server is closed")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, self._port))
            except OSError as exc:
                sock.close()
                raise RftError(
                    f"cannot bind the OpenAI API server to {self.host}:{self._port}: {exc}"
                ) from exc
            sock.listen(1024)
            sock.setblocking(False)
            self._sock = sock
            self._port = int(sock.getsockname()[1])

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Serve the bound port (idempotent). Call it on the engine's event loop.

        On asyncio the aiohttp site is started on this loop and this returns at
        once; on other backends a daemon thread with its own asyncio loop is
        started first (waits for it in a worker thread).
        """
        if self._ready is not None:
            await self._ready.wait()
            if self._start_error is not None:
                raise RftError(f"the OpenAI API server failed to start: {self._start_error}")
            return
        self._ready = anyio.Event()
        try:
            self.bind()
            self._token = anyio.lowlevel.current_token()
            if _on_asyncio():
                self._mode = "loop"
                self._runner = await _start_site(self._app(), self._sock)
            else:
                self._mode = "thread"
                self._bridge = concurrent.futures.ThreadPoolExecutor(
                    max_workers=256, thread_name_prefix="rft-openai-bridge"
                )
                await anyio.to_thread.run_sync(self._start_thread)
            self.started = True
            log.info("OpenAI API of %s on %s", self.root.model_path, self.base_url)
        except BaseException as exc:
            self._start_error = exc
            raise
        finally:
            self._ready.set()

    async def aclose(self) -> None:
        """Stop serving and release the port (idempotent). In-flight requests are dropped."""
        self.closed = True
        if self._runner is not None:
            runner, self._runner = self._runner, None
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
        if self._thread is not None and self._thread_loop is not None:
            loop, stop = self._thread_loop, self._thread_stop
            if stop is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))
            thread, self._thread = self._thread, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join, 10.0)
        if self._bridge is not None:
            self._bridge.shutdown(wait=False, cancel_futures=True)
            self._bridge = None
        with self._bind_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None
        self.started = False

    def _start_thread(self) -> None:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            loop = asyncio.get_running_loop()
            self._thread_loop = loop
            self._thread_stop = loop.create_future()
            try:
                runner = await _start_site(self._app(), self._sock)
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                raise
            ready.set()
            try:
                await self._thread_stop
            finally:
                await runner.cleanup()

        def target() -> None:
            with contextlib.suppress(BaseException):
                asyncio.run(main())
            ready.set()

        self._thread = threading.Thread(target=target, name="rft-openai-server", daemon=True)
        self._thread.start()
        ready.wait(30.0)
        if errors:
            raise errors[0]
        if not ready.is_set():
            raise RftError("the OpenAI API server thread did not start within 30 s")

    # ------------------------------------------------------------ HTTP
    def _app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/v1/completions", self._completions)
            app.router.add_get(f"{prefix}/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    def _wrapper(self, request: Any) -> ModelWrapper:
        sid = request.match_info.get("session")
        if sid is None:
            return self.root
        wrapper = self._sessions.get(sid)
        if wrapper is None:
            raise ApiError(f"unknown session {sid!r}", status=404, type="not_found_error")
        return wrapper

    async def _on_engine_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine's loop (directly when the server lives there)."""
        if self._mode == "loop":
            return await fn(*args)
        loop = asyncio.get_running_loop()
        call = lambda: anyio.from_thread.run(fn, *args, token=self._token)  # noqa: E731
        return await loop.run_in_executor(self._bridge, call)

    async def _json_response(
        self, request: Any, handler: Callable[[ModelWrapper, dict[str, Any]], Awaitable[Any]]
    ) -> Any:
        from aiohttp import web

        self.requests += 1
        try:
            wrapper = self._wrapper(request)
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(f"the request body is not valid JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            if getattr(wrapper.engine, "_closed", False):
                raise ApiError("the rollout engine is closed", status=503, type="server_error")
            result = await self._on_engine_loop(handler, wrapper, body)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except RftError as exc:
            return web.json_response(ApiError(str(exc)).body(), status=400)
        except Exception as exc:  # noqa: BLE001 - reported to the client
            log.exception("OpenAI API request failed")
            err = ApiError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
            return web.json_response(err.body(), status=500)
        if not body.get("stream"):
            return web.json_response(result)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = (
            _sse_chat_chunks(result, include_usage)
            if result["object"] == "chat.completion"
            else _sse_completion_chunks(result, include_usage)
        )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _chat(self, request: Any) -> Any:
        return await self._json_response(request, handle_chat)

    async def _completions(self, request: Any) -> Any:
        return await self._json_response(request, handle_completion)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        try:
            wrapper = self._wrapper(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response(models_body(wrapper))

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok"})


def _on_asyncio() -> bool:
    import sniffio

    try:
        return sniffio.current_async_library() == "asyncio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


async def _start_site(app: Any, sock: socket.socket | None) -> Any:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock, shutdown_timeout=0.5)
    await site.start()
    return runner


# ---------------------------------------------------------------------------
# Auxiliary models
# ---------------------------------------------------------------------------


def _auxiliary_model_path(index: int, model_path: str) -> str:
    """The local directory of ``explorer.auxiliary_models[index]``; builds the tiny model for
    ``builtin:tiny``. Blocks. RftError naming the entry when the directory does not exist."""
    from pathlib import Path

    if model_path == "builtin:tiny":
        from rftstream.engines.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    if not Path(model_path).is_dir():
        raise RftError(
            f"explorer.auxiliary_models[{index}].model_path: no such directory {model_path!r} "
            "(models are loaded from local paths; builtin:tiny is the embedded tiny model)"
        )
    return model_path


@contextlib.asynccontextmanager
async def serve_auxiliary_models(
    configs: Sequence[Any],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 42,
) -> AsyncIterator[list[Any]]:
    """Start ``explorer.auxiliary_models`` and yield one ``openai.OpenAI`` client per entry.

    An entry with ``model_path`` (and no ``base_url``) gets its own rollout
    engine (``engine_type``, default ``transformers``) and its own
    :class:`OpenAIServer` on another loopback port; its ``max_response_tokens``
    and ``temperature`` are the server's defaults for requests that omit
    them. An entry with ``base_url`` just gets a client for that server. Every
    client has ``model_path`` set to the model name to pass as ``model=``
    (``name``, else ``model_path``). ``model_path: builtin:tiny`` is the
    embedded tiny model (built and cached on first use, as for
    ``model.model_path``). Loading blocks a worker thread; on exit the servers
    and engines stop. Raises :class:`RftError` naming the entry for one with
    neither key or with a ``model_path`` that is not a directory.
    """
    import openai

    from rftstream.engines import create_engine
    from rftstream.engines.model_wrapper import ModelWrapper

    for i, cfg in enumerate(configs):
        if not cfg.model_path and not cfg.base_url:
            raise RftError(
                f"explorer.auxiliary_models[{i}]: set `model_path` (served here) "
                "or `base_url` (an external OpenAI-compatible server)"
            )
    paths = {  # before anything starts: a wrong path is one plain error
        i: await anyio.to_thread.run_sync(_auxiliary_model_path, i, cfg.model_path)
        for i, cfg in enumerate(configs)
        if not cfg.base_url
    }
    clients: list[Any] = []
    wrappers: list[ModelWrapper] = []
    engines: list[Any] = []
    async with anyio.create_task_group() as tg:
        try:
            for i, cfg in enumerate(configs):
                name = cfg.name or cfg.model_path
                if cfg.base_url:
                    client = openai.OpenAI(base_url=cfg.base_url, api_key=cfg.api_key or "EMPTY")
                    client.model_path = name  # type: ignore[attr-defined]
                    clients.append(client)
                    continue
                path = paths[i]
                engine = await anyio.to_thread.run_sync(
                    lambda c=cfg, p=path: create_engine(
                        c.engine_type,
                        p,
                        dtype=dtype,
                        device=device,
                        seed=seed,
                        default_max_tokens=c.max_response_tokens,
                    )
                )
                engines.append(engine)
                await tg.start(engine.run)
                wrapper = ModelWrapper(
                    engine,
                    model_path=path,
                    max_response_tokens=cfg.max_response_tokens,
                    default_temperature=cfg.temperature,
                    served_model_name=name,
                )
                wrappers.append(wrapper)
                await wrapper.start_openai_server()
                clients.append(wrapper.get_openai_client())
            yield clients
        finally:
            with anyio.CancelScope(shield=True):
                for c in clients:
                    with contextlib.suppress(Exception):
                        c.close()
                for w in wrappers:
                    await w.aclose()
                for e in engines:
                    with contextlib.suppress(Exception):
                        await e.aclose()
            tg.cancel_scope.cancel()
