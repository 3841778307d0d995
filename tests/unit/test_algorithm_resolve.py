"""resolve_algorithm: preset merge order, args merging, loss_agg_mode, error messages."""

from __future__ import annotations

import pytest
import torch

from algorithms import (
    ALGORITHM_TYPE,
    POLICY_LOSS_FN,
    AlgorithmType,
    PolicyLossFn,
    ResolvedAlgorithm,
    masked_loss,
    resolve_algorithm,
)
from algorithms.advantage_fn import GRPOGroupedAdvantage, OPMDGroupAdvantage
from algorithms.entropy_loss_fn import DefaultEntropyLossFn, MixEntropyLossFn
from algorithms.kl_fn import DummyKLFn, K2Fn
from algorithms.policy_loss_fn import MIXPolicyLossFn, OPMDPolicyLossFn, PPOPolicyLossFn
from algorithms.sample_strategy import MixSampleStrategy
from rftstream.config.schema import AlgorithmConfig, BufferConfig, StorageConfig, TrainerInput
from rftstream.errors import ConfigError


@POLICY_LOSS_FN.register_module("test_seed_opmd")
class SeedOPMDPolicyLossFn(PolicyLossFn):
    """Verbatim guide code: __init__ takes only tau, default_args also names loss_agg_mode."""

    def __init__(self, tau: float = 1.0) -> None:
        self.tau = tau

    def __call__(self, logprob, action_mask, advantages, **kwargs):  # type: ignore[override]
        pg_losses = -advantages * logprob
        opmd_loss = masked_loss(pg_losses, action_mask, loss_agg_mode=self.loss_agg_mode)
        opmd_loss = opmd_loss / (1.0 + self.tau)
        return opmd_loss, {"opmd_loss": opmd_loss.detach().item()}

    @classmethod
    def default_args(cls) -> dict:
        return {"tau": 1.0, "loss_agg_mode": "token-mean"}


@ALGORITHM_TYPE.register_module("test_custom_algo")
class CustomAlgorithm(AlgorithmType):
    use_critic = False
    use_reference = False

    @classmethod
    def default_config(cls) -> dict:
        return {
            "repeat_times": 4,
            "policy_loss_fn": "test_seed_opmd",
            "advantage_fn": "opmd",
            "advantage_fn_args": {"tau": 0.5, "opmd_baseline": "logavgexp"},
            "loss_agg_mode": "seq-mean-token-mean",
        }


def test_grpo_preset():
    r = resolve_algorithm(AlgorithmConfig(algorithm_type="grpo"))
    assert isinstance(r, ResolvedAlgorithm)
    assert r.name == "grpo" and r.algorithm_type is ALGORITHM_TYPE.get("grpo")
    assert r.repeat_times == 2
    assert isinstance(r.advantage_fn, GRPOGroupedAdvantage)
    assert isinstance(r.policy_loss_fn, PPOPolicyLossFn)
    assert isinstance(r.kl_penalty_fn, DummyKLFn)
    assert isinstance(r.kl_loss_fn, K2Fn)
    assert isinstance(r.entropy_loss_fn, DefaultEntropyLossFn)
    assert r.sample_strategy_name == "default" and r.sample_strategy_args == {}
    assert r.use_reference and not r.use_critic and not r.compute_advantage_in_trainer
    # every field of the merged config is filled
    for field in AlgorithmConfig.__struct_fields__:
        assert getattr(r.config, field) is not None, field
    assert r.config.policy_loss_fn_args == {
        "clip_range": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "enable_sequence_masking": False,
        "delta_sequence_masking": 0.1,
        "fallback_to_policy_gradient": False,
    }


def test_merge_order_global_then_preset_then_user():
    mix = resolve_algorithm(AlgorithmConfig(algorithm_type="mix"))
    # preset sets these
    assert mix.repeat_times == 8 and mix.sample_strategy_name == "mix"
    assert isinstance(mix.policy_loss_fn, MIXPolicyLossFn)
    # preset is silent: global defaults fill in
    assert type(mix.kl_loss_fn) is K2Fn and type(mix.kl_penalty_fn) is DummyKLFn
    # the preset names the mix entropy (a DefaultEntropyLossFn subclass: check the exact class)
    assert type(mix.entropy_loss_fn) is MixEntropyLossFn
    assert type(resolve_algorithm(AlgorithmConfig(algorithm_type="grpo")).entropy_loss_fn) is (
        DefaultEntropyLossFn
    )
    # user keys beat the preset
    user = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo", repeat_times=8, policy_loss_fn="opmd", kl_loss_fn="none"
        )
    )
    assert user.repeat_times == 8
    assert isinstance(user.policy_loss_fn, OPMDPolicyLossFn)
    assert isinstance(user.kl_loss_fn, DummyKLFn)
    assert isinstance(user.advantage_fn, GRPOGroupedAdvantage)


