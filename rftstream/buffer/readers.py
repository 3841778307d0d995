"""``get_buffer_reader``: the buffers a sample strategy reads, as in Trinity-RFT.

Trinity-RFT sample strategies open their own readers
(``get_buffer_reader(storage_config, buffer_config)``). Here the trainer owns
its inputs and publishes them for the duration of its run with
:func:`trainer_inputs`:

* the trainer's experience buffer (``buffer.trainer_input.experience_buffer``,
  ``None`` in ``mode: both``): the live ``exp.train`` consumer, or the dataset
  in ``mode: train``;
* any other storage (``auxiliary_buffers.<name>``, e.g. MIX's expert data): a
  tokenised dataset from that file, cycled for as long as the trainer runs.

A reader's :meth:`BufferReader.read_async` returns ``buffer_config.train_batch_size``
experiences (the config passed to ``get_buffer_reader``), waiting for them.
Readers exist only inside a trainer (a sample strategy is built there);
elsewhere :func:`get_buffer_reader` raises RuntimeError.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rftstream.config.schema import BufferConfig, StorageConfig
from rftstream.experience import Experience


@dataclass
class TrainerInputs:
    """What a trainer lends its sample strategy's readers."""

    experience_buffer: StorageConfig | None
    source: Any  # ExperienceSource: the trainer's main input
    open_dataset: Callable[[StorageConfig], Any]  # storage -> ExperienceSource


_INPUTS: contextvars.ContextVar[TrainerInputs | None] = contextvars.ContextVar(
    "rftstream_trainer_inputs", default=None
)


@contextlib.contextmanager
def trainer_inputs(inputs: TrainerInputs) -> Iterator[None]:
    """Make ``inputs`` what :func:`get_buffer_reader` opens, inside the ``with`` block."""
    token = _INPUTS.set(inputs)
    try:
        yield
    finally:
        _INPUTS.reset(token)


class BufferReader:
    """Reads ``batch_size`` experiences per call from one of the trainer's inputs."""

    def __init__(self, source: Any, batch_size: int) -> None:
        self.source = source
        self.batch_size = batch_size

    async def read_async(self, batch_size: int | None = None) -> list[Experience]:
        """The next ``batch_size`` (default: the config's ``train_batch_size``) experiences.

        Waits until they are there; fewer only when the input is exhausted, and
        raises ``StopAsyncIteration`` once nothing is left (as Trinity-RFT's
        readers signal the end; the trainer then finishes the run).
        """
        exps = await self.source.read(batch_size or self.batch_size)
        if not exps:
            raise StopAsyncIteration(f"{type(self.source).__name__} is exhausted")
        return exps


def get_buffer_reader(
    storage_config: StorageConfig | None, buffer_config: BufferConfig
) -> BufferReader:
    """A reader of ``storage_config`` yielding ``buffer_config.train_batch_size`` per read.

    ``None`` or the trainer's own ``experience_buffer`` is the trainer's main
    input; any other storage is opened as a dataset (see the module docstring).
    """
    inputs = _INPUTS.get()
    if inputs is None:
        raise RuntimeError(
            "get_buffer_reader works inside a trainer only (sample strategies are built there)"
        )
    size = int(buffer_config.train_batch_size)
    if storage_config is None or storage_config == inputs.experience_buffer:
        return BufferReader(inputs.source, size)
    return BufferReader(inputs.open_dataset(storage_config), size)
