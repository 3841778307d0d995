"""A rollout engine on plain ``transformers`` (CPU or GPU), with request batching.

Concurrent :meth:`TransformersEngine.generate` calls are put on an anyio
memory object stream; :meth:`TransformersEngine.run` (started by the owner in
its task group) collects them into one batch (up to ``max_batch_size``
sequences: every request already waiting; an idle engine waits at most
``batch_wait_ms`` after the first request for more), then
runs ONE sampling loop for the whole batch in a worker thread. The loop is
written here (no ``model.generate``): left-padded prompts, a KV cache,
per-sequence temperature / top-p / top-k / min_tokens / max_tokens / stop, and
the log-probability of every sampled token.

Log-probability convention, which the trainer must reproduce: for a sampled
token ``t`` at a step with logits ``z`` (float32), ``logprob =
log_softmax(z / temperature)[t]``: the raw logits divided by the SAME
temperature the rollout used, before top-k / top-p filtering and before the
``min_tokens`` ban on end tokens (greedy, ``temperature == 0``: ``log_softmax(z)[t]``).
Where that ban applied, the completion also carries the log of the mass left to draw
from, ``log(1 - p(banned))`` under the same distribution
(``Completion.allowed_logprobs``, with ``banned_ids``): the trainer needs it to weight a
stale token by the distribution that actually sampled it.

Blocking: model forward passes and weight copies run in worker threads
(``anyio.to_thread``, with the engine's own capacity limiter of one thread, so
workflows that occupy the default thread pool can never starve it); the event
loop only moves requests and sets events. Construction blocks (it loads the
model): build the engine in a worker thread from async code. Where the fast decoder
covers the checkpoint, it is loaded without transformers' modeling code
(:mod:`rftstream.engines.light_model`: about 1.6 s less CPU in the explorer's start-up).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from anyio.abc import TaskStatus

from rftstream.engines.base import (
    Completion,
    RolloutEngine,
    SamplingParams,
    TokenScores,
    eos_ids,
    prompt_ids,
    score_ids,
    strip_module_prefix,
)
from rftstream.engines.fast_decoder import FastDecoder, fast_decoder_for
from rftstream.engines.light_model import load_light_causal_lm
from rftstream.errors import RftError
from rftstream.model_loading import forward_kwargs, output_cache, quiet_progress_bars

log = logging.getLogger(__name__)

# a staged version this small is copied on the event loop (well under a millisecond)
STAGE_INLINE_BYTES = 1 << 20

__all__ = ["SequenceSpec", "TransformersEngine", "quiet_progress_bars", "sample_sequences"]


@dataclass
class SequenceSpec:
    """One sequence of a sampling batch (a request with ``n`` > 1 gives ``n`` of them)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    generator: torch.Generator | None = None  # None: the batch's shared generator
    stop: list[str] | None = None
    stop_token_ids: set[int] = field(default_factory=set)
    min_new_tokens: int = 0  # eos and stop tokens cannot be drawn before this many tokens


