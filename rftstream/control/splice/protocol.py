"""The splice protocol without I/O: its transitions, its decisions, its clocks.

Every party's move is a pure function of what it read and the time ``now``
(passed in, so tests use a fake clock); the I/O loops
(:mod:`rftstream.control.splice.operator_side`, :mod:`rftstream.actors.topology`,
:mod:`rftstream.actors.spliced`) read the KV records, call these, and perform
what they return. Nothing here blocks, sleeps or reads a clock.

* :func:`step` moves the ``splice`` record (:data:`~rftstream.wire.SpliceRecord`)
  on by one event of one party; an event its state does not allow raises
  :class:`IllegalTransition`. It returns the new record and the actions that go
  with the write (:class:`WriteSplice` compare-and-set on the revision read,
  :class:`DeleteStage`).
* :func:`trainer_plan` is the trainer's answer to a claimed request.
* :func:`stage_chain` walks the stages from ``exp.raw`` to the trainer.

Who serves a spliced stage is decided in :mod:`rftstream.control.splice.ownership`; the
waiting sides' clocks are :mod:`rftstream.control.splice.watch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rftstream.errors import RftError
from rftstream.subjects import RAW_STAGE, TRAIN_STAGE
from rftstream.wire import (
    Owner,
    SpliceAbandoned,
    SpliceAsked,
    SpliceClaimed,
    SpliceCut,
    SpliceDone,
    SpliceDrained,
    SpliceRecord,
    SpliceRefused,
    SpliceRequested,
    StageRecord,
    TopologyEdge,
    TrainerInput,
)


@dataclass(frozen=True)
class Timing:
    """The protocol's clocks, in seconds (config, not constants, so tests can shrink them).

    ``owner_refresh_s``: how often a stage's owner refreshes its claim;
    ``owner_stale_s``: an owner not seen for this long (and not a live pid on this
    host) is gone; ``trainer_patience_s``: how long a request waits without any live
    trainer; ``asked_stale_s``: an ``asked`` nobody took up may be replaced after
    this long; ``quiet_patience_s``: how long a new request waits for the change in
    flight to end; ``check_every_s``: how often a waiting party reads the run's
    status and the trainer's heartbeat; ``trainer_heartbeat_s``: a trainer heartbeat
    younger than this is a live trainer.
    """

    owner_refresh_s: float = 2.0
    owner_stale_s: float = 15.0
    trainer_patience_s: float = 90.0
    asked_stale_s: float = 60.0
    quiet_patience_s: float = 60.0
    check_every_s: float = 3.0
    trainer_heartbeat_s: float = 30.0


DEFAULT_TIMING = Timing()


class IllegalTransition(RftError):
    """An event the ``splice`` record's state does not allow (a party out of turn)."""


# ----------------------------------------------------------------- the splice record

ACTIVE = (SpliceAsked, SpliceRequested, SpliceClaimed)


def state_of(record: SpliceRecord | None) -> str | None:
    """The record's ``state`` tag (None: no record)."""
    return None if record is None else str(record.__struct_config__.tag)


def in_flight(record: SpliceRecord | None) -> bool:
    """True while ``record`` is a change not finished yet (an unsplice still drains
    after its cut, and must be closed by the trainer after ``drained``)."""
    if isinstance(record, ACTIVE):
        return True
    return isinstance(record, SpliceCut | SpliceDrained) and record.kind == "unsplice"


def unsplice_in_flight(record: SpliceRecord | None, stage: str | None = None) -> bool:
    """True while ``record`` is an unsplice not finished yet (of ``exp.<stage>`` if given)."""
    return (
        record is not None
        and in_flight(record)
        and record.kind == "unsplice"
        and (stage is None or record.to_stage == stage)
    )


