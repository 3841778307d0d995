"""The interface every metrics backend implements, and what a step's values become.

A :class:`Monitor` receives each trainer step's scalar metrics (the keys of
``metrics.jsonl``: ``reward/mean``, ``staleness/mean``, ``actor/pg_loss`` ...) with the
step number. Its methods block (file writes, a backend's own service); callers in an
event loop run them through ``anyio.to_thread``. No method is called concurrently with
another on the same monitor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

# keys of a step record that are not metrics: the step itself and its wall-clock time
NOT_METRICS = frozenset({"step", "ts"})


def scalar_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric values of a step record, as floats, without ``step`` and ``ts``.

    Booleans, strings, nested values, ``None`` and NaN/inf are left out (a backend gets no
    point for a step where a metric has no value)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        number = float(value)
        if math.isfinite(number):
            out[key] = number
    return out


class Monitor(ABC):
    """One metrics backend of one actor of a run.

    Subclasses set :attr:`name` (the ``monitor.monitor_type`` value), :attr:`package`
    (the module they import) and :attr:`extra` (the pip extra that installs it), and
    open their backend in ``__init__`` (which blocks and raises
    :class:`~rftstream.errors.ConfigError` for bad ``monitor.monitor_args``).
    """

    name: ClassVar[str]
    package: ClassVar[str | None] = None  # the module the backend needs (None: none)
    extra: ClassVar[str | None] = None  # pip install 'rftstream[<extra>]'
    args: ClassVar[tuple[str, ...]] = ()  # the monitor.monitor_args keys it reads

    def __init__(self, run: RunInfo) -> None:
        self.run = run

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (finite floats) at ``step``. Blocks."""

    @abstractmethod
    def close(self) -> None:
        """Flush and close the backend. Blocks; safe to call once."""


class RunInfo:
    """What a monitor knows of its run: names, directory, its role, the config it records."""

    def __init__(
        self,
        *,
        project: str,
        group: str,
        name: str,
        role: str,
        run_dir: Path,
        config: dict[str, Any],
        monitor_args: Mapping[str, Any],
    ) -> None:
        self.project = project
        self.group = group or name
        self.name = name
        self.role = role
        self.run_dir = Path(run_dir)
        self.config = config  # resolved, secrets masked
        self.monitor_args = dict(monitor_args)

    @property
    def display_name(self) -> str:
        """``<name>_<role>``: the run name backends show (as Trinity-RFT names them)."""
        return f"{self.name}_{self.role}"
