"""Policy loss functions (``from algorithms.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn``).

Registered: ``ppo``, ``sft``, ``opmd``, ``mix``.
"""

from algorithms.policy_loss_fn.mix_policy_loss import MIXPolicyLossFn
from algorithms.policy_loss_fn.opmd_policy_loss import OPMDPolicyLossFn
from algorithms.policy_loss_fn.policy_loss_fn import (
    POLICY_LOSS_FN,
    PolicyLossFn,
    check_loss_inputs,
    loss_inputs_for,
)
from algorithms.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
from algorithms.policy_loss_fn.sft_loss import SFTLossFn

__all__ = [
    "MIXPolicyLossFn",
    "OPMDPolicyLossFn",
    "POLICY_LOSS_FN",
    "PPOPolicyLossFn",
    "PolicyLossFn",
    "SFTLossFn",
    "check_loss_inputs",
    "loss_inputs_for",
]