def replaceable(record: SpliceRecord | None, now: float, timing: Timing = DEFAULT_TIMING) -> bool:
    """Whether a new change may take the record's place: none is in flight, or an
    ``asked`` nobody took up for :attr:`Timing.asked_stale_s`."""
    if not in_flight(record):
        return True
    return isinstance(record, SpliceAsked) and now - record.ts > timing.asked_stale_s


@dataclass(frozen=True)
class RequestSplice:
    """Operator: splice ``operator`` in, writing ``to_stage`` (it is ``owner``)."""

    id: str
    operator: str
    to_stage: str
    owner: Owner
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AskUnsplice:
    """``--unsplice``: ask the owner of ``to_stage`` to take itself out."""

    id: str
    operator: str
    from_stage: str
    to_stage: str


@dataclass(frozen=True)
class OwnerParked:
    """Owner: every replica stopped at ``cut_seq`` of ``from_stage``; the trainer's turn.
    Takes up the ``asked`` of the same id, or starts an unsplice (Ctrl-C)."""

    id: str
    operator: str
    from_stage: str
    to_stage: str
    cut_seq: int


@dataclass(frozen=True)
class Abandon:
    """The requester gives up (``reason``) before anyone took the request up."""

    reason: str


@dataclass(frozen=True)
class Claim:
    """Trainer: take the request up; it can no longer be abandoned."""


@dataclass(frozen=True)
class TrainerCut:
    """Trainer: switched. Splice: the operator reads ``from_stage`` from ``start_seq``;
    ``consumer``: the durable the trainer reads now."""

    consumer: str
    from_stage: str | None = None
    start_seq: int | None = None


@dataclass(frozen=True)
class Refuse:
    """Trainer: cannot do it (``reason``)."""

    reason: str


@dataclass(frozen=True)
class OwnerDrained:
    """Owner: processed everything up to the cut; its stage ends at ``drain_until``."""

    drain_until: int


@dataclass(frozen=True)
class Close:
    """Trainer: the removed stage is drained up to ``drain_until``; the unsplice is done."""


Event = (
    RequestSplice
    | AskUnsplice
    | OwnerParked
    | Abandon
    | Claim
    | TrainerCut
    | Refuse
    | OwnerDrained
    | Close
)


@dataclass(frozen=True)
class WriteSplice:
    """Write ``record`` with compare-and-set on the revision the event was based on
    (absent: create); losing the race means another party moved first: read again."""

    record: SpliceRecord


@dataclass(frozen=True)
class DeleteStage:
    """Delete ``stage.<stage>``: the stage is out of the chain."""

    stage: str


Action = WriteSplice | DeleteStage


def _move(record: SpliceRecord, cls: type, now: float, **fields: Any) -> SpliceRecord:
    """``record`` in state ``cls`` (keeping every field they share), with ``fields``."""
    common = {f: getattr(record, f) for f in cls.__struct_fields__ if hasattr(record, f)}
    return cls(**{**common, **fields, "ts_changed": now})  # type: ignore[no-any-return]


def _illegal(record: SpliceRecord | None, event: Event) -> IllegalTransition:
    what = "no change" if record is None else f"{record.kind} {record.id} is {state_of(record)!r}"
    return IllegalTransition(f"{type(event).__name__} is not allowed while {what}")


