"""Algorithm presets (``AlgorithmType``) and resolution of the ``algorithm:`` config.

An :class:`AlgorithmType` bundles the components of one algorithm
(``default_config()``) and the resources it needs (``use_critic``,
``use_reference``, ...), registered in :data:`ALGORITHM_TYPE` so that
``algorithm: {algorithm_type: grpo}`` is enough in a config.

:func:`resolve_algorithm` turns an :class:`AlgorithmConfig` into instantiated
components. Merge order (later wins), as in Trinity-RFT:

1. global defaults: ``repeat_times: 1, sample_strategy: warmup, advantage_fn:
   ppo, policy_loss_fn: ppo, kl_penalty_fn: none, kl_loss_fn: k2,
   entropy_loss_fn: default``;
2. the preset's ``default_config()``;
3. the user's non-None ``algorithm:`` keys.

Each ``<x>_args`` is the function class's ``default_args()``, updated with the
preset's ``<x>_args`` (if any), updated with the user's ``<x>_args`` (Trinity
replaces the defaults wholesale; merging keeps defaults the user did not
mention). ``algorithm.loss_agg_mode`` (the preset's when the config leaves the
default ``token-mean``) goes to the policy loss, KL and entropy
functions unless their user ``_args`` set ``loss_agg_mode`` themselves; a
class whose constructor does not take ``loss_agg_mode`` gets it as the
attribute ``loss_agg_mode`` instead. Pure configuration logic, no I/O.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import msgspec

from algorithms.advantage_fn import ADVANTAGE_FN, AdvantageFn
from algorithms.entropy_loss_fn import ENTROPY_LOSS_FN, EntropyLossFn
from algorithms.kl_fn import KL_FN, KLFn
from algorithms.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn, check_loss_inputs
from algorithms.sample_strategy import (
    SAMPLE_STRATEGY,
    CustomField,
    ExperienceSource,
    SampleStrategy,
)
from algorithms.utils import check_loss_agg_mode
from rftstream.config.schema import AlgorithmConfig, BufferConfig
from rftstream.errors import ConfigError, RegistryError
from rftstream.plugins.registries import ALGORITHM_RESOLVERS, ALGORITHM_TYPE
from rftstream.plugins.registry import Registry


class AlgorithmType:
    """Describes one algorithm; never instantiated, only its class attributes are read.

    * ``use_critic``: needs a critic (value) model.
    * ``use_reference``: needs a reference model (KL).
    * ``compute_advantage_in_trainer``: the trainer calls the advantage fn; if
      False the experience pipeline already did (group advantages).
    * ``can_balance_batch``: the trainer may reorder samples when splitting
      micro-batches.
    * ``schema``: the experience schema it trains on.
    """

    use_critic: bool = False
    use_reference: bool = True
    compute_advantage_in_trainer: bool = False
    can_balance_batch: bool = True
    schema: str = "experience"

    @classmethod
    def default_config(cls) -> dict:
        """Algorithm config keys this preset sets (overriding the global defaults).

        Allowed keys: ``repeat_times``, ``loss_agg_mode``, the component names
        (``advantage_fn``, ``policy_loss_fn``, ...) and their ``<x>_args``.
        """
        return {}

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Hook to check or adjust the whole run config (Trinity-RFT's); no-op by default.

        ``prepare_run`` calls it on a private copy of the config before the
        algorithm is resolved, so keys it sets (e.g. ``config.algorithm.
        repeat_times``) take effect; a ValueError becomes a ConfigError at
        ``algorithm.algorithm_type``. Not called by :func:`resolve_algorithm`,
        which sees only the ``algorithm`` and ``buffer`` sections.
        """
        return None


