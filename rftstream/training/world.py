"""The trainer's rank world as the launcher describes it in the environment.

``torchrun`` / ``deepspeed`` set ``WORLD_SIZE`` and ``RANK`` for every trainer
process; these helpers read them (no I/O besides the environment) and size one
rank's share of the train batch. :mod:`rftstream.training.ranks` runs the ranks;
:mod:`rftstream.training.engine` sizes its gradient accumulation from here.
"""

from __future__ import annotations

import math
import os

from rftstream.errors import ConfigError


def env_world_size() -> int:
    """The number of trainer ranks of this process's launch (``WORLD_SIZE``, default 1).

    Raises:
        ConfigError: ``WORLD_SIZE`` is not a positive integer.
    """
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError("WORLD_SIZE", f"must be a positive integer, got {raw!r}")
    return n


def env_rank() -> int:
    """This process's trainer rank (``RANK``, default 0)."""
    return int(os.environ.get("RANK", "0"))


def per_rank_batch_size(train_batch_size: int, world_size: int) -> int:
    """Rows one rank trains per step: ``ceil(train_batch_size / world_size)`` (at least 1).

    Every rank sizes its gradient accumulation from it, so all ranks run the same
    number of micro-batches (DeepSpeed's accumulation boundary) whatever their shard.
    """
    return max(1, math.ceil(max(1, train_batch_size) / max(1, world_size)))