def step(
    record: SpliceRecord | None, event: Event, now: float, timing: Timing = DEFAULT_TIMING
) -> tuple[SpliceRecord | None, list[Action]]:
    """Move the ``splice`` record on by ``event`` at time ``now``. Pure.

    Returns the new record and the actions to perform, in order (none when the
    event repeats one already applied: a retried answer writes nothing). Raises
    :class:`IllegalTransition` for an event the state does not allow.
    """
    match event:
        case RequestSplice():
            if not replaceable(record, now, timing):
                raise _illegal(record, event)
            new: SpliceRecord = SpliceRequested(
                id=event.id,
                kind="splice",
                operator=event.operator,
                to_stage=event.to_stage,
                args=dict(event.args),
                owner=event.owner,
                ts=now,
                ts_changed=now,
            )
            return new, [WriteSplice(new)]
        case AskUnsplice():
            if not replaceable(record, now, timing):
                raise _illegal(record, event)
            new = SpliceAsked(
                id=event.id,
                kind="unsplice",
                operator=event.operator,
                from_stage=event.from_stage,
                to_stage=event.to_stage,
                ts=now,
                ts_changed=now,
            )
            return new, [WriteSplice(new)]
        case OwnerParked():
            fields = {
                "kind": "unsplice",
                "operator": event.operator,
                "from_stage": event.from_stage,
                "to_stage": event.to_stage,
                "cut_seq": event.cut_seq,
            }
            if isinstance(record, SpliceAsked) and record.id == event.id:
                new = _move(record, SpliceRequested, now, **fields)
            elif record is not None and record.id == event.id:
                raise _illegal(record, event)
            elif replaceable(record, now, timing):
                new = SpliceRequested(id=event.id, ts=now, ts_changed=now, **fields)  # type: ignore[arg-type]
            else:
                raise _illegal(record, event)
            return new, [WriteSplice(new)]
        case Abandon():
            if isinstance(record, SpliceAbandoned):
                return record, []
            if not isinstance(record, SpliceAsked | SpliceRequested):
                raise _illegal(record, event)
            new = _move(record, SpliceAbandoned, now, reason=event.reason)
            return new, [WriteSplice(new)]
        case Claim():
            if isinstance(record, SpliceClaimed):
                return record, []
            if not isinstance(record, SpliceRequested):
                raise _illegal(record, event)
            new = _move(record, SpliceClaimed, now)
            return new, [WriteSplice(new)]
        case TrainerCut():
            if not isinstance(record, SpliceClaimed):
                raise _illegal(record, event)
            if record.kind == "splice" and (event.from_stage is None or event.start_seq is None):
                raise IllegalTransition(f"splice {record.id}: a cut needs from_stage and start_seq")
            extra: dict[str, Any] = {"consumer": event.consumer, "start_seq": event.start_seq}
            if event.from_stage is not None:
                extra["from_stage"] = event.from_stage
            new = _move(record, SpliceCut, now, **extra)
            return new, [WriteSplice(new)]
        case Refuse():
            if not isinstance(record, SpliceClaimed):
                raise _illegal(record, event)
            new = _move(record, SpliceRefused, now, reason=event.reason)
            return new, [WriteSplice(new)]
        case OwnerDrained():
            if record is None or record.kind != "unsplice":
                raise _illegal(record, event)
            if isinstance(record, SpliceDrained | SpliceDone):  # resumed after writing it
                return record, [DeleteStage(record.to_stage)]
            if not isinstance(record, SpliceCut):
                raise _illegal(record, event)
            new = _move(
                record,
                SpliceDrained,
                now,
                drain_until=event.drain_until,
                consumer=record.consumer,
            )
            return new, [WriteSplice(new), DeleteStage(record.to_stage)]
        case Close():
            if isinstance(record, SpliceDone):
                return record, []
            if not isinstance(record, SpliceDrained):
                raise _illegal(record, event)
            new = _move(record, SpliceDone, now, drain_until=record.drain_until)
            return new, [WriteSplice(new)]
    raise TypeError(f"not a splice event: {event!r}")  # pragma: no cover - exhaustive match


def trainer_to_act(record: SpliceRecord | None) -> Claim | Close | None:
    """What the trainer does about the record it read: claim a request (and answer it,
    :func:`trainer_plan`), close a drained unsplice, or nothing."""
    if isinstance(record, SpliceRequested | SpliceClaimed):
        return Claim()
    if isinstance(record, SpliceDrained):
        return Close()
    return None


# ----------------------------------------------------------------- the trainer's answer


