"""A long-tail workload for ``benchmarks/vs_trl.py``: the arithmetic task with a slow verifier.

``longtail_math_workflow`` is ``math_workflow`` whose scoring of a task's group
first waits :func:`verifier_delay` seconds (20-200 ms, fixed per task row), as
a remote verifier or a sandbox would. The wait runs where the workflow scores,
in a worker thread (as ``math_workflow`` scores with a reward fn that may block),
so it holds one task, not the explorer. Load it with ``--plugin-dir benchmarks/plugins``.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import anyio.to_thread

from workflows import WORKFLOWS
from workflows.math_workflow import MathWorkflow

MIN_DELAY_S = 0.02
MAX_DELAY_S = 0.2


def verifier_delay(index: int) -> float:
    """The verifier's time for task row ``index``: uniform in [20, 200] ms, fixed per row."""
    digest = hashlib.sha256(f"longtail:{index}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return MIN_DELAY_S + (MAX_DELAY_S - MIN_DELAY_S) * u


@WORKFLOWS.register_module("longtail_math_workflow")
class LongTailMathWorkflow(MathWorkflow):
    """``math_workflow`` with a verifier that takes :func:`verifier_delay` per task."""

    async def run_async(self) -> list[Any]:
        """The replies, then :meth:`score` in a worker thread (the verifier blocks)."""
        responses = await self.generate_async()
        return await anyio.to_thread.run_sync(self.score, responses, abandon_on_cancel=True)

    def score(self, responses: list[Any]) -> list[Any]:
        time.sleep(verifier_delay(int(self.task.index or 0)))
        return super().score(responses)
