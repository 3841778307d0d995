"""Collating experiences into padded training tensors. Pure tensor logic, no I/O.

Layout (as verl): prompts left-padded to ``P``, responses right-padded to
``R``; ``input_ids`` is ``[B, P + R]``. The logits that predict response token
``j`` sit at column ``P - 1 + j``, the same for every row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rftstream.config.resolved import ResolvedAlgorithmProtocol
from rftstream.experience import Experience, array_numpy

LOSS_TENSORS: frozenset[str] = frozenset(
    {
        "logprob",
        "old_logprob",
        "ref_logprob",
        "action_mask",
        "advantages",
        "returns",
        "entropy",
        "rollout_logprob",
        "rollout_logprob_mask",
    }
)
"""Tensors the trainer can pass to any policy loss, by ``__call__`` parameter name.

Besides these: ``values`` when the algorithm has a critic, and only the custom
fields the sample strategy declares (MIX: ``expert_mask``, ``step``); without
a reference model ``ref_logprob`` is not available either.
"""


def trainer_tensors(algorithm: ResolvedAlgorithmProtocol) -> set[str]:
    """The tensors the trainer has for any sample strategy: :data:`LOSS_TENSORS`, plus
    ``values`` when the algorithm has a critic.

    The argument of ``ResolvedAlgorithm.check_loss_inputs``, which adds the
    sample strategy's fields and takes ``ref_logprob`` away when the algorithm
    has no reference model. The run's preparation and the trainer check with it.
    """
    return set(LOSS_TENSORS) | ({"values"} if algorithm.use_critic else set())


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P+R] long
    attention_mask: torch.Tensor  # [B, P+R] long
    position_ids: torch.Tensor  # [B, P+R] long
    prompt_width: int  # P
    response_mask: torch.Tensor  # [B, R] float (action_mask & real token)
    advantages: torch.Tensor  # [B, R] float
    returns: torch.Tensor  # [B, R] float
    rollout_logprobs: torch.Tensor  # [B, R] float (zeros where absent)
    rollout_logprob_mask: torch.Tensor  # [B, R] float: 1 where rollout_logprobs holds one
    rewards: torch.Tensor  # [B] float
    fields: dict[str, torch.Tensor]  # custom per-row fields (e.g. expert_mask)
    # where a row's tokens were sampled under a ban (min_tokens): the behaviour policy's
    # log(1 - p(banned)) per token, 0 elsewhere ([B, R] float), and each row's banned
    # ids ([B, K] long, -1 padding); None when no row of the batch has any
    rollout_allowed: torch.Tensor | None = None
    ban_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        return int(self.response_mask.shape[1])

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """The same batch with ``fn`` applied to every tensor."""
        return TrainBatch(
            input_ids=fn(self.input_ids),
            attention_mask=fn(self.attention_mask),
            position_ids=fn(self.position_ids),
            prompt_width=self.prompt_width,
            response_mask=fn(self.response_mask),
            advantages=fn(self.advantages),
            returns=fn(self.returns),
            rollout_logprobs=fn(self.rollout_logprobs),
            rollout_logprob_mask=fn(self.rollout_logprob_mask),
            rewards=fn(self.rewards),
            fields={k: fn(v) for k, v in self.fields.items()},
            rollout_allowed=None if self.rollout_allowed is None else fn(self.rollout_allowed),
            ban_ids=None if self.ban_ids is None else fn(self.ban_ids),
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch on ``device`` (the trainer's: CPU, or the GPU DeepSpeed chose)."""
        return self._map(lambda t: t.to(device))

    def rows(self, idx: torch.Tensor | slice) -> TrainBatch:
        """A sub-batch (micro-batch) of the given rows."""
        return self._map(lambda t: t[idx])

    def prompt_lengths(self) -> list[int]:
        """Each row's real (unpadded) prompt tokens."""
        return [int(n) for n in self.attention_mask[:, : self.prompt_width].sum(1).tolist()]

    def response_lengths(self) -> list[int]:
        """Each row's real (unpadded) response tokens."""
        return [int(n) for n in self.attention_mask[:, self.prompt_width :].sum(1).tolist()]

    def trimmed(self, *, responses: bool = True) -> TrainBatch:
        """The same rows with the padding no row needs cut away: the prompt columns
        narrowed to the longest real prompt (left padding), and with ``responses`` the
        response columns to the longest real response (right padding).

        The model sees the same tokens at the same positions (``position_ids`` count
        real tokens only), so log-probs are unchanged; every ``[B, R]`` tensor keeps its
        first columns. ``responses=False`` keeps the response width, for a loss
        that divides by it (``seq-mean-token-sum-norm``).
        """
        p = max(1, max(self.prompt_lengths(), default=1))
        r = max(1, max(self.response_lengths(), default=1)) if responses else self.response_width
        cut = self.prompt_width - p

        def seq(t: torch.Tensor) -> torch.Tensor:
            return t[:, cut : self.prompt_width + r]

        def resp(t: torch.Tensor) -> torch.Tensor:
            return t[:, :r]

        return TrainBatch(
            input_ids=seq(self.input_ids),
            attention_mask=seq(self.attention_mask),
            position_ids=seq(self.position_ids),
            prompt_width=p,
            response_mask=resp(self.response_mask),
            advantages=resp(self.advantages),
            returns=resp(self.returns),
            rollout_logprobs=resp(self.rollout_logprobs),
            rollout_logprob_mask=resp(self.rollout_logprob_mask),
            rewards=self.rewards,
            fields=dict(self.fields),
            rollout_allowed=None if self.rollout_allowed is None else resp(self.rollout_allowed),
            ban_ids=self.ban_ids,
        )

    def token_ban(self) -> TokenBan | None:
        """The tokens of this batch sampled under a ban, for the policy's pass to measure
        the same banned mass (:func:`target_logprobs`); None when there are none."""
        if self.rollout_allowed is None or self.ban_ids is None:
            return None
        return TokenBan(self.ban_ids, self.rollout_allowed < 0)

    def behaviour_logprobs(self, policy_allowed: torch.Tensor | None) -> torch.Tensor:
        """``rollout_logprobs`` made comparable with the policy's unbanned log-probs where
        the behaviour policy sampled under a ban: ``rollout - log(1 - mu(banned)) +
        log(1 - pi(banned))`` there (``policy_allowed``: the policy's ``log(1 -
        pi(banned))``, [B, R], 0 elsewhere; None: no ban), so that ``exp(logprob_pi -
        result)`` is the ratio of the two banned (sampled) distributions,
        ``pi_banned(a) / mu_banned(a)``, where the unbanned ratio would be off by
        ``(1 - mu(banned)) / (1 - pi(banned))`` (up to e^20 where the end token held
        nearly all the mass). Elsewhere the rollout log-probs as they are."""
        if policy_allowed is None or self.rollout_allowed is None:
            return self.rollout_logprobs
        width = self.rollout_logprobs.shape[1]
        allowed = self.rollout_allowed[:, :width]
        here = allowed < 0
        return torch.where(
            here, self.rollout_logprobs - allowed + policy_allowed[:, :width], self.rollout_logprobs
        )


