"""A loss gets only fields something provides: the config-time check through prepare_run.

``expert_mask`` and every other custom field exist only where the sample
strategy declares them (its ``custom_fields``, or, Trinity-RFT style, the
``CustomField(...)`` it gathers its batch with); a loss or entropy fn naming a
field nothing provides fails in ``prepare_run`` with the class and the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from algorithms import (
    POLICY_LOSS_FN,
    SAMPLE_STRATEGY,
    CustomField,
    PolicyLossFn,
)
from algorithms.sample_strategy import DefaultSampleStrategy, SampleStrategy
from rftstream.config import config_from_dict
from rftstream.errors import ConfigError
from rftstream.runtime import prepare_run
from rftstream.training.batch import LOSS_TENSORS, trainer_tensors
from tests.integration._util import small_config


class WeightedLoss(PolicyLossFn):
    """Needs a custom per-row field ``row_weight``."""

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        action_mask: torch.Tensor,
        row_weight: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        return (logprob.sum(-1) * row_weight).mean(), {}


class WeightStrategy(DefaultSampleStrategy):
    """Declares ``row_weight`` the rftstream way: a class-level CustomField."""

    custom_fields: ClassVar[tuple[CustomField, ...]] = (
        CustomField("w", "row_weight", torch.float32),
    )


class TrinityStyleStrategy(SampleStrategy):
    """Declares ``row_weight`` the Trinity-RFT way: where it gathers the batch."""

    async def sample(self, step: int) -> tuple[list, dict, list]:
        from rftstream.experience import Experiences

        exps = await self.source.read(4)  # type: ignore[union-attr]
        batch = Experiences.gather_experiences(
            experiences=exps,
            pad_token_id=0,
            custom_fields=[
                CustomField(
                    source_field="w", destination_field="row_weight", data_type=torch.float32
                )
            ],
        )
        return batch, {}, []


class RefLoss(PolicyLossFn):
    """Needs ``ref_logprob``."""

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        ref_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict]:
        return (logprob - ref_logprob).sum(), {}


class RefFieldStrategy(DefaultSampleStrategy):
    """Declares a custom field named ``ref_logprob``."""

    custom_fields: ClassVar[tuple[CustomField, ...]] = (
        CustomField("r", "ref_logprob", torch.float32),
    )


class OtherFieldStrategy(SampleStrategy):
    """Declares a field, but not ``row_weight``."""

    async def sample(self, step: int) -> tuple[list, dict, list]:
        fields = [CustomField("w", "something_else", torch.float32)]
        return [], {"n": len(fields)}, []


@pytest.fixture
def registered() -> None:
    POLICY_LOSS_FN.register_module("weighted_loss")(WeightedLoss)
    SAMPLE_STRATEGY.register_module("weight_strategy")(WeightStrategy)
    SAMPLE_STRATEGY.register_module("trinity_style")(TrinityStyleStrategy)
    SAMPLE_STRATEGY.register_module("other_field")(OtherFieldStrategy)
    POLICY_LOSS_FN.register_module("ref_loss")(RefLoss)
    SAMPLE_STRATEGY.register_module("ref_field")(RefFieldStrategy)


def _cfg(tmp_path: Path, tiny_model_path: str, **algo: Any) -> Any:
    data = small_config(tmp_path, tiny_model_path)
    data["algorithm"].update(algo)
    return config_from_dict(data)


def test_expert_mask_is_not_always_available() -> None:
    assert "expert_mask" not in LOSS_TENSORS


def test_trainer_tensors() -> None:
    always = {
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

    class Algo:
        def __init__(self, use_critic: bool) -> None:
            self.use_critic = use_critic

    assert trainer_tensors(Algo(False)) == always
    assert trainer_tensors(Algo(True)) == always | {"values"}


def test_no_reference_model_no_ref_logprob_whoever_names_it(
    tmp_path: Path, tiny_model_path: str, registered: None
) -> None:
    # asymre has no reference model; grpo has one
    assert "ref_logprob" in prepare_run(
        _cfg(tmp_path, tiny_model_path, policy_loss_fn="ref_loss")
    ).algorithm.check_loss_inputs(set(LOSS_TENSORS))
    for strategy in ("default", "ref_field"):
        with pytest.raises(ConfigError) as ei:
            prepare_run(
                _cfg(
                    tmp_path,
                    tiny_model_path,
                    algorithm_type="asymre",
                    policy_loss_fn="ref_loss",
                    sample_strategy=strategy,
                )
            )
        assert ei.value.key_path == "algorithm.policy_loss_fn"
        assert "RefLoss" in str(ei.value) and "'ref_logprob'" in str(ei.value)


def test_mix_loss_without_the_mix_strategy_fails_at_config_time(
    tmp_path: Path, tiny_model_path: str
) -> None:
    # grpo's default sample strategy provides no expert_mask
    with pytest.raises(ConfigError) as ei:
        prepare_run(_cfg(tmp_path, tiny_model_path, policy_loss_fn="mix"))
    assert ei.value.key_path == "algorithm.policy_loss_fn"
    msg = str(ei.value)
    assert "MIXPolicyLossFn" in msg and "'expert_mask'" in msg


def test_mix_loss_with_the_mix_strategy_passes(tmp_path: Path, tiny_model_path: str) -> None:
    data = small_config(tmp_path, tiny_model_path)
    expert = tmp_path / "expert.jsonl"
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    expert.write_text(json.dumps(row) + "\n")
    data["algorithm"].update(
        {"policy_loss_fn": "mix", "sample_strategy": "mix", "sample_strategy_args": {}}
    )
    data["buffer"]["trainer_input"] = {"auxiliary_buffers": {"sft_dataset": {"path": str(expert)}}}
    run = prepare_run(config_from_dict(data))
    assert run.algorithm.provided_fields == {"expert_mask", "step"}
    assert "expert_mask" in run.algorithm.check_loss_inputs(set(LOSS_TENSORS))


def test_unknown_field_names_the_loss_and_the_field(
    tmp_path: Path, tiny_model_path: str, registered: None
) -> None:
    with pytest.raises(ConfigError) as ei:
        prepare_run(_cfg(tmp_path, tiny_model_path, policy_loss_fn="weighted_loss"))
    assert ei.value.key_path == "algorithm.policy_loss_fn"
    assert "WeightedLoss" in str(ei.value) and "'row_weight'" in str(ei.value)
    # a strategy declaring another field does not help
    with pytest.raises(ConfigError, match="WeightedLoss.*'row_weight'"):
        prepare_run(
            _cfg(
                tmp_path,
                tiny_model_path,
                policy_loss_fn="weighted_loss",
                sample_strategy="other_field",
            )
        )


@pytest.mark.parametrize("strategy", ["weight_strategy", "trinity_style"])
def test_a_declared_custom_field_is_accepted(
    tmp_path: Path, tiny_model_path: str, registered: None, strategy: str
) -> None:
    run = prepare_run(
        _cfg(tmp_path, tiny_model_path, policy_loss_fn="weighted_loss", sample_strategy=strategy)
    )
    assert run.algorithm.provided_fields == {"row_weight"}
    assert run.algorithm.check_loss_inputs(set(LOSS_TENSORS)) == [
        "logprob",
        "action_mask",
        "row_weight",
    ]


def test_provided_fields_of_each_strategy(registered: None) -> None:
    assert SAMPLE_STRATEGY.get("default").provided_fields() == frozenset()
    assert SAMPLE_STRATEGY.get("staleness_control").provided_fields() == frozenset()
    assert SAMPLE_STRATEGY.get("mix").provided_fields() == {"expert_mask", "step"}
    assert OtherFieldStrategy.provided_fields() == {"something_else"}
    assert TrinityStyleStrategy.provided_fields() == {"row_weight"}

    class Sub(WeightStrategy):  # inherits its base's declaration
        pass

    assert Sub.provided_fields() == {"row_weight"}


def test_the_seed_mix_strategy_declares_its_fields_in_sample() -> None:
    import importlib.util

    # executed under a name of its own: load_plugins (which loads a file once per session)
    # stays untouched for the integration test that runs it as a plugin
    path = Path(__file__).resolve().parents[2] / "examples" / "seed_mix" / "mix_plugin.py"
    spec = importlib.util.spec_from_file_location("seed_mix_for_loss_fields", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        cls = module.MixSampleStrategy
        assert issubclass(cls, SampleStrategy)
        assert "custom_fields" not in vars(cls)  # no class-level declaration: found in sample()
        assert cls.provided_fields() == {"expert_mask", "step"}
    finally:
        del sys.modules[spec.name]


def test_mix_entropy_without_expert_mask_fails_at_config_time(
    tmp_path: Path, tiny_model_path: str
) -> None:
    with pytest.raises(ConfigError) as ei:
        prepare_run(_cfg(tmp_path, tiny_model_path, entropy_loss_fn="mix"))
    assert ei.value.key_path == "algorithm.entropy_loss_fn"
    assert "MixEntropyLossFn" in str(ei.value) and "'expert_mask'" in str(ei.value)
