"""The splice protocol's KV loops on the operator side: the process that asks for a
splice, ``--unsplice``, and the process that serves (owns) a spliced stage.

Each function reads the KV records (typed, :mod:`rftstream.wire`), lets
:mod:`rftstream.control.splice.protocol` decide, and writes what it returns
(compare-and-set on the revision read, so two parties never both win). The
waiting ones run in :func:`rftstream.control.drive`: they read the ``splice``
record again when it (or the run's status, or the stage's record) is written,
and read the run's status and the trainer's heartbeat every
``Timing.check_every_s`` s, the longest they wait without a write; the clock
they decide by is a parameter (``clock``). They block until their answer, raise :class:`~rftstream.errors.RftError` (or
:class:`TrainerGone`) when they give up, and can be cancelled at any point:
the KV state stays consistent (a request left behind is abandoned or
completed by whoever comes next). The trainer's side is
:class:`~rftstream.actors.topology.TrainerTopology`, which writes the record
through the same :func:`apply`. ``Timing`` (patience, staleness, how often
health is checked) is a parameter, defaulting to
:data:`~rftstream.control.splice.protocol.DEFAULT_TIMING`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio

from rftstream.bus.state import END_STATUSES, RunState
from rftstream.control import Clock, drive, wall_clock
from rftstream.control.splice import ownership, protocol, watch
from rftstream.control.splice.protocol import (
    DEFAULT_TIMING,
    Abandon,
    Action,
    AskUnsplice,
    DeleteStage,
    Event,
    OwnerDrained,
    OwnerParked,
    RequestSplice,
    Timing,
    WriteSplice,
)
from rftstream.control.splice.watch import (
    Answered,
    AnswerWatch,
    Failed,
    Health,
    NoTrainer,
    OwnerGone,
)
from rftstream.errors import RftError
from rftstream.subjects import RAW_STAGE, TRAIN_STAGE, check_stage
from rftstream.wire import (
    SPLICE,
    STAGE,
    STATUS,
    TRAINER_INPUT,
    Owner,
    SpliceAbandoned,
    SpliceAsked,
    SpliceCut,
    SpliceDone,
    SpliceDrained,
    SpliceRecord,
    SpliceRequested,
    StageRecord,
)

log = logging.getLogger(__name__)


class TrainerGone(RftError):
    """No trainer answers a splice or unsplice request."""


def local_pid_alive(owner: Owner | None) -> bool | None:
    """Whether ``owner``'s pid runs, when it is on this host (None: another host, or no pid)."""
    if owner is None or owner.host != socket.gethostname() or not owner.pid:
        return None
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, someone else's
    return True


def owner_alive(record: StageRecord | None, timing: Timing = DEFAULT_TIMING) -> bool:
    """Whether the process serving a spliced stage still runs (see :func:`ownership.owner_alive`)."""
    owner = None if record is None else record.owner
    return ownership.owner_alive(owner, time.time(), local_pid_alive(owner), timing)


def owner_info(actor: str, token: str | None = None) -> Owner:
    """This process as the owner of a stage; ``token`` tells two claims of one process apart."""
    return Owner(
        actor=actor,
        pid=os.getpid(),
        host=socket.gethostname(),
        ts=time.time(),
        token=token or uuid.uuid4().hex[:12],
    )


async def read_health(state: RunState, now: float, timing: Timing) -> Health:
    """The run's status and whether a trainer is alive at ``now`` (see
    :func:`watch.trainer_alive`). KV reads."""
    status = await state.status()
    alive = watch.trainer_alive(await state.heartbeats(), now, timing)
    return Health(status, status in END_STATUSES, alive)


async def perform(state: RunState, actions: list[Action], revision: int | None) -> bool:
    """Perform ``actions`` of :func:`protocol.step`; the ``splice`` write is a
    compare-and-set on ``revision``. False (and nothing after it done): another party
    wrote the record first."""
    for action in actions:
        match action:
            case WriteSplice(record):
                if await state.cas(SPLICE, record, revision) is None:
                    return False
            case DeleteStage(stage):
                await state.delete(STAGE.of(stage=stage))
    return True


async def apply(
    state: RunState,
    record: SpliceRecord | None,
    revision: int | None,
    event: Event,
    timing: Timing = DEFAULT_TIMING,
) -> SpliceRecord | None:
    """Move the ``splice`` record (read at ``revision``) on by ``event`` and write it.
    Returns the new record, or None when another party wrote it first (read again).
    Raises :class:`~rftstream.control.splice.protocol.IllegalTransition` out of turn."""
    new, actions = protocol.step(record, event, time.time(), timing)
    return new if await perform(state, actions, revision) else None


