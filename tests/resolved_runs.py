"""A :class:`~rftstream.config.resolved.ResolvedRun` for a test's config, resolved as
``prepare_run`` resolves it (the algorithm plugin's components, the train batch size),
without building a model or validating files."""

from __future__ import annotations

from rftstream.config.resolve import with_train_batch_size
from rftstream.config.resolved import ResolvedRun
from rftstream.config.schema import Config


def resolved_run(cfg: Config) -> ResolvedRun:
    from algorithms.algorithm import resolve_algorithm

    algorithm = resolve_algorithm(cfg.algorithm, cfg.buffer)
    return ResolvedRun.of(with_train_batch_size(cfg, algorithm.repeat_times), algorithm)
