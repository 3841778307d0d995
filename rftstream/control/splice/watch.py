"""The waiting sides of the splice protocol, without I/O: a requester waiting for the
trainer's answer (:class:`AnswerWatch`) and ``--unsplice`` waiting for the owner to
drain (:class:`UnspliceWatch`).

Each is an immutable state fed every read of the ``splice`` record with the time
``now`` (and, every ``Timing.check_every_s``, a :class:`Health` reading); it answers
with a verdict: keep waiting, answered, or why to give up. The patience without a
trainer is measured on that clock, so tests use a fake one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Self

from rftstream.control.splice.ownership import owner_alive, restart_hint
from rftstream.control.splice.protocol import DEFAULT_TIMING, Timing, state_of
from rftstream.wire import (
    Heartbeat,
    SpliceAbandoned,
    SpliceClaimed,
    SpliceDone,
    SpliceDrained,
    SpliceRecord,
    SpliceRefused,
    SpliceRequested,
    StageRecord,
)


@dataclass(frozen=True)
class Health:
    """What a waiting party reads every :attr:`Timing.check_every_s`: the run's status
    (``ended``: finished, failed or stopped) and whether a trainer is alive."""

    status: str
    ended: bool
    trainer_alive: bool


@dataclass(frozen=True)
class KeepWaiting:
    """Nothing to do yet: read again shortly."""


@dataclass(frozen=True)
class Answered:
    """The awaited state is reached."""

    record: SpliceRecord


@dataclass(frozen=True)
class Failed:
    """Give up: raise :class:`RftError` with ``message``."""

    message: str


@dataclass(frozen=True)
class NoTrainer:
    """No trainer for the patience: raise ``TrainerGone`` with ``message`` (a requester
    abandons its request first; one a trainer claimed is waited for again)."""

    message: str


@dataclass(frozen=True)
class OwnerGone:
    """The stage's owner is not running while ``--unsplice`` waits (request ``splice_id``
    in ``state``; ``hint``: the command that restarts it). An ``asked`` nobody took up is
    abandoned first (:attr:`abandon_first`); raise :meth:`message`."""

    what: str
    splice_id: str
    state: str
    hint: str

    @property
    def abandon_first(self) -> bool:
        return self.state == "asked"

    def message(self, now_state: str | None = None) -> str:
        """Why it gives up; ``now_state``: the request's state after abandoning it (None:
        not tried, ``"abandoned"``: it was)."""
        state = self.state if now_state is None else now_state
        if state in ("asked", "abandoned"):
            return (
                f"{self.what}: its operator stopped before removing itself; start it "
                f"again with `{self.hint}`, then retry"
            )
        return (
            f"{self.what}: its operator stopped in the middle of removing itself (request "
            f"{self.splice_id} is {state!r}); start it again with `{self.hint}`: it resumes "
            "the removal and finishes it"
        )


Verdict = KeepWaiting | Answered | Failed | NoTrainer | OwnerGone


@dataclass(frozen=True, kw_only=True)
class TrainerPatience:
    """The clock both waits share: when the run's health was last read (``checked``) and
    when a trainer was last seen alive (``last_alive``), on the caller's clock ``now``."""

    patience: float
    timing: Timing
    last_alive: float
    checked: float | None = None

    def health_due(self, now: float) -> bool:
        """Whether the next ``step`` wants a :class:`Health` reading."""
        return self.checked is None or now - self.checked > self.timing.check_every_s

    def _read_health(
        self, now: float, health: Health, needs_trainer: bool
    ) -> tuple[Self, Literal["ended", "no trainer"] | None]:
        """The wait after a :class:`Health` reading, and why to give up (None: keep waiting):
        the run ended, or ``needs_trainer`` and none was alive for :attr:`patience` s."""
        waited = replace(self, checked=now)
        if health.ended:
            return waited, "ended"
        if health.trainer_alive or not needs_trainer:
            return replace(waited, last_alive=now), None
        return waited, "no trainer" if now - self.last_alive > self.patience else None