def _put(dst: np.ndarray, row: int, src: np.ndarray | None, n: int) -> None:
    """``dst[row, :m] = src[:m]`` with ``m = min(n, len(src))`` (the rest stays zero)."""
    if src is not None and n:
        m = min(n, src.shape[0])
        dst[row, :m] = src[:m]


def has_rollout_logprobs(e: Experience, temperature: float | None = None) -> bool:
    """Whether ``e.logprobs`` are the behaviour policy's: set, not flagged inexact by the
    engine (``info["logprobs_exact"] is False``), not the zeros MIX gives expert rows, and
    (with ``temperature``, the trainer's) sampled at that temperature when the experience
    says at which (``info["temperature"]``): other temperatures give other log-probs."""
    if e.logprobs is None or e.info.get("logprobs_exact", True) is False:
        return False
    if e.info.get("is_expert", False):
        return False
    sampled = e.info.get("temperature")
    if temperature is not None and isinstance(sampled, (int, float)):
        return abs(float(sampled) - temperature) <= 1e-6
    return True


def _rollout_logprob_mask(
    exps: list[Experience], lengths: list[int], width: int, temperature: float | None
) -> torch.Tensor:
    """``[B, width]`` float: 1 on the first ``min(response length, len(logprobs))`` tokens
    of a row with rollout logprobs (:func:`has_rollout_logprobs`), else 0."""
    n = [
        min(nr, int(e.logprobs.numel())) if has_rollout_logprobs(e, temperature) else 0
        for e, nr in zip(exps, lengths, strict=True)
    ]
    return (torch.arange(width) < torch.tensor(n).unsqueeze(1)).to(torch.float32)


