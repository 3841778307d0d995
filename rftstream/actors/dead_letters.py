"""Stop a run that dead-letters (nearly) everything: ``monitor.dead_letter_window`` and
``monitor.max_dead_letter_share``.

A group is one message: a task (``dlq.tasks`` when the explorer gives it up)
or one group of experiences (``dlq.<stage>`` from an operator host,
``dlq.train`` from the trainer). It *passes* when the trainer accepts it for
training. Of the last ``dead_letter_window`` groups seen (default 64, a few
batches of a usual run, large enough that a burst of bad tasks in a healthy
run does not fill it), when at least ``max_dead_letter_share`` (default 1.0:
all of them) were dead-lettered, the run fails with an error naming the
stage(s) and the most common reason. A run that ends before the window fills,
with no trainer step and only dead letters, fails the same way.

Why the trainer watches (not ``rftstream up``'s supervisor): the trainer is
the one actor of every deployment (``up``, separate ``rftstream trainer``
processes), it sees each group it accepts without a round trip, and its
failure already sets the run status to ``failed`` and makes ``rftstream up``
exit non-zero. The dead letters come from a headers-only ordered consumer on
``rft.<run>.dlq.>`` starting at the watcher's start time (a restarted
trainer does not count the dead letters of an earlier life against groups it
never saw).

:class:`DeadLetterWindow` is the logic (no I/O); :class:`DeadLetterWatcher`
the NATS side.
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio

from rftstream.bus.client import Bus
from rftstream.errors import RftError
from rftstream.wire import H_DLQ_REASON, H_DLQ_STAGE

POLL_S = 0.5  # how often the watcher counts the trainer's accepted groups and judges


class DeadLetterThresholdError(RftError):
    """The run dead-lettered at least ``monitor.max_dead_letter_share`` of its last groups."""


def reason_kind(reason: str) -> str:
    """``reason`` with what differs between instances of one cause (numbers, ids,
    quoted values) blanked, so the reasons of one cause count together."""
    kind = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
    kind = re.sub(r"\b(?=[0-9a-f_-]*\d)[0-9a-zA-Z_-]{8,}\b", "<id>", kind)
    return re.sub(r"\d+", "#", kind)


class DeadLetterWindow:
    """The outcomes (passed, or dead-lettered at a stage for a reason) of the last ``size``
    groups, and the verdict on them.

    ``size`` 0 disables every verdict. Pure logic: no I/O, no clock.
    """

    def __init__(self, size: int, max_share: float) -> None:
        if size < 0:
            raise ValueError(f"dead_letter_window must be >= 0, got {size}")
        if not 0 < max_share <= 1:
            raise ValueError(f"max_dead_letter_share must be in (0, 1], got {max_share}")
        self.size = size
        self.max_share = max_share
        # None: passed; else (stage, reason)
        self._window: deque[tuple[str, str] | None] = deque(maxlen=max(size, 1))
        self.passed_total = 0
        self.dead_total = 0

    def passed(self, n: int = 1) -> None:
        """``n`` groups passed (the trainer accepted them)."""
        for _ in range(min(n, self._window.maxlen or 0)):
            self._window.append(None)
        self.passed_total += n

    def dead(self, stage: str, reason: str) -> None:
        """One group was dead-lettered at ``stage`` for ``reason``."""
        self._window.append((stage, reason))
        self.dead_total += 1

    def verdict(self) -> str | None:
        """Why the run must fail (the window is full and its dead share reaches
        ``max_share``), or None."""
        if self.size == 0 or len(self._window) < self.size:
            return None
        dead = [d for d in self._window if d is not None]
        if len(dead) < self.max_share * self.size - 1e-9:
            return None
        if len(dead) == self.size:
            head = f"the last {self.size} groups were all dead-lettered"
        else:
            head = f"{len(dead)} of the last {self.size} groups were dead-lettered"
        return f"{head} {_where(dead)}"

    def final_verdict(self, trained_steps: int) -> str | None:
        """At the run's end: :meth:`verdict`, or, for a run that ended with no trainer step,
        no group passed and some dead-lettered, why it failed; else None."""
        found = self.verdict()
        if found is not None or self.size == 0:
            return found
        if trained_steps == 0 and self.passed_total == 0 and self.dead_total:
            dead = [d for d in self._window if d is not None]
            return (
                f"no trainer step: all {self.dead_total} groups of the run were dead-lettered "
                f"{_where(dead)}"
            )
        return None


def _where(dead: list[tuple[str, str]]) -> str:
    """``at stage S; most common reason (Kx): R`` for the dead letters ``dead``."""
    stages = Counter(stage for stage, _ in dead)
    if len(stages) == 1:
        at = f"at stage {next(iter(stages))}"
    else:
        at = "at stages " + ", ".join(f"{s} ({n})" for s, n in stages.most_common())
    kinds = Counter(reason_kind(reason) for _, reason in dead)
    kind, count = kinds.most_common(1)[0]
    example = next(reason for _, reason in dead if reason_kind(reason) == kind)
    return f"{at}; most common reason ({count}x): {example}"


class DeadLetterWatcher:
    """Counts the run's dead letters (from NATS) and the groups the trainer accepted
    (``accepted()``: a running total), and fails the run when the window says so.

    :meth:`start` subscribes (returns at once); :meth:`watch` judges every
    ``POLL_S`` and raises :class:`DeadLetterThresholdError` when the threshold
    is passed (cancel it to stop; it holds nothing); :meth:`check_final` judges
    once more at the run's end; :meth:`stop` unsubscribes.
    """

    def __init__(
        self, bus: Bus, accepted: Callable[[], int], *, window: int, max_share: float
    ) -> None:
        self.bus = bus
        self.accepted = accepted
        self.window = DeadLetterWindow(window, max_share)
        self._accepted_seen = 0
        self._last_seq = 0  # the stream sequence of the last dead letter counted
        self._sub: Any = None

    def _sync_passed(self) -> None:
        now = self.accepted()
        if now > self._accepted_seen:
            self.window.passed(now - self._accepted_seen)
            self._accepted_seen = now

    def on_dead_letter(self, headers: dict[str, str] | None) -> None:
        """Count one dead letter (its ``Rft-Dlq-Stage`` / ``Rft-Dlq-Reason`` headers), after
        the groups the trainer accepted until now."""
        h = headers or {}
        self._sync_passed()
        self.window.dead(h.get(H_DLQ_STAGE, "?"), h.get(H_DLQ_REASON, "no reason given"))

    async def start(self) -> None:
        """Subscribe to ``rft.<run>.dlq.>`` from now on (headers only). Does not block."""
        if self.window.size == 0:
            return

        async def on_msg(msg: Any) -> None:
            self.on_dead_letter(msg.headers)
            try:
                self._last_seq = max(self._last_seq, int(msg.metadata.sequence.stream))
            except Exception:  # noqa: BLE001 - no JetStream metadata
                pass

        self._sub = await self.bus.watch(
            self.bus.names.dlq_stream,
            self.bus.names.dlq_wildcard,
            on_msg,
            start_time=datetime.fromtimestamp(time.time(), UTC),
            headers_only=True,
            description=f"run {self.bus.names.run}: the dead-letter watch of {self.bus.actor} "
            "(monitor.max_dead_letter_share) reads the headers of new dead letters",
        )

    def _raise_if(self, why: str | None) -> None:
        if why is not None:
            raise DeadLetterThresholdError(
                f"run failed: {why} (monitor.dead_letter_window {self.window.size}, "
                f"monitor.max_dead_letter_share {self.window.max_share}; the dead letters are "
                f"on {self.bus.names.dlq_wildcard})"
            )

    async def watch(self) -> None:
        """Judge every ``POLL_S`` until cancelled. Raises:
        DeadLetterThresholdError: the share of dead letters reached the threshold."""
        if self.window.size == 0:
            await anyio.sleep_forever()
        while True:
            await anyio.sleep(POLL_S)
            self._sync_passed()
            self._raise_if(self.window.verdict())

    async def check_final(self, trained_steps: int) -> None:
        """At the run's end: wait (at most 5 s) until the dead letters stored so far have
        been counted, then judge. Raises:
        DeadLetterThresholdError: see :meth:`DeadLetterWindow.final_verdict`."""
        if self.window.size == 0 or self._sub is None:
            return
        last = (await self.bus.stream_state(self.bus.names.dlq_stream)).last_seq
        with anyio.move_on_after(5.0):
            while self._last_seq < last:
                try:
                    info = await self._sub.info()
                    if not info.num_pending and info.delivered <= self._last_seq:
                        break  # all stored since the start counted (older ones are not ours)
                except Exception:  # noqa: BLE001 - an ordered consumer being recreated
                    pass
                await anyio.sleep(0.05)
        self._sync_passed()
        self._raise_if(self.window.final_verdict(trained_steps))

    async def stop(self) -> None:
        """Unsubscribe (errors of a closed connection are ignored)."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be gone
                pass
            self._sub = None
