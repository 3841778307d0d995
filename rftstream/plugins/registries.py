"""The registries the core looks config names up in, whose interfaces plugins define.

A config names its algorithm preset, loss, advantage, KL and entropy functions,
sample strategy and reward function by string; the core resolves those names here.
The interfaces (``PolicyLossFn``, ``AdvantageFn``, ``RewardFn``, ...) and the
built-ins live in the plugin packages, which import these registries and register
into them; each registry names its built-ins' package (``defaults``) and imports it
by name on its first lookup, so the core never imports ``algorithms`` or
``workflows``. User plugins register the same way (see :mod:`rftstream.plugins.loader`).

The registries whose interface is the core's own sit beside it:
:data:`~rftstream.experience_pipeline.EXPERIENCE_OPERATORS` and
:data:`~rftstream.workflow.WORKFLOWS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rftstream.plugins.registry import Registry

ALGORITHMS_PACKAGE = "algorithms"
WORKFLOWS_PACKAGE = "workflows"

ALGORITHM_TYPE: Registry[type[Any]] = Registry("algorithm", defaults=(ALGORITHMS_PACKAGE,))
"""Algorithm presets (``algorithm.algorithm_type``): ``algorithms.AlgorithmType`` classes."""

POLICY_LOSS_FN: Registry[type[Any]] = Registry("policy_loss_fn", defaults=(ALGORITHMS_PACKAGE,))
"""``algorithm.policy_loss_fn``: ``algorithms.PolicyLossFn`` classes."""

ADVANTAGE_FN: Registry[type[Any]] = Registry("advantage_fn", defaults=(ALGORITHMS_PACKAGE,))
"""``algorithm.advantage_fn``: ``algorithms.AdvantageFn`` classes."""

KL_FN: Registry[type[Any]] = Registry("kl_fn", defaults=(ALGORITHMS_PACKAGE,))
"""``algorithm.kl_loss_fn`` / ``kl_penalty_fn``: ``algorithms.KLFn`` classes."""

ENTROPY_LOSS_FN: Registry[type[Any]] = Registry("entropy_loss_fn", defaults=(ALGORITHMS_PACKAGE,))
"""``algorithm.entropy_loss_fn``: ``algorithms.EntropyLossFn`` classes."""

SAMPLE_STRATEGY: Registry[type[Any]] = Registry("sample_strategy", defaults=(ALGORITHMS_PACKAGE,))
"""``algorithm.sample_strategy``: ``algorithms.SampleStrategy`` classes."""

ALGORITHM_RESOLVERS: Registry[Callable[..., Any]] = Registry(
    "algorithm_resolvers", defaults=(ALGORITHMS_PACKAGE,)
)
"""How the ``algorithm:`` section becomes instantiated components: ``"default"`` is
``algorithms.resolve_algorithm(algorithm_config, buffer_config)``, which returns an
``algorithms.ResolvedAlgorithm`` or raises ConfigError naming the key."""

REWARD_FUNCTIONS: Registry[type[Any]] = Registry("reward_functions", defaults=(WORKFLOWS_PACKAGE,))
"""``default_reward_fn_type`` of a taskset: ``workflows.RewardFn`` classes."""