@dataclass(frozen=True)
class SwitchIn:
    """Splice: read ``to_stage`` (a new durable from the stream's next sequence), retire
    the consumer read now with its cut at the last sequence it delivered."""

    to_stage: str


@dataclass(frozen=True)
class SwitchBack:
    """Unsplice: read ``from_stage`` from ``start_seq`` (the owner's cut + 1), retire the
    consumer of ``exp.<to_stage>`` with an open cut."""

    from_stage: str
    start_seq: int


@dataclass(frozen=True)
class AnswerAgain:
    """Switched already (a poll, or a trainer, died before answering): persist, write what
    may be missing, answer again. ``from_stage``/``start_seq``: the switch's."""

    from_stage: str
    start_seq: int


Plan = SwitchIn | SwitchBack | AnswerAgain | Refuse


def trainer_plan(request: SpliceClaimed, reading: str, last_switch: TrainerInput | None) -> Plan:
    """The trainer's answer to a claimed ``request`` while it reads ``exp.<reading>``;
    ``last_switch``: its ``trainer.input`` record (the id and cut of its last switch)."""
    switched = last_switch is not None and last_switch.splice_id == request.id
    if request.kind == "splice":
        if switched and reading == request.to_stage:
            assert last_switch is not None
            return AnswerAgain(str(last_switch.from_stage), int(last_switch.start_seq or 1))
        if request.to_stage == reading:
            return Refuse(f"the trainer already reads exp.{request.to_stage}")
        return SwitchIn(request.to_stage)
    if request.from_stage is None or request.cut_seq is None:
        return Refuse(f"unsplice {request.id} names no from_stage and cut_seq")
    if switched and reading == request.from_stage:
        return AnswerAgain(request.to_stage, request.cut_seq + 1)
    if reading != request.to_stage:
        return Refuse(f"the trainer reads exp.{reading}, not exp.{request.to_stage}")
    return SwitchBack(request.from_stage, request.cut_seq + 1)


def with_edge(edges: list[TopologyEdge], edge: TopologyEdge) -> list[TopologyEdge] | None:
    """``topology`` with ``edge`` appended; None when its ``splice_id`` is recorded already."""
    if edge.splice_id is not None and any(e.splice_id == edge.splice_id for e in edges):
        return None
    return [*edges, edge]


# ----------------------------------------------------------------- the stage chain


def trainer_durable(stage: str) -> str:
    """The trainer's usual durable consumer on ``stage`` (``trainer`` on ``train``)."""
    return "trainer" if stage == TRAIN_STAGE else f"trainer_{stage}".replace("-", "_")


def input_of(record: TrainerInput | None) -> tuple[str, str]:
    """``(stage, durable)`` a ``trainer.input`` record names (``exp.train`` if none)."""
    if record is not None and record.stage:
        return record.stage, record.consumer or trainer_durable(record.stage)
    return TRAIN_STAGE, trainer_durable(TRAIN_STAGE)


def stage_chain(
    trainer_input: TrainerInput | None,
    stages: dict[str, StageRecord],
    input_stage: str = RAW_STAGE,
    output_stage: str = TRAIN_STAGE,
) -> list[dict[str, Any]]:
    """The stages from ``exp.raw`` to the trainer: each ``{"stage", "operator"}``
    (operator None for the configured stages). Walks back from the stage the trainer
    reads through the spliced stages' (``stages``, by name) ``from_stage``."""
    current, _ = input_of(trainer_input)
    spliced: list[dict[str, Any]] = []
    seen: set[str] = set()
    while current not in seen:
        seen.add(current)
        rec = stages.get(current)
        if rec is None:
            break
        spliced.append({"stage": current, "operator": rec.operator})
        current = rec.from_stage
    spliced_names = {s["stage"] for s in spliced}
    names = dict.fromkeys([input_stage, output_stage, current])
    base = [{"stage": s, "operator": None} for s in names if s not in spliced_names]
    return base + list(reversed(spliced))