def _filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (with -inf) what top-k, then top-p, removes; rows with neither are untouched."""
    vocab = scaled.shape[-1]
    need_k = (top_k > 0) & (top_k < vocab)
    need_p = top_p < 1.0
    if not bool(need_k.any()) and not bool(need_p.any()):
        return scaled
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    if bool(need_k.any()):
        k = torch.where(need_k, top_k, torch.full_like(top_k, vocab))
        sorted_vals = sorted_vals.masked_fill(ranks >= k[:, None], -math.inf)
    if bool(need_p.any()):
        probs = sorted_vals.softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs
        remove = (cum_before >= top_p[:, None]) & need_p[:, None]
        remove[:, 0] = False
        sorted_vals = sorted_vals.masked_fill(remove, -math.inf)
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_vals)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (rows sum to 1 up to rounding), by inverse CDF:
    a uniform draw per row located in the row's cumulative distribution. The same
    distribution as ``torch.multinomial(probs, 1)``, without its per-call setup cost."""
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _sample_step(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sample one token per row; return (tokens [B], logprobs [B], allowed [B] or None)
    per the module convention.

    ``banned`` (bool [B, V]): tokens a row may not draw (``min_tokens``); the logprob
    stays that of the unbanned distribution, as the trainer computes it, and
    ``allowed`` is the log of the probability mass left to draw from under that
    distribution, ``log(1 - p(banned))`` (0 in a row with no ban; None without
    ``banned``): the sampled token's log-probability under the distribution it was
    drawn from is ``logprob - allowed``."""
    greedy = temps <= 0
    t = torch.where(greedy, torch.ones_like(temps), temps)
    scaled = logits / t[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    allowed = None
    if banned is not None:
        scaled = scaled.masked_fill(banned, -math.inf)
        logits = logits.masked_fill(banned, -math.inf)
        # a sum of the allowed tokens' probabilities, each exact, not 1 - p(banned):
        # where an end token holds nearly all the mass, that difference would be rounding
        kept = torch.logsumexp(logprobs_all.masked_fill(banned, -math.inf), dim=-1)
        allowed = torch.where(banned.any(-1), kept.clamp(max=0.0), torch.zeros_like(kept))
    probs = _filter_logits(scaled, top_k, top_p).softmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_rows = greedy.tolist()
    shared = [i for i, g in enumerate(generators) if g is None and not greedy_rows[i]]
    if len(shared) == len(generators):
        tokens = _draw(probs, default_generator)
    elif shared:
        idx = torch.tensor(shared, device=logits.device)
        tokens[idx] = _draw(probs[idx], default_generator)
    for i, g in enumerate(generators):
        if g is not None and not greedy_rows[i]:
            tokens[i] = _draw(probs[i : i + 1], g)[0]
    if any(greedy_rows):
        gidx = greedy.nonzero().squeeze(-1)
        tokens[gidx] = logits[gidx].argmax(dim=-1)
    chosen = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen, allowed


def sample_sequences(
    model: Any,
    seqs: list[SequenceSpec],
    *,
    eos_token_ids: set[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    tokenizer: Any = None,
    stats: dict[str, int] | None = None,
    decoder: FastDecoder | None = None,
) -> list[Completion]:
    """Sample every sequence of ``seqs`` in one batched loop with a KV cache. Blocking.

    Prompts are left-padded; position ids count only real tokens, so a padded
    row sees exactly what it would see alone. A row ends at an eos / stop token
    (``"stop"``), when its decoded text contains a stop string (``"stop"``,
    needs ``tokenizer``) or after ``max_new_tokens`` tokens (``"length"``); before
    ``min_new_tokens`` tokens it cannot draw an eos or stop token (stop strings still end it).
    Finished rows are dropped from the cache once they are the majority.
    ``decoder`` (a :class:`~rftstream.engines.fast_decoder.FastDecoder` of
    ``model``) runs the forward passes instead of the HF module (same logits,
    a fraction of the Python overhead). Runs under ``torch.inference_mode``;
    call it from a worker thread.
    """
    if not seqs:
        return []
    device = next(model.parameters()).device
    out_tokens: list[list[int]] = [[] for _ in seqs]
    out_logprobs: list[list[float]] = [[] for _ in seqs]
    # per token, log(1 - p(banned)) for sequences that may draw under a ban (min_new_tokens)
    out_allowed: list[list[float] | None] = [
        [] if s.min_new_tokens > 0 and _banned_ids(s, eos_token_ids) else None for s in seqs
    ]
    reasons: list[str | None] = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if s.max_new_tokens <= 0:
            reasons[i] = "length"
    live = [i for i, r in enumerate(reasons) if r is None]
    if not live:
        return [Completion([], [], "length") for _ in seqs]

    with torch.inference_mode():
        # each distinct prompt is prefilled once; its rows share the result (a group's n samples)
        distinct: dict[tuple[int, ...], int] = {}
        prompt_of_row = [distinct.setdefault(tuple(seqs[i].prompt), len(distinct)) for i in live]
        width = max(len(p) for p in distinct)
        input_ids = torch.full((len(distinct), width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, p in enumerate(distinct):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[row, width - len(p) :] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        expand = torch.tensor(prompt_of_row, dtype=torch.long, device=device)
        shared = len(distinct) < len(live)
        rows = list(live)  # row -> sequence index
        temps = torch.tensor(
            [seqs[i].temperature for i in rows], dtype=torch.float32, device=device
        )
        top_k = torch.tensor([seqs[i].top_k for i in rows], dtype=torch.long, device=device)
        top_p = torch.tensor([seqs[i].top_p for i in rows], dtype=torch.float32, device=device)
        session = None
        positions = (attn.cumsum(-1) - 1).clamp_min(0)
        if decoder is not None:
            longest = max(seqs[i].max_new_tokens for i in live)
            session, logits = decoder.start(input_ids, attn, longest)
            if shared:
                session.select(expand)
        else:
            cache_kw, keep_kw = forward_kwargs(model)
            last_only = {keep_kw: 1} if keep_kw else {}
            out = model(
                input_ids=input_ids,
                attention_mask=attn,
                position_ids=positions,
                use_cache=True,
                **last_only,
            )
            past = output_cache(out)
            if shared:
                past.batch_select_indices(expand)
            logits = out.logits[:, -1, :].float()
        if shared:
            logits, attn, positions = logits[expand], attn[expand], positions[expand]
        forwards, prunes = 1, 0
        next_pos = positions[:, -1] + 1
        alive = [True] * len(rows)  # host-side copy of the active mask (no per-row device syncs)
        produced = 0  # tokens each live row has drawn (rows advance in lockstep)
        # the end-token ban is the same from step to step until a row reaches its
        # min_new_tokens or the rows are pruned: built again only then
        banned: torch.Tensor | None = None
        banned_for: tuple[list[int], list[int]] | None = None
        while True:
            gens = [seqs[i].generator for i in rows]
            short = [r for r, i in enumerate(rows) if seqs[i].min_new_tokens > produced]
            if banned_for is None or banned_for != (rows, short):
                banned = _end_tokens_banned(seqs, rows, short, eos_token_ids, logits)
                banned_for = (rows, short)
            tok, lp, allowed = _sample_step(logits, temps, top_k, top_p, gens, generator, banned)
            produced += 1
            tok_list, lp_list = tok.tolist(), lp.tolist()
            allowed_list = allowed.tolist() if allowed is not None else None
            for row, i in enumerate(rows):
                if not alive[row]:
                    continue
                t = tok_list[row]
                out_tokens[i].append(t)
                out_logprobs[i].append(lp_list[row])
                kept = out_allowed[i]
                if kept is not None:
                    kept.append(allowed_list[row] if allowed_list is not None else 0.0)
                spec = seqs[i]
                if t in eos_token_ids or t in spec.stop_token_ids:
                    reasons[i] = "stop"
                elif (
                    spec.stop
                    and tokenizer is not None
                    and _hits_stop(tokenizer, out_tokens[i], spec.stop)
                ):
                    reasons[i] = "stop"
                elif len(out_tokens[i]) >= spec.max_new_tokens:
                    reasons[i] = "length"
                if reasons[i] is not None:
                    alive[row] = False
            n_active = sum(alive)
            if n_active == 0:
                break
            if n_active * 2 <= len(rows) and len(rows) >= 8:
                prunes += 1
                keep_rows = [r for r, a in enumerate(alive) if a]
                keep = torch.tensor(keep_rows, dtype=torch.long, device=device)
                if session is not None:
                    session.select(keep)
                else:
                    past.batch_select_indices(keep)
                rows = [rows[r] for r in keep_rows]
                tok, attn, next_pos = tok[keep], attn[keep], next_pos[keep]
                temps, top_k, top_p = temps[keep], top_k[keep], top_p[keep]
                alive = [True] * len(rows)
            active = torch.tensor(alive, dtype=torch.bool, device=device)
            feed = torch.where(active, tok, torch.full_like(tok, pad_token_id))
            forwards += 1
            if session is not None:
                logits = session.step(feed, active)
                continue
            attn = torch.cat([attn, active.long()[:, None]], dim=1)
            out = model(
                input_ids=feed[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{cache_kw: past},
                **last_only,
            )
            past = output_cache(out)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
    if stats is not None:
        stats["forward_passes"] = stats.get("forward_passes", 0) + forwards
        stats["cache_prunes"] = stats.get("cache_prunes", 0) + prunes
        stats["generated_tokens"] = stats.get("generated_tokens", 0) + sum(map(len, out_tokens))
    completions = []
    for i, spec in enumerate(seqs):
        c = Completion(
            token_ids=out_tokens[i], logprobs=out_logprobs[i], finish_reason=reasons[i] or "length"
        )  # type: ignore[arg-type]
        kept = out_allowed[i]
        if kept and any(a < 0.0 for a in kept):  # some token was drawn from less than all
            c.allowed_logprobs = kept
            c.banned_ids = _banned_ids(spec, eos_token_ids, int(logits.shape[-1]))
        completions.append(c)
    return completions


def _banned_ids(spec: SequenceSpec, eos_token_ids: set[int], vocab: int | None = None) -> list[int]:
    """The token ids ``spec`` may not draw before its ``min_new_tokens``: the end tokens
    and its stop ids, sorted; with ``vocab``, only those in the vocabulary (the others
    are never banned, see :func:`_end_tokens_banned`)."""
    stops = spec.stop_token_ids
    ids = eos_token_ids | stops if stops else eos_token_ids
    return sorted(t for t in ids if vocab is None or 0 <= t < vocab)


def _end_tokens_banned(
    seqs: list[SequenceSpec],
    rows: list[int],
    short: list[int],
    eos_token_ids: set[int],
    logits: torch.Tensor,
) -> torch.Tensor | None:
    """The bool [B, V] mask of end tokens (eos, the row's stop ids) that the ``short``
    rows (positions in ``rows``, still short of their ``min_new_tokens``) may not draw;
    None when no row is."""
    if not short:
        return None
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for r in short:  # (row, token) pairs, set in one indexed write (a write per row cost
        # about a tenth of a generation-heavy explorer's time)
        stops = seqs[rows[r]].stop_token_ids
        ids = eos_token_ids | stops if stops else eos_token_ids
        for t in ids:
            if 0 <= t < vocab:
                row_idx.append(r)
                col_idx.append(t)
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    if row_idx:
        banned[torch.tensor(row_idx), torch.tensor(col_idx)] = True
    return banned


def _hits_stop(tokenizer: Any, tokens: list[int], stop: list[str]) -> bool:
    window = 2 * max(len(s) for s in stop) + 8
    text = tokenizer.decode(tokens[-window:], skip_special_tokens=False)
    return any(s and s in text for s in stop)


class _Request:
    __slots__ = ("prompt", "params", "done", "result", "error", "cancelled")

    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.prompt = prompt
        self.params = params
        self.done = anyio.Event()
        self.result: list[Completion] | None = None
        self.error: RftError | None = None
        self.cancelled = False

    def fail(self, message: str) -> None:
        if not self.done.is_set():
            self.error = RftError(message)
            self.done.set()


def _copy_state(
    model: Any,
    decoder: FastDecoder | None,
    state_dict: dict[str, torch.Tensor],
    partial: bool,
    model_path: str,
) -> None:
    """Copy ``state_dict`` into ``model`` (converting dtype and device), then refresh
    ``decoder``'s fused weights. Checks every key and shape first: raises
    :class:`RftError` naming the offending tensors, with nothing copied."""
    cleaned = {strip_module_prefix(k): v for k, v in state_dict.items()}
    own = model.state_dict()
    unexpected = sorted(set(cleaned) - set(own))
    missing = [] if partial else sorted(set(own) - set(cleaned))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if unexpected or missing:
        raise RftError(
            f"load_weights: state dict does not match the model at {model_path!r}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in cleaned.items():
        if own[k].shape != v.shape:
            raise RftError(
                f"load_weights: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}"
            )
    with torch.no_grad():
        for k, v in cleaned.items():
            own[k].copy_(v)
        if decoder is not None:
            decoder.refresh()


class TransformersEngine(RolloutEngine):
    """Batched sampling with a ``transformers`` causal LM (see the module docstring).

    ``stats`` counts ``batches`` (sampling loops run), ``requests``,
    ``sequences``, ``forward_passes``, ``generated_tokens``, ``cache_prunes``
    (finished rows dropped from the KV cache) and ``cancelled`` (requests whose
    caller went away).
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_batch_size: int = 64,
        batch_wait_ms: float = 5.0,
        dtype: str = "float32",
        seed: int = 42,
        device: str = "cpu",
        torch_threads: int | None = None,
        default_max_tokens: int = 512,
        fast_decoder: bool = True,
        double_buffer: bool = True,
    ) -> None:
        from rftstream.model_loading import hf_classes

        (AutoTokenizer,) = hf_classes("AutoTokenizer")

        if max_batch_size < 1:
            raise RftError(
                f"explorer.rollout_model.max_batch_size must be >= 1, got {max_batch_size}"
            )
        if torch_threads is not None:
            torch.set_num_threads(int(torch_threads))
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise RftError(f"model.dtype: unknown torch dtype {dtype!r}")
        self.model_path = str(model_path)
        self.max_batch_size = int(max_batch_size)
        self.batch_wait = max(float(batch_wait_ms), 0.0) / 1000.0
        self.default_max_tokens = int(default_max_tokens)
        self.device = torch.device(device)
        try:
            from rftstream.model_loading import HF_LOAD_LOCK  # concurrent loads in one process race

            with quiet_progress_bars(), HF_LOAD_LOCK:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                # the fast decoder needs the parameters only: where it covers the checkpoint,
                # no transformers modeling code is imported (rftstream.engines.light_model)
                model = load_light_causal_lm(self.model_path, torch_dtype) if fast_decoder else None
                if model is None:
                    (AutoModelForCausalLM,) = hf_classes("AutoModelForCausalLM")
                    model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype)
                model = model.to(self.device)
        except (OSError, ValueError) as exc:
            raise RftError(
                f"model.model_path: cannot load a model from {self.model_path!r}: {exc}"
            ) from exc
        self._model = model.to(self.device).eval()
        # the lean forward of rftstream.engines.fast_decoder where it covers the model exactly
        self._decoder = fast_decoder_for(self._model) if fast_decoder else None
        cfg = self._model.config
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        eos = eos_ids(
            self._tokenizer.eos_token_id,
            cfg.eos_token_id,
            getattr(self._model.generation_config, "eos_token_id", None),
        )
        self.eos_token_ids = eos
        pad = self._tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (min(eos) if eos else 0))
        self._generator = torch.Generator(device=self.device).manual_seed(int(seed))
        self._version = 0
        self._send, self._recv = anyio.create_memory_object_stream[_Request](
            max_buffer_size=math.inf
        )
        self._lock = anyio.Lock()
        # double-buffered weight sync (stage_weights / swap_staged): the second copy
        self.double_buffer = bool(double_buffer)
        self._spare: Any = None
        self._spare_decoder: FastDecoder | None = None
        self._staged_version: int | None = None
        self._stage_lock = anyio.Lock()
        self._limiter: anyio.CapacityLimiter | None = None
        self._closed = False
        self._running = False
        self._inflight: list[_Request] = []
        self.stats: dict[str, int] = {
            "batches": 0,
            "requests": 0,
            "sequences": 0,
            "forward_passes": 0,
            "generated_tokens": 0,
            "cache_prunes": 0,
            "cancelled": 0,
        }

    # ------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model(self) -> Any:
        """The model sampled with (do not run it while a batch is in flight): a
        :class:`~rftstream.engines.light_model.LightCausalLM` where the fast decoder covers
        the checkpoint (the same parameter names, ``config``, and ``model(input_ids=...)
        .logits``), else the ``transformers`` model."""
        return self._model

    @property
    def model_version(self) -> int:
        return self._version

    # ------------------------------------------------------------ API
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Completion]:
        """Sample ``params.n`` completions of one prompt; waits for :meth:`run` to serve it.

        Raises :class:`RftError` at once when the prompt does not fit the
        context or the engine is closed. Cancelling the caller marks its
        request dropped: it is skipped if not started, and its results are
        discarded (the rest of the batch is unaffected) if already running.
        """
        if self._closed:
            raise RftError("rollout engine is closed")
        prompt = prompt_ids(prompt_token_ids, self.max_model_len)
        req = _Request(prompt, params)
        try:
            self._send.send_nowait(req)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise RftError("rollout engine is closed") from exc
        try:
            await req.done.wait()
        except BaseException:
            req.cancelled = True
            raise
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    async def score(
        self,
        token_ids: list[int],
        *,
        start: int = 1,
        temperature: float = 1.0,
        top_logprobs: int = 0,
    ) -> TokenScores:
        """Logprobs of ``token_ids[start:]`` from one full forward pass (no KV cache).

        Runs between sampling batches (it takes the batcher's lock) in the
        engine's worker thread; does not need :meth:`run`. Same convention as
        sampling: ``log_softmax(logits / temperature)``; ``temperature <= 0``
        means 1. Raises :class:`RftError` when the engine is closed or the
        sequence does not fit the model context.
        """
        if self._closed:
            raise RftError("rollout engine is closed")
        ids = score_ids(token_ids, self.max_model_len)
        start = max(1, int(start))
        if start >= len(ids):
            return TokenScores([], [] if top_logprobs > 0 else None)
        async with self._lock:
            return await anyio.to_thread.run_sync(
                self._score,
                ids,
                start,
                float(temperature),
                int(top_logprobs),
                limiter=self._thread_limiter(),
            )

    def _score(self, ids: list[int], start: int, temperature: float, top: int) -> TokenScores:
        with torch.inference_mode():
            seq = torch.tensor([ids], dtype=torch.long, device=self.device)
            keep = len(ids) - start + 1
            if self._decoder is not None:  # the engine's own (its fused weights are current)
                full = self._decoder.logits(seq, torch.ones_like(seq), keep)
            else:
                full = self._model(input_ids=seq, use_cache=False, logits_to_keep=keep).logits
            logits = full[0, :-1].float()  # predictions for positions start .. len-1
            t = temperature if temperature > 0 else 1.0
            lp = torch.log_softmax(logits / t, dim=-1)
            chosen = lp.gather(-1, seq[0, start:, None]).squeeze(-1).tolist()
            alts = None
            if top > 0:
                vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)
                alts = [
                    list(zip(i, v, strict=True))
                    for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
                ]
        return TokenScores(chosen, alts)

    def _thread_limiter(self) -> anyio.CapacityLimiter:
        """The engine's own one-thread limiter (created on first use, on the event loop)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return self._limiter

    async def load_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Copy ``state_dict`` into the model between batches, then set the version.

        Waits for the batch in flight (the batcher holds the same lock); the
        copy runs in a worker thread. Accepts DeepSpeed/DDP ``module.`` prefixes
        and a missing ``lm_head.weight`` with tied embeddings; other missing
        (unless ``partial``) or unexpected keys, and tensors of another shape, raise
        :class:`RftError` naming them and leave the version unchanged. Drops a
        staged version (:meth:`stage_weights`): these weights are newer.
        """
        async with self._lock:
            await anyio.to_thread.run_sync(
                _copy_state, self._model, self._decoder, state_dict, partial, self.model_path
            )
            self._version = int(version)
            self._staged_version = None

    # ------------------------------------------------------------ double buffer
    @property
    def staged_version(self) -> int | None:
        if not self.double_buffer:
            return super().staged_version
        return self._staged_version

    async def stage_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Copy ``version`` into the second copy of the model (made on first use) while
        batches go on with the current one; :meth:`swap_staged` then swaps the two.

        Blocks (a worker thread of the default pool, not the batcher's) for the copy and
        the fast decoder's fused weights. Raises :class:`RftError` naming a tensor that
        does not fit the model; nothing is staged then. Without ``double_buffer`` the
        tensors are kept and loaded in place at the swap (:class:`RolloutEngine`).
        """
        if not self.double_buffer:
            await super().stage_weights(state_dict, version, partial=partial)
            return
        async with self._stage_lock:
            self._staged_version = None
            size = sum(t.numel() * t.element_size() for t in state_dict.values())
            if size <= STAGE_INLINE_BYTES and self._spare is not None:  # no thread hop
                copied = self._stage_copy(state_dict, partial)
            else:
                copied = await anyio.to_thread.run_sync(self._stage_copy, state_dict, partial)
            if not copied:
                self.double_buffer = False
                await super().stage_weights(state_dict, version, partial=partial)
                return
            self._staged_version = int(version)

    def _stage_copy(self, state_dict: dict[str, torch.Tensor], partial: bool) -> bool:
        """Worker thread: copy into the second model (made here the first time). Returns
        False when there is no memory for a second copy (nothing staged)."""
        if self._spare is None:
            import copy

            try:
                self._spare = copy.deepcopy(self._model).eval()
            except (MemoryError, RuntimeError) as exc:  # torch's out-of-memory included
                log.warning(
                    "no memory for a second copy of the model (%s): weights are loaded in "
                    "place from now on (synchronizer.double_buffer: false), pausing "
                    "generation for the copy",
                    exc,
                )
                return False
            self._spare_decoder = fast_decoder_for(self._spare) if self._decoder else None
        _copy_state(self._spare, self._spare_decoder, state_dict, partial, self.model_path)
        return True

    async def swap_staged(self, *, wait: bool = True) -> float | None:
        """Swap the staged copy in between two batches (a pointer swap under the batcher's
        lock: generation pauses for microseconds). Returns that pause, or None when
        nothing is staged, or a stage is being copied and ``wait`` is False. Blocks for
        the batch in flight (and, with ``wait``, for a stage being copied)."""
        if not self.double_buffer:
            return await super().swap_staged(wait=wait)
        if self._stage_lock.locked() and not wait:
            return None
        async with self._stage_lock:
            if self._staged_version is None:
                return None
            async with self._lock:
                t0 = time.perf_counter()
                self._model, self._spare = self._spare, self._model
                self._decoder, self._spare_decoder = self._spare_decoder, self._decoder
                self._version, self._staged_version = self._staged_version, None
                return time.perf_counter() - t0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Batch and serve requests until cancelled or :meth:`aclose` is called.

        Start it with ``tg.start_soon(engine.run)`` (or ``await tg.start(engine.run)``
        to wait until it serves). On cancel the batch in flight finishes first
        (forward passes are not interruptible), then every waiting request
        fails with :class:`RftError`.
        """
        if self._running:
            raise RftError("TransformersEngine.run() is already running")
        self._running = True
        limiter = self._thread_limiter()
        pending: deque[_Request] = deque()
        task_status.started()
        try:
            while True:
                batch = await self._collect(pending)
                if batch is None:
                    return
                if batch:
                    # taken off the stream: failed by the finally below if cancelled
                    # before or while it is served
                    self._inflight = batch
                    await self._serve(batch, limiter)
                    self._inflight = []
        finally:
            self._running = False
            for req in [*self._inflight, *pending]:
                req.fail("rollout engine stopped before serving the request")
            self._inflight = []
            while True:
                try:
                    self._recv.receive_nowait().fail(
                        "rollout engine stopped before serving the request"
                    )
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break

    async def aclose(self) -> None:
        """Stop accepting requests; :meth:`run` returns after the batch in flight."""
        self._closed = True
        self._send.close()

    # ------------------------------------------------------------ batcher
    async def _collect(self, pending: deque[_Request]) -> list[_Request] | None:
        """The next batch: every request already waiting, up to ``max_batch_size`` sequences.

        Only an engine that was idle (its first request had to be awaited) then waits up
        to ``batch_wait`` seconds for more, so that requests made together are sampled
        together. Requests that queued while a batch was being sampled start at once:
        waiting would yield the event loop to the workflows of the batch just finished
        (decoding, scoring, publishing), and the sampler would stand idle meanwhile.
        """
        waited = False
        if pending:
            first = pending.popleft()
        else:
            try:
                first = self._recv.receive_nowait()
            except anyio.WouldBlock:
                waited = True
                try:
                    first = await self._recv.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    return None
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return None
        batch: list[_Request] = []
        size = 0
        if not first.cancelled:
            batch.append(first)
            size = first.params.n
        deadline = anyio.current_time() + (self.batch_wait if waited else 0.0)
        while size < self.max_batch_size:
            try:
                req = self._recv.receive_nowait()
            except anyio.WouldBlock:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    break
                got: _Request | None = None
                with anyio.move_on_after(remaining):
                    try:
                        got = await self._recv.receive()
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        break
                if got is None:
                    break
                req = got
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if req.cancelled:
                self.stats["cancelled"] += 1
                continue
            if batch and size + req.params.n > self.max_batch_size:
                pending.append(req)
                break
            batch.append(req)
            size += req.params.n
        return batch

    async def _serve(self, batch: list[_Request], limiter: anyio.CapacityLimiter) -> None:
        async with self._lock:
            live = [r for r in batch if not r.cancelled]
            self.stats["cancelled"] += len(batch) - len(live)
            if not live:
                return
            version = self._version
            try:
                results = await anyio.to_thread.run_sync(
                    self._generate_batch, live, limiter=limiter
                )
            except Exception as exc:  # noqa: BLE001 - reported to every caller of the batch
                log.exception("rollout batch of %d requests failed", len(live))
                for r in live:
                    r.fail(f"generation failed: {type(exc).__name__}: {exc}")
                return
            self.stats["batches"] += 1
            self.stats["requests"] += len(live)
            self.stats["sequences"] += sum(r.params.n for r in live)
            for r, comps in zip(live, results, strict=True):
                for c in comps:
                    c.model_version = version
                if r.cancelled:
                    self.stats["cancelled"] += 1
                r.result = comps
                r.done.set()

    def _generate_batch(self, reqs: list[_Request]) -> list[list[Completion]]:
        """Worker thread: expand requests into sequences and sample them all at once."""
        seqs: list[SequenceSpec] = []
        for r in reqs:
            p = r.params
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(int(p.seed))
            room = self.max_model_len - len(r.prompt)
            want = p.max_tokens if p.max_tokens is not None else self.default_max_tokens
            for _ in range(p.n):
                seqs.append(
                    SequenceSpec(
                        prompt=r.prompt,
                        max_new_tokens=max(0, min(int(want), room)),
                        temperature=float(p.temperature),
                        top_p=float(p.top_p),
                        top_k=int(p.top_k),
                        generator=gen,
                        stop=list(p.stop) if p.stop else None,
                        stop_token_ids=set(p.stop_token_ids or ()),
                        min_new_tokens=int(p.min_tokens),
                    )
                )
        comps = sample_sequences(
            self._model,
            seqs,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            generator=self._generator,
            tokenizer=self._tokenizer,
            stats=self.stats,
            decoder=self._decoder,
        )
        out: list[list[Completion]] = []
        pos = 0
        for r in reqs:
            out.append(comps[pos : pos + r.params.n])
            pos += r.params.n
        return out
