"""Experience operators: the ``ExperienceOperator`` interface and its async form.

As in Trinity-RFT (``trinity.buffer.operators``): an operator takes the
experiences of one batch and returns the processed list plus a metrics dict.
The experience pipeline runs operators inside an operator host's event loop,
so each operator also has an async face:

* :class:`ExperienceOperator` implements the synchronous :meth:`process`
  (exactly Trinity-RFT's interface). Its default :meth:`process_async` runs
  :meth:`process` in a worker thread (``anyio.to_thread.run_sync``), so a slow
  operator never blocks the event loop; :meth:`prepare` and :meth:`close` do
  nothing.
* :class:`AsyncExperienceOperator` implements :meth:`process_async` directly
  (an operator that awaits I/O, e.g. a reward model server) and may use
  :meth:`prepare` / :meth:`close` to open and release resources.

Cancellation: cancelling ``process_async`` of a sync operator (e.g. the
operator host's ``process_timeout``) returns at once and abandons the worker
thread's result; the thread itself runs to completion.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import anyio.to_thread

from rftstream.config.schema import OperatorConfig
from rftstream.experience import Experience
from rftstream.registry import Registry

EXPERIENCE_OPERATORS: Registry[type[ExperienceOperator]] = Registry("experience_operators")


class ExperienceOperator(ABC):
    """Base class of every experience operator."""

    @abstractmethod
    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Process a list of experiences and return a transformed list.

        Args:
            exps: the experiences of one batch (one or more tasks' groups).

        Returns:
            The processed experiences and a dict of metrics.
        """

    async def prepare(self) -> None:
        """Acquire resources before the first batch (no-op by default)."""
        return None

    async def process_async(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Run :meth:`process` in a worker thread; the event loop stays free meanwhile."""
        return await anyio.to_thread.run_sync(self.process, exps, abandon_on_cancel=True)

    async def close(self) -> None:
        """Release resources after the last batch (no-op by default)."""
        return None

    @classmethod
    def create_operators(cls, operator_configs: list[OperatorConfig]) -> list[ExperienceOperator]:
        """Instantiate operators from configs (Trinity-RFT's classmethod; see ``create_operators``)."""
        from operators.pipeline import create_operators

        return create_operators(operator_configs)


class AsyncExperienceOperator(ExperienceOperator):
    """An operator whose work is a coroutine: implement :meth:`process_async`.

    The synchronous :meth:`process` is not available (it raises TypeError):
    run it through an :class:`~operators.pipeline.ExperiencePipeline`.
    """

    @abstractmethod
    async def process_async(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Process one batch; may await I/O. Returns ``(experiences, metrics)``."""

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        raise TypeError(
            f"{type(self).__name__} is asynchronous: await process_async() "
            f"(or run it in an ExperiencePipeline)"
        )