def _preset(
    name: str,
    doc: str,
    config: dict[str, Any],
    *,
    use_critic: bool = False,
    use_reference: bool = True,
    compute_advantage_in_trainer: bool = False,
    can_balance_batch: bool = True,
    schema: str = "experience",
) -> type[AlgorithmType]:
    """Define and register a preset whose ``default_config()`` returns ``config``."""
    frozen = dict(config)

    def default_config(cls: type[AlgorithmType]) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in frozen.items()}

    cls = type(
        f"{name.upper()}Algorithm",
        (AlgorithmType,),
        {
            "__doc__": doc,
            "__module__": __name__,
            "use_critic": use_critic,
            "use_reference": use_reference,
            "compute_advantage_in_trainer": compute_advantage_in_trainer,
            "can_balance_batch": can_balance_batch,
            "schema": schema,
            "default_config": classmethod(default_config),
        },
    )
    ALGORITHM_TYPE.register_module(name)(cls)
    return cls


def _rl(advantage_fn: str, policy_loss_fn: str, kl_loss_fn: str = "k2", **more: Any) -> dict:
    """The usual preset shape: repeat 2, default sampling, no KL penalty, default entropy."""
    out: dict[str, Any] = {
        "repeat_times": 2,
        "advantage_fn": advantage_fn,
        "sample_strategy": "default",
        "policy_loss_fn": policy_loss_fn,
        "kl_penalty_fn": "none",
        "kl_loss_fn": kl_loss_fn,
        "entropy_loss_fn": "default",
    }
    out.update(more)
    return out