def collate(
    exps: list[Experience],
    pad_token_id: int,
    *,
    max_prompt: int | None = None,
    max_response: int | None = None,
    custom_fields: Sequence[Any] = (),
    temperature: float | None = None,
) -> TrainBatch:
    """Pad a list of experiences into a :class:`TrainBatch`.

    Prompts longer than ``max_prompt`` keep their last tokens; responses longer
    than ``max_response`` are cut (their mask too). ``fields`` holds one
    ``(batch,)`` tensor per ``custom_fields`` entry (a sample strategy's
    ``CustomField``: ``source_field``, ``destination_field``, ``data_type``)
    and nothing else; raises KeyError naming the first experience without the
    source field. ``rollout_logprob_mask`` marks the rows whose log-probs are the
    behaviour policy's at ``temperature`` (:func:`has_rollout_logprobs`). The
    padding is done in numpy (one array per field, rows copied in place), then
    wrapped as tensors without a copy.
    """
    if not exps:
        raise ValueError("collate: empty batch")
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    for e in exps:
        tokens = array_numpy(e, "tokens")
        assert tokens is not None
        p, r = tokens[: e.prompt_length], tokens[e.prompt_length :]
        if max_prompt is not None and p.shape[0] > max_prompt:
            p = p[p.shape[0] - max_prompt :]
        if max_response is not None and r.shape[0] > max_response:
            r = r[:max_response]
        prompts.append(p)
        responses.append(r)
    P = max(max(p.shape[0] for p in prompts), 1)
    R = max(max(r.shape[0] for r in responses), 1)
    B = len(exps)
    input_ids_np = np.full((B, P + R), pad_token_id, dtype=np.int64)
    attention_np = np.zeros((B, P + R), dtype=np.int64)
    response_np = np.zeros((B, R), dtype=np.float32)
    advantages_np = np.zeros((B, R), dtype=np.float32)
    returns_np = np.zeros((B, R), dtype=np.float32)
    rollout_np = np.zeros((B, R), dtype=np.float32)
    rewards_np = np.zeros(B, dtype=np.float32)
    allowed_np: np.ndarray | None = None  # made at the first row sampled under a ban
    banned_rows: dict[int, np.ndarray] = {}
    for i, (e, p, r) in enumerate(zip(exps, prompts, responses, strict=True)):
        np_, nr = p.shape[0], r.shape[0]
        input_ids_np[i, P - np_ : P] = p
        attention_np[i, P - np_ : P + nr] = 1
        input_ids_np[i, P : P + nr] = r
        mask = array_numpy(e, "action_mask")
        if mask is None:
            response_np[i, :nr] = 1.0
        else:
            _put(response_np, i, mask, nr)
        _put(advantages_np, i, array_numpy(e, "advantages"), nr)
        _put(returns_np, i, array_numpy(e, "returns"), nr)
        _put(rollout_np, i, array_numpy(e, "logprobs"), nr)
        rewards_np[i] = float(e.reward) if e.reward is not None else 0.0
        # where the row was sampled under a ban: kept whether or not its rollout log-probs
        # can serve as behaviour log-probs (rollout_logprob_mask says that), since the
        # trainer's own log-probs there are the banned distribution's (logprobs_of)
        allowed = array_numpy(e, "allowed_logprobs")
        if allowed is not None:
            banned = array_numpy(e, "banned_ids")
            if banned is not None and banned.shape[0]:
                if allowed_np is None:
                    allowed_np = np.zeros((B, R), dtype=np.float32)
                _put(allowed_np, i, allowed, nr)
                banned_rows[i] = banned
    input_ids = torch.from_numpy(input_ids_np)
    attention_mask = torch.from_numpy(attention_np)
    response_mask = torch.from_numpy(response_np)
    advantages = torch.from_numpy(advantages_np)
    returns = torch.from_numpy(returns_np)
    rollout_lp = torch.from_numpy(rollout_np)
    rewards = torch.from_numpy(rewards_np)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    fields: dict[str, torch.Tensor] = {}
    for cf in custom_fields:
        values = []
        for e in exps:
            if cf.source_field not in e.info:
                raise KeyError(
                    f"experience {e.eid.uid} has no info[{cf.source_field!r}] "
                    f"(custom field {cf.destination_field!r})"
                )
            values.append(e.info[cf.source_field])
        fields[cf.destination_field] = torch.tensor(values, dtype=cf.data_type)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        prompt_width=P,
        response_mask=response_mask,
        advantages=advantages,
        returns=returns,
        rollout_logprobs=rollout_lp,
        rollout_logprob_mask=_rollout_logprob_mask(
            exps, [r.shape[0] for r in responses], R, temperature
        ),
        rewards=rewards,
        fields=fields,
        rollout_allowed=None if allowed_np is None else torch.from_numpy(allowed_np),
        ban_ids=_ban_ids(banned_rows, B),
    )