@dataclass(frozen=True, kw_only=True)
class AnswerWatch(TrainerPatience):
    """A requester's wait for the trainer's answer to request ``splice_id``: done in one
    of the ``answers`` states; gives up when the record is replaced, abandoned or
    refused, when the run ends, or (:class:`NoTrainer`) when no trainer was alive for
    ``patience`` s. Start it with :meth:`start`; feed :meth:`step` every read."""

    what: str
    splice_id: str
    answers: tuple[type, ...]

    @classmethod
    def start(
        cls,
        what: str,
        splice_id: str,
        answers: tuple[type, ...],
        now: float,
        timing: Timing = DEFAULT_TIMING,
        patience: float | None = None,
    ) -> AnswerWatch:
        return cls(
            what=what,
            splice_id=splice_id,
            answers=answers,
            patience=timing.trainer_patience_s if patience is None else patience,
            timing=timing,
            last_alive=now,
        )

    def step(
        self, record: SpliceRecord | None, now: float, health: Health | None = None
    ) -> tuple[AnswerWatch, Verdict]:
        if record is None or record.id != self.splice_id:
            return self, Failed(f"{self.what}: the request was replaced by another: {record}")
        if isinstance(record, self.answers):
            return self, Answered(record)
        if isinstance(record, SpliceAbandoned | SpliceRefused):
            return self, Failed(f"{self.what}: {record.reason or state_of(record)}")
        if health is None:
            return self, KeepWaiting()
        watch, why = self._read_health(now, health, needs_trainer=True)
        if why == "ended":
            return watch, Failed(f"{self.what}: the run is {health.status}")
        if why == "no trainer":
            return watch, NoTrainer(
                f"{self.what}: no trainer has been running for {self.patience:.0f}s "
                f"(no fresh trainer heartbeat; run status {health.status!r})"
            )
        return watch, KeepWaiting()


@dataclass(frozen=True, kw_only=True)
class UnspliceWatch(TrainerPatience):
    """``--unsplice``'s wait until the owner has drained (``drained`` or ``done``).

    Gives up when the stage's owner is not running (whatever the state: before it took
    the request up, the request is abandoned; after, the restarted operator finishes
    the removal), when the run ends, and (:class:`NoTrainer`) when no trainer was alive
    for ``patience`` s while the request waits for one (the owner keeps it)."""

    stage: str
    splice_id: str

    @classmethod
    def start(
        cls,
        stage: str,
        splice_id: str,
        now: float,
        timing: Timing = DEFAULT_TIMING,
        patience: float | None = None,
    ) -> UnspliceWatch:
        return cls(
            stage=stage,
            splice_id=splice_id,
            patience=timing.trainer_patience_s if patience is None else patience,
            timing=timing,
            last_alive=now,
        )

    def step(
        self,
        record: SpliceRecord | None,
        stage: StageRecord | None,
        now: float,
        owner_pid_alive: bool | None = None,
        health: Health | None = None,
    ) -> tuple[UnspliceWatch, Verdict]:
        """``stage``: the ``stage.<Y>`` record; ``owner_pid_alive``: its owner's pid
        checked on this host (None: elsewhere, see :func:`owner_alive`)."""
        what = f"--unsplice {self.stage}"
        if record is None or record.id != self.splice_id:
            return self, Failed(f"{what}: the request was replaced by another: {record}")
        if isinstance(record, SpliceDrained | SpliceDone):
            return self, Answered(record)
        if isinstance(record, SpliceAbandoned | SpliceRefused):
            return self, Failed(f"{what}: {record.reason or state_of(record)}")
        st = str(state_of(record))
        if stage is not None and not owner_alive(stage.owner, now, owner_pid_alive, self.timing):
            return self, OwnerGone(what, self.splice_id, st, restart_hint(stage))
        if health is None:
            return self, KeepWaiting()
        # only a request still waiting for the trainer needs one alive
        waits_for_trainer = isinstance(record, SpliceRequested | SpliceClaimed)
        watch, why = self._read_health(now, health, needs_trainer=waits_for_trainer)
        if why == "ended":
            return watch, Failed(f"{what}: the run is {health.status}; the stage was not removed")
        if why == "no trainer":
            return watch, NoTrainer(
                f"{what}: no trainer has been running for {self.patience:.0f}s (request "
                f"{self.splice_id} is {st!r}); the operator keeps the request, and a restarted "
                "trainer completes it"
            )
        return watch, KeepWaiting()


def trainer_alive(heartbeats: dict[str, Heartbeat], now: float, timing: Timing) -> bool:
    """A trainer heartbeat younger than :attr:`Timing.trainer_heartbeat_s` exists, and
    it is not the trainer's last one (which carries its end ``status``)."""
    return any(
        hb.role == "trainer" and not hb.status and now - hb.ts < timing.trainer_heartbeat_s
        for hb in heartbeats.values()
    )