GRPOAlgorithm = _preset(
    "grpo", "GRPO: group-normalised advantages, PPO-clip loss, k2 KL loss.", _rl("grpo", "ppo")
)
GRPOVerlAlgorithm = _preset(
    "grpo_verl",
    "GRPO with the advantage computed in the trainer on the whole batch (Trinity-RFT's "
    "grpo_verl): the preset for trainer-side advantages such as clipb / clipv, which need "
    "the current policy's per-token entropies.",
    _rl("grpo", "ppo"),
    compute_advantage_in_trainer=True,
)
PPOAlgorithm = _preset(
    "ppo",
    "PPO: a critic (value head) and GAE advantages computed in the trainer.",
    _rl("ppo", "ppo", repeat_times=1),
    use_critic=True,
    compute_advantage_in_trainer=True,
)
DAPOAlgorithm = _preset(
    "dapo",
    "DAPO: GRPO advantages, decoupled clip (clip_range_high 0.28), token-level loss, no KL; "
    "pair it with the dapo_dynamic_sampling / overlong operators.",
    _rl(
        "grpo",
        "ppo",
        kl_loss_fn="none",
        repeat_times=16,
        loss_agg_mode="token-mean",
        policy_loss_fn_args={"clip_range_low": 0.2, "clip_range_high": 0.28},
    ),
    use_reference=False,
)
OPMDAlgorithm = _preset(
    "opmd", "OPMD: group mean baselines and the OPMD policy loss.", _rl("opmd", "opmd")
)
AsymREAlgorithm = _preset(
    "asymre",
    "AsymRE: a shifted group baseline with the OPMD-style REINFORCE loss, no reference.",
    _rl("asymre", "opmd", kl_loss_fn="none", entropy_loss_fn="none"),
    use_reference=False,
)
RLOOAlgorithm = _preset(
    "rloo",
    "RLOO: leave-one-out group baselines with the PPO loss (computed in the pipeline: a NATS "
    "message carries the whole group).",
    _rl("rloo", "ppo"),
)
ReinforcePlusPlusAlgorithm = _preset(
    "reinforceplusplus",
    "REINFORCE++: discounted token returns whitened over the batch, in the trainer.",
    _rl("reinforceplusplus", "ppo"),
    compute_advantage_in_trainer=True,
)
GSPOAlgorithm = _preset(
    "gspo",
    "GSPO: sequence-level importance ratios (clip 3e-4 / 4e-4), sequence-mean aggregation.",
    _rl("grpo", "gspo", policy_loss_fn_args={"loss_agg_mode": "seq-mean-token-mean"}),
)
CISPOAlgorithm = _preset(
    "cispo", "CISPO: clipped importance-sampling weights.", _rl("grpo", "cispo")
)
TOPRAlgorithm = _preset("topr", "TOPR: tapered off-policy REINFORCE.", _rl("reinforce", "topr"))
SPPOAlgorithm = _preset(
    "sppo",
    "sPPO.",
    _rl("opmd", "sppo", kl_loss_fn="none", entropy_loss_fn="none"),
    use_reference=False,
)
RECAlgorithm = _preset(
    "rec", "REC: group-relative REINFORCE with clipping variants.", _rl("rec", "rec")
)
StepWiseGRPOAlgorithm = _preset(
    "multi_step_grpo",
    "GRPO for multi-step workflows: the rollout's advantage is shared by all its steps.",
    _rl("step_wise_grpo", "ppo", repeat_times=8),
)
MIXAlgorithm = _preset(
    "mix",
    "MIX: GRPO on rollouts plus SFT on expert data (seed guide 000).",
    {
        "repeat_times": 8,
        "advantage_fn": "grpo",
        "policy_loss_fn": "mix",
        "sample_strategy": "mix",
        "entropy_loss_fn": "mix",
    },
)
MIXCHORDAlgorithm = _preset(
    "mix_chord",
    "CHORD (arXiv:2508.11408): MIX with a scheduled SFT weight mu and the phi-weighted SFT loss.",
    {
        "repeat_times": 8,
        "advantage_fn": "grpo",
        "policy_loss_fn": "mix_chord",
        "sample_strategy": "mix",
        "entropy_loss_fn": "mix",
    },
)
SAPOAlgorithm = _preset(
    "sapo",
    "SAPO (arXiv:2511.20347): GRPO advantages with a soft, temperature-controlled gate "
    "instead of PPO's hard clip.",
    _rl("grpo", "sapo"),
)
GiGPOAlgorithm = _preset(
    "gigpo",
    "GiGPO (arXiv:2505.10978): episode-level plus anchor-state step-level advantages for "
    "multi-step agents (info['env_state_hash'], optional info['step_reward']).",
    _rl(
        "gigpo",
        "ppo",
        repeat_times=8,
        advantage_fn_args={"omega": 1.0, "gamma": 1.0, "fnorm": "none", "epsilon": 1e-6},
        policy_loss_fn_args={
            "clip_range_low": 0.2,
            "clip_range_high": 0.2,
            "loss_agg_mode": "token-mean",
        },
    ),
)
OnPolicyDistillAlgorithm = _preset(
    "on_policy_distill",
    "On-policy distillation: advantage = kl_coef * (teacher - student log-prob) per token, "
    "teacher log-probs in info['teacher_logprobs'] (policy_loss_fn importance_sampling when "
    "no clipping is wanted).",
    _rl(
        "on_policy_distill",
        "ppo",
        kl_loss_fn="none",
        repeat_times=8,
        entropy_loss_fn="none",
        advantage_fn_args={"kl_coef": 1.0},
    ),
    use_reference=False,
    compute_advantage_in_trainer=True,
)
JSDAlgorithm = _preset(
    "jsd",
    "Distillation with the generalised Jensen-Shannon divergence between teacher "
    "(info['teacher_logprobs']) and student as the negative advantage.",
    _rl(
        "jsd",
        "ppo",
        kl_loss_fn="none",
        repeat_times=8,
        entropy_loss_fn="none",
        advantage_fn_args={"kl_coef": 1.0, "lambda_coef": 0.5},
    ),
    use_reference=False,
    compute_advantage_in_trainer=True,
)
RAFTAlgorithm = _preset(
    "raft",
    "RAFT: SFT on the explorer's rollouts (put a reward filter in the pipeline to keep the good ones).",
    {
        "sample_strategy": "default",
        "advantage_fn": "none",
        "policy_loss_fn": "sft",
        "kl_loss_fn": "none",
        "entropy_loss_fn": "none",
    },
    use_reference=False,
)