def test_args_merged_over_default_args():
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn_args={"clip_range_high": 0.28},
            advantage_fn_args={"std_threshold": 0.0},
            kl_loss_fn_args={"kl_coef": 0.01},
        )
    )
    pl = r.policy_loss_fn
    assert (pl.clip_range_low, pl.clip_range_high, pl.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert r.advantage_fn.std_threshold == 0.0 and r.advantage_fn.epsilon == 1e-6
    assert r.kl_loss_fn.kl_coef == 0.01 and r.kl_loss_fn.adaptive is False
    assert r.config.kl_loss_fn_args == {
        "adaptive": False,
        "kl_coef": 0.01,
        "loss_agg_mode": "token-mean",
    }


def test_guide_opmd_yaml():
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="opmd",
            repeat_times=8,
            advantage_fn_args={"opmd_baseline": "logavgexp", "tau": 0.99},
            policy_loss_fn_args={"tau": 0.99},
        )
    )
    assert r.repeat_times == 8
    assert isinstance(r.advantage_fn, OPMDGroupAdvantage)
    assert (r.advantage_fn.opmd_baseline, r.advantage_fn.tau) == ("logavgexp", 0.99)
    assert r.policy_loss_fn.tau == 0.99


def test_loss_agg_mode_goes_to_policy_kl_entropy_unless_overridden():
    r = resolve_algorithm(
        AlgorithmConfig(algorithm_type="grpo", loss_agg_mode="seq-mean-token-sum")
    )
    for fn in (r.policy_loss_fn, r.kl_loss_fn, r.kl_penalty_fn, r.entropy_loss_fn):
        assert fn.loss_agg_mode == "seq-mean-token-sum"
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            loss_agg_mode="seq-mean-token-sum",
            policy_loss_fn_args={"loss_agg_mode": "seq-mean-token-mean"},
        )
    )
    assert r.policy_loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert r.kl_loss_fn.loss_agg_mode == "seq-mean-token-sum"
    mix = resolve_algorithm(
        AlgorithmConfig(algorithm_type="mix", loss_agg_mode="seq-mean-token-mean")
    )
    assert mix.policy_loss_fn.grpo_loss_fn.loss_agg_mode == "seq-mean-token-mean"


def test_seed_style_class_without_loss_agg_mode_parameter():
    r = resolve_algorithm(
        AlgorithmConfig(algorithm_type="test_custom_algo", loss_agg_mode="seq-mean-token-sum-norm")
    )
    assert r.repeat_times == 4 and not r.use_reference
    fn = r.policy_loss_fn
    assert isinstance(fn, SeedOPMDPolicyLossFn)
    assert fn.loss_agg_mode == "seq-mean-token-sum-norm" and fn.tau == 1.0
    lp = torch.tensor([[-1.0, -2.0]])
    loss, _ = fn(lp, torch.tensor([[True, True]]), torch.tensor([[1.0, 1.0]]))
    assert loss.item() == pytest.approx((1.0 + 2.0) / 2 / 2)


def test_preset_args_and_loss_agg_mode():
    r = resolve_algorithm(AlgorithmConfig(algorithm_type="test_custom_algo"))
    assert (r.advantage_fn.tau, r.advantage_fn.opmd_baseline) == (0.5, "logavgexp")
    assert r.policy_loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert r.config.loss_agg_mode == "seq-mean-token-mean"
    r = resolve_algorithm(
        AlgorithmConfig(algorithm_type="test_custom_algo", advantage_fn_args={"tau": 2.0})
    )
    assert (r.advantage_fn.tau, r.advantage_fn.opmd_baseline) == (2.0, "logavgexp")


def test_preset_with_unknown_key():
    @ALGORITHM_TYPE.register_module("test_bad_preset")
    class Bad(AlgorithmType):
        @classmethod
        def default_config(cls):
            return {"policy_los_fn": "ppo"}

    with pytest.raises(ConfigError, match="policy_los_fn"):
        resolve_algorithm(AlgorithmConfig(algorithm_type="test_bad_preset"))


def test_dotted_path_name():
    r = resolve_algorithm(
        AlgorithmConfig(
            algorithm_type="grpo",
            policy_loss_fn="algorithms.policy_loss_fn.opmd_policy_loss.OPMDPolicyLossFn",
        )
    )
    assert isinstance(r.policy_loss_fn, OPMDPolicyLossFn)


