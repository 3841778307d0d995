"""``ModelWrapper``: what a workflow sees of the rollout model (Trinity-RFT's interface).

``chat`` / ``generate`` are synchronous and meant for a workflow's ``run()``,
which the runner executes in a worker thread (``anyio.to_thread.run_sync``):
they hop back to the event loop with ``anyio.from_thread.run`` and block the
worker thread until the engine has served the request. ``chat_async`` /
``generate_async`` are the native forms for ``run_async()``; they never block
the event loop (tokenising or decoding large inputs goes to a worker thread).
Cancelling an async call cancels its engine request without disturbing
others batched with it.

Every returned :class:`~rftstream.experience.Experience` carries ``tokens``
(prompt + response, eos included when generation stopped there),
``prompt_length``, per-token ``logprobs`` of the response (convention:
``log_softmax(logits / temperature)``, see :mod:`rftstream.engines.base`),
``action_mask`` (all ones), ``response_text`` (decoded without special
tokens), ``prompt_text``, ``messages`` (chat: the conversation plus the
assistant reply), ``model_version`` (the weights that generated it) and
``info["finish_reason"]``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import torch

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams
from rftstream.errors import RftError
from rftstream.experience import Experience

T = TypeVar("T")

# Inputs above these sizes are tokenised / decoded in a worker thread.
_INLINE_CHARS = 4096
_INLINE_TOKENS = 4096

_SAMPLING_KEYS = {"stop", "stop_token_ids", "seed"}
_IGNORED_KEYS = {"logprobs", "return_logprobs", "use_tqdm"}


class ModelWrapper:
    """The rollout model as workflows see it: ``chat``, ``generate``, async forms, history.

    ``max_response_tokens`` is the default ``max_tokens`` (``model.max_response_tokens``);
    ``max_prompt_tokens`` (``model.max_prompt_tokens``), when set, rejects longer prompts
    with :class:`RftError`. With ``enable_history`` every returned experience is
    also kept until :meth:`extract_experience_from_history`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        model_path: str,
        enable_history: bool = False,
        max_response_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.model_path = model_path
        self.enable_history = enable_history
        self.max_response_tokens = max_response_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.history: list[Experience] = []
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe for concurrent use

    # ------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_version(self) -> int:
        return self.engine.model_version

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
        in ``kwargs`` overrides the tokenizer's template; ``stop``,
        ``stop_token_ids`` and ``seed`` go to the engine.
        """
        chat_template = kwargs.pop("chat_template", None)
        params = self._params(n, temperature, max_tokens, top_p, top_k, kwargs)
        messages = [dict(m) for m in messages]
        render = functools.partial(self._render_chat, messages, chat_template)
        size = sum(len(str(m.get("content", ""))) for m in messages)
        prompt_text, prompt_ids = await self._maybe_thread(render, size > _INLINE_CHARS)
        completions = await self.engine.generate(prompt_ids, params)
        exps = await self._to_experiences(prompt_text, prompt_ids, completions, messages)
        self._remember(exps)
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
        size = sum(len(p) for p in prompts)
        encoded: list[tuple[str, list[int]]] = await self._maybe_thread(
            lambda: [(p, self._encode(p, add_special_tokens=True)) for p in prompts],
            size > _INLINE_CHARS,
        )
        results: list[list[Experience]] = [[] for _ in prompts]

        async def one(i: int, text: str, ids: list[int]) -> None:
            comps = await self.engine.generate(ids, params)
            results[i] = await self._to_experiences(text, ids, comps, None)

        async with anyio.create_task_group() as tg:
            for i, (text, ids) in enumerate(encoded):
                tg.start_soon(one, i, text, ids)
        exps = [e for group in results for e in group]
        self._remember(exps)
        return exps

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

    # ------------------------------------------------------------ later versions
    def get_openai_client(self) -> Any:
        """Not available yet: raises :class:`RftError`."""
        raise RftError(
            "the OpenAI-compatible API of the rollout model (enabled with "
            "`explorer.rollout_model.enable_openai_api: true`) arrives in a later version of "
            "rftstream; use model.chat() / model.chat_async() in workflows for now"
        )

    async def get_openai_async_client(self) -> Any:
        """Not available yet: raises :class:`RftError`."""
        self.get_openai_client()

    def logprobs(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Not available yet: raises :class:`RftError`."""
        raise RftError(
            "ModelWrapper.logprobs() (scoring a given sequence) arrives in a later version of rftstream"
        )

    def extract_experience_from_history(self, clear_history: bool = True) -> list[Experience]:
        """Experiences generated since the last call (needs ``enable_history``)."""
        if not self.enable_history:
            raise RftError("history is disabled; set `explorer.rollout_model.enable_history: true`")
        exps = list(self.history)
        if clear_history:
            self.history.clear()
        return exps

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
            )
        except ValueError as exc:
            raise RftError(f"ModelWrapper: {exc}") from exc

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        with self._tok_lock:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise RftError(
                f"prompt has {len(ids)} tokens, more than model.max_prompt_tokens={self.max_prompt_tokens}"
            )
        return ids

    def _render_chat(
        self, messages: list[dict[str, Any]], chat_template: str | None
    ) -> tuple[str, list[int]]:
        cont = bool(messages) and messages[-1].get("role") == "assistant"
        with self._tok_lock:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not cont,
                continue_final_message=cont,
                chat_template=chat_template,
            )
        return text, self._encode(text, add_special_tokens=False)

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
    ) -> list[Experience]:
        total = sum(len(c.token_ids) for c in completions)
        texts = await self._maybe_thread(
            lambda: [self._decode(c.token_ids) for c in completions], total > _INLINE_TOKENS
        )
        exps = []
        for c, text in zip(completions, texts, strict=True):
            convo = None
            if messages is not None:
                convo = [dict(m) for m in messages]
                if convo and convo[-1].get("role") == "assistant":
                    convo[-1]["content"] = str(convo[-1].get("content", "")) + text
                else:
                    convo.append({"role": "assistant", "content": text})
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
                    info={"finish_reason": c.finish_reason},
                )
            )
        return exps

    def _remember(self, exps: list[Experience]) -> None:
        if self.enable_history:
            self.history.extend(exps)

    def _blocking(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            anyio.get_current_task()
        except RuntimeError:
            pass  # not on an event loop thread: good
        else:
            raise RftError(
                "ModelWrapper.chat()/generate() block and cannot run on the event loop; "
                "use `await model.chat_async(...)` / `generate_async` in async code"
            )
        try:
            return anyio.from_thread.run(call)  # type: ignore[arg-type]
        except anyio.NoEventLoopError as exc:
            raise RftError(
                "ModelWrapper.chat()/generate() must be called from an anyio worker thread "
                "(a workflow's run() executed by the WorkflowRunner); use the async forms otherwise"
            ) from exc
