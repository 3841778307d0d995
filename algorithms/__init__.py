"""Algorithm components, as in Trinity-RFT's ``trinity.algorithm``.

``from algorithms import ADVANTAGE_FN, POLICY_LOSS_FN, ALGORITHM_TYPE`` and the
other registries; :func:`resolve_algorithm` turns the ``algorithm:`` config
into instantiated components. Depends only on the ``rftstream`` kernel
(experience, registry, config, errors), torch and numpy.
"""

from algorithms.advantage_fn import ADVANTAGE_FN, AdvantageFn, GroupAdvantage
from algorithms.algorithm import (
    ALGORITHM_TYPE,
    AlgorithmType,
    ResolvedAlgorithm,
    resolve_algorithm,
)
from algorithms.entropy_loss_fn import ENTROPY_LOSS_FN, EntropyLossFn
from algorithms.kl_fn import KL_FN, KLFn
from algorithms.policy_loss_fn import (
    POLICY_LOSS_FN,
    PolicyLossFn,
    check_loss_inputs,
    loss_inputs_for,
)
from algorithms.sample_strategy import (
    SAMPLE_STRATEGY,
    CustomField,
    ExperienceSource,
    SampleStrategy,
    gather_custom_fields,
)
from algorithms.utils import (
    aggregate_loss,
    masked_count,
    masked_loss,
    masked_mean,
    masked_sum,
    masked_whiten,
    whole_batch,
)

__all__ = [
    "ADVANTAGE_FN",
    "ALGORITHM_TYPE",
    "ENTROPY_LOSS_FN",
    "KL_FN",
    "POLICY_LOSS_FN",
    "SAMPLE_STRATEGY",
    "AdvantageFn",
    "AlgorithmType",
    "CustomField",
    "EntropyLossFn",
    "ExperienceSource",
    "GroupAdvantage",
    "KLFn",
    "PolicyLossFn",
    "ResolvedAlgorithm",
    "SampleStrategy",
    "aggregate_loss",
    "check_loss_inputs",
    "gather_custom_fields",
    "loss_inputs_for",
    "masked_loss",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "masked_count",
    "whole_batch",
    "resolve_algorithm",
]
