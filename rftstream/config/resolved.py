"""A run as resolved once: the values derived from the config and the algorithm preset,
and the core's view of the components the algorithm plugin instantiates.

``rftstream.runtime.prepare_run`` resolves a run once: it validates the config,
fills it (:mod:`rftstream.config.resolve`), asks the algorithm plugin for its
components (the ``"default"`` resolver of
:data:`~rftstream.plugins.registries.ALGORITHM_RESOLVERS`) and builds one frozen
:class:`ResolvedRun`. The actors read ``repeat_times``, ``train_batch_size`` and the
synchronisation policy from it, not from the config again.

The plugin boundary is typed: :class:`ResolvedAlgorithmProtocol` is what the core
uses of the plugin's ``algorithms.ResolvedAlgorithm``, :class:`SampleStrategyProtocol`
what the trainer uses of a sample strategy. The core never imports the plugin package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rftstream.config.schema import AlgorithmConfig, BufferConfig, Config
from rftstream.config.sync_policy import SyncPolicy

if TYPE_CHECKING:
    from rftstream.experience import Experience


@runtime_checkable
class SampleStrategyProtocol(Protocol):
    """What the trainer uses of a sample strategy (``algorithms.SampleStrategy``)."""

    async def sample(self, step: int) -> tuple[list[Experience], dict[str, Any], list[Any]]:
        """The experiences of trainer step ``step``, the sampling metrics and the raw
        samples (the strategy's own). Blocks until the batch is there."""
        ...


@runtime_checkable
class ResolvedAlgorithmProtocol(Protocol):
    """What the core uses of the resolved algorithm (``algorithms.ResolvedAlgorithm``).

    ``config`` is the merged ``algorithm:`` section (every field filled);
    ``repeat_times`` the rollouts per task; the ``*_fn`` attributes the instantiated
    components (the trainer calls them; their interfaces are the plugin's).
    """

    name: str
    config: AlgorithmConfig
    repeat_times: int
    advantage_fn: Any
    policy_loss_fn: Any
    kl_penalty_fn: Any
    kl_loss_fn: Any
    entropy_loss_fn: Any
    sample_strategy_cls: type[Any]
    sample_strategy_args: dict[str, Any]
    use_reference: bool
    use_critic: bool
    compute_advantage_in_trainer: bool
    batch_shape: Any  # rftstream.config.resolve.VerlBatchShape, or None

    @property
    def custom_fields(self) -> tuple[Any, ...]:
        """Extra per-experience batch tensors the sample strategy provides."""
        ...

    def create_sample_strategy(
        self, buffer_config: BufferConfig, source: Any = None, **extra: Any
    ) -> SampleStrategyProtocol:
        """The sample strategy on ``source`` (the trainer's experience source)."""
        ...

    def check_loss_inputs(self, available: set[str]) -> list[str]:
        """Inputs the losses need that neither ``available`` nor the strategy provide."""
        ...


@dataclass(frozen=True)
class ResolvedRun:
    """What a run's config comes to, derived once (``prepare_run``) and handed to the
    actors: the algorithm's components, the rollouts per task, the experiences per
    trainer step and the synchronisation policy."""

    algorithm: ResolvedAlgorithmProtocol
    repeat_times: int
    train_batch_size: int
    sync: SyncPolicy

    @classmethod
    def of(cls, cfg: Config, algorithm: ResolvedAlgorithmProtocol) -> ResolvedRun:
        """The run of a resolved ``cfg`` (``buffer.train_batch_size`` filled) and its
        resolved ``algorithm``."""
        return cls(
            algorithm=algorithm,
            repeat_times=int(algorithm.repeat_times),
            train_batch_size=int(cfg.buffer.train_batch_size),
            sync=SyncPolicy.from_config(cfg.synchronizer),
        )


def names_missing(algorithm: object) -> list[str]:
    """The members of :class:`ResolvedAlgorithmProtocol` (its attributes, properties and
    methods, read off the class) that ``algorithm`` lacks: a plugin's resolver returning
    something else is named at once."""
    members = dict.fromkeys(
        [*ResolvedAlgorithmProtocol.__annotations__, *vars(ResolvedAlgorithmProtocol)]
    )
    return [name for name in members if not name.startswith("_") and not hasattr(algorithm, name)]
