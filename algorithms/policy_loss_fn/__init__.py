"""Policy loss functions (``from algorithms.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn``).

Registered: ``ppo``, ``decoupled_ppo``, ``sft``, ``opmd``, ``mix``, ``gspo``,
``cispo``, ``topr``, ``sppo``, ``rec``, ``dpo``, ``importance_sampling``, ``sapo``,
``sft_is``, ``sft_phi``, ``mix_chord``.
"""

from algorithms.policy_loss_fn.chord_policy_loss import (
    MIXCHORDPolicyLossFn,
    SFTISLossFn,
    SFTPhiLossFn,
    mu_schedule,
)
from algorithms.policy_loss_fn.cispo_policy_loss import CISPOPolicyLossFn
from algorithms.policy_loss_fn.decoupled_ppo_policy_loss import DecoupledPPOPolicyLossFn
from algorithms.policy_loss_fn.dpo_loss import DPOLossFn
from algorithms.policy_loss_fn.gspo_policy_loss import GSPOPolicyLossFn
from algorithms.policy_loss_fn.importance_sampling_policy_loss import ImportanceSamplingLossFn
from algorithms.policy_loss_fn.mix_policy_loss import MIXPolicyLossFn
from algorithms.policy_loss_fn.opmd_policy_loss import OPMDPolicyLossFn
from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
from algorithms.policy_loss_fn.rec_policy_loss import RECPolicyLossFn
from algorithms.policy_loss_fn.sapo_policy_loss import SAPOPolicyLossFn
from algorithms.policy_loss_fn.sft_loss import SFTLossFn
from algorithms.policy_loss_fn.sppo_policy_loss import SPPOPolicyLossFn
from algorithms.policy_loss_fn.topr_policy_loss import TOPRPolicyLossFn
from rftstream.training.loss_inputs import check_loss_inputs, loss_inputs_for

__all__ = [
    "CISPOPolicyLossFn",
    "DPOLossFn",
    "DecoupledPPOPolicyLossFn",
    "GSPOPolicyLossFn",
    "ImportanceSamplingLossFn",
    "MIXCHORDPolicyLossFn",
    "MIXPolicyLossFn",
    "OPMDPolicyLossFn",
    "POLICY_LOSS_FN",
    "PPOPolicyLossFn",
    "PolicyLossFn",
    "RECPolicyLossFn",
    "SAPOPolicyLossFn",
    "SFTISLossFn",
    "SFTLossFn",
    "SFTPhiLossFn",
    "SPPOPolicyLossFn",
    "TOPRPolicyLossFn",
    "check_loss_inputs",
    "loss_inputs_for",
    "mu_schedule",
]