class _DatasetAlgorithm(AlgorithmType):
    """Presets that train from a dataset in ``mode: train`` with no explorer."""

    @classmethod
    def check_config(cls, config: Any) -> None:
        name = cls.__name__.removesuffix("Algorithm").upper()
        if config.mode != "train":
            raise ValueError(
                f"{name} trains from a dataset: set `mode: train` and "
                "`buffer.trainer_input.experience_buffer.path` (to fine-tune on the explorer's "
                "rollouts use algorithm_type: raft)"
            )
        eb = config.buffer.trainer_input.experience_buffer
        if eb is None or not eb.path:
            raise ValueError(
                f"`buffer.trainer_input.experience_buffer.path` is required when "
                f"algorithm_type is {name.lower()}"
            )


@ALGORITHM_TYPE.register_module("sft")
class SFTAlgorithm(_DatasetAlgorithm):
    """Supervised fine-tuning on a dataset of prompts and replies (``mode: train``)."""

    use_critic: bool = False
    use_reference: bool = False
    compute_advantage_in_trainer: bool = False
    can_balance_batch: bool = True
    schema: str = "sft"

    @classmethod
    def default_config(cls) -> dict:
        return {
            "sample_strategy": "default",
            "advantage_fn": "none",
            "policy_loss_fn": "sft",
            "kl_penalty_fn": "none",
            "kl_loss_fn": "none",
            "entropy_loss_fn": "none",
        }


@ALGORITHM_TYPE.register_module("cpt")
class CPTAlgorithm(SFTAlgorithm):
    """Continued pre-training (``mode: train``): next-token loss on every token of a
    plain-text dataset (rows' ``format.prompt_key``, else ``text``), through the ``sft``
    loss; no chat template, no prompt/reply split."""

    schema: str = "cpt"


@ALGORITHM_TYPE.register_module("dpo")
class DPOAlgorithm(_DatasetAlgorithm):
    """DPO on a dataset of (prompt, chosen, rejected) rows (``mode: train``).

    Rows are trained as adjacent chosen/rejected pairs, so the batch is never
    reordered (``can_balance_batch`` False); ``repeat_times`` is 2 (one pair).
    """

    use_critic: bool = False
    use_reference: bool = True
    compute_advantage_in_trainer: bool = False
    can_balance_batch: bool = False
    schema: str = "dpo"

    @classmethod
    def default_config(cls) -> dict:
        return {
            "repeat_times": 2,
            "sample_strategy": "default",
            "advantage_fn": "none",
            "policy_loss_fn": "dpo",
            "kl_loss_fn": "k2",
            "entropy_loss_fn": "default",
        }


GLOBAL_DEFAULTS: dict[str, Any] = {
    "repeat_times": 1,
    "sample_strategy": "warmup",
    "advantage_fn": "ppo",
    "policy_loss_fn": "ppo",
    "kl_penalty_fn": "none",
    "kl_loss_fn": "k2",
    "entropy_loss_fn": "default",
}

# component key -> (registry, required base class, receives loss_agg_mode)
_COMPONENTS: dict[str, tuple[Registry, type, bool]] = {
    "advantage_fn": (ADVANTAGE_FN, AdvantageFn, False),
    "policy_loss_fn": (POLICY_LOSS_FN, PolicyLossFn, True),
    "kl_penalty_fn": (KL_FN, KLFn, True),
    "kl_loss_fn": (KL_FN, KLFn, True),
    "entropy_loss_fn": (ENTROPY_LOSS_FN, EntropyLossFn, True),
    "sample_strategy": (SAMPLE_STRATEGY, SampleStrategy, False),
}


