"""The OpenAI API's wire format, pure (no I/O, no server, no model).

Request parsing (:func:`sampling_from_request`), chat message normalisation for a
chat template (:func:`normalize_messages`, Hermes-style tool prompts), tool-call
parsing and stop truncation of generated text, log-prob and server-sent-event
response bodies, and :class:`ApiError`, the rejection that becomes an
OpenAI-style error body. :class:`~rftstream.engines.model_wrapper.ModelWrapper`
renders and parses chats with these; :mod:`rftstream.engines.openai_server`
serves them over HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from rftstream.engines.base import SamplingParams
from rftstream.errors import RftError

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    "ApiError",
    "chat_logprobs",
    "completion_logprobs",
    "normalize_messages",
    "parse_tool_calls",
    "render_tool_call",
    "sampling_from_request",
    "sse_chat_chunks",
    "sse_completion_chunks",
    "tools_system_prompt",
    "truncate_at_stop",
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
            min_tokens=_number(body, "min_tokens", int, 0),
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


def sse_chat_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
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


def sse_completion_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    base = {k: body[k] for k in ("id", "object", "created", "model")}
    chunks = [{**base, "choices": [ch]} for ch in body["choices"]]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks
