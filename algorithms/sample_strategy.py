"""Sample strategies: how the trainer assembles one step's batch of experiences.

As in Trinity-RFT (``trinity.algorithm.sample_strategy``), except that the
experience buffer is not opened here: the trainer owns the NATS consumer and
hands it in as an :class:`ExperienceSource`. A strategy reads from it (and from
any auxiliary sources, e.g. MIX's expert data) and returns the batch as a
``list[Experience]``; the trainer pads and collates it.

Fields a strategy adds for the loss functions (MIX's ``expert_mask``) are
declared in :attr:`SampleStrategy.custom_fields`: each names an ``exp.info``
key and the ``(batch,)`` tensor the trainer builds from it
(:func:`gather_custom_fields`). A Trinity-RFT style strategy declares them
where it gathers its batch instead
(``Experiences.gather_experiences(..., custom_fields=[CustomField(...)])``);
:meth:`SampleStrategy.provided_fields` finds those literal ``CustomField``
calls in the class's source, so a loss naming such a field passes the
config-time check. A field nothing declares is a config error.

``sample`` only awaits its sources; it never blocks the event loop and is
backend-neutral (asyncio or trio). Cancelling it cancels the pending read.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import textwrap
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from rftstream.config.resolve import train_batch_size
from rftstream.config.schema import BufferConfig
from rftstream.errors import ConfigError
from rftstream.experience import Experience
from rftstream.plugins.registries import SAMPLE_STRATEGY


@runtime_checkable
class ExperienceSource(Protocol):
    """Where a sample strategy reads experiences from (the trainer's consumer, a dataset)."""

    async def read(self, n: int) -> list[Experience]:
        """Return ``n`` experiences, waiting until they are available.

        Returns fewer only when the source is exhausted (then possibly none).
        """
        ...


@dataclass(frozen=True)
class CustomField:
    """A per-experience value the trainer collates into a ``(batch,)`` tensor.

    ``exp.info[source_field]`` becomes the tensor ``destination_field`` of
    dtype ``data_type`` (Trinity-RFT's ``CustomField``).
    """

    source_field: str
    destination_field: str
    data_type: torch.dtype


def gather_custom_fields(
    exps: Sequence[Experience], custom_fields: Sequence[CustomField]
) -> dict[str, torch.Tensor]:
    """Build ``{destination_field: tensor (len(exps),)}`` from ``exp.info``.

    Raises KeyError naming the experience that lacks a source field.
    """
    out: dict[str, torch.Tensor] = {}
    for cf in custom_fields:
        values = []
        for exp in exps:
            if cf.source_field not in exp.info:
                raise KeyError(f"experience {exp.eid.uid} has no info[{cf.source_field!r}]")
            values.append(exp.info[cf.source_field])
        out[cf.destination_field] = torch.tensor(values, dtype=cf.data_type)
    return out


@functools.cache
def _custom_fields_in_source(klass: type) -> frozenset[str]:
    """Literal ``destination_field`` names of the ``CustomField(...)`` calls in ``klass``'s source.

    Empty when the source cannot be read (a class built at run time).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if called != "CustomField":
            continue
        value: ast.expr | None = None
        for kw in node.keywords:
            if kw.arg == "destination_field":
                value = kw.value
        if value is None and len(node.args) >= 2:
            value = node.args[1]
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            names.add(value.value)
    return frozenset(names)


def representative_sample(exps: Sequence[Experience]) -> list[dict[str, Any]]:
    """Up to two experiences for logging: the lowest- and highest-reward ones.

    Each is ``{"prompt": ..., "response": ..., "reward": ...}``; without rewards,
    the first experience without ``reward``.
    """
    if not exps:
        return []
    rewarded = [e for e in exps if e.reward is not None and not math.isnan(e.reward)]
    if not rewarded:
        e = exps[0]
        return [{"prompt": e.prompt_text, "response": e.response_text}]
    lo = min(rewarded, key=lambda e: e.reward)  # type: ignore[arg-type,return-value]
    hi = max(rewarded, key=lambda e: e.reward)  # type: ignore[arg-type,return-value]
    picked = [lo] if lo is hi else [lo, hi]
    return [
        {"prompt": e.prompt_text, "response": e.response_text, "reward": e.reward} for e in picked
    ]


class SampleStrategy(ABC):
    """Reads one training batch per step.

    ``source`` may be given later by assigning :attr:`source`. Extra keyword
    arguments (``sample_strategy_args``) are accepted as in Trinity-RFT.
    """

    custom_fields: ClassVar[tuple[CustomField, ...]] = ()

    def __init__(
        self,
        buffer_config: BufferConfig,
        source: ExperienceSource | None = None,
        **kwargs: Any,
    ) -> None:
        self.buffer_config = buffer_config
        self.source = source
        # the tokenizer's pad id, as Trinity-RFT strategies expect (set by the trainer)
        self.pad_token_id = getattr(buffer_config, "pad_token_id", None) or 0

    @classmethod
    def provided_fields(cls) -> frozenset[str]:
        """Names of the extra batch tensors this strategy provides (for ``check_loss_inputs``).

        The ``destination_field`` of every entry of :attr:`custom_fields`, plus
        every ``CustomField(..., destination_field="name")`` (or
        ``CustomField(source, "name", dtype)``) written with a literal name in
        the source of the class or of a base class below
        :class:`SampleStrategy`: the way a Trinity-RFT strategy declares
        them when it gathers its batch.
        """
        names = {cf.destination_field for cf in cls.custom_fields}
        for klass in cls.__mro__:
            if klass is SampleStrategy or not (
                isinstance(klass, type) and issubclass(klass, SampleStrategy)
            ):
                continue
            names |= _custom_fields_in_source(klass)
        return frozenset(names)

    @abstractmethod
    async def sample(self, step: int) -> tuple[list[Experience], dict, list]:
        """Read the batch of trainer step ``step``.

        Returns ``(batch, metrics, representative_samples)``. Waits for the
        source; the batch is shorter than the train batch size only at the end.
        """

    def warmup_state(self, step: int) -> tuple[bool, bool]:
        """``(step is in warmup, warmup finishes at this step)``; no warmup by default."""
        return False, False

    @classmethod
    def default_args(cls) -> dict:
        """Default ``sample_strategy_args``."""
        return {}

    def _require_source(self) -> ExperienceSource:
        if self.source is None:
            raise RuntimeError(
                f"{type(self).__name__}: no experience source; pass source=... or set .source"
            )
        return self.source


@SAMPLE_STRATEGY.register_module("default")
class DefaultSampleStrategy(SampleStrategy):
    """Reads ``train_batch_size`` experiences from the source.

    Metrics: ``sample/read_time`` (seconds spent waiting) and ``sample/count``.
    """

    def __init__(
        self,
        buffer_config: BufferConfig,
        source: ExperienceSource | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(buffer_config, source, **kwargs)
        self.train_batch_size = train_batch_size(buffer_config, kwargs.get("repeat_times"))

    async def sample(self, step: int) -> tuple[list[Experience], dict, list]:
        source = self._require_source()
        start = time.perf_counter()
        exps = await source.read(self.train_batch_size)
        metrics = {
            "sample/read_time": time.perf_counter() - start,
            "sample/count": float(len(exps)),
        }
        return exps, metrics, representative_sample(exps)


@SAMPLE_STRATEGY.register_module("warmup")
class WarmupSampleStrategy(DefaultSampleStrategy):
    """Same as ``default`` (Trinity-RFT's SFT warm-up steps are not supported here)."""


@SAMPLE_STRATEGY.register_module("staleness_control")
class StalenessControlSampleStrategy(DefaultSampleStrategy):
    """``default``, minus experiences generated by too old weights (Trinity-RFT's ``staleness_control``).

    Staleness is measured in trainer versions, as in the trainer's
    ``staleness/*`` metrics and the ``staleness_filter`` operator:
    ``staleness = current_version - exp.model_version``, where
    ``exp.model_version`` is the version of the weights that generated the
    experience. An experience is dropped when its staleness is ``>
    max_staleness``, i.e. kept iff ``exp.model_version >= min_model_version
    = max(current_version - max_staleness, 0)``; newer-than-current ones are
    kept. ``max_staleness`` None or ``inf`` (the default, as in Trinity-RFT)
    drops nothing; ``0`` keeps only on-policy experiences.

    ``current_version``: a zero-argument callable returning the trainer's
    weight version at sampling time. Without it the version is assumed to be
    ``step - 1``: the trainer sets its version to ``step`` once step ``step``
    is trained, so while it samples the batch of ``step`` it holds version
    ``step - 1`` (what ``rftstream.actors.trainer`` does).

    Reading: asks the source for the missing count, drops the stale ones,
    and asks again until ``train_batch_size`` experiences are kept or the
    source returns fewer than asked (exhausted); the batch is then short,
    possibly empty. The dropped experiences were consumed from the source
    (the trainer's feed acks them with the step's batch); they are counted,
    never trained. Experiences kept by a ``sample`` call that was cancelled
    are not lost: the next call starts from them (re-checking staleness).

    Metrics: ``sample/read_time``, ``sample/count`` (as ``default``),
    ``sample/stale_dropped`` (dropped in this call),
    ``sample/stale_dropped_total`` (since construction),
    ``sample/min_model_version`` (the threshold used; absent without a
    limit) and, for a non-empty batch, ``sample/model_version/min``,
    ``/max`` and ``/mean`` of the batch (Trinity-RFT's names).
    """

    def __init__(
        self,
        buffer_config: BufferConfig,
        source: ExperienceSource | None = None,
        *,
        max_staleness: float | None = None,
        current_version: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(buffer_config, source, **kwargs)
        if max_staleness is not None and (
            isinstance(max_staleness, bool)
            or not isinstance(max_staleness, int | float)
            or math.isnan(max_staleness)
            or max_staleness < 0
        ):
            raise ConfigError(
                "algorithm.sample_strategy_args.max_staleness",
                "must be a number >= 0 (or null for no limit)",
                value=max_staleness,
                has_value=True,
            )
        self.max_staleness = (
            None if max_staleness is None or math.isinf(max_staleness) else int(max_staleness)
        )
        self.current_version = current_version
        self.stale_dropped_total = 0
        self._carry: list[Experience] = []

    def min_model_version(self, step: int) -> int | None:
        """The oldest ``model_version`` kept when sampling ``step`` (None: no limit)."""
        if self.max_staleness is None:
            return None
        version = int(self.current_version()) if self.current_version is not None else step - 1
        return max(version - self.max_staleness, 0)

    async def sample(self, step: int) -> tuple[list[Experience], dict, list]:
        source = self._require_source()
        start = time.perf_counter()
        min_version = self.min_model_version(step)

        def fresh(exp: Experience) -> bool:
            return min_version is None or exp.model_version >= min_version

        kept = self._carry  # survivors of a cancelled call
        dropped = len(kept)
        kept[:] = [e for e in kept if fresh(e)]
        dropped -= len(kept)
        self.stale_dropped_total += dropped
        while len(kept) < self.train_batch_size:
            need = self.train_batch_size - len(kept)
            got = await source.read(need)
            usable = [e for e in got if fresh(e)]
            kept.extend(usable)
            self.stale_dropped_total += len(got) - len(usable)
            dropped += len(got) - len(usable)
            if len(got) < need:
                break  # the source is exhausted
        self._carry = []
        metrics: dict[str, float] = {
            "sample/read_time": time.perf_counter() - start,
            "sample/count": float(len(kept)),
            "sample/stale_dropped": float(dropped),
            "sample/stale_dropped_total": float(self.stale_dropped_total),
        }
        if min_version is not None:
            metrics["sample/min_model_version"] = float(min_version)
        if kept:
            versions = [e.model_version for e in kept]
            metrics["sample/model_version/min"] = float(min(versions))
            metrics["sample/model_version/max"] = float(max(versions))
            metrics["sample/model_version/mean"] = sum(versions) / len(versions)
        return kept, metrics, representative_sample(kept)

    @classmethod
    def default_args(cls) -> dict:
        return {"max_staleness": None}


@SAMPLE_STRATEGY.register_module("mix")
class MixSampleStrategy(SampleStrategy):
    """MIX: usual experiences from the source plus expert experiences from ``expert_source``.

    ``expert_batch = ceil(expert_data_ratio * train_batch_size)``, the rest are
    usual. Every experience gets ``info["is_expert"]`` and ``info["step"]``;
    expert ones get ``reward = 0`` and zero ``logprobs``/``advantages`` (as in
    the guide). Custom fields: ``expert_mask`` (bool) and ``step`` (int32).

    The expert data are named by ``buffer.trainer_input.auxiliary_buffers
    [sft_dataset_name]``; turning that jsonl of chat messages into tokenised
    experiences needs the tokenizer, so the trainer builds ``expert_source``
    and passes it in.

    Metrics: ``sample/read_time``, ``sample/count``, ``sample/expert_count``.
    """

    custom_fields: ClassVar[tuple[CustomField, ...]] = (
        CustomField("is_expert", "expert_mask", torch.bool),
        CustomField("step", "step", torch.int32),
    )

    def __init__(
        self,
        buffer_config: BufferConfig,
        source: ExperienceSource | None = None,
        expert_source: ExperienceSource | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(buffer_config, source, **kwargs)
        self.expert_data_ratio = float(kwargs.get("expert_data_ratio", 0.5))
        self.sft_dataset_name = kwargs.get("sft_dataset_name", "sft_dataset")
        if self.sft_dataset_name not in buffer_config.trainer_input.auxiliary_buffers:
            raise ConfigError(
                f"buffer.trainer_input.auxiliary_buffers.{self.sft_dataset_name}",
                "is required by the MIX sample strategy (expert data)",
            )
        total = train_batch_size(buffer_config, kwargs.get("repeat_times"))
        self.expert_batch_size = math.ceil(self.expert_data_ratio * total)
        self.usual_batch_size = total - self.expert_batch_size
        self.expert_source = expert_source

    async def sample(self, step: int) -> tuple[list[Experience], dict, list]:
        source = self._require_source()
        if self.expert_source is None:
            raise RuntimeError("MixSampleStrategy: no expert_source; pass expert_source=...")
        start = time.perf_counter()
        usual = await source.read(self.usual_batch_size) if self.usual_batch_size > 0 else []
        if self.usual_batch_size > 0 and not usual:
            # the rollouts are exhausted: the run ends (expert data alone is not a MIX step)
            return [], {"sample/read_time": time.perf_counter() - start, "sample/count": 0.0}, []
        expert = (
            await self.expert_source.read(self.expert_batch_size)
            if self.expert_batch_size > 0
            else []
        )
        for exp in usual:
            exp.info["is_expert"] = False
            exp.info["step"] = step
        for exp in expert:
            exp.reward = 0.0
            exp.logprobs = torch.zeros(exp.response_length, dtype=torch.float32)
            exp.advantages = torch.zeros(exp.response_length, dtype=torch.float32)
            exp.info["is_expert"] = True
            exp.info["step"] = step
        exps = usual + expert
        metrics = {
            "sample/read_time": time.perf_counter() - start,
            "sample/count": float(len(exps)),
            "sample/expert_count": float(len(expert)),
        }
        return exps, metrics, representative_sample(exps)

    @classmethod
    def default_args(cls) -> dict:
        return {"expert_data_ratio": 0.5, "sft_dataset_name": "sft_dataset"}
