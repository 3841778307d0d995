"""Synchronisation policies (DESIGN §4). Pure logic, no I/O.

``SyncPolicy`` answers three questions for the actors:

* :meth:`trainer_publishes_after` — does the trainer publish weights after step N?
* :meth:`explorer_checks_before` — does the explorer look for new weights before step N?
* :meth:`explorer_may_run` — may the explorer start another step, given how much
  experience is waiting for the trainer and how old its weights are (``max_staleness``)?
  :meth:`explorer_room` — how much may it generate now (a step may be cut to fit)?
"""

from __future__ import annotations

from dataclasses import dataclass

from rftstream.config.resolve import canonical_sync_style
from rftstream.config.schema import SynchronizerConfig


@dataclass(frozen=True)
class SyncPolicy:
    style: str
    interval: int
    offset: int
    max_staleness: int | None

    @classmethod
    def from_config(cls, cfg: SynchronizerConfig) -> SyncPolicy:
        style = canonical_sync_style(cfg.sync_style)
        return cls(style, max(1, cfg.sync_interval), max(0, cfg.sync_offset), cfg.max_staleness)

    def trainer_publishes_after(self, step: int) -> bool:
        """Trainer step ``step`` (1-based) just finished: publish weights now?"""
        if self.style == "fully_async":
            return True
        return step > self.offset and (step - self.offset) % self.interval == 0

    def explorer_checks_before(self, step: int) -> bool:
        """Explorer is about to run step ``step`` (1-based): look for newer weights?"""
        if self.style in ("fully_async", "dynamic_by_trainer"):
            return True
        return step > 1 and (step - 1 - self.offset) % self.interval == 0

    def explorer_waits_for_version(self, step: int) -> int | None:
        """``fixed`` style: the weights version the explorer must have before ``step``.

        Explorer and trainer meet every ``sync_interval`` steps: before explorer
        step ``k*interval + offset + 1`` the trainer must have published version
        ``k*interval`` (interval 1 is strictly on-policy). Other styles never wait.
        """
        if self.style != "fixed" or step <= 1 + self.offset:
            return None
        done = step - 1 - self.offset
        if done % self.interval:
            return None
        return done

    def explorer_room(
        self, backlog_experiences: int, train_batch_size: int, version_lag: int = 0
    ) -> int | None:
        """``max_staleness``: how many experiences may the explorer generate now? None: any.

        Experience generated now with weights ``version_lag`` versions behind
        the newest lands behind the ``backlog_experiences`` already waiting
        upstream of (or inside) the trainer; the one at position ``p`` of that
        queue is trained about ``ceil(p / train_batch_size) - 1`` versions
        later. Positions up to ``(max_staleness - version_lag + 1) *
        train_batch_size`` stay within the bound: the room is what is left of
        them. Counting by position, not by whole batches, lets an explorer top
        up a trainer batch that waits for a few groups (a failed task, a
        filter, a group that came in late) instead of waiting for a whole
        batch's worth of room. A starving trainer (less than one batch waiting)
        always gets at least a batch, so filters can never deadlock the run.
        """
        if self.max_staleness is None:
            return None
        room = (self.max_staleness - version_lag + 1) * train_batch_size - backlog_experiences
        if backlog_experiences < train_batch_size:
            room = max(room, train_batch_size)
        return max(0, room)

    def explorer_may_run(
        self, backlog_experiences: int, train_batch_size: int, version_lag: int = 0
    ) -> bool:
        """``max_staleness``: may the explorer generate another batch now?

        A batch generated now with weights ``version_lag`` versions behind the
        newest is trained after the ``backlog_experiences`` already waiting
        upstream of (or inside) the trainer, i.e. about ``backlog /
        train_batch_size`` trainer versions later. The explorer runs only if
        ``version_lag + backlog / train_batch_size <= max_staleness``. A
        starving trainer (less than one batch waiting) never pauses the
        explorer, so filters can never deadlock the run.
        """
        room = self.explorer_room(backlog_experiences, train_batch_size, version_lag)
        return room is None or room >= train_batch_size
