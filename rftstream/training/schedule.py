"""Learning-rate schedules of ``algorithm.optimizer`` (and ``trainer.critic.optim``), as verl.

Trinity-RFT hands its optimizer keys to verl, which builds the schedule with
``get_constant_schedule_with_warmup`` or ``get_cosine_schedule_with_warmup``.
This module computes the same multiplier of the base ``lr`` for each
0-based optimizer step, without I/O and without torch:

* warm-up: ``step / warmup_steps`` for ``step < warmup_steps`` (the first
  optimizer step therefore runs at lr 0 when there is a warm-up, as in verl);
* ``warmup_style: constant``: 1.0 after the warm-up;
* ``warmup_style: cosine``: ``max(m, c * cos(2 * pi * num_cycles * p) + i)``
  after the warm-up, where ``p = (step - warmup) / max(1, total - warmup)``,
  ``m = min_lr_ratio``, ``c = (1 - m) / 2``, ``i = (1 + m) / 2`` and
  ``num_cycles = 0.5`` (a half cosine from lr down to ``m * lr`` at the last step).

The warm-up length is ``lr_warmup_steps`` when it is positive, else
``int(lr_warmup_steps_ratio * total_steps)`` (verl reads the ratio when the
step count is not set). ``min_lr_ratio`` unset means Trinity-RFT's default 0.01.
A schedule that needs the run's total step count (cosine, or a warm-up ratio)
needs ``buffer.total_steps``; without it :func:`lr_schedule` raises
:class:`~rftstream.errors.ConfigError` naming that key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rftstream.config.schema import WARMUP_STYLES
from rftstream.errors import ConfigError

DEFAULT_MIN_LR_RATIO = 0.01  # Trinity-RFT's OptimizerConfig default
COSINE_CYCLES = 0.5  # verl's default: a half cosine over the run


@dataclass(frozen=True)
class LRSchedule:
    """The lr multiplier of each 0-based optimizer step (callable, for ``LambdaLR``)."""

    style: str
    warmup_steps: int
    total_steps: int | None
    min_lr_ratio: float
    num_cycles: float = COSINE_CYCLES

    def __call__(self, step: int) -> float:
        """The multiplier of the base lr at optimizer step ``step`` (0 for the first step)."""
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.style == "constant":
            return 1.0
        assert self.total_steps is not None  # lr_schedule() refuses a cosine without it
        progress = float(step - self.warmup_steps) / float(
            max(1, self.total_steps - self.warmup_steps)
        )
        m = self.min_lr_ratio
        wave = math.cos(math.pi * float(self.num_cycles) * 2.0 * progress)
        return max(m, wave * (1.0 - m) * 0.5 + (1.0 + m) * 0.5)


def lr_schedule(
    opt_cfg: Any, total_steps: int | None, *, key: str = "algorithm.optimizer"
) -> LRSchedule | None:
    """The schedule ``opt_cfg`` asks for, or None for a constant lr without warm-up.

    ``opt_cfg`` has ``warmup_style``, ``lr_warmup_steps``, ``lr_warmup_steps_ratio``
    and ``min_lr_ratio`` (an :class:`~rftstream.config.schema.OptimizerConfig`);
    ``key`` is its path in the config, for error messages. ``total_steps`` is the
    run's trainer step count (``buffer.total_steps``), None when the run has no set
    length.

    Raises:
        ConfigError: an unknown ``warmup_style``; ``min_lr_ratio`` or
            ``lr_warmup_steps_ratio`` outside [0, 1]; a cosine schedule or a
            warm-up ratio without ``buffer.total_steps``.
    """
    style = str(opt_cfg.warmup_style or "constant")
    if style not in WARMUP_STYLES:
        raise ConfigError(
            f"{key}.warmup_style",
            f"must be one of {list(WARMUP_STYLES)} (verl's lr schedules)",
            value=style,
        )
    ratio = float(opt_cfg.lr_warmup_steps_ratio or 0.0)
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            f"{key}.lr_warmup_steps_ratio", "must be in [0, 1] (a share of the steps)", value=ratio
        )
    min_lr = opt_cfg.min_lr_ratio
    min_lr = DEFAULT_MIN_LR_RATIO if min_lr is None else float(min_lr)
    if not 0.0 <= min_lr <= 1.0:
        raise ConfigError(
            f"{key}.min_lr_ratio", "must be in [0, 1] (a share of the base lr)", value=min_lr
        )
    steps = int(opt_cfg.lr_warmup_steps or 0)
    needs_total = style == "cosine" or (steps <= 0 and ratio > 0)
    if needs_total and total_steps is None:
        what = (
            f"{key}.warmup_style: cosine decays over the run's length"
            if style == "cosine"
            else f"{key}.lr_warmup_steps_ratio is a share of the run's length"
        )
        raise ConfigError(
            "buffer.total_steps",
            f"must be set: {what}, and the run has no set number of trainer steps "
            f"(or set {key}.lr_warmup_steps and warmup_style: constant)",
        )
    if total_steps is not None and total_steps < 1:
        raise ConfigError("buffer.total_steps", "must be >= 1", value=total_steps)
    warmup = steps if steps > 0 else int(ratio * (total_steps or 0))
    if style == "constant" and warmup <= 0:
        return None
    return LRSchedule(
        style=style, warmup_steps=warmup, total_steps=total_steps, min_lr_ratio=min_lr
    )