async def _watch(state: RunState, watcher: AnswerWatch, clock: Clock) -> SpliceRecord:
    """Read ``splice`` at each of its writes until ``watcher`` has its answer; raise when
    it gives up."""
    timing = watcher.timing

    async def attempt(now: float) -> SpliceRecord | None:
        nonlocal watcher
        record = await state.get(SPLICE)
        health = await read_health(state, now, timing) if watcher.health_due(now) else None
        watcher, verdict = watcher.step(record, now, health)
        match verdict:
            case Answered(answer):
                return answer
            case Failed(message):
                raise RftError(message)
            case NoTrainer(message):
                raise TrainerGone(message)
        return None

    return await drive(
        state.kv, (SPLICE, STATUS), attempt, wake_s=timing.check_every_s, clock=clock
    )


async def _wait_answer(
    state: RunState,
    what: str,
    answers: tuple[type, ...],
    *,
    splice_id: str,
    patience: float | None = None,
    timing: Timing = DEFAULT_TIMING,
    clock: Clock = wall_clock,
) -> SpliceRecord:
    """Wait for the trainer's answer (a record in one of ``answers``) to a request this
    process wrote. Blocks.

    When no trainer has been alive for ``patience`` s, the request is abandoned
    (compare-and-set) and :class:`TrainerGone` raised, unless a trainer claimed it
    meanwhile: a claimed request is completed by a restarted trainer, so this keeps
    waiting for it (logging a warning each ``patience`` s), until the run ends.
    """
    while True:
        watcher = AnswerWatch.start(what, splice_id, answers, clock(), timing, patience)
        try:
            return await _watch(state, watcher, clock)
        except TrainerGone:
            st = await abandon(state, splice_id, "no trainer answered")
            if st in (None, "abandoned"):
                raise
            if st == "claimed":
                log.warning(
                    "%s: a trainer claimed the request, then stopped; a restarted trainer "
                    "completes it: waiting for one (run `rftstream status` to see the run)",
                    what,
                )


async def _wait_quiet(
    state: RunState, what: str, timing: Timing = DEFAULT_TIMING, clock: Clock = wall_clock
) -> tuple[SpliceRecord | None, int | None]:
    """Wait until the ``splice`` record may be replaced (:func:`protocol.replaceable`);
    ``(record, revision)``. Raises after ``Timing.quiet_patience_s`` s."""
    deadline = clock() + timing.quiet_patience_s

    async def attempt(now: float) -> tuple[SpliceRecord | None, int | None] | None:
        record, rev = await state.entry(SPLICE)
        if protocol.replaceable(record, now, timing):
            return record, rev
        if now > deadline:
            assert record is not None
            raise RftError(
                f"{what}: another change ({record.kind} of exp.{record.to_stage}, state "
                f"{protocol.state_of(record)}) has been under way for {now - record.ts:.0f}s; "
                "try again when it is done (`rftstream status` shows it)"
            )
        return None

    # a record grows replaceable by its age too: looked at again every check_every_s
    return await drive(state.kv, (SPLICE,), attempt, wake_s=timing.check_every_s, clock=clock)


# ----------------------------------------------------------------- splice: operator side


async def request_splice(
    state: RunState,
    operator: str,
    to_stage: str,
    *,
    args: dict[str, Any] | None = None,
    actor: str | None = None,
    patience: float | None = None,
    timing: Timing = DEFAULT_TIMING,
) -> SpliceCut:
    """Operator side: ask the trainer to cut over to ``to_stage``; wait for its answer.

    Blocks (polling the KV bucket) until the trainer has switched; returns its
    ``cut`` (``from_stage``, ``start_seq``: where the operator reads from). Raises
    :class:`RftError` when the trainer already reads ``to_stage``, another change is
    under way for over ``Timing.quiet_patience_s``, the run ends, or no trainer has
    been alive for ``patience`` s. If no trainer answers, the request is abandoned
    (compare-and-set); one a trainer claimed meanwhile is waited for.
    """
    check_stage(to_stage)
    current, _ = protocol.input_of(await state.get(TRAINER_INPUT))
    if to_stage == current:
        raise RftError(f"the trainer already reads exp.{to_stage}; choose another --to stage")
    if to_stage in (RAW_STAGE, TRAIN_STAGE):
        raise RftError(f"--to {to_stage}: choose a new stage name, not {to_stage!r}")
    what = f"splice {operator} -> exp.{to_stage}"
    record, rev = await _wait_quiet(state, what, timing)
    event = RequestSplice(
        id=uuid.uuid4().hex[:12],
        operator=operator,
        to_stage=to_stage,
        owner=owner_info(actor or operator),
        args=args or {},
    )
    if await apply(state, record, rev, event, timing) is None:
        raise RftError("another splice or unsplice was requested at the same moment; try again")
    cut = await _wait_answer(
        state, what, (SpliceCut,), splice_id=event.id, patience=patience, timing=timing
    )
    assert isinstance(cut, SpliceCut) and cut.from_stage is not None and cut.start_seq is not None
    return cut


