"""Every built-in preset resolves to exactly its components and resource flags."""

from __future__ import annotations

import pytest

from algorithms import ALGORITHM_TYPE, resolve_algorithm
from algorithms.advantage_fn import (
    ASYMREGroupAdvantage,
    GiGPOAdvantageFn,
    GRPOGroupedAdvantage,
    JSDAdvantage,
    NoAdvantageFn,
    OnPolicyDistillAdvantage,
    OPMDGroupAdvantage,
    PPOAdvantageFn,
    RECGroupedAdvantage,
    REINFORCEGroupAdvantage,
    REINFORCEPLUSPLUSAdvantageFn,
    RLOOGroupAdvantage,
    StepWiseGRPOAdvantageFn,
)
from algorithms.entropy_loss_fn import DefaultEntropyLossFn, DummyEntropyLossFn, MixEntropyLossFn
from algorithms.kl_fn import DummyKLFn, K2Fn
from algorithms.policy_loss_fn import (
    CISPOPolicyLossFn,
    DPOLossFn,
    GSPOPolicyLossFn,
    MIXCHORDPolicyLossFn,
    MIXPolicyLossFn,
    OPMDPolicyLossFn,
    PPOPolicyLossFn,
    RECPolicyLossFn,
    SAPOPolicyLossFn,
    SFTLossFn,
    SPPOPolicyLossFn,
    TOPRPolicyLossFn,
)
from algorithms.sample_strategy import DefaultSampleStrategy, MixSampleStrategy
from rftstream.config.schema import AlgorithmConfig

Default, Dummy, Mix = DefaultEntropyLossFn, DummyEntropyLossFn, MixEntropyLossFn
DS = DefaultSampleStrategy

# preset: (advantage, policy loss, kl penalty, kl loss, entropy, sample strategy,
#          use_critic, use_reference, compute_advantage_in_trainer, can_balance_batch)
EXPECTED = {
    "ppo": (PPOAdvantageFn, PPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS, True, True, True, True),
    "grpo": (GRPOGroupedAdvantage, PPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "grpo_verl": (GRPOGroupedAdvantage, PPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, True, True),
    "dapo": (GRPOGroupedAdvantage, PPOPolicyLossFn, DummyKLFn, DummyKLFn, Default, DS)
    + (False, False, False, True),
    "opmd": (OPMDGroupAdvantage, OPMDPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "asymre": (ASYMREGroupAdvantage, OPMDPolicyLossFn, DummyKLFn, DummyKLFn, Dummy, DS)
    + (False, False, False, True),
    "rloo": (RLOOGroupAdvantage, PPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "reinforceplusplus": (REINFORCEPLUSPLUSAdvantageFn, PPOPolicyLossFn, DummyKLFn, K2Fn)
    + (Default, DS, False, True, True, True),
    "gspo": (GRPOGroupedAdvantage, GSPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "cispo": (GRPOGroupedAdvantage, CISPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "topr": (REINFORCEGroupAdvantage, TOPRPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "sppo": (OPMDGroupAdvantage, SPPOPolicyLossFn, DummyKLFn, DummyKLFn, Dummy, DS)
    + (False, False, False, True),
    "rec": (RECGroupedAdvantage, RECPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "mix": (GRPOGroupedAdvantage, MIXPolicyLossFn, DummyKLFn, K2Fn, Mix, MixSampleStrategy)
    + (False, True, False, True),
    "sft": (NoAdvantageFn, SFTLossFn, DummyKLFn, DummyKLFn, Dummy, DS)
    + (False, False, False, True),
    "cpt": (NoAdvantageFn, SFTLossFn, DummyKLFn, DummyKLFn, Dummy, DS)
    + (False, False, False, True),
    "dpo": (NoAdvantageFn, DPOLossFn, DummyKLFn, K2Fn, Default, DS) + (False, True, False, False),
    "raft": (NoAdvantageFn, SFTLossFn, DummyKLFn, DummyKLFn, Dummy, DS)
    + (False, False, False, True),
    "multi_step_grpo": (StepWiseGRPOAdvantageFn, PPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "mix_chord": (GRPOGroupedAdvantage, MIXCHORDPolicyLossFn, DummyKLFn, K2Fn, Mix)
    + (MixSampleStrategy, False, True, False, True),
    "sapo": (GRPOGroupedAdvantage, SAPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "gigpo": (GiGPOAdvantageFn, PPOPolicyLossFn, DummyKLFn, K2Fn, Default, DS)
    + (False, True, False, True),
    "on_policy_distill": (OnPolicyDistillAdvantage, PPOPolicyLossFn, DummyKLFn, DummyKLFn, Dummy)
    + (DS, False, False, True, True),
    "jsd": (JSDAdvantage, PPOPolicyLossFn, DummyKLFn, DummyKLFn, Dummy, DS)
    + (False, False, True, True),
}


def test_the_table_covers_every_builtin_preset() -> None:
    builtin = {
        n
        for n in ALGORITHM_TYPE.names()
        if ALGORITHM_TYPE.get(n).__module__.startswith("algorithms.")
    }
    assert builtin == set(EXPECTED)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_resolves_to_exactly_its_components(preset: str) -> None:
    adv, loss, kl_pen, kl_loss, ent, strategy, critic, ref, in_trainer, balance = EXPECTED[preset]
    r = resolve_algorithm(AlgorithmConfig(algorithm_type=preset))
    # exact classes: a subclass (MixEntropyLossFn of DefaultEntropyLossFn) must not pass
    assert type(r.advantage_fn) is adv
    assert type(r.policy_loss_fn) is loss
    assert type(r.kl_penalty_fn) is kl_pen
    assert type(r.kl_loss_fn) is kl_loss
    assert type(r.entropy_loss_fn) is ent
    assert r.sample_strategy_cls is strategy
    assert (r.use_critic, r.use_reference, r.compute_advantage_in_trainer) == (
        critic,
        ref,
        in_trainer,
    )
    assert r.algorithm_type.can_balance_batch is balance
    # the advantage runs where its own compute_in_trainer() says, for every preset with one,
    # except grpo_verl, whose point is a group advantage computed in the trainer (Trinity's)
    if adv is not NoAdvantageFn and preset != "grpo_verl":
        assert adv.compute_in_trainer() is in_trainer
