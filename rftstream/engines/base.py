"""The rollout-engine interface shared by every engine (transformers, later vLLM / OpenAI).

An engine turns a prompt (token ids) into ``n`` sampled completions with the
log-probability of every sampled token. Engines are backend-neutral anyio
objects: the owner starts :meth:`RolloutEngine.run` in its task group (it
batches requests from concurrent callers) and calls :meth:`RolloutEngine.aclose`
when done. Nothing here does I/O.

Log-probability convention (the trainer must match it): the logprob of a
sampled token is ``log_softmax(logits / temperature)[token]``, computed from the
raw logits divided by the request's temperature, *before* top-k / top-p
filtering. With ``temperature == 0`` (greedy) the logprob is
``log_softmax(logits)[token]``. :meth:`RolloutEngine.score` (the logprobs of a
given sequence) follows the same convention.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rftstream.errors import RftError

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """Sampling parameters of one request (``n`` completions of one prompt).

    ``max_tokens`` ``None`` means: the engine's default, capped by the model's
    context. ``top_k <= 0`` and ``top_p >= 1`` disable those filters;
    ``temperature == 0`` is greedy decoding. ``stop`` strings end a completion
    once its decoded text contains one (the tokens that produced it are kept).
    ``seed`` makes the request's samples reproducible independently of what it
    is batched with. ``min_tokens`` (vLLM's name): no end-of-sequence or stop token
    is drawn before that many new tokens (capped by ``max_tokens``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"SamplingParams.max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0, got {self.min_tokens}")


@dataclass
class Completion:
    """One sampled completion: response tokens only (eos included when it stopped there).

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` (see the module
    docstring for the convention); ``model_version`` is the engine's weight
    version that generated it.

    ``allowed_logprobs`` (None: nothing was banned): where the sampler banned the
    tokens ``banned_ids`` (``min_tokens``: end and stop tokens), ``allowed_logprobs[i]``
    is the log of the probability it could still draw ``token_ids[i]`` from,
    ``log(1 - p(banned_ids))`` under the distribution of ``logprobs``; 0 where no ban
    applied. The token's log-probability under the distribution actually sampled is
    ``logprobs[i] - allowed_logprobs[i]``: the trainer needs both to weight a stale
    token by what sampled it (see :class:`~rftstream.experience.Experience`).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    model_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    allowed_logprobs: list[float] | None = None
    banned_ids: list[int] | None = None


@dataclass
class TokenScores:
    """Log-probabilities of the tokens of a given sequence (:meth:`RolloutEngine.score`).

    ``logprobs[i]`` is the logprob of ``token_ids[start + i]`` given every
    token before it; ``top_logprobs[i]`` (when asked for) lists the
    ``(token_id, logprob)`` pairs of the most likely tokens at that position,
    best first.
    """

    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


class RolloutEngine(ABC):
    """A rollout engine: batched sampling plus weight loading.

    Lifecycle: construct (may block: loads weights), start :meth:`run` in a
    task group, call :meth:`generate` from any number of tasks, :meth:`aclose`
    at the end. :meth:`generate` waits until :meth:`run` serves it.

    ``can_load_weights`` False (an external server) tells the explorer never
    to sync weights into this engine.
    """

    can_load_weights: bool = True

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the model."""

    @property
    @abstractmethod
    def model_version(self) -> int:
        """Version of the weights currently loaded (0 = the initial checkpoint)."""

    @abstractmethod
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Completion]:
        """Sample ``params.n`` completions of one prompt.

        Waits until the request has been served; cancelling the caller drops
        its request without disturbing others batched with it.
        """

    async def score(
        self,
        token_ids: list[int],
        *,
        start: int = 1,
        temperature: float = 1.0,
        top_logprobs: int = 0,
    ) -> TokenScores:
        """Logprobs of ``token_ids[start:]`` under the current weights (no sampling).

        ``start`` is clamped to at least 1 (the first token has no context).
        ``temperature`` divides the logits as in sampling (``0`` means ``1``);
        ``top_logprobs > 0`` also returns that many alternatives per position.
        Engines that cannot score raise :class:`RftError` (the default).
        """
        raise RftError(f"rollout engine {type(self).__name__} cannot score given token sequences")

    @abstractmethod
    async def load_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Replace the weights between batches and set :attr:`model_version` to ``version``.

        ``partial``: ``state_dict`` holds only the tensors that changed (a LoRA run's
        adapted layers); the others keep their values."""

    # -- double-buffered sync: stage in the background, swap between requests
    @property
    def staged_version(self) -> int | None:
        """The version :meth:`stage_weights` prepared and :meth:`swap_staged` has not
        swapped in yet (None: nothing staged)."""
        staged = self.__dict__.get("_rft_staged")
        return None if staged is None else int(staged[1])

    async def stage_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Prepare ``version`` while requests are being served; :meth:`swap_staged` makes it
        current. A later stage replaces one not swapped in yet.

        This default keeps the tensors (they must not change meanwhile) and loads
        them in place at the swap, so the swap pauses generation for the load; an
        engine with a second copy of the model copies them there now (blocks in a
        worker thread; requests are served meanwhile) and swaps in microseconds.
        """
        self.__dict__["_rft_staged"] = (state_dict, int(version), partial)

    async def swap_staged(self, *, wait: bool = True) -> float | None:
        """Make the staged version current between two batches; returns how long
        generation paused for it (seconds), or None when nothing was staged (or, with
        ``wait`` False, a stage is still being copied). Blocks until the batch in
        flight is done. A failed load keeps the current weights and raises."""
        staged = self.__dict__.pop("_rft_staged", None)
        if staged is None:
            return None
        state_dict, version, partial = staged
        t0 = time.perf_counter()
        if partial:
            await self.load_weights(state_dict, version, partial=True)
        else:  # engines written before `partial` existed take two arguments
            await self.load_weights(state_dict, version)
        return time.perf_counter() - t0

    @abstractmethod
    async def run(self) -> None:
        """Serve requests until cancelled or closed (start it in the owner's task group)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop serving; pending and later :meth:`generate` calls raise ``RftError``."""


# ------------------------------------------------------------ shared by the engines


def eos_ids(*sources: Any) -> set[int]:
    """The eos token ids named by ``sources``: each an id, a list / tuple of ids, or None
    (the tokenizer's ``eos_token_id``, the model config's, the generation config's)."""
    eos: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(x) for x in source)
    return eos


def prompt_ids(prompt_token_ids: Iterable[int], max_model_len: int) -> list[int]:
    """``prompt_token_ids`` as a list of ints, checked for :meth:`RolloutEngine.generate`.

    Raises :class:`RftError` when the prompt is empty or leaves no room for a
    generated token in the model context of ``max_model_len`` tokens.
    """
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise RftError("cannot generate from an empty prompt")
    if len(prompt) >= max_model_len:
        raise RftError(
            f"prompt of {len(prompt)} tokens leaves no room in the model context of "
            f"{max_model_len} tokens (see model.max_prompt_tokens)"
        )
    return prompt


def score_ids(token_ids: Iterable[int], max_model_len: int) -> list[int]:
    """``token_ids`` as a list of ints, checked for :meth:`RolloutEngine.score`.

    Raises :class:`RftError` when the sequence does not fit the model context.
    """
    ids = [int(t) for t in token_ids]
    if len(ids) > max_model_len:
        raise RftError(f"cannot score {len(ids)} tokens: the model context has {max_model_len}")
    return ids


def strip_module_prefix(name: str) -> str:
    """A state-dict key without the ``module.`` prefix DeepSpeed / DDP wrappers add."""
    return name[len("module.") :] if name.startswith("module.") else name
