"""Metrics backends (``monitor.monitor_type``): TensorBoard, Weights & Biases, MLflow.

``monitor.monitor_type`` names one backend or a list of them::

    monitor:
      monitor_type: [jsonl, tensorboard, wandb, mlflow]
      monitor_args: {mode: offline}

``jsonl`` (the default) is the run's own record: the trainer writes every step to
``<run_dir>/metrics.jsonl`` and explorers their evaluations to ``eval.jsonl``. The
trainer writes ``metrics.jsonl`` whatever the setting (the summary, the plots, the report
and resuming read it); ``none`` alone turns off ``eval.jsonl`` and every backend.
``tensorboard``, ``wandb`` and ``mlflow`` (:data:`BACKENDS`) each get the same scalars
as ``metrics.jsonl`` at the same steps. Each needs its optional extra
(``pip install 'rftstream[wandb]'``); a missing one fails the run before it starts,
naming the key and the extra.

:class:`MonitorSet` is what the trainer holds: it opens the backends, logs each step to
all of them and closes them. A backend that fails while logging is closed and dropped
with one warning naming it; the run goes on (``metrics.jsonl`` keeps every step).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rftstream.config.masking import masked_config
from rftstream.config.monitor_keys import KEY, check_monitor_config, monitor_types
from rftstream.errors import ConfigError
from rftstream.monitors.base import Monitor, RunInfo, scalar_metrics

__all__ = [
    "BACKENDS",
    "Monitor",
    "MonitorSet",
    "RunInfo",
    "check_monitor_config",
    "check_monitor_packages",
    "monitor_types",
    "scalar_metrics",
]

log = logging.getLogger(__name__)


def _tensorboard() -> type[Monitor]:
    from rftstream.monitors.tensorboard_monitor import TensorboardMonitor

    return TensorboardMonitor


def _wandb() -> type[Monitor]:
    from rftstream.monitors.wandb_monitor import WandbMonitor

    return WandbMonitor


def _mlflow() -> type[Monitor]:
    from rftstream.monitors.mlflow_monitor import MlflowMonitor

    return MlflowMonitor


# name -> its class, imported on use (the classes import wandb / mlflow only when opened)
BACKENDS: dict[str, Callable[[], type[Monitor]]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
}


def check_monitor_packages(monitor_type: Any) -> None:
    """Raise :class:`ConfigError` (key ``monitor.monitor_type``) when a chosen backend's
    package is not installed, naming the extra that installs it. Looks packages up
    without importing them."""
    for name in monitor_types(monitor_type):
        if name in BACKENDS:
            backend = BACKENDS[name]()
            if backend.package and importlib.util.find_spec(backend.package) is None:
                raise ConfigError(
                    KEY,
                    f"`{name}` needs the {backend.package} package, which is not installed: "
                    f"pip install 'rftstream[{backend.extra}]'",
                    value=monitor_type,
                    has_value=True,
                )


class MonitorSet:
    """The backends of one actor, logged to together. Every method blocks."""

    def __init__(self, monitors: list[Monitor]) -> None:
        self.monitors = monitors

    @classmethod
    def open(cls, cfg: Any, run_dir: str | Path, role: str) -> MonitorSet:
        """Open every backend ``cfg.monitor.monitor_type`` names for actor ``role``.

        Blocks (wandb starts its service process, MLflow creates its run). Raises
        :class:`ConfigError` for a missing package or bad ``monitor_args``; a backend
        opened before the failing one is closed again."""
        names = [n for n in monitor_types(cfg.monitor.monitor_type) if n in BACKENDS]
        if not names:
            return cls([])
        check_monitor_packages(names)
        info = RunInfo(
            project=cfg.project,
            group=getattr(cfg, "group", ""),
            name=cfg.name,
            role=role,
            run_dir=Path(run_dir),
            config=masked_config(cfg),
            monitor_args=cfg.monitor.monitor_args,
        )
        opened: list[Monitor] = []
        try:
            for name in names:
                opened.append(BACKENDS[name]()(info))
        except BaseException:
            cls(opened).close()
            raise
        log.info("monitors of %s: %s", role, ", ".join(m.name for m in opened))
        return cls(opened)

    def __bool__(self) -> bool:
        return bool(self.monitors)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        """Log the scalars of one step record (:func:`scalar_metrics`) to every backend.

        A backend that raises is closed and dropped with a warning naming it."""
        if not self.monitors:
            return
        metrics = scalar_metrics(record)
        for monitor in list(self.monitors):
            try:
                monitor.log(metrics, step)
            except Exception as exc:  # a backend's failure does not stop training
                log.warning(
                    "monitor %s failed at step %d and is dropped (metrics.jsonl has every "
                    "step): %s: %s",
                    monitor.name,
                    step,
                    type(exc).__name__,
                    exc,
                )
                self.monitors.remove(monitor)
                self._close_one(monitor)

    def close(self) -> None:
        """Close every backend (each once); failures are logged, not raised."""
        monitors, self.monitors = self.monitors, []
        for monitor in monitors:
            self._close_one(monitor)

    @staticmethod
    def _close_one(monitor: Monitor) -> None:
        try:
            monitor.close()
        except Exception as exc:
            log.warning("monitor %s did not close cleanly: %s", monitor.name, exc)
