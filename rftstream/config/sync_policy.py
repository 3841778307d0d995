"""Synchronisation policies (DESIGN §4). Pure logic, no I/O.

``SyncPolicy`` answers three questions for the actors:

* :meth:`trainer_publishes_after` — does the trainer publish weights after step N?
* :meth:`explorer_checks_before` — does the explorer look for new weights before step N?
* :meth:`explorer_may_run` — may the explorer start another step, given how much
  experience is waiting for the trainer and how old its weights are (``max_staleness``)?
  :meth:`explorer_quota` — how much may it generate now (a step may be cut to fit)?
  :meth:`starving_trainer_overrides` — does the trainer's ``trainer.starving``
  record let it start a batch that ``max_staleness`` would hold back?
"""

from __future__ import annotations

from dataclasses import dataclass

from rftstream.config.resolve import canonical_sync_style
from rftstream.config.schema import SynchronizerConfig
from rftstream.wire import TrainerStarving


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

    def explorer_quota(
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
        batch's worth of room.

        No floor: with weights within the bound there is always room to
        complete the trainer's next batch, and a whole batch taken when less
        than one waits would put its tail a version past the bound whenever
        the weights are behind. A trainer that starves for what the count
        cannot see (filtered messages carry fewer experiences than a group)
        is served by :meth:`starving_trainer_overrides`.
        """
        if self.max_staleness is None:
            return None
        room = (self.max_staleness - version_lag + 1) * train_batch_size - backlog_experiences
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
        starving trainer is not seen here: see :meth:`starving_trainer_overrides`.
        """
        room = self.explorer_quota(backlog_experiences, train_batch_size, version_lag)
        return room is None or room >= train_batch_size

    def starving_trainer_overrides(
        self, starving: TrainerStarving | None, *, held_by_trainer: int, ahead_of_trainer: int
    ) -> bool:
        """``max_staleness`` found no room: may the explorer start its batch anyway, because
        the trainer says it starves?

        Only when all the backlog is what the trainer holds (``ahead_of_trainer``:
        the messages anywhere upstream of it, with the explorer's tasks in flight,
        is 0) and the trainer says it is starving (its messages carry fewer
        experiences than full groups: a filter, failed tasks): never stall it. A
        flag written before more was delivered to it (``held_by_trainer`` above the
        ``held`` it said it with) is stale: it said so while waiting for its first
        batch, and holds two batches now; the trainer says it again with its new
        count at its next empty fetch if it still starves.
        """
        if ahead_of_trainer > 0 or starving is None or not starving.since:
            return False
        return held_by_trainer <= starving.held