def _ban_ids(rows: dict[int, np.ndarray], B: int) -> torch.Tensor | None:
    """``[B, K]`` long: each row's banned ids, -1 padding (rows without a ban all -1)."""
    if not rows:
        return None
    K = max(ids.shape[0] for ids in rows.values())
    out = np.full((B, K), -1, dtype=np.int64)
    for i, ids in rows.items():
        out[i, : ids.shape[0]] = ids
    return torch.from_numpy(out)


@dataclass
class TokenBan:
    """Which tokens were sampled under a ban, and of which ids: ``ids`` ``[..., K]`` long
    (-1 padding) and ``at`` ``[...]`` bool, of the leading shape of the targets they go
    with (rows: ``ids`` ``[B, K]`` with ``at`` ``[B, R]`` is taken as every token of row
    ``b`` banning ``ids[b]``; see :meth:`for_tokens`).

    ``exclude``: the log-probs wanted there are those of the distribution the sampler drew
    from, the banned ids left out of the softmax (``algorithm.logprobs_of: sampler``),
    not the model's over the whole vocabulary (``model``): see :func:`target_logprobs`."""

    ids: torch.Tensor
    at: torch.Tensor
    exclude: bool = False

    def for_tokens(self) -> TokenBan:
        """The per-row form (``ids`` [B, K], ``at`` [B, R]) as one id list per token
        (``ids`` [B, R, K])."""
        if self.ids.dim() == self.at.dim() + 1:
            return self
        R = self.at.shape[1]
        return TokenBan(self.ids[:, None, :].expand(-1, R, -1), self.at, self.exclude)

    def leading(self, width: int) -> TokenBan:
        """The per-row form's first ``width`` response columns (a forward's logits cover
        the response up to its longest row)."""
        return TokenBan(self.ids, self.at[:, :width], self.exclude)