def test_unknown_names():
    with pytest.raises(ConfigError) as info:
        resolve_algorithm(AlgorithmConfig(algorithm_type="grpo", policy_loss_fn="ppo2"))
    err = info.value
    assert err.key_path == "algorithm.policy_loss_fn"
    assert "unknown policy_loss_fn 'ppo2'" in str(err)
    assert "registered: " in str(err)
    listed = str(err).split("registered: ")[1].split(" (")[0].split(", ")
    assert {"mix", "opmd", "ppo", "sft", "gspo", "dpo"} <= set(listed)
    with pytest.raises(ConfigError, match="algorithm.kl_loss_fn.*'k9'.*k1, k2, k3"):
        resolve_algorithm(AlgorithmConfig(algorithm_type="grpo", kl_loss_fn="k9"))
    with pytest.raises(ConfigError) as info:
        resolve_algorithm(AlgorithmConfig(algorithm_type="grpoo"))
    assert info.value.key_path == "algorithm.algorithm_type"
    assert "grpo" in str(info.value) and "opmd" in str(info.value)
    with pytest.raises(ConfigError, match="not a AdvantageFn subclass"):
        resolve_algorithm(
            AlgorithmConfig(algorithm_type="grpo", advantage_fn="algorithms.kl_fn.K2Fn")
        )


def test_bad_args():
    with pytest.raises(ConfigError) as info:
        resolve_algorithm(
            AlgorithmConfig(algorithm_type="grpo", policy_loss_fn_args={"clip_rnage": 0.3})
        )
    err = info.value
    assert err.key_path == "algorithm.policy_loss_fn_args"
    assert "PPOPolicyLossFn does not accept argument 'clip_rnage'" in str(err)
    assert "clip_range" in str(err)  # lists the accepted ones
    # **kwargs constructors: the TypeError of the base class is reported
    with pytest.raises(ConfigError, match=r"algorithm.advantage_fn_args.*bogus"):
        resolve_algorithm(AlgorithmConfig(algorithm_type="grpo", advantage_fn_args={"bogus": 1}))
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss_fn_args.*clip_ratio_c"):
        resolve_algorithm(
            AlgorithmConfig(algorithm_type="grpo", policy_loss_fn_args={"clip_ratio_c": 0.5})
        )
    with pytest.raises(ConfigError, match=r"algorithm.kl_loss_fn_args.*target_kl"):
        resolve_algorithm(
            AlgorithmConfig(algorithm_type="grpo", kl_loss_fn_args={"adaptive": True})
        )
    with pytest.raises(ConfigError) as info:
        resolve_algorithm(AlgorithmConfig(algorithm_type="grpo", loss_agg_mode="mean"))
    assert info.value.key_path == "algorithm.loss_agg_mode"
    with pytest.raises(ConfigError, match="algorithm.repeat_times"):
        resolve_algorithm(AlgorithmConfig(algorithm_type="grpo", repeat_times=0))


def test_presets_flags():
    ppo = resolve_algorithm(AlgorithmConfig(algorithm_type="ppo"))
    assert ppo.use_critic and ppo.compute_advantage_in_trainer and ppo.repeat_times == 1
    assert ppo.advantage_fn.compute_in_trainer()
    sft = resolve_algorithm(AlgorithmConfig(algorithm_type="sft"))
    assert not sft.use_reference and sft.sample_strategy_name == "default"
    assert sft.algorithm_type.schema == "sft"
    assert ALGORITHM_TYPE.get("opmd").default_config()["kl_loss_fn"] == "k2"


def test_mix_with_buffer_and_loss_inputs():
    seed_args = {
        "mu": 0.1,
        "clip_range": 0.2,
        "use_token_level_loss_in_sft": False,
        "use_dynamic_bsz": False,
        "repeat_times": 8,
        "ppo_mini_batch_size": 256,
        "ppo_micro_batch_size_per_gpu": 4,
        "ngpus_trainer": 4,
        "train_batch_size_expert": 64,
        "train_batch_size_usual": 192,
    }
    cfg = AlgorithmConfig(
        algorithm_type="mix",
        sample_strategy_args={"expert_data_ratio": 0.25},
        policy_loss_fn_args=seed_args,
    )
    with pytest.raises(ConfigError) as info:
        resolve_algorithm(cfg, BufferConfig(batch_size=4))
    assert info.value.key_path == "buffer.trainer_input.auxiliary_buffers.sft_dataset"
    buf = BufferConfig(
        batch_size=4,
        trainer_input=TrainerInput(
            auxiliary_buffers={"sft_dataset": StorageConfig(path="x.jsonl")}
        ),
    )
    r = resolve_algorithm(cfg, buf)
    assert r.sample_strategy_args == {"expert_data_ratio": 0.25, "sft_dataset_name": "sft_dataset"}
    assert r.policy_loss_fn.train_batch_size_usual == 192
    base = {"logprob", "old_logprob", "action_mask", "advantages"}
    assert r.check_loss_inputs(base)[-1] == "expert_mask"  # provided by the mix sample strategy
    with pytest.raises(ConfigError, match="needs field 'expert_mask'"):
        resolve_algorithm(
            AlgorithmConfig(algorithm_type="grpo", policy_loss_fn="mix")
        ).check_loss_inputs(base)
    ss = r.create_sample_strategy(buf, source=None)
    assert isinstance(ss, MixSampleStrategy)
    assert (ss.usual_batch_size, ss.expert_batch_size) == (24, 8)  # 4 tasks * 8 repeats