async def abandon(
    state: RunState, which: str | Callable[[SpliceRecord], bool], reason: str
) -> str | None:
    """Mark a request abandoned unless it was taken up meanwhile (compare-and-set).

    ``which``: the request's id, or a test on the ``splice`` record. Returns the
    request's state afterwards: ``"abandoned"`` (by this call or before), the state
    it was moved on to (``"claimed"``, ``"cut"``, ``"refused"``, ...), or None when
    ``splice`` holds no such request.
    """
    match = which if callable(which) else (lambda r: r.id == which)
    while True:
        record, rev = await state.entry(SPLICE)
        if record is None or not match(record):
            return None
        if not isinstance(record, SpliceAsked | SpliceRequested | SpliceAbandoned):
            return protocol.state_of(record)
        if await apply(state, record, rev, Abandon(reason)) is not None:
            return "abandoned"
        # moved on meanwhile: look at its new state


# ----------------------------------------------------------------- unsplice: asking and owning


async def ask_unsplice(state: RunState, stage: str, timing: Timing = DEFAULT_TIMING) -> str:
    """``--unsplice``: ask the owner of ``exp.<stage>`` to take itself out. Returns the id.

    Raises :class:`RftError` when the stage is not spliced, is not the one the
    trainer reads (remove the later ones first), or its owner is not running (with
    the command that restarts it).
    """
    check_stage(stage)
    record = await state.get(STAGE.of(stage=stage))
    if record is None:
        raise RftError(
            f"--unsplice {stage}: exp.{stage} is not a spliced stage "
            "(`rftstream status` shows the chain)"
        )
    current, _ = protocol.input_of(await state.get(TRAINER_INPUT))
    change = await state.get(SPLICE)
    resuming = protocol.unsplice_in_flight(change, stage)
    if current != stage and not resuming:
        raise RftError(
            f"--unsplice {stage}: the trainer reads exp.{current}, which is spliced after "
            f"exp.{stage}; remove exp.{current} first"
        )
    if not owner_alive(record, timing):
        raise RftError(
            f"--unsplice {stage}: its operator {record.operator!r} is not running "
            f"(owner {record.owner.actor!r} last seen {time.time() - record.owner.ts:.0f}s "
            f"ago). Start it again with `{ownership.restart_hint(record)}` (it resumes where it "
            "stopped), then remove it with Ctrl-C or --unsplice"
        )
    if resuming:
        assert change is not None
        return change.id
    change, rev = await _wait_quiet(state, f"unsplice exp.{stage}", timing)
    ask = AskUnsplice(
        id=uuid.uuid4().hex[:12],
        operator=record.operator,
        from_stage=record.from_stage,
        to_stage=stage,
    )
    if await apply(state, change, rev, ask, timing) is None:
        raise RftError("another splice or unsplice was requested at the same moment; try again")
    return ask.id


async def wait_unsplice(
    state: RunState,
    splice_id: str,
    stage: str,
    *,
    patience: float | None = None,
    timing: Timing = DEFAULT_TIMING,
    clock: Clock = wall_clock,
) -> SpliceDrained | SpliceDone:
    """``--unsplice``: wait until the owner has drained (``"drained"`` or ``"done"``). Blocks.

    Raises :class:`RftError` when the stage's owner is not running, whatever the
    state of the request (with the command that restarts it: before it took the
    request up, the request is abandoned; after, the restarted operator finishes the
    removal itself), when the run ends, and (:class:`TrainerGone`) when no trainer
    has been running for ``patience`` s while the request waits for one (the
    operator keeps it: a restarted trainer completes it).
    """
    watcher = watch.UnspliceWatch.start(stage, splice_id, clock(), timing, patience)
    stage_key = STAGE.of(stage=stage)

    async def attempt(now: float) -> SpliceDrained | SpliceDone | None:
        nonlocal watcher
        record = await state.get(SPLICE)
        stage_record = await state.get(stage_key)
        health = await read_health(state, now, timing) if watcher.health_due(now) else None
        pid_alive = local_pid_alive(stage_record.owner) if stage_record else None
        watcher, verdict = watcher.step(record, stage_record, now, pid_alive, health)
        match verdict:
            case Answered(answer):
                assert isinstance(answer, SpliceDrained | SpliceDone)
                return answer
            case Failed(message):
                raise RftError(message)
            case NoTrainer(message):
                raise TrainerGone(message)
            case OwnerGone() as gone:
                took = None
                if gone.abandon_first:
                    took = await abandon(state, splice_id, "the stage's operator stopped running")
                raise RftError(gone.message(took or None))
        return None

    # the owner's refreshes of stage.<Y> wake it too: a silent owner is found by its age
    keys = (SPLICE, stage_key, STATUS)
    return await drive(state.kv, keys, attempt, wake_s=timing.check_every_s, clock=clock)


