"""Advantage functions (``from algorithms.advantage_fn import ADVANTAGE_FN, GroupAdvantage``).

Registered (Trinity-RFT names): ``grpo``, ``opmd``, ``rloo``, ``reinforce``,
``asymre``, ``rec`` (group advantages) and ``step_wise_grpo`` (multi-step
GRPO) and ``gigpo`` (multi-step, anchor states), which run in the experience
pipeline; ``ppo`` (GAE),
``reinforceplusplus``, ``remax``, the distillation advantages
``on_policy_distill`` and ``jsd`` (teacher log-probs in
``info["teacher_logprobs"]``) and the entropy-guided ``clipb`` / ``clipv``
(per-token entropies from the trainer's no-grad pass), which run in the trainer
(``compute_in_trainer() -> True``); and ``none``.
"""

from algorithms.advantage_fn.advantage_fn import (
    ADVANTAGE_FN,
    AdvantageFn,
    GroupAdvantage,
    NoAdvantageFn,
)
from algorithms.advantage_fn.asymre_advantage import ASYMREGroupAdvantage
from algorithms.advantage_fn.distill_advantage import JSDAdvantage, OnPolicyDistillAdvantage
from algorithms.advantage_fn.entropy_clip_advantage import ClipBAdvantageFn, ClipVAdvantageFn
from algorithms.advantage_fn.gigpo_advantage import GiGPOAdvantageFn
from algorithms.advantage_fn.grpo_advantage import (
    GRPOGroupedAdvantage,
    REINFORCEGroupAdvantage,
    RLOOGroupAdvantage,
)
from algorithms.advantage_fn.multi_step_grpo_advantage import StepWiseGRPOAdvantageFn
from algorithms.advantage_fn.opmd_advantage import OPMDGroupAdvantage
from algorithms.advantage_fn.ppo_advantage import PPOAdvantageFn, compute_gae_advantage_return
from algorithms.advantage_fn.rec_advantage import RECGroupedAdvantage
from algorithms.advantage_fn.reinforce_plus_plus_advantage import REINFORCEPLUSPLUSAdvantageFn
from algorithms.advantage_fn.remax_advantage import REMAXAdvantageFn
from rftstream.training.loss_inputs import TRAINER_ADVANTAGE_INPUTS

__all__ = [
    "ADVANTAGE_FN",
    "ASYMREGroupAdvantage",
    "AdvantageFn",
    "ClipBAdvantageFn",
    "ClipVAdvantageFn",
    "GRPOGroupedAdvantage",
    "GiGPOAdvantageFn",
    "GroupAdvantage",
    "JSDAdvantage",
    "NoAdvantageFn",
    "OPMDGroupAdvantage",
    "OnPolicyDistillAdvantage",
    "PPOAdvantageFn",
    "RECGroupedAdvantage",
    "REINFORCEGroupAdvantage",
    "REINFORCEPLUSPLUSAdvantageFn",
    "REMAXAdvantageFn",
    "RLOOGroupAdvantage",
    "StepWiseGRPOAdvantageFn",
    "TRAINER_ADVANTAGE_INPUTS",
    "compute_gae_advantage_return",
]
