"""Pieces every actor uses: in-progress ticking, draining a consumer up to a cut,
JSON-lines records, a frozen heap. (Heartbeats: :mod:`rftstream.control.liveness`.)

:meth:`InProgressTicker.run` is long-running, meant to be started in the actor's own
anyio task group; it returns only when cancelled.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import anyio

from rftstream.bus.client import Bus
from rftstream.bus.transport import Delivery, PullSubscription
from rftstream.errors import ConsumerNotFound

log = logging.getLogger(__name__)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects that exist now (the model, the libraries) out of the garbage
    collector's passes while the block runs (``gc.freeze``; ``gc.unfreeze`` after).

    An actor's loop makes many short-lived objects per step, and each collection
    pass used to walk the whole model's Python objects too: about 1 ms per trainer
    step on the embedded default (2% of it). Objects that become garbage inside
    the block are still collected; frozen ones that do are freed after it.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class InProgressTicker:
    """Keeps held JetStream messages from being redelivered during long work.

    Messages added with :meth:`hold` get ``+WPI`` (``in_progress()``) every
    ``interval`` seconds until :meth:`release`. Run :meth:`run` in a task group.
    """

    def __init__(self, interval: float) -> None:
        self.interval = max(0.5, interval)
        self._held: dict[int, Delivery] = {}

    def hold(self, msg: Delivery) -> None:
        self._held[id(msg)] = msg

    def release(self, msg: Delivery) -> None:
        self._held.pop(id(msg), None)

    @property
    def held(self) -> int:
        return len(self._held)

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            for msg in list(self._held.values()):
                try:
                    await msg.in_progress()
                except Exception as exc:  # noqa: BLE001 - connection trouble: next tick retries
                    log.debug("in_progress failed: %s", exc)


async def consumer_drained(bus: Bus, stream: str, durable: str) -> bool:
    """True if the durable has nothing left to deliver and nothing unacked."""
    try:
        info = await bus.consumer_state(stream, durable)
    except ConsumerNotFound:
        return True
    return info.num_pending == 0 and info.num_ack_pending == 0


class DrainStep(NamedTuple):
    """What one :func:`drain_step` did."""

    mine: list[Delivery]  # fetched messages up to the cut: the caller's to process and ack
    done: bool  # every message up to the cut is acked: the consumer may go
    skipped: int  # fetched messages after the cut, acked unprocessed


async def drained_to(consumer: PullSubscription, cut: int) -> bool:
    """Whether every message of ``consumer`` up to stream sequence ``cut`` is acked.

    True when the ack floor reached ``cut``, or when nothing is left to
    deliver and nothing is unacked (the floor of a filtered consumer stops at
    its last message, which may lie before ``cut``). A cut is never beyond the
    stream's end when it is taken, so no message up to it can arrive later.
    One JetStream API round trip.
    """
    info = await consumer.info()
    if info.ack_floor >= cut:
        return True
    return info.num_pending == 0 and info.num_ack_pending == 0


async def drain_step(
    consumer: PullSubscription, cut: int | None, *, batch: int, timeout: float
) -> DrainStep:
    """One step of draining ``consumer`` up to ``cut`` (after a splice or an unsplice).

    ``cut`` None (not known yet): fetch and return everything. Otherwise
    first check :func:`drained_to` (then nothing is fetched); else fetch up
    to ``batch`` messages (waiting up to ``timeout`` s), ack the ones after
    the cut unprocessed (they belong to whoever reads from ``cut + 1``) and
    return the others unacked. Blocks for the API round trips and the fetch.
    """
    if cut is not None and await drained_to(consumer, cut):
        return DrainStep([], True, 0)
    mine: list[Delivery] = []
    skipped = 0
    for m in await consumer.fetch(batch, timeout=timeout):
        if cut is not None and m.metadata.sequence.stream > cut:
            await m.ack()
            skipped += 1
        else:
            mine.append(m)
    return DrainStep(mine, False, skipped)


def nan_to_none(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float (NaN, inf) replaced by None (JSON null)."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path``, creating its directory if needed.

    Blocking file I/O: call it through ``anyio.to_thread.run_sync``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line + "\n")
