"""A run resolved once: ``config.resolved.ResolvedRun`` and the typed plugin boundary."""

from __future__ import annotations

from typing import Any

import pytest

from rftstream.config.resolve import run_repeat_times, with_train_batch_size
from rftstream.config.resolved import (
    ResolvedAlgorithmProtocol,
    ResolvedRun,
    names_missing,
)
from rftstream.config.schema import AlgorithmConfig, BufferConfig, Config, SynchronizerConfig
from rftstream.config.sync_policy import SyncPolicy
from rftstream.errors import ConfigError


def _algorithm(cfg: Config) -> Any:
    from algorithms.algorithm import resolve_algorithm

    return resolve_algorithm(cfg.algorithm, cfg.buffer)


def test_the_plugins_resolved_algorithm_is_what_the_core_types_it_as() -> None:
    cfg = Config(algorithm=AlgorithmConfig(algorithm_type="grpo"))
    algorithm = _algorithm(cfg)
    assert names_missing(algorithm) == []
    assert isinstance(algorithm, ResolvedAlgorithmProtocol)


def test_a_resolved_run_carries_what_the_actors_read() -> None:
    cfg = Config(
        algorithm=AlgorithmConfig(algorithm_type="grpo", repeat_times=4),
        buffer=BufferConfig(batch_size=6, train_batch_size=0),
        synchronizer=SynchronizerConfig(sync_interval=2, max_staleness=3),
    )
    algorithm = _algorithm(cfg)
    run = ResolvedRun.of(with_train_batch_size(cfg, algorithm.repeat_times), algorithm)
    assert (run.repeat_times, run.train_batch_size) == (4, 24)
    assert run.sync == SyncPolicy.from_config(cfg.synchronizer)
    assert run.sync.max_staleness == 3
    assert run.algorithm is algorithm


def test_an_unresolved_repeat_times_is_named_not_guessed() -> None:
    with pytest.raises(ConfigError, match="algorithm.repeat_times"):
        run_repeat_times(Config())
    assert run_repeat_times(Config(algorithm=AlgorithmConfig(repeat_times=5))) == 5


def test_a_resolver_returning_something_else_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from rftstream import runtime

    class Half:
        name = "half"
        repeat_times = 2

    monkeypatch.setattr(runtime.ALGORITHM_RESOLVERS, "get", lambda name: lambda a, b: Half())
    with pytest.raises(ConfigError, match="without config, advantage_fn") as err:
        runtime._resolve_algorithm(AlgorithmConfig(algorithm_type="grpo"), BufferConfig())
    assert "algorithm.algorithm_type" in str(err.value)
