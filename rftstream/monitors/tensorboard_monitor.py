"""``monitor_type: tensorboard``: TensorBoard event files under ``<run_dir>/tensorboard/<role>``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rftstream.monitors.base import Monitor, RunInfo


class TensorboardMonitor(Monitor):
    """Scalars through torch's ``SummaryWriter`` (the ``tensorboard`` package writes the
    files); view them with ``tensorboard --logdir <run_dir>/tensorboard``."""

    name = "tensorboard"
    package = "tensorboard"
    extra = "tensorboard"

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run.run_dir / "tensorboard" / run.role
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
