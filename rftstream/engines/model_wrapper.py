"""``ModelWrapper``: what a workflow sees of the rollout model (Trinity-RFT's interface).

``chat`` / ``generate`` / ``logprobs`` are synchronous and meant for a
workflow's ``run()``, which the runner executes in a worker thread
(``anyio.to_thread.run_sync``): they hop back to the event loop with
``anyio.from_thread.run`` and block the worker thread until the engine has
served the request. ``chat_async`` / ``generate_async`` / ``logprobs_async``
are the native forms for ``run_async()``; they never block the event loop
(tokenising or decoding large inputs goes to a worker thread). Cancelling an
async call cancels its engine request without disturbing others batched with
it.

Every returned :class:`~rftstream.experience.Experience` carries ``tokens``
(prompt + response, eos included when generation stopped there),
``prompt_length``, per-token ``logprobs`` of the response (convention:
``log_softmax(logits / temperature)``, see :mod:`rftstream.engines.base`),
``action_mask`` (all ones), ``response_text`` (decoded without special
tokens), ``prompt_text``, ``messages`` (chat: the conversation plus the
assistant reply), ``model_version`` (the weights that generated it) and
``info["finish_reason"]``.

OpenAI API: :meth:`ModelWrapper.get_openai_client` / :meth:`get_openai_async_client`
return ``openai`` clients of an :class:`~rftstream.engines.openai_server.OpenAIServer`
on a loopback port, served on the engine's event loop and routed to the same
engine (so HTTP requests batch with everything else). The server starts on
the first client (or with ``enable_openai_api``, when the runner starts);
``client.model_path`` (and ``client.models.list().data[0].id``) is the name to
pass as ``model=``. The sync client must be used from a worker thread (a
workflow's ``run()``), never on the event loop itself.

History (``enable_history``): every completion the wrapper serves — through
``chat``/``generate`` or through its OpenAI clients — is kept as one
Experience per completion, in completion order, until
:meth:`extract_experience_from_history`. This is Trinity-RFT's convention
(one experience per model call, as ``step_wise_grpo`` expects); to train on a
multi-turn conversation as ONE sequence, :func:`merge_history` (or
``extract_experience_from_history(merge_turns=True)``) chains the calls whose
prompt extends an earlier call's full sequence into one Experience whose
``action_mask`` is 1 exactly on the tokens the model generated. The runner
gives each workflow its own :meth:`clone` when history is on, so concurrent
workflows never see each other's calls.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import msgspec
import torch

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams
from rftstream.engines.openai_protocol import (
    ApiError,
    normalize_messages,
    parse_tool_calls,
    truncate_at_stop,
)
from rftstream.engines.openai_server import OpenAIServer
from rftstream.errors import RftError
from rftstream.experience import Experience

__all__ = ["ModelWrapper", "merge_history", "wrapper_of"]

T = TypeVar("T")

# Inputs above these sizes are tokenised / decoded in a worker thread.
_INLINE_CHARS = 4096
_INLINE_TOKENS = 4096

_RENDER_CACHE_SIZE = 4096  # rendered chats kept per model (LRU)
_KEY_ENCODER = msgspec.msgpack.Encoder(order="deterministic")

_SAMPLING_KEYS = {"stop", "stop_token_ids", "seed", "min_tokens"}
_IGNORED_KEYS = {"logprobs", "return_logprobs", "use_tqdm"}


class _Shared:
    """What a wrapper shares with its clones: the tokenizer lock, the server, the engine loop."""

    def __init__(self, root: ModelWrapper) -> None:
        self.root = root
        self.tok_lock = threading.Lock()  # HF fast tokenizers are not safe for concurrent use
        self.server: OpenAIServer | None = None
        self.server_lock = threading.Lock()
        self.token: Any = None  # anyio EventLoopToken of the engine's loop
        self.loop_thread: int | None = None
        # every wrapper of this model (root and clones): the root's aclose closes their clients
        self.wrappers: weakref.WeakSet[ModelWrapper] = weakref.WeakSet()
        # rendered chats: (text, ids, continued) by the rendering's inputs (tasks repeat every epoch)
        self.renders: collections.OrderedDict[bytes, tuple[str, list[int], bool]] = (
            collections.OrderedDict()
        )
        self.renders_lock = threading.Lock()


class ModelWrapper:
    """The rollout model as workflows see it: ``chat``, ``generate``, async forms, history, OpenAI API.

    ``max_response_tokens`` is the default ``max_tokens`` (``model.max_response_tokens``);
    ``max_prompt_tokens`` (``model.max_prompt_tokens``), when set, rejects longer prompts
    with :class:`RftError`. With ``enable_history`` every returned experience is
    also kept until :meth:`extract_experience_from_history`. ``enable_openai_api``
    (``explorer.rollout_model.enable_openai_api``) asks the runner to start the
    OpenAI server up front; ``served_model_name`` (default ``model_path``) is
    the model name of the API; ``default_temperature`` is the API's
    temperature when a request has none.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        model_path: str,
        enable_history: bool = False,
        max_response_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
        enable_openai_api: bool = False,
        served_model_name: str | None = None,
        default_temperature: float = 1.0,
        api_key: str = "EMPTY",
    ) -> None:
        self.engine = engine
        self.model_path = model_path
        self.enable_history = enable_history
        self.max_response_tokens = max_response_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.enable_openai_api = enable_openai_api
        self.served_model_name = served_model_name or str(model_path)
        self.default_temperature = float(default_temperature)
        self.api_key = api_key or "EMPTY"
        self.history: list[Experience] = []
        self.session_id = uuid.uuid4().hex
        self._history_lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._shared = _Shared(self)
        self._shared.wrappers.add(self)

    # ------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_version(self) -> int:
        return self.engine.model_version

    @property
    def _tok_lock(self) -> threading.Lock:
        return self._shared.tok_lock

    def clone(self, *, enable_history: bool | None = None) -> ModelWrapper:
        """A view of the same model with its own history and its own OpenAI session URL.

        Shares the engine, the tokenizer lock and the OpenAI server; cheap (no
        I/O). The runner gives every workflow instance a clone when history is
        on.
        """
        other = copy.copy(self)
        other.history = []
        other.session_id = uuid.uuid4().hex
        other._history_lock = threading.Lock()
        other._clients = {}
        self._shared.wrappers.add(other)
        if enable_history is not None:
            other.enable_history = enable_history
        return other

    # ------------------------------------------------------------ async API
    async def chat_async(
        self,
        messages: list[dict[str, Any]],
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        **kwargs: Any,
    ) -> list[Experience]:
        """Sample ``n`` assistant replies to ``messages`` (rendered with the chat template).

        If the last message is from the assistant, it is continued (its content
        is a reply prefix) instead of starting a new turn. ``chat_template``
        in ``kwargs`` overrides the tokenizer's template; ``tools`` (OpenAI tool
        schemas) are rendered into the prompt and ``<tool_call>`` blocks of
        the replies parsed into the reply message's ``tool_calls``;
        ``chat_template_kwargs`` go to the template; ``stop``,
        ``stop_token_ids`` and ``seed`` go to the engine.
        """
        chat_template = kwargs.pop("chat_template", None)
        tools = kwargs.pop("tools", None)
        template_kwargs = kwargs.pop("chat_template_kwargs", None)
        params = self._params(n, temperature, max_tokens, top_p, top_k, kwargs)
        _, _, exps = await self._chat(
            messages,
            params,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return exps

    async def generate_async(
        self,
        prompts: list[str],
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        **kwargs: Any,
    ) -> list[Experience]:
        """Sample ``n`` completions of each raw prompt (no chat template).

        Returns ``len(prompts) * n`` experiences, prompt-major. All prompts are
        submitted at once, so the engine batches them together.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        params = self._params(n, temperature, max_tokens, top_p, top_k, kwargs)
        results = await self._complete(list(prompts), params, strip_stop=False)
        return [e for _, _, group in results for e in group]

    async def logprobs_async(
        self, tokens: Sequence[int] | torch.Tensor, temperature: float | None = None
    ) -> torch.Tensor:
        """Logprobs of ``tokens[1:]`` under the current weights (float32, length ``len(tokens) - 1``).

        Element ``i`` is ``log p(tokens[i + 1] | tokens[: i + 1])`` with the
        logits divided by ``temperature`` (the sampling convention; ``None``
        means 1), as Trinity-RFT's ``ModelWrapper.logprobs``. Raises
        :class:`RftError` if the engine cannot score.
        """
        self._note_loop()
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        if len(ids) < 2:
            return torch.zeros(0, dtype=torch.float32)
        t = 1.0 if temperature is None else float(temperature)
        scores = await self.engine.score(ids, start=1, temperature=t)
        return torch.tensor(scores.logprobs, dtype=torch.float32)

    # ------------------------------------------------------------ sync API
    def chat(
        self,
        messages: list[dict[str, Any]],
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        **kwargs: Any,
    ) -> list[Experience]:
        """Blocking :meth:`chat_async`, for a workflow's ``run()`` in an anyio worker thread."""
        return self._blocking(
            functools.partial(
                self.chat_async, messages, n, temperature, max_tokens, top_p, top_k, **kwargs
            )
        )

    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        **kwargs: Any,
    ) -> list[Experience]:
        """Blocking :meth:`generate_async`, for a workflow's ``run()`` in an anyio worker thread."""
        return self._blocking(
            functools.partial(
                self.generate_async, prompts, n, temperature, max_tokens, top_p, top_k, **kwargs
            )
        )

    def logprobs(
        self, tokens: Sequence[int] | torch.Tensor, temperature: float | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`logprobs_async` (from a worker thread)."""
        return self._blocking(functools.partial(self.logprobs_async, tokens, temperature))

    # ------------------------------------------------------------ OpenAI API
    def get_openai_client(self) -> Any:
        """An ``openai.OpenAI`` client of this model's server (cached; ``client.model_path`` is the model name).

        Starts the server now when called from a worker thread, else on the
        first request. Use it from worker threads (a workflow's ``run()``); on
        the event loop its requests raise :class:`RftError` (they would block
        the loop that serves them): use :meth:`get_openai_async_client` there.
        """
        return self._client("sync")

    def get_openai_async_client(self) -> Any:
        """An ``openai.AsyncOpenAI`` client of this model's server (cached), for ``run_async()``."""
        return self._client("async")

    async def start_openai_server(self) -> str:
        """Start the OpenAI server on the running (engine's) event loop; idempotent. Returns its base URL."""
        self._note_loop()
        server = self._server()
        await server.start()
        return server.register(self)

    @property
    def openai_base_url(self) -> str:
        """This wrapper's OpenAI ``base_url`` (binds the port; does not start serving)."""
        return self._server().register(self)

    async def aclose(self) -> None:
        """Close this wrapper's clients; the root wrapper also closes every clone's clients and
        stops the server. Idempotent.

        Clients left open would be closed by the garbage collector later, on whatever event
        loop runs then (or on a closed one), so the model's owner closes the root.
        """
        shared = self._shared
        wrappers = list(shared.wrappers) if shared.root is self else [self]
        for wrapper in wrappers:
            await wrapper._close_clients()
        if shared.root is self and shared.server is not None:
            server, shared.server = shared.server, None
            await server.aclose()

    async def _close_clients(self) -> None:
        clients, self._clients = list(self._clients.items()), {}
        for kind, client in clients:
            with contextlib.suppress(Exception):
                if kind == "async":
                    await client.close()
                else:
                    client.close()

    # ------------------------------------------------------------ history
    def extract_experience_from_history(
        self, clear_history: bool = True, *, merge_turns: bool = False
    ) -> list[Experience]:
        """Experiences generated since the last call (needs ``enable_history``).

        One per completion, in completion order (Trinity-RFT's convention);
        ``merge_turns=True`` returns :func:`merge_history` of them instead.
        """
        if not self.enable_history:
            raise RftError("history is disabled; set `explorer.rollout_model.enable_history: true`")
        with self._history_lock:
            exps = list(self.history)
            if clear_history:
                self.history.clear()
        return merge_history(exps) if merge_turns else exps

    # ------------------------------------------------------------ API internals (server)
    async def _chat_for_api(
        self,
        messages: Any,
        params: SamplingParams,
        *,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        chat_template: str | None = None,
    ) -> tuple[list[int], list[Experience]]:
        """A chat request of the OpenAI API: vLLM's template flags, stop strings cut from the text."""
        kwargs = dict(template_kwargs)
        add_gen = bool(kwargs.pop("add_generation_prompt", True))
        cont = bool(kwargs.pop("continue_final_message", False))
        _, prompt_ids, exps = await self._chat(
            messages,
            params,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=kwargs,
            continue_final=cont,
            add_generation_prompt=add_gen and not cont,
            strip_stop=True,
        )
        return prompt_ids, exps

    async def _complete_for_api(
        self, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[tuple[str, list[int], list[Experience]]]:
        return await self._complete(prompts, params, strip_stop=True)

    # ------------------------------------------------------------ generation internals
    async def _chat(
        self,
        messages: Any,
        params: SamplingParams,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final: bool | None = None,
        add_generation_prompt: bool | None = None,
        strip_stop: bool = False,
    ) -> tuple[str, list[int], list[Experience]]:
        self._note_loop()
        if not isinstance(messages, list):
            raise ApiError("`messages` must be a list of messages", param="messages")
        messages = [dict(m) if isinstance(m, dict) else m for m in messages]
        render = functools.partial(
            self._render_chat,
            messages,
            chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
            continue_final=continue_final,
            add_generation_prompt=add_generation_prompt,
        )
        key = _render_key(
            messages, chat_template, tools, template_kwargs, continue_final, add_generation_prompt
        )
        cached = self._cached_render(key)
        if cached is not None:
            prompt_text, prompt_ids, cont = cached[0], list(cached[1]), cached[2]
            self._check_prompt_length(prompt_ids)
        else:
            size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
            prompt_text, prompt_ids, cont = await self._maybe_thread(render, size > _INLINE_CHARS)
            self._store_render(key, (prompt_text, list(prompt_ids), cont))
        completions = await self.engine.generate(prompt_ids, params)
        exps = await self._to_experiences(
            prompt_text,
            prompt_ids,
            completions,
            messages,
            continued=cont,
            parse_tools=bool(tools),
            stop=params.stop if strip_stop else None,
            temperature=params.temperature,
        )
        self._remember(exps)
        return prompt_text, prompt_ids, exps

    async def _complete(
        self, prompts: list[str | list[int]], params: SamplingParams, *, strip_stop: bool
    ) -> list[tuple[str, list[int], list[Experience]]]:
        self._note_loop()
        size = sum(len(p) for p in prompts)

        def encode_all() -> list[tuple[str, list[int]]]:
            out = []
            for p in prompts:
                if isinstance(p, str):
                    out.append((p, self._encode(p, add_special_tokens=True)))
                else:
                    ids = [int(t) for t in p]
                    self._check_prompt_length(ids)
                    with self._tok_lock:
                        text = self.tokenizer.decode(ids, skip_special_tokens=False)
                    out.append((text, ids))
            return out

        encoded = await self._maybe_thread(encode_all, size > _INLINE_CHARS)
        results: list[tuple[str, list[int], list[Experience]]] = [
            (text, ids, []) for text, ids in encoded
        ]

        async def one(i: int, text: str, ids: list[int]) -> None:
            comps = await self.engine.generate(ids, params)
            exps = await self._to_experiences(
                text,
                ids,
                comps,
                None,
                stop=params.stop if strip_stop else None,
                temperature=params.temperature,
            )
            results[i] = (text, ids, exps)

        async with anyio.create_task_group() as tg:
            for i, (text, ids) in enumerate(encoded):
                tg.start_soon(one, i, text, ids)
        self._remember([e for _, _, group in results for e in group])
        return results

    # ------------------------------------------------------------ helpers
    def _params(
        self,
        n: int,
        temperature: float,
        max_tokens: int | None,
        top_p: float,
        top_k: int | None,
        extra: dict[str, Any],
    ) -> SamplingParams:
        if "max_new_tokens" in extra and max_tokens is None:
            max_tokens = extra.pop("max_new_tokens")
        if "min_new_tokens" in extra:  # transformers' name for it
            extra.setdefault("min_tokens", extra.pop("min_new_tokens"))
        unknown = sorted(set(extra) - _SAMPLING_KEYS - _IGNORED_KEYS - {"max_new_tokens"})
        if unknown:
            raise RftError(f"ModelWrapper: unsupported sampling argument(s) {unknown}")
        if max_tokens is None:
            max_tokens = self.max_response_tokens
        stop = extra.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        try:
            return SamplingParams(
                n=int(n),
                temperature=float(temperature),
                top_p=float(top_p if top_p is not None else 1.0),
                top_k=int(top_k if top_k is not None else -1),
                max_tokens=max_tokens,
                stop=stop,
                stop_token_ids=extra.get("stop_token_ids"),
                seed=extra.get("seed"),
                min_tokens=int(extra.get("min_tokens") or 0),
            )
        except ValueError as exc:
            raise RftError(f"ModelWrapper: {exc}") from exc

    def _check_prompt_length(self, ids: list[int]) -> None:
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise RftError(
                f"prompt has {len(ids)} tokens, more than model.max_prompt_tokens={self.max_prompt_tokens}"
            )

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        with self._tok_lock:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        self._check_prompt_length(ids)
        return ids

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None,
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final: bool | None = None,
        add_generation_prompt: bool | None = None,
    ) -> tuple[str, list[int], bool]:
        """Render ``messages`` (OpenAI shape: tool calls, tool results, ``tools``) to (text, ids, continued).

        ``tools`` go to the template when it uses them, else into a
        Hermes-style system prompt; ``tool`` messages become ``user`` messages
        with ``<tool_response>`` tags if the template rejects the role.
        """
        if continue_final is None:
            last = messages[-1] if messages else None
            continue_final = isinstance(last, dict) and last.get("role") == "assistant"
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final
        template = chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        source = " ".join(template.values()) if isinstance(template, dict) else str(template)
        native_tools = bool(tools) and "tools" in source
        native_calls = "tool_calls" in source
        extra = dict(template_kwargs or {})
        if native_tools:
            extra["tools"] = tools

        def render(tool_role: bool) -> str:
            msgs = normalize_messages(
                messages,
                native_tool_calls=native_calls,
                tool_role=tool_role,
                tools=None if native_tools else tools,
            )
            with self._tok_lock:
                return self.tokenizer.apply_chat_template(
                    msgs,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final,
                    chat_template=chat_template,
                    **extra,
                )

        try:
            text = render(True)
        except Exception as exc:
            if not any(isinstance(m, dict) and m.get("role") == "tool" for m in messages):
                if isinstance(exc, RftError):
                    raise
                raise RftError(f"cannot render the chat template: {exc}") from exc
            try:
                text = render(False)  # the template has no `tool` role
            except RftError:
                raise
            except Exception as exc2:
                raise RftError(f"cannot render the chat template: {exc2}") from exc2
        return text, self._encode(text, add_special_tokens=False), continue_final

    def _cached_render(self, key: bytes | None) -> tuple[str, list[int], bool] | None:
        if key is None:
            return None
        shared = self._shared
        with shared.renders_lock:
            hit = shared.renders.get(key)
            if hit is not None:
                shared.renders.move_to_end(key)
            return hit

    def _store_render(self, key: bytes | None, value: tuple[str, list[int], bool]) -> None:
        if key is None:
            return
        shared = self._shared
        with shared.renders_lock:
            shared.renders[key] = value
            while len(shared.renders) > _RENDER_CACHE_SIZE:
                shared.renders.popitem(last=False)

    def _decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _maybe_thread(self, fn: Callable[[], T], use_thread: bool) -> T:
        if use_thread:
            return await anyio.to_thread.run_sync(fn)
        return fn()

    async def _to_experiences(
        self,
        prompt_text: str,
        prompt_ids: list[int],
        completions: list[Completion],
        messages: list[dict[str, Any]] | None,
        *,
        continued: bool | None = None,
        parse_tools: bool = False,
        stop: list[str] | None = None,
        temperature: float | None = None,
    ) -> list[Experience]:
        """Experiences of ``completions``; ``info`` holds the engine's flags, the finish reason
        and the sampling ``temperature`` (the trainer uses the log-probs only when it scores
        at the same temperature)."""
        total = sum(len(c.token_ids) for c in completions)
        texts = await self._maybe_thread(
            lambda: [self._decode(c.token_ids) for c in completions], total > _INLINE_TOKENS
        )
        if continued is None:
            continued = bool(messages) and messages[-1].get("role") == "assistant"
        extra_info = {} if temperature is None else {"temperature": float(temperature)}
        exps = []
        for c, text in zip(completions, texts, strict=True):
            if stop and c.finish_reason == "stop":
                text = truncate_at_stop(text, stop)
            convo = None
            if messages is not None:
                convo = [dict(m) for m in messages]
                if continued:
                    convo[-1]["content"] = str(convo[-1].get("content") or "") + text
                else:
                    reply: dict[str, Any] = {"role": "assistant", "content": text}
                    if parse_tools:
                        content, calls = parse_tool_calls(text)
                        if calls:
                            reply = {"role": "assistant", "content": content, "tool_calls": calls}
                    convo.append(reply)
            exps.append(
                Experience(
                    tokens=torch.tensor(prompt_ids + c.token_ids, dtype=torch.int32),
                    prompt_length=len(prompt_ids),
                    logprobs=torch.tensor(c.logprobs, dtype=torch.float32),
                    action_mask=torch.ones(len(c.token_ids), dtype=torch.bool),
                    response_text=text,
                    prompt_text=prompt_text,
                    messages=convo,
                    model_version=c.model_version,
                    info={**c.info, "finish_reason": c.finish_reason, **extra_info},
                    allowed_logprobs=c.allowed_logprobs,
                    banned_ids=c.banned_ids,
                )
            )
        return exps

    def _remember(self, exps: list[Experience]) -> None:
        if self.enable_history:
            with self._history_lock:
                self.history.extend(exps)

    # ------------------------------------------------------------ loop plumbing
    def _note_loop(self) -> None:
        """Remember the engine's event loop (the first loop this wrapper is used on)."""
        shared = self._shared
        if shared.token is None:
            shared.token = anyio.lowlevel.current_token()
            shared.loop_thread = threading.get_ident()

    def _on_engine_loop_thread(self) -> bool:
        loop_thread = self._shared.loop_thread
        if loop_thread is not None:
            return threading.get_ident() == loop_thread
        return _on_event_loop()

    def _run_on_loop(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the engine's loop from a thread and wait (never call it on the loop)."""
        try:
            return anyio.from_thread.run(fn)  # an anyio worker thread of the loop
        except anyio.NoEventLoopError:
            token = self._shared.token
            if token is None:
                raise RftError(
                    "this thread is not an anyio worker thread and the model has not been "
                    "used on its event loop yet; call it from a workflow's run()"
                ) from None
            return anyio.from_thread.run(fn, token=token)

    def _blocking(self, call: Callable[[], Awaitable[T]]) -> T:
        if _on_event_loop():
            raise RftError(
                "ModelWrapper.chat()/generate()/logprobs() block and cannot run on the event loop; "
                "use `await model.chat_async(...)` / `generate_async` / `logprobs_async` in async code"
            )
        try:
            return self._run_on_loop(call)
        except RftError as exc:
            if "not an anyio worker thread" in str(exc):
                raise RftError(
                    "ModelWrapper.chat()/generate() must be called from an anyio worker thread "
                    "(a workflow's run() executed by the WorkflowRunner); use the async forms otherwise"
                ) from exc
            raise

    # ------------------------------------------------------------ OpenAI plumbing
    def _server(self) -> OpenAIServer:
        shared = self._shared
        with shared.server_lock:
            if shared.server is None or shared.server.closed:
                shared.server = OpenAIServer(shared.root)
            server = shared.server
        server.bind()
        return server

    def _client(self, kind: str) -> Any:
        client = self._clients.get(kind)
        if client is not None:
            return client
        server = self._server()
        base_url = server.register(self)
        if not server.started and not self._on_engine_loop_thread():
            with contextlib.suppress(RftError):
                self._run_on_loop(self.start_openai_server)  # else: on the first request
        sync_cls, async_cls = _client_classes()
        cls = sync_cls if kind == "sync" else async_cls
        client = cls(base_url=base_url, api_key=self.api_key, max_retries=0)
        client._rft_wrapper = self
        client.model_path = self.served_model_name
        self._clients[kind] = client
        return client

    def _before_sync_request(self) -> None:
        if self._on_engine_loop_thread():
            raise RftError(
                "the synchronous OpenAI client was used on the event loop that serves it (it would "
                "block forever); use model.get_openai_async_client() in async code"
            )
        server = self._server()
        if not server.started:
            self._run_on_loop(self.start_openai_server)

    async def _before_async_request(self) -> None:
        server = self._server()
        if server.started:
            return
        if self._shared.loop_thread is None or self._on_engine_loop_thread():
            await self.start_openai_server()
        else:  # an event loop of its own (asyncio.run in a worker thread)
            await anyio.to_thread.run_sync(lambda: self._run_on_loop(self.start_openai_server))


def _render_key(
    messages: list[Any],
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    continue_final: bool | None,
    add_generation_prompt: bool | None,
) -> bytes | None:
    """What a chat rendering depends on (besides the tokenizer), as bytes; None when some of
    it is not plain JSON (such a call is rendered every time)."""
    try:
        return _KEY_ENCODER.encode(
            [messages, chat_template, tools, template_kwargs, continue_final, add_generation_prompt]
        )
    except (TypeError, msgspec.EncodeError):
        return None


def wrapper_of(client: Any) -> ModelWrapper | None:
    """The :class:`ModelWrapper` behind an OpenAI client from :meth:`ModelWrapper.get_openai_client`
    (e.g. an ``explorer.auxiliary_models`` entry served here), None for any other client (one of
    an external ``base_url`` server). Non-blocking."""
    wrapper = getattr(client, "_rft_wrapper", None)
    return wrapper if isinstance(wrapper, ModelWrapper) else None


def _on_event_loop() -> bool:
    try:
        anyio.get_current_task()
    except RuntimeError:
        return False
    return True


@functools.cache
def _client_classes() -> tuple[type, type]:
    """``openai.OpenAI`` / ``AsyncOpenAI`` subclasses that start the wrapper's server before a request."""
    import openai

    class RftOpenAI(openai.OpenAI):  # type: ignore[misc]
        """``openai.OpenAI`` for a :class:`ModelWrapper`'s server (``model_path``: the model name)."""

        model_path: str = ""
        _rft_wrapper: Any = None

        def _prepare_options(self, options: Any) -> Any:
            if self._rft_wrapper is not None:
                self._rft_wrapper._before_sync_request()
            return super()._prepare_options(options)

    class RftAsyncOpenAI(openai.AsyncOpenAI):  # type: ignore[misc]
        """``openai.AsyncOpenAI`` for a :class:`ModelWrapper`'s server (``model_path``: the model name)."""

        model_path: str = ""
        _rft_wrapper: Any = None

        async def _prepare_options(self, options: Any) -> Any:
            if self._rft_wrapper is not None:
                await self._rft_wrapper._before_async_request()
            return await super()._prepare_options(options)

    return RftOpenAI, RftAsyncOpenAI


# ---------------------------------------------------------------------------
# Multi-turn merge
# ---------------------------------------------------------------------------


def merge_history(experiences: Sequence[Experience]) -> list[Experience]:
    """Merge per-call experiences of multi-turn conversations into one Experience per conversation.

    A call B *continues* call A (earlier in the list) when A's full token
    sequence (prompt + response) is a prefix of B's prompt: that is what
    re-sending the conversation with A's reply appended produces whenever the
    chat template re-tokenises the reply to the same tokens. Each call is
    attached to the longest such A; every chain that ends in a call nobody
    continues becomes one Experience:

    * ``tokens``: the last call's full sequence; ``prompt_length``: the first
      call's prompt length;
    * ``action_mask``: 1 exactly on the tokens a call of the chain generated
      (its response tokens, under its own mask), 0 on everything the template
      or the user / tools added between them; ``logprobs`` aligned (0 where
      the mask is 0), ``allowed_logprobs`` too where a call sampled under a ban
      (``banned_ids`` then the calls' one list);
    * ``info["logprobs_exact"]`` False when any call's was, or when calls banned
      different tokens (one list cannot say which were banned where);
    * ``messages`` / ``response_text`` / ``info["finish_reason"]`` of the
      last call, ``prompt_text`` of the first, ``model_version`` the oldest
      of the chain, ``info["num_turns"]`` and ``info["turn_spans"]`` (the
      ``[start, end)`` token positions of each generated span).

    A call whose prompt continues nothing (a template that rewrites earlier
    replies, e.g. dropping reasoning) starts a chain of its own. With ``n > 1``
    a call continued by several later calls appears in each of their chains.
    Pure; the inputs are not modified.
    """
    exps = list(experiences)
    toks = [e.tokens.tolist() for e in exps]
    parent: list[int | None] = [None] * len(exps)
    has_child = [False] * len(exps)
    for j, e in enumerate(exps):
        prompt = toks[j][: e.prompt_length]
        best: int | None = None
        for i in range(j):
            full = toks[i]
            if len(full) <= len(prompt) and prompt[: len(full)] == full:
                if best is None or len(full) > len(toks[best]):
                    best = i
        parent[j] = best
        if best is not None:
            has_child[best] = True
    merged = []
    for leaf in range(len(exps)):
        if has_child[leaf]:
            continue
        chain = [leaf]
        while parent[chain[-1]] is not None:
            chain.append(parent[chain[-1]])  # type: ignore[arg-type]
        chain.reverse()
        first, last = exps[chain[0]], exps[leaf]
        start = first.prompt_length
        length = len(toks[leaf]) - start
        mask = torch.zeros(length, dtype=torch.bool)
        logprobs = torch.zeros(length, dtype=torch.float32)
        allowed = torch.zeros(length, dtype=torch.float32)
        banned: set[tuple[int, ...]] = set()
        spans = []
        for k in chain:
            e = exps[k]
            lo, hi = e.prompt_length - start, len(toks[k]) - start
            mask[lo:hi] = e.action_mask.to(torch.bool)[: hi - lo]
            if e.logprobs is not None and e.logprobs.numel() == hi - lo:
                logprobs[lo:hi] = e.logprobs
            if e.allowed_logprobs is not None and e.banned_ids is not None:
                if e.allowed_logprobs.numel() == hi - lo:
                    allowed[lo:hi] = e.allowed_logprobs
                    banned.add(tuple(int(t) for t in e.banned_ids.tolist()))
            spans.append([e.prompt_length, len(toks[k])])
        logprobs = logprobs * mask
        allowed = allowed * mask
        info = {k: v for k, v in last.info.items()}
        info["num_turns"] = len(chain)
        info["turn_spans"] = spans
        if any(exps[k].info.get("logprobs_exact", True) is False for k in chain):
            info["logprobs_exact"] = False  # one inexact turn: the row's weights would be wrong
        if len(banned) > 1:  # turns banned different tokens: one list cannot say which where
            info["logprobs_exact"] = False
            banned.clear()
        merged.append(
            Experience(
                tokens=last.tokens.clone(),
                prompt_length=start,
                logprobs=logprobs,
                action_mask=mask,
                response_text=last.response_text,
                prompt_text=first.prompt_text,
                messages=[dict(m) for m in last.messages] if last.messages else None,
                model_version=min(exps[k].model_version for k in chain),
                info=info,
                allowed_logprobs=allowed if banned else None,
                banned_ids=list(next(iter(banned))) if banned else None,
            )
        )
    return merged
