"""GiGPO (Group-in-Group Policy Optimization, arXiv:2505.10978) for multi-step agents.

As Trinity-RFT's ``gigpo_advantage.py``: ``A = A_E(episode) + omega * A_S(step)``.

* Episode level: per task, each rollout (``eid.rid``) has the return
  ``sum(r_t)`` of its per-step rewards; the rollouts of a task are
  normalised against each other (``(x - mean) / (denom + epsilon)`` with
  ``denom`` the unbiased std for ``fnorm: std``, 1 for ``fnorm: none``).
* Step level: every step carries ``info[env_state_hash_key]`` (the
  environment state it acted in); the steps of the whole call that share a
  state form an anchor group, normalised the same way on their discounted
  returns ``R_t = sum_k gamma^(k-t) r_k``. Steps without a state hash, and
  anchor groups of one step, get ``A_S = 0``.
* Per-step rewards come from ``info[step_reward_key]``; a rollout with no
  step carrying that key has a sparse reward: its last step (largest
  ``eid.step``) gets ``exp.reward``, the others 0.

Runs in the experience pipeline (one NATS message carries a task's whole
group). rftstream difference: a task with a single rollout gets ``A_E = 0``
(no baseline), as with ``grpo``; Trinity-RFT gives it ``return / (1 + epsilon)``.
Pure tensor/Python code, no I/O.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms.advantage_fn.advantage_fn import (
    ADVANTAGE_FN,
    AdvantageFn,
    _aggregate_group_metrics,
)
from rftstream.experience import Experience, group_by

FNORMS: tuple[str, ...] = ("std", "none")


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """``R_t = sum_{k >= t} gamma^(k - t) r_k`` for every ``t``."""
    out = [0.0] * len(rewards)
    running = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        running = rewards[i] + gamma * running
        out[i] = running
    return out


@ADVANTAGE_FN.register_module("gigpo")
class GiGPOAdvantageFn(AdvantageFn):
    """Hierarchical critic-free advantages (see the module docstring).

    Arguments (Trinity-RFT's): ``omega`` (weight of the step level),
    ``gamma`` (discount of the step-level returns), ``fnorm`` (``std`` or
    ``none``; ValueError otherwise), ``epsilon``, ``step_reward_key``,
    ``env_state_hash_key``. Raises ValueError naming an experience whose
    sparse reward is None.

    Metrics: ``gigpo/episode_reward_mean`` / ``gigpo/episode_reward_std``
    (averaged over tasks), ``gigpo/anchor_groups_total``,
    ``gigpo/anchor_groups_size_gt1``, ``gigpo/anchor_group_hit_ratio``,
    ``gigpo/mean_abs_A_E``, ``gigpo/mean_abs_A_S``, ``experience_count`` and, as every
    group advantage, ``group_count`` (tasks).
    """

    def __init__(
        self,
        omega: float = 1.0,
        gamma: float = 1.0,
        fnorm: str = "none",
        epsilon: float = 1e-6,
        step_reward_key: str = "step_reward",
        env_state_hash_key: str = "env_state_hash",
    ) -> None:
        super().__init__()
        if fnorm not in FNORMS:
            raise ValueError(f"fnorm must be one of {list(FNORMS)}, got {fnorm!r}")
        self.omega = float(omega)
        self.gamma = float(gamma)
        self.fnorm = fnorm
        self.epsilon = float(epsilon)
        self.step_reward_key = step_reward_key
        self.env_state_hash_key = env_state_hash_key

    def _normalise(self, values: list[float]) -> tuple[list[float], float, float]:
        """``(scores, mean, denom)``; a single value scores 0 (no baseline)."""
        x = torch.tensor(values, dtype=torch.float64)
        if len(values) < 2:
            return [0.0] * len(values), float(x.mean()) if values else 0.0, 0.0
        mean = x.mean()
        denom = x.std() if self.fnorm == "std" else torch.tensor(1.0, dtype=torch.float64)
        return ((x - mean) / (denom + self.epsilon)).tolist(), float(mean), float(denom)

    def _step_rewards(self, steps: list[Experience]) -> list[float]:
        if any(self.step_reward_key in (e.info or {}) for e in steps):
            return [float((e.info or {}).get(self.step_reward_key, 0.0)) for e in steps]
        last = steps[-1]
        if last.reward is None:
            raise ValueError(
                f"experience {last.eid.uid} has reward None and its rollout has no "
                f"info[{self.step_reward_key!r}]; GiGPO needs a reward"
            )
        return [0.0] * (len(steps) - 1) + [float(last.reward)]

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Set ``advantages``/``returns`` on every experience; returns them (same order) and metrics."""
        if not exps:
            return [], {}
        run_adv: dict[str, float] = {}
        step_return: dict[int, float] = {}
        episode_metrics: list[dict] = []
        for task_exps in group_by(exps, "task").values():
            run_ids: list[str] = []
            episode_returns: list[float] = []
            for run_id, run_exps in group_by(task_exps, "run").items():
                steps = sorted(run_exps, key=lambda e: e.eid.step)
                rewards = self._step_rewards(steps)
                for exp, ret in zip(steps, discounted_returns(rewards, self.gamma), strict=True):
                    step_return[id(exp)] = ret
                run_ids.append(run_id)
                episode_returns.append(sum(rewards))
            scores, mean, denom = self._normalise(episode_returns)
            episode_metrics.append({"episode_reward_mean": mean, "episode_reward_std": denom})
            run_adv.update(zip(run_ids, scores, strict=True))

        anchors: dict[str, list[Experience]] = {}
        for exp in exps:
            state = (exp.info or {}).get(self.env_state_hash_key)
            if state is not None:
                anchors.setdefault(str(state), []).append(exp)
        step_adv: dict[int, float] = {}
        hits = 0
        for members in anchors.values():
            if len(members) < 2:
                continue
            hits += 1
            scores, _, _ = self._normalise([step_return[id(e)] for e in members])
            step_adv.update(zip((id(e) for e in members), scores, strict=True))

        abs_e: list[float] = []
        abs_s: list[float] = []
        with torch.no_grad():
            for exp in exps:
                a_e = run_adv[exp.eid.rid]
                a_s = step_adv.get(id(exp), 0.0)
                adv = exp.action_mask.to(torch.float32) * float(a_e + self.omega * a_s)
                exp.advantages = adv
                exp.returns = adv.clone()
                abs_e.append(abs(a_e))
                abs_s.append(abs(a_s))
        metrics = {f"gigpo/{k}": v for k, v in _aggregate_group_metrics(episode_metrics).items()}
        metrics.update(
            {
                "gigpo/anchor_groups_total": float(len(anchors)),
                "gigpo/anchor_groups_size_gt1": float(hits),
                "gigpo/anchor_group_hit_ratio": hits / len(anchors) if anchors else 0.0,
                "gigpo/mean_abs_A_E": sum(abs_e) / len(abs_e),
                "gigpo/mean_abs_A_S": sum(abs_s) / len(abs_s),
                "experience_count": float(len(exps)),
                "group_count": float(len(episode_metrics)),
            }
        )
        return exps, metrics

    def __call__(self, exps: list[Experience], **kwargs: Any) -> tuple[list[Experience], dict]:
        return self.process(exps)

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return False

    @classmethod
    def default_args(cls) -> dict:
        return {
            "omega": 1.0,
            "gamma": 1.0,
            "fnorm": "none",
            "epsilon": 1e-6,
            "step_reward_key": "step_reward",
            "env_state_hash_key": "env_state_hash",
        }