async def claim_stage(
    state: RunState, stage: str, actor: str, timing: Timing = DEFAULT_TIMING
) -> StageRecord:
    """Owner side: become the process serving a spliced stage (its record must exist).

    Raises :class:`RftError` when another live process owns it. The record returned
    carries this claim's ``owner`` (pass it to :func:`refresh_owner`).
    """
    key = STAGE.of(stage=stage)
    record, rev = await state.entry(key)
    if record is None:
        raise RftError(f"exp.{stage} is not a spliced stage")
    now = time.time()
    new = ownership.claim_owner(
        record, owner_info(actor), now, local_pid_alive(record.owner), timing
    )
    if await state.cas(key, new, rev) is None:
        raise RftError(f"exp.{stage}: another process claimed it at the same moment")
    return new


async def refresh_owner(
    state: RunState, stage: str, owner: Owner, timing: Timing = DEFAULT_TIMING
) -> None:
    """Keep this process's claim on ``stage.<Y>`` fresh every ``Timing.owner_refresh_s`` s.

    ``owner``: the claim :func:`claim_stage` wrote. Returns when the record is gone
    (unspliced); runs until cancelled otherwise. Raises :class:`RftError`
    (:class:`~rftstream.control.splice.ownership.TakenOver`) when another process owns the
    stage now (it claimed it while this one looked gone): this process must stop
    serving it, so two never process one stage. A KV error is logged and retried at
    the next refresh.
    """
    key = STAGE.of(stage=stage)
    while True:
        await anyio.sleep(timing.owner_refresh_s)
        try:
            record, rev = await state.entry(key)
            new = ownership.refresh_owner(record, owner, time.time(), timing)
            if new is None:
                return  # unspliced
            await state.cas(key, new, rev)  # lost to a writer: checked next time
        except ownership.TakenOver:
            raise
        except Exception as exc:  # noqa: BLE001 - KV trouble: the next refresh retries
            log.warning("%s: could not refresh its claim on exp.%s: %s", owner.actor, stage, exc)


async def request_unsplice(
    state: RunState,
    splice_id: str,
    *,
    operator: str,
    from_stage: str,
    to_stage: str,
    cut_seq: int,
    timing: Timing = DEFAULT_TIMING,
) -> None:
    """Owner side, step 2: the hosts stopped at ``cut_seq``; ask the trainer to read
    ``exp.<from_stage>`` from ``cut_seq + 1`` and wait until it does (step 3). Blocks."""
    record, rev = await state.entry(SPLICE)
    parked = OwnerParked(splice_id, operator, from_stage, to_stage, int(cut_seq))
    try:
        new = await apply(state, record, rev, parked, timing)
    except protocol.IllegalTransition as exc:
        raise RftError(
            f"unsplice exp.{to_stage}: another change is under way ({record}); try again"
        ) from exc
    if new is None:
        raise RftError(f"unsplice exp.{to_stage}: the splice record changed meanwhile; try again")
    await wait_unsplice_cut(state, splice_id, to_stage, timing=timing)


async def wait_unsplice_cut(
    state: RunState,
    splice_id: str,
    to_stage: str,
    *,
    patience: float | None = None,
    timing: Timing = DEFAULT_TIMING,
) -> SpliceRecord:
    """Owner side: wait until the trainer reads the upstream stage again (``"cut"``). Blocks.

    No trainer for a while: the request is abandoned and :class:`TrainerGone`
    raised, unless a trainer claimed it (then this keeps waiting), exactly as for a
    splice.
    """
    return await _wait_answer(
        state,
        f"unsplice exp.{to_stage}",
        (SpliceCut, SpliceDrained, SpliceDone),
        splice_id=splice_id,
        patience=patience,
        timing=timing,
    )


async def finish_unsplice(state: RunState, splice_id: str, stage: str, drain_until: int) -> None:
    """Owner side, step 4: everything up to the cut is processed; ``exp.<stage>`` ends at
    ``drain_until``: write ``"drained"``, delete the ``stage.<Y>`` record."""
    record, rev = await state.entry(SPLICE)
    if record is None or record.id != splice_id or isinstance(record, SpliceAbandoned):
        raise RftError(f"unsplice exp.{stage}: the splice record changed meanwhile: {record}")
    try:
        new = await apply(state, record, rev, OwnerDrained(int(drain_until)))
    except protocol.IllegalTransition as exc:
        raise RftError(f"unsplice exp.{stage}: {exc}") from exc
    if new is None:
        raise RftError(f"unsplice exp.{stage}: the splice record changed meanwhile")