@dataclass
class ResolvedAlgorithm:
    """The algorithm of a run, with every component instantiated (except the sample strategy).

    ``config`` is the merged :class:`AlgorithmConfig` with every field filled
    (``<x>_args`` hold the arguments actually used). The sample strategy needs
    the trainer's experience source, so it is built by
    :meth:`create_sample_strategy`.
    """

    algorithm_type: type[AlgorithmType]
    name: str
    config: AlgorithmConfig
    repeat_times: int
    advantage_fn: AdvantageFn
    policy_loss_fn: PolicyLossFn
    kl_penalty_fn: KLFn
    kl_loss_fn: KLFn
    entropy_loss_fn: EntropyLossFn
    sample_strategy_name: str
    sample_strategy_args: dict[str, Any]
    use_reference: bool
    use_critic: bool
    compute_advantage_in_trainer: bool
    sample_strategy_cls: type[SampleStrategy] = field(default=SampleStrategy)
    # verl's batch arithmetic for a loss that weights its micro-batches itself (MIX): a
    # rftstream.config.resolve.VerlBatchShape, set when the run is prepared; None otherwise
    batch_shape: Any = None

    @property
    def custom_fields(self) -> tuple[CustomField, ...]:
        """Extra per-experience batch tensors the sample strategy provides (e.g. ``expert_mask``)."""
        return tuple(self.sample_strategy_cls.custom_fields)

    def create_sample_strategy(
        self,
        buffer_config: BufferConfig,
        source: ExperienceSource | None = None,
        **extra: Any,
    ) -> SampleStrategy:
        """Instantiate the sample strategy on ``source``.

        Passes ``sample_strategy_args`` plus ``repeat_times`` (unless the args
        set it) plus ``extra`` (e.g. MIX's ``expert_source``). A Trinity-RFT
        style strategy whose constructor is ``(buffer_config, **kwargs)`` opens
        its inputs itself with ``rftstream.buffer.get_buffer_reader``; it gets
        ``source`` as the attribute ``.source`` instead.
        """
        args = {"repeat_times": self.repeat_times, **self.sample_strategy_args, **extra}
        return construct_sample_strategy(self.sample_strategy_cls, buffer_config, source, args)

    @property
    def provided_fields(self) -> frozenset[str]:
        """Names of the extra batch tensors the sample strategy declares (see
        :meth:`SampleStrategy.provided_fields`); nothing else provides custom fields."""
        return frozenset(self.sample_strategy_cls.provided_fields())

    def check_loss_inputs(self, available: set[str]) -> list[str]:
        """Check the policy and entropy losses against ``available`` plus the strategy's fields.

        ``available`` are the tensors the trainer always has (logprobs, masks,
        advantages, ...; ``rftstream.training.batch.trainer_tensors``); the
        sample strategy's :attr:`provided_fields` are added, and without a
        reference model (``use_reference`` False) ``ref_logprob`` is taken
        away, whoever names it. Returns the policy loss's inputs
        (:func:`check_loss_inputs`). Raises :class:`ConfigError` naming the
        loss class and the first field nothing provides
        (``algorithm.policy_loss_fn`` / ``algorithm.entropy_loss_fn``).
        """
        have = set(available) | self.provided_fields
        if not self.use_reference:
            have.discard("ref_logprob")
        names = check_loss_inputs(self.policy_loss_fn, have)
        required = getattr(self.entropy_loss_fn, "required_fields", frozenset()) or frozenset()
        for name in sorted(set(required) - have):
            raise ConfigError(
                "algorithm.entropy_loss_fn",
                f"{type(self.entropy_loss_fn).__name__} needs field {name!r} which no experience "
                f"field provides; sample strategy {self.sample_strategy_name!r} provides "
                f"{sorted(self.provided_fields) or 'no extra fields'} (sample_strategy 'mix' "
                f"adds 'expert_mask')",
                value=self.config.entropy_loss_fn,
            )
        return names


def _takes_source(cls: type) -> bool:
    """Whether the constructor has a parameter named ``source`` (this project's strategies)."""
    return "source" in inspect.signature(cls.__init__).parameters


def construct_sample_strategy(
    cls: type[SampleStrategy],
    buffer_config: BufferConfig,
    source: ExperienceSource | None,
    args: dict[str, Any],
) -> SampleStrategy:
    """``cls(buffer_config, source, **args)``, or ``cls(buffer_config, **args)`` plus
    ``.source = source`` for a constructor without a source parameter."""
    if _takes_source(cls):
        return cls(buffer_config, source, **args)
    obj = cls(buffer_config, **args)
    obj.source = source
    return obj


