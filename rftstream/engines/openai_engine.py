"""A rollout engine that is a client of an external OpenAI-compatible server (``engine_type: openai``).

For ``mode: explore`` / ``bench`` against a model served elsewhere (vLLM,
SGLang, another rftstream's :class:`~rftstream.engines.openai_server.OpenAIServer`):
``explorer.rollout_model.base_url`` / ``api_key`` name the server;
``model.model_path`` must name a tokenizer that can be loaded locally (the
``ModelWrapper`` renders chat templates and counts tokens with it) and, unless
``served_model_name`` is given, the model id is the server's first
``/v1/models`` entry.

Each :meth:`OpenAIEngine.generate` is one ``/v1/completions`` request with the
prompt as token ids, ``logprobs: 0`` and vLLM's ``return_token_ids`` /
``return_tokens_as_token_ids`` extensions, so the sampled token ids and their
logprobs come back exactly; a server that ignores both extensions gets its
text re-tokenised (then the logprobs are kept only when the token counts
agree, else they are zeros and ``info["logprobs_exact"]`` is False). The
logprob convention is the server's (vLLM returns the raw model's logprobs by
default; rftstream's own server divides by the temperature). ``min_tokens`` is sent
as vLLM's extension of the same name; the server's logprobs cannot say how much
probability the ban took away, so such completions are flagged inexact too. Requests run
concurrently (at most ``max_concurrency`` in flight); the server batches them.
:meth:`score` uses ``echo`` with ``logprobs`` (prompt logprobs). Weights cannot
be loaded: :meth:`load_weights` raises :class:`RftError`.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import torch

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams, TokenScores
from rftstream.errors import RftError

log = logging.getLogger(__name__)

__all__ = ["OpenAIEngine"]

_IGNORED = {"max_batch_size", "batch_wait_ms", "dtype", "seed", "device", "torch_threads"}


class OpenAIEngine(RolloutEngine):
    """Rollouts from an OpenAI-compatible server (see the module docstring).

    Construction blocks (loads the tokenizer). ``stats`` counts ``requests``,
    ``sequences`` and ``generated_tokens``.
    """

    can_load_weights = False  # the model is served elsewhere

    def __init__(
        self,
        model_path: str,
        *,
        base_url: str = "",
        api_key: str = "EMPTY",
        served_model_name: str | None = None,
        max_concurrency: int = 256,
        timeout: float = 600.0,
        max_retries: int = 2,
        default_max_tokens: int = 512,
        tokenizer_path: str | None = None,
        **ignored: Any,
    ) -> None:
        from rftstream.model_loading import hf_classes

        (AutoTokenizer,) = hf_classes("AutoTokenizer")

        unknown = sorted(set(ignored) - _IGNORED)
        if unknown:
            raise RftError(f"engine_type openai: unknown argument(s) {unknown}")
        self.model_path = str(model_path)
        self.base_url = base_url or None  # None: the openai package reads OPENAI_BASE_URL
        self.api_key = api_key or "EMPTY"
        self.served_model_name = served_model_name
        self.max_concurrency = max(1, int(max_concurrency))
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.default_max_tokens = int(default_max_tokens)
        try:
            from rftstream.model_loading import HF_LOAD_LOCK

            with HF_LOAD_LOCK:
                self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or self.model_path)
        except (OSError, ValueError) as exc:
            raise RftError(
                f"model.model_path: engine_type openai needs a tokenizer; cannot load one from "
                f"{tokenizer_path or self.model_path!r}: {exc}"
            ) from exc
        self._client: Any = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._stop: anyio.Event | None = None
        self._closed = False
        self.stats: dict[str, int] = {"requests": 0, "sequences": 0, "generated_tokens": 0}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_version(self) -> int:
        return 0

    # ------------------------------------------------------------ plumbing
    def _api(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                timeout=self.timeout,
                max_retries=self.max_retries,
            )
        return self._client

    def _slots(self) -> anyio.CapacityLimiter:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        return self._limiter

    async def model_name(self) -> str:
        """The model id sent with every request (asks ``/v1/models`` once if not configured)."""
        if self.served_model_name is None:
            import openai

            try:
                page = await self._api().models.list()
            except openai.OpenAIError as exc:
                raise RftError(
                    f"explorer.rollout_model.base_url: cannot list the models of "
                    f"{self.base_url!r}: {exc}"
                ) from exc
            ids = [m.id for m in page.data]
            if not ids:
                raise RftError(f"the OpenAI-compatible server {self.base_url!r} serves no model")
            self.served_model_name = self.model_path if self.model_path in ids else ids[0]
        return self.served_model_name

    async def _request(self, body: dict[str, Any]) -> Any:
        import openai

        if self._closed:
            raise RftError("rollout engine is closed")
        name = await self.model_name()
        std = {
            k: body.pop(k)
            for k in list(body)
            if k in ("prompt", "n", "temperature", "top_p", "max_tokens", "stop", "seed")
            or k in ("logprobs", "echo")
        }
        async with self._slots():
            try:
                return await self._api().completions.create(model=name, extra_body=body, **std)
            except openai.OpenAIError as exc:
                raise RftError(f"OpenAI-compatible server {self.base_url!r}: {exc}") from exc

    # ------------------------------------------------------------ RolloutEngine
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Completion]:
        """``params.n`` completions of the prompt from one ``/v1/completions`` request.

        Raises :class:`RftError` when the server fails or the engine is closed.
        Cancelling the caller closes the HTTP request.
        """
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RftError("cannot generate from an empty prompt")
        body: dict[str, Any] = {
            "prompt": prompt,
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens
            if params.max_tokens is not None
            else self.default_max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = int(params.seed)
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.min_tokens:
            body["min_tokens"] = int(params.min_tokens)
        resp = await self._request(body)
        choices = sorted(resp.choices, key=lambda c: c.index)
        out = [self._completion(c) for c in choices]
        if params.min_tokens and params.temperature > 0:
            for c in out:  # drawn under a ban whose mass the logprobs do not carry
                c.info["logprobs_exact"] = False
        self.stats["requests"] += 1
        self.stats["sequences"] += len(out)
        self.stats["generated_tokens"] += sum(len(c.token_ids) for c in out)
        return out

    def _completion(self, choice: Any) -> Completion:
        extra = getattr(choice, "model_extra", None) or {}
        lp = choice.logprobs
        token_lps = (
            [float(x) if x is not None else 0.0 for x in (lp.token_logprobs or [])] if lp else []
        )
        ids = extra.get("token_ids")
        exact = True
        if ids is None and lp is not None and lp.tokens:
            parsed = [_token_id(t) for t in lp.tokens]
            if all(p is not None for p in parsed):
                ids = parsed
        if ids is None:
            ids = list(self._tokenizer.encode(choice.text or "", add_special_tokens=False))
            exact = len(ids) == len(token_lps)
        ids = [int(t) for t in ids]
        if len(token_lps) != len(ids):
            token_lps, exact = [0.0] * len(ids), False
        finish = "length" if choice.finish_reason == "length" else "stop"
        return Completion(
            token_ids=ids,
            logprobs=token_lps,
            finish_reason=finish,
            info={"logprobs_exact": exact} if not exact else {},
        )

    async def score(
        self,
        token_ids: list[int],
        *,
        start: int = 1,
        temperature: float = 1.0,
        top_logprobs: int = 0,
    ) -> TokenScores:
        """Prompt logprobs from ``echo: true`` + ``logprobs`` (one generated token is discarded)."""
        ids = [int(t) for t in token_ids]
        start = max(1, int(start))
        if start >= len(ids):
            return TokenScores([], [] if top_logprobs > 0 else None)
        resp = await self._request(
            {
                "prompt": ids,
                "max_tokens": 1,
                "echo": True,
                "logprobs": int(top_logprobs),
                "temperature": float(temperature) if temperature > 0 else 1.0,
                "return_tokens_as_token_ids": True,
            }
        )
        lp = resp.choices[0].logprobs
        if lp is None or lp.token_logprobs is None or len(lp.token_logprobs) < len(ids):
            raise RftError(f"the server at {self.base_url!r} does not return prompt logprobs")
        chosen = [float(x) for x in lp.token_logprobs[start : len(ids)]]
        alts = None
        if top_logprobs > 0 and lp.top_logprobs is not None:
            alts = []
            for entry in lp.top_logprobs[start : len(ids)]:
                pairs = [(_token_id(k), float(v)) for k, v in (entry or {}).items()]
                alts.append([(t, v) for t, v in pairs if t is not None])
        return TokenScores(chosen, alts)

    async def load_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Not possible for an external server: raises :class:`RftError`."""
        raise RftError(
            "explorer.rollout_model.engine_type 'openai' cannot load new weights (the model is "
            "served elsewhere); use it with mode: explore or bench"
        )

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Resolve the served model name, then idle until :meth:`aclose` or cancellation.

        Requests do not need it (they are sent directly), but it checks the
        server early and owns the HTTP client, which it closes on exit.
        """
        self._stop = anyio.Event()
        try:
            await self.model_name()
            task_status.started()
            if not self._closed:
                await self._stop.wait()
        finally:
            client, self._client = self._client, None
            if client is not None:
                with anyio.CancelScope(shield=True):
                    await client.close()

    async def aclose(self) -> None:
        """Refuse new requests and let :meth:`run` return."""
        self._closed = True
        if self._stop is not None:
            self._stop.set()


def _token_id(token: str) -> int | None:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:") :])
        except ValueError:
            return None
    return None
