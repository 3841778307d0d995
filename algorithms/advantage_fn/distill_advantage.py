"""Distillation advantages from a teacher's log-probs: ``on_policy_distill`` and ``jsd``.

As Trinity-RFT's ``on_policy_distill_advantage.py`` / ``jsd_advantage.py``:
the workflow stores the teacher's log-prob of every response token in
``exp.info["teacher_logprobs"]`` (a list of floats or a 1-D tensor, one per
response token, the same place Trinity-RFT's workflows put them); the advantage
of each token says how much more likely the teacher finds it than the student.

The student's log-probs are ``exp.logprobs``, the rollout engine's sampling
log-probs (Tinker's definition). Trinity-RFT uses the trainer's recomputed
``old_log_probs`` instead; the two agree whenever the rollout engine and the
trainer compute the same probabilities (on-policy, same weights). Computed in
the trainer (``compute_in_trainer() -> True``), as in Trinity-RFT. CPU tensor
code, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import ADVANTAGE_FN, AdvantageFn
from rftstream.experience import Experience

TEACHER_LOGPROBS_KEY = "teacher_logprobs"


def teacher_logprobs(exp: Experience) -> torch.Tensor:
    """``exp.info["teacher_logprobs"]`` as a float32 tensor of response length.

    Raises ValueError naming the experience when the key is missing or its
    length is not the response length.
    """
    raw = (exp.info or {}).get(TEACHER_LOGPROBS_KEY)
    if raw is None:
        raise ValueError(
            f"experience {exp.eid.uid} has no info[{TEACHER_LOGPROBS_KEY!r}]; a distillation "
            f"advantage needs the teacher's log-prob of every response token (the workflow "
            f"sets it)"
        )
    values = torch.as_tensor(raw, dtype=torch.float32).reshape(-1)
    if values.numel() != exp.response_length:
        raise ValueError(
            f"experience {exp.eid.uid}: info[{TEACHER_LOGPROBS_KEY!r}] has {values.numel()} "
            f"values for {exp.response_length} response tokens"
        )
    return values


def student_logprobs(exp: Experience) -> torch.Tensor:
    """``exp.logprobs`` as float32; ValueError naming the experience when they are missing."""
    if exp.logprobs is None or exp.logprobs.numel() != exp.response_length:
        raise ValueError(
            f"experience {exp.eid.uid} has no rollout logprobs for its "
            f"{exp.response_length} response tokens; a distillation advantage needs them"
        )
    return exp.logprobs.to(torch.float32)


def _row_stats(per_row: list[float]) -> tuple[float, float]:
    """(mean, unbiased std; 0 for fewer than two rows) of per-row sums."""
    if not per_row:
        return 0.0, 0.0
    mean = sum(per_row) / len(per_row)
    if len(per_row) < 2:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in per_row) / (len(per_row) - 1)
    return mean, math.sqrt(var)


def _set(exp: Experience, advantages: torch.Tensor) -> None:
    mask = exp.action_mask.to(torch.float32)
    exp.advantages = (advantages * mask).contiguous()
    exp.returns = exp.advantages.clone()


@ADVANTAGE_FN.register_module("on_policy_distill")
class OnPolicyDistillAdvantage(AdvantageFn):
    """``advantages = kl_coef * (teacher_logprobs - student_logprobs) * action_mask``.

    Metrics: ``kl/mean`` and ``kl/std`` (over rows of the masked per-row sum of
    ``student - teacher``), ``advantages/mean`` (mean over rows of the per-row
    advantage sum). Raises ValueError naming an experience without teacher or
    student log-probs.
    """

    def __init__(self, kl_coef: float = 1.0) -> None:
        super().__init__()
        self.kl_coef = float(kl_coef)

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        kl_rows: list[float] = []
        adv_rows: list[float] = []
        with torch.no_grad():
            for exp in exps:
                teacher = teacher_logprobs(exp)
                student = student_logprobs(exp)
                _set(exp, self.kl_coef * (teacher - student))
                mask = exp.action_mask.to(torch.float32)
                kl_rows.append(float(((student - teacher) * mask).sum()))
                adv_rows.append(float(exp.advantages.sum()))
        kl_mean, kl_std = _row_stats(kl_rows)
        return exps, {
            "kl/mean": kl_mean,
            "kl/std": kl_std,
            "advantages/mean": _row_stats(adv_rows)[0],
        }

    @classmethod
    def default_args(cls) -> dict:
        return {"kl_coef": 1.0}


def jsd_per_token(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalised Jensen-Shannon term of each token, in log space.

    ``beta = 0``: ``student - teacher`` (KL(student || teacher) estimate);
    ``beta = 1``: ``teacher - student``; otherwise, with the mixture
    ``log m = log((1 - beta) * p_s + beta * p_t)``,
    ``beta * (teacher - log m) + (1 - beta) * (student - log m)``.
    """
    if beta == 0:
        return student - teacher
    if beta == 1:
        return teacher - student
    log_m = torch.logsumexp(
        torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0
    )
    return beta * (teacher - log_m) + (1 - beta) * (student - log_m)


@ADVANTAGE_FN.register_module("jsd")
class JSDAdvantage(AdvantageFn):
    """``advantages = -kl_coef * jsd_per_token(student / T, teacher / T, lambda_coef) * action_mask``.

    ``lambda_coef`` (beta) must be in ``[0, 1]`` and ``temperature`` > 0
    (ValueError otherwise). ``chunk_size`` is accepted for Trinity-RFT configs
    and has no effect (each experience is computed on its own; the result is
    the same). Metrics: ``jsd/mean``, ``jsd/std`` (over rows of the masked
    per-row JSD sum), ``advantages/mean``.
    """

    def __init__(
        self,
        lambda_coef: float = 0.5,
        kl_coef: float = 1.0,
        temperature: float = 1.0,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= lambda_coef <= 1.0:
            raise ValueError(f"lambda_coef must be in [0, 1], got {lambda_coef}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.lambda_coef = float(lambda_coef)
        self.kl_coef = float(kl_coef)
        self.temperature = float(temperature)
        self.chunk_size = chunk_size

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        jsd_rows: list[float] = []
        adv_rows: list[float] = []
        with torch.no_grad():
            for exp in exps:
                teacher = teacher_logprobs(exp) / self.temperature
                student = student_logprobs(exp) / self.temperature
                jsd = jsd_per_token(student, teacher, self.lambda_coef)
                mask = exp.action_mask.to(torch.float32)
                jsd = torch.where(mask != 0, jsd, torch.zeros_like(jsd))
                _set(exp, -self.kl_coef * jsd)
                jsd_rows.append(float(jsd.sum()))
                adv_rows.append(float(exp.advantages.sum()))
        jsd_mean, jsd_std = _row_stats(jsd_rows)
        return exps, {
            "jsd/mean": jsd_mean,
            "jsd/std": jsd_std,
            "advantages/mean": _row_stats(adv_rows)[0],
        }

    @classmethod
    def default_args(cls) -> dict:
        return {"lambda_coef": 0.5, "kl_coef": 1.0, "temperature": 1.0, "chunk_size": None}