def allowed_logprob(logp_all: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log(1 - sum_{i in ids} p_i)`` per position of ``logp_all`` ``[N, V]`` (log-probs),
    ``ids`` ``[N, K]`` (-1 padding): the log of the mass left outside the banned ids.

    Accurate at both ends: where the banned mass is under a half, ``log1p(-p)``; where
    it is more, the log-sum-exp of the other tokens' log-probs (each exact), never ``1 -
    p`` (rounding where an end token holds nearly all the mass). No gradient."""
    with torch.no_grad():
        valid = ids >= 0
        safe = ids.clamp(min=0)
        gathered = logp_all.gather(-1, safe).masked_fill(~valid, -torch.inf)
        banned = torch.logsumexp(gathered, dim=-1)
        out = torch.log1p(-torch.exp(banned).clamp(max=1.0))
        big = banned > -0.6931471805599453  # p(banned) > 1/2
        if bool(big.any()):
            rows = big.nonzero().squeeze(-1)
            hit = torch.zeros(
                (rows.shape[0], logp_all.shape[-1]), dtype=torch.int32, device=logp_all.device
            ).scatter_add_(-1, safe[rows], valid[rows].to(torch.int32))
            kept = torch.logsumexp(logp_all[rows].masked_fill(hit > 0, -torch.inf), dim=-1)
            out = out.index_copy(0, rows, kept)
        return out.clamp(max=0.0)


def response_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    prompt_width: int,
    temperature: float,
    *,
    with_entropy: bool = False,
    logits_start: int = 0,
    ban: TokenBan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities (and entropy, and with ``ban`` the allowed mass) of the response
    tokens under ``logits / temperature``: see :func:`target_logprobs`.

    Uses the same temperature scaling as the rollout engine, so ratios start at 1.
    ``logits_start``: the sequence position of ``logits[:, 0]`` (logits computed
    for the last positions only start at ``prompt_width - 1``). ``ban``: the batch's
    (:meth:`TrainBatch.token_ban`, per row).
    """
    R = input_ids.shape[1] - prompt_width
    first = prompt_width - 1 - logits_start
    targets = input_ids[:, prompt_width : prompt_width + R]
    return target_logprobs(
        logits[:, first : first + R, :].float(),
        targets,
        temperature,
        with_entropy=with_entropy,
        ban=None if ban is None else ban.leading(R).for_tokens(),
    )


def target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool,
    ban: TokenBan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each target token's log-probability under ``logits / temperature`` (logits
    ``[..., vocab]``, targets ``[...]``), the distribution's entropy there (with
    ``with_entropy``), and with ``ban`` (per token: ``ids`` ``[..., K]``, ``at``
    ``[...]``) the log of the mass outside the banned ids where ``at`` holds
    (:func:`allowed_logprob`; 0 elsewhere, no gradient), else None.

    With ``ban.exclude`` the distribution is the sampler's: where ``at`` holds, the
    banned ids are left out of the softmax, so the log-prob is ``log p(a) - log(1 -
    p(banned))`` with its gradient (none flows to the banned ids' logits there), the
    entropy is that distribution's, and the mass outside the banned ids is all of it
    (0)."""
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, -1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    if ban is not None and ban.exclude:  # the sampler's distribution: _without_banned
        logp, entropy, _ = _without_banned(logp_all, logp, ban, entropy)
        return logp, entropy, torch.zeros(ban.at.shape, dtype=torch.float32, device=logits.device)
    return logp, entropy, _allowed_at(logp_all, ban)


def _without_banned(
    logp_all: torch.Tensor,
    logp: torch.Tensor,
    ban: TokenBan,
    entropy: torch.Tensor | None,
    squares: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target log-prob, entropy and (with ``squares``, the model's ``sum(p^2)`` and
    ``sum(p^2 log p)``) ``nec`` of the distribution without the banned ids where
    ``ban.at`` holds, from the model's (``logp_all``, ``logp``, ``entropy``); the model's
    elsewhere. Keeps the gradient; makes no second ``[..., vocab]`` tensor.

    With ``q = 1 - p(banned)`` and sums over the kept ids: ``log p(a) - log q``; the
    entropy ``-sum p log p / q + log q``; ``sum(p_b^2) = sum p^2 / q^2`` and ``sum(p_b^2
    log p_b) = (sum p^2 log p - log q sum p^2) / q^2``; each kept sum the whole
    vocabulary's less the banned ids' gathered terms, where those hold under half the
    mass (``q`` at least a half). Where they hold more, ``1 - p`` would be rounding (as in
    :func:`allowed_logprob`): those positions' rows alone are masked and measured
    directly."""
    valid = (ban.ids >= 0) & ban.at[..., None]
    # padding slots gather id 0; zeroed so that no 0 * inf reaches a gradient
    gathered = logp_all.gather(-1, ban.ids.clamp(min=0).long()).masked_fill(~valid, 0.0)
    p_gathered = torch.where(valid, gathered.exp(), torch.zeros_like(gathered))
    p_banned = p_gathered.sum(-1)  # 0 where nothing is banned
    big = p_banned > 0.5
    # where the banned mass is over a half this is replaced below; 0 here keeps its
    # gradient zero, never the infinite one of log1p(-1)
    small = torch.where(big, torch.zeros_like(p_banned), p_banned)
    log_q, q = torch.log1p(-small), 1.0 - small
    nec = None
    if entropy is not None:
        kept_entropy = entropy + (p_gathered * gathered).sum(-1)  # -sum over kept of p log p
        entropy_b = kept_entropy / q + log_q
        if squares is not None:
            sum_p2, sum_p2_logp = squares
            kept_p2 = sum_p2 - (p_gathered * p_gathered).sum(-1)
            kept_p2_logp = sum_p2_logp - (p_gathered * p_gathered * gathered).sum(-1)
            p2_b = kept_p2 / (q * q)
            p2_logp_b = (kept_p2_logp - log_q * kept_p2) / (q * q)
            nec_full = entropy * sum_p2 + sum_p2_logp
            nec = torch.where(ban.at, entropy_b * p2_b + p2_logp_b, nec_full)
        entropy = torch.where(ban.at, entropy_b, entropy)
    if bool(big.any()):
        where = big.nonzero(as_tuple=True)
        rows = logp_all[where]  # [n, vocab]: these positions only
        ids, ok = ban.ids[where].long(), valid[where]
        first = ids.gather(-1, ok.long().argmax(-1, keepdim=True))  # a banned id of the row
        masked = rows.scatter(-1, torch.where(ok, ids, first), -torch.inf)
        kept = torch.logsumexp(masked, dim=-1)
        log_q = log_q.index_put(where, kept)
        if entropy is not None:
            lp = masked - kept[:, None]
            finite = lp.masked_fill(torch.isinf(lp), 0.0)
            p_b = lp.exp()
            entropy_rows = -(p_b * finite).sum(-1)
            entropy = entropy.index_put(where, entropy_rows)
            if nec is not None:
                p2 = p_b * p_b
                nec = nec.index_put(where, entropy_rows * p2.sum(-1) + (p2 * finite).sum(-1))
    return logp - log_q, entropy, nec


def _allowed_at(logp_all: torch.Tensor, ban: TokenBan | None) -> torch.Tensor | None:
    """:func:`allowed_logprob` where ``ban.at`` holds, 0 elsewhere (shape of ``ban.at``)."""
    if ban is None:
        return None
    with torch.no_grad():
        out = torch.zeros(ban.at.shape, dtype=torch.float32, device=logp_all.device)
        if bool(ban.at.any()):
            flat = out.view(-1)
            where = ban.at.reshape(-1).nonzero().squeeze(-1)
            V = logp_all.shape[-1]
            rows = logp_all.detach().reshape(-1, V).index_select(0, where)
            ids = ban.ids.reshape(-1, ban.ids.shape[-1]).index_select(0, where)
            flat.index_copy_(0, where, allowed_logprob(rows.float(), ids))
        return out


@dataclass
class TokenStats:
    """Per-token statistics of the policy over the response positions, ``(B, R)`` float32.

    ``nec`` is ``H * sum(p^2) + sum(p^2 log p)`` (Clip_V's ``necs``), None unless asked for;
    ``allowed`` the log of the mass outside the banned ids where a token was sampled under
    a ban (:func:`target_logprobs`), None without one.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor
    nec: torch.Tensor | None = None
    allowed: torch.Tensor | None = None

    def cat(self, other: TokenStats) -> TokenStats:
        """Rows of ``self`` then rows of ``other``."""

        def both(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None or b is None else torch.cat([a, b], 0)

        return TokenStats(
            torch.cat([self.logprob, other.logprob], 0),
            torch.cat([self.entropy, other.entropy], 0),
            both(self.nec, other.nec),
            both(self.allowed, other.allowed),
        )


def response_token_stats(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    prompt_width: int,
    temperature: float,
    *,
    with_nec: bool = False,
    logits_start: int = 0,
    ban: TokenBan | None = None,
) -> TokenStats:
    """Log-prob, entropy (and ``nec``, and with ``ban`` the allowed mass) of every response
    token under ``logits / temperature``.

    The same positions and scaling as :func:`response_logprobs`; with ``p`` the
    next-token distribution: ``entropy = -sum(p log p)``, ``nec = entropy *
    sum(p^2) + sum(p^2 log p)``. Float32; meant for no-grad passes.
    """
    R = input_ids.shape[1] - prompt_width
    first = prompt_width - 1 - logits_start
    lg = logits[:, first : first + R, :].float()
    if temperature and temperature != 1.0:
        lg = lg / temperature
    logp_all = torch.log_softmax(lg, dim=-1)
    p = logp_all.exp()
    targets = input_ids[:, prompt_width : prompt_width + R]
    logp = torch.gather(logp_all, -1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(p * logp_all).sum(-1)
    nec = None
    squares = None
    if with_nec:
        p2 = p * p
        squares = (p2.sum(-1), (p2 * logp_all).sum(-1))
        nec = entropy * squares[0] + squares[1]
    token_ban = None if ban is None else ban.leading(R).for_tokens()
    if token_ban is not None and token_ban.exclude:  # the sampler's distribution
        if bool(token_ban.at.any()):
            logp, banned_entropy, nec = _without_banned(logp_all, logp, token_ban, entropy, squares)
            assert banned_entropy is not None
            entropy = banned_entropy
        allowed = torch.zeros(token_ban.at.shape, dtype=torch.float32, device=lg.device)
    else:
        allowed = _allowed_at(logp_all, token_ban)
    return TokenStats(logp, entropy, nec, allowed)


def balanced_partitions(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split row indices into ``k`` micro-batches of (nearly) equal token totals.

    Sizes differ by at most one row (``len // k`` or ``len // k + 1``, and
    exactly ``len % k`` micro-batches get the extra row), so DeepSpeed's
    accumulation steps stay even; within that, rows are placed longest first
    into the micro-batch with the fewest tokens so far (greedy LPT), any
    micro-batch may be one of the larger ones. Each partition lists its rows in
    ascending index order. Used where the algorithm's ``can_balance_batch``
    allows reordering.
    """
    n = len(lengths)
    k = max(1, k)
    base, extra = divmod(n, k)
    parts: list[list[int]] = [[] for _ in range(k)]
    totals = [0] * k
    larger = 0  # partitions already holding base + 1 rows
    for idx in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        open_parts = [
            p
            for p in range(k)
            if len(parts[p]) < base or (len(parts[p]) == base and larger < extra)
        ]
        target = min(open_parts, key=lambda p: (totals[p], len(parts[p]), p))
        parts[target].append(idx)
        totals[target] += int(lengths[idx])
        if len(parts[target]) == base + 1:
            larger += 1
    return [sorted(p) for p in parts]


def contiguous_partitions(n: int, k: int, unit: int = 1) -> list[list[int]]:
    """Split ``range(n)`` into ``k`` contiguous runs of whole ``unit``-row blocks (DPO pairs: 2).

    Sizes differ by at most one unit; some runs are empty when ``n < k * unit``.
    """
    units = n // unit
    base, extra = divmod(units, max(1, k))
    out: list[list[int]] = []
    start = 0
    for i in range(max(1, k)):
        size = (base + (1 if i < extra else 0)) * unit
        out.append(list(range(start, start + size)))
        start += size
    if start < n:  # a trailing partial unit joins the last run
        out[-1].extend(range(start, n))
    return out


def padded_tokens(prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> int:
    """The tokens of a micro-batch of these rows once padded (:meth:`TrainBatch.trimmed`):
    rows x (longest prompt + longest response)."""
    if not prompt_lengths:
        return 0
    return len(prompt_lengths) * (max(prompt_lengths) + max(response_lengths))


def token_budget_partitions(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    budget: int,
    *,
    unit: int = 1,
    reorder: bool = True,
) -> list[list[int]]:
    """Split row indices into micro-batches of at most ``budget`` padded tokens each
    (:func:`padded_tokens`: rows x (longest prompt + longest response), the size of the
    micro-batch's tensors after :meth:`TrainBatch.trimmed`), as few as this greedy finds.

    Rows go in blocks of ``unit`` consecutive rows that are never split (DPO pairs: 2; a
    trailing partial block is a block of its own). Blocks are taken longest first
    (``reorder``; by their longest prompt + response) or in their order, each added to the
    open micro-batch while that stays within ``budget``, else opening the next one.

    The count: in order (``reorder=False``), the fewest of any split into consecutive
    runs (a run's size only grows with its rows). Reordered, with ``unit`` 1: the fewest
    possible when every row has the same prompt length or the same response length (the
    size is then rows x the longest row, where longest-first is optimal); in general at
    most the fewest possible for half the budget, since a micro-batch opened by a row of
    ``w`` tokens takes every following row while rows x ``2w`` fit. Each micro-batch
    lists its rows in ascending order; micro-batches come longest first. Pure.

    A block that alone needs more than ``budget`` tokens gets a micro-batch of its own
    (over the budget: the budget is the configured maxima's, rows are rarely that long;
    verl fails the step instead).

    Raises:
        ValueError: the lengths differ in number.
    """
    n = len(prompt_lengths)
    if len(response_lengths) != n:
        raise ValueError(
            f"token_budget_partitions: {n} prompt lengths but {len(response_lengths)} "
            f"response lengths"
        )
    unit = max(1, unit)
    blocks = [list(range(i, min(i + unit, n))) for i in range(0, n, unit)]
    if reorder:
        blocks.sort(key=lambda b: (-max(prompt_lengths[i] + response_lengths[i] for i in b), b[0]))
    parts: list[list[int]] = []
    current: list[int] = []
    for block in blocks:
        alone = padded_tokens(
            [prompt_lengths[i] for i in block], [response_lengths[i] for i in block]
        )
        if alone > budget:  # a micro-batch of its own, over the budget
            if current:
                parts.append(sorted(current))
            parts.append(sorted(block))
            current = []
            continue
        grown = current + block
        if current and (
            padded_tokens([prompt_lengths[i] for i in grown], [response_lengths[i] for i in grown])
            > budget
        ):
            parts.append(sorted(current))
            grown = list(block)
        current = grown
    if current:
        parts.append(sorted(current))
    return parts