def _lookup(key: str, registry: Registry, base: type, name: str) -> type:
    try:
        obj = registry.get(name)
    except RegistryError as exc:
        raise ConfigError(
            f"algorithm.{key}",
            f"unknown {key} {name!r}; registered: {', '.join(registry.names())} ({exc})",
            value=name,
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError(
            f"algorithm.{key}", f"{name!r} resolves to {obj!r}, not a {base.__name__} subclass"
        )
    return obj


def _init_params(cls: type) -> tuple[set[str], bool]:
    """(named constructor parameters, whether it takes **kwargs)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    names = {
        p.name
        for p in params
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


_BOUND_SUFFIXES = ("_low", "_high")


def _merge_args(
    key: str, cls: type, preset: dict[str, Any], user: dict[str, Any] | None
) -> dict[str, Any]:
    """``default_args()``, updated with the preset's ``<key>_args``, updated with the user's.

    A user key ``X`` whose bounds ``X_low`` / ``X_high`` came only from the
    defaults or the preset drops those bounds, so the constructor derives them
    from ``X``: ``policy_loss_fn_args: {clip_range: 0.1}`` on GSPO (whose
    ``default_args`` set ``clip_range_low/high``) or DAPO (whose preset does)
    clips at 0.1 on both sides. Bounds the user sets beside ``X`` stay.
    """
    args = dict(cls.default_args() or {})
    preset_args = preset.get(f"{key}_args")
    if preset_args:
        args.update(preset_args)
    if user:
        for name in user:
            for suffix in _BOUND_SUFFIXES:
                bound = f"{name}{suffix}"
                if bound in args and bound not in user:
                    del args[bound]
        args.update(user)
    return args


def _instantiate(
    key: str, cls: type, args: dict[str, Any], loss_agg_mode: str | None
) -> tuple[Any, dict[str, Any]]:
    """Construct ``cls(**args)``; return (instance, args used).

    ``loss_agg_mode`` (None for components without one) is the mode the
    instance must end up with unless ``args`` already name one. It is passed
    to the constructor if it takes it (by name or ``**kwargs``), else set as
    the attribute ``loss_agg_mode`` after construction.
    """
    names, var_kw = _init_params(cls)
    args = dict(args)
    intended: str | None = None
    if loss_agg_mode is not None:
        intended = args.setdefault("loss_agg_mode", loss_agg_mode)
    call_args = dict(args)
    if intended is not None:
        if "loss_agg_mode" not in names and not var_kw:
            call_args.pop("loss_agg_mode", None)
    if not var_kw:
        unknown = [k for k in call_args if k not in names]
        if unknown:
            raise ConfigError(
                f"algorithm.{key}_args",
                f"{cls.__name__} does not accept argument {unknown[0]!r}; "
                f"accepted: {sorted(names)}",
                value=unknown[0],
            )
    try:
        obj = cls(**call_args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"algorithm.{key}_args", f"{cls.__name__}(**{call_args!r}) failed: {exc}"
        ) from exc
    if intended is not None and getattr(obj, "loss_agg_mode", None) != intended:
        obj.loss_agg_mode = intended
    return obj, args


def _loss_agg_mode(user: str | None, preset: str | None) -> str:
    """The config's mode, else the preset's, else ``token-mean``.

    The schema defaults ``algorithm.loss_agg_mode`` to ``"token-mean"``, which
    cannot be told apart from an explicit value, so ``"token-mean"`` yields to a
    preset that names another mode.
    """
    if user is None or (user == "token-mean" and preset):
        return preset or "token-mean"
    return user


@ALGORITHM_RESOLVERS.register_module("default")
def resolve_algorithm(
    cfg: AlgorithmConfig, buffer: BufferConfig | None = None
) -> ResolvedAlgorithm:
    """Resolve ``cfg`` into a :class:`ResolvedAlgorithm` (see the module docstring for merge order).

    With ``buffer``, the sample strategy is also constructed once (without a
    source) to validate its arguments against the buffer (e.g. MIX's
    auxiliary dataset). Raises :class:`ConfigError` naming the key
    (``algorithm.algorithm_type``, ``algorithm.policy_loss_fn``,
    ``algorithm.policy_loss_fn_args``, ...).
    """
    try:
        algo_cls = ALGORITHM_TYPE.get(cfg.algorithm_type)
    except RegistryError as exc:
        raise ConfigError(
            "algorithm.algorithm_type",
            f"unknown algorithm_type {cfg.algorithm_type!r}; registered: "
            f"{', '.join(ALGORITHM_TYPE.names())}",
            value=cfg.algorithm_type,
        ) from exc
    preset = dict(algo_cls.default_config())
    allowed = set(GLOBAL_DEFAULTS) | {f"{k}_args" for k in _COMPONENTS} | {"loss_agg_mode"}
    unknown = sorted(k for k in preset if k not in allowed)
    if unknown:
        raise ConfigError(
            "algorithm.algorithm_type",
            f"preset {cfg.algorithm_type!r} default_config() has unknown key(s) {unknown}",
        )

    merged: dict[str, Any] = dict(GLOBAL_DEFAULTS)
    merged.update({k: v for k, v in preset.items() if not k.endswith("_args")})
    for k in GLOBAL_DEFAULTS:
        user_value = getattr(cfg, k)
        if user_value is not None:
            merged[k] = user_value
    repeat_times = int(merged["repeat_times"])
    if repeat_times < 1:
        raise ConfigError("algorithm.repeat_times", "must be >= 1", value=repeat_times)

    mode = _loss_agg_mode(cfg.loss_agg_mode, preset.get("loss_agg_mode"))
    try:
        check_loss_agg_mode(mode)
    except ValueError as exc:
        raise ConfigError("algorithm.loss_agg_mode", str(exc), value=mode) from exc
    instances: dict[str, Any] = {}
    filled: dict[str, Any] = {"repeat_times": repeat_times, "loss_agg_mode": mode}
    classes: dict[str, type] = {}
    for key, (registry, base, takes_mode) in _COMPONENTS.items():
        name = merged[key]
        cls = _lookup(key, registry, base, name)
        classes[key] = cls
        user_args = getattr(cfg, f"{key}_args")
        args = _merge_args(key, cls, preset, user_args)
        filled[key] = name
        if key == "sample_strategy":
            filled[f"{key}_args"] = args
            continue
        preset_args = preset.get(f"{key}_args") or {}
        keeps_own = (user_args and "loss_agg_mode" in user_args) or (
            "loss_agg_mode" in preset_args and cfg.loss_agg_mode is None
        )
        if takes_mode and not keeps_own:
            args["loss_agg_mode"] = mode  # algorithm.loss_agg_mode beats default_args
        obj, used = _instantiate(key, cls, args, mode if takes_mode else None)
        instances[key] = obj
        filled[f"{key}_args"] = used

    ss_cls = classes["sample_strategy"]
    if buffer is not None and _takes_source(ss_cls):
        # a strategy that opens its own readers (get_buffer_reader) can only be built in a trainer
        probe_args = {"repeat_times": repeat_times, **filled["sample_strategy_args"]}
        try:
            ss_cls(buffer, None, **probe_args)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                "algorithm.sample_strategy_args", f"{ss_cls.__name__}: {exc}"
            ) from exc

    config = msgspec.structs.replace(cfg, **filled)
    return ResolvedAlgorithm(
        algorithm_type=algo_cls,
        name=cfg.algorithm_type,
        config=config,
        repeat_times=repeat_times,
        advantage_fn=instances["advantage_fn"],
        policy_loss_fn=instances["policy_loss_fn"],
        kl_penalty_fn=instances["kl_penalty_fn"],
        kl_loss_fn=instances["kl_loss_fn"],
        entropy_loss_fn=instances["entropy_loss_fn"],
        sample_strategy_name=filled["sample_strategy"],
        sample_strategy_args=filled["sample_strategy_args"],
        use_reference=bool(algo_cls.use_reference),
        use_critic=bool(algo_cls.use_critic),
        compute_advantage_in_trainer=bool(algo_cls.compute_advantage_in_trainer),
        sample_strategy_cls=ss_cls,
    )
