"""``Timer``: adds the wall time of a ``with`` block to a metrics dict (Trinity-RFT's ``trinity.utils.timer``)."""

from __future__ import annotations

import time
from types import TracebackType


class Timer:
    """``with Timer(metrics, "read_time"):`` adds the block's wall time (seconds) to ``metrics[name]``.

    As Trinity-RFT's ``trinity.utils.timer.Timer``; the value accumulates if the
    key is already there. Never blocks.
    """

    def __init__(self, metrics: dict, name: str) -> None:
        self.metrics = metrics
        self.name = name
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self._start
        self.metrics[self.name] = self.metrics.get(self.name, 0.0) + elapsed
