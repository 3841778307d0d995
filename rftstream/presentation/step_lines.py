"""How trainer steps read on the console of ``rftstream up`` and the trainer command.

:func:`step_line` renders one ``metrics.jsonl`` record; :class:`StepLines` decides
which steps get a line. Pure: no I/O.
"""

from __future__ import annotations

import time
from typing import Any


class StepLines:
    """Which trainer steps get a line on the console: the first few, the last, and then at
    most ``per_second`` a second (every step of a slow run; the progress bar shows the
    rest, ``metrics.jsonl`` has every step)."""

    def __init__(self, total: int | None, first: int = 5, per_second: float = 2.0) -> None:
        self.total = total
        self.first = first
        self.gap = 1.0 / per_second
        self._last = float("-inf")

    def due(self, step: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if step <= self.first or step == self.total or now - self._last >= self.gap:
            self._last = now
            return True
        return False


def format_number(v: Any, spec: str = ".3f") -> str:
    """``v`` formatted with ``spec``; ``-`` for None (a metric a step did not report)."""
    return "-" if v is None else format(v, spec)


def step_line(r: dict[str, Any]) -> str:
    """The console line of one ``metrics.jsonl`` record: step, reward, filtered, staleness,
    trainer wait and loss."""
    return (
        f"step {r['step']:>4}  reward {format_number(r.get('reward/mean')):>5}  "
        f"filtered {int(r.get('experience/filtered') or 0):>4}  "
        f"staleness {format_number(r.get('staleness/mean'), '.2f'):>4}  "
        f"wait {format_number(r.get('time/trainer_wait'), '.2f'):>4}s  "
        f"loss {format_number(step_loss(r), '.4f')}"
    )


def step_loss(r: dict[str, Any]) -> float | None:
    """The step's policy loss; for runs without one (sft, dpo) the loss they train on."""
    for key in ("actor/pg_loss", "actor/sft_loss", "actor/dpo_loss", "actor/loss"):
        if r.get(key) is not None:
            return r[key]
    return None
