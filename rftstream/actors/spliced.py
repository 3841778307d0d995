"""A spliced operator process: splice in (or resume), serve the stage, take itself out again.

``rftstream operator NAME --splice --to Y`` runs :func:`run_spliced`; the
protocol is in :mod:`rftstream.control.splice`, its KV loops in
:mod:`rftstream.control.splice.operator_side`. What a user sees:

* First start: the trainer cuts over to ``exp.Y``; this process reads the
  trainer's old stage from the cut on (``--replicas`` hosts sharing one durable).
* Ctrl-C / SIGTERM (``stop`` set), or ``rftstream operator --unsplice Y`` from
  another shell: the process removes the stage (every replica stops fetching,
  acks its batch, the trainer reads the old stage again from the cut, leftovers
  up to the cut are processed) and exits. A second Ctrl-C aborts at once; the
  stage then stays spliced.
* After a crash (SIGKILL, OOM): the same command resumes the stage, or an
  unsplice that was under way, instead of splicing again.
* The run ends: the hosts stop, the stage stays in the KV record (harmless).

:func:`run_spliced` blocks until one of these ends it; cancelling it stops
the hosts where they are (their batches are redelivered after ``ack_wait``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio

from rftstream.actors.operator_host import DrainControl, replica_names, run_hosts
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.control import LOOK_AGAIN_S, drive
from rftstream.control.splice import operator_side, protocol
from rftstream.errors import ConsumerNotFound, NotFound, RftError
from rftstream.wire import (
    HEARTBEAT,
    SPLICE,
    STAGE,
    SpliceAsked,
    SpliceClaimed,
    SpliceCut,
    SpliceRecord,
    SpliceRequested,
    StageRecord,
)

log = logging.getLogger(__name__)


async def last_seq_on(bus: Bus, stage: str) -> int:
    """The stream sequence of the last message on ``exp.<stage>`` (0: none)."""
    try:
        msg = await bus.last_msg(bus.names.exp_stream, bus.names.exp_subject(stage))
    except NotFound:
        return 0
    return msg.seq


async def _our_unsplice(state: RunState, stage: str) -> SpliceRecord | None:
    """The ``splice`` record when it is an unsplice of ``exp.<stage>`` under way."""
    record = await state.get(SPLICE)
    return record if protocol.unsplice_in_flight(record, stage) else None


async def run_spliced(
    run: Any,
    url: str,
    *,
    operator: str,
    args: dict[str, Any],
    to_stage: str,
    pipelines: list[Any],
    name: str,
    stop: anyio.Event,
    say: Callable[[str], None],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    unsplice_now: bool = False,
) -> str:
    """Serve ``exp.<to_stage>`` in front of the trainer until removed or the run ends.

    Returns ``"removed"``, ``"run ended"`` or ``"cancelled"`` (stopped before
    the trainer answered the splice). ``unsplice_now``: resume the stage only
    to remove it (``rftstream operator NAME --unsplice Y``).
    """
    n = run.names
    async with await Bus.connect(url, n, run.cfg.nats, f"{name}-splice") as bus:
        state = RunState(await bus.kv())
        record = await state.get(STAGE.of(stage=to_stage))
        if record is None and unsplice_now:
            raise RftError(f"--unsplice {to_stage}: exp.{to_stage} is not a spliced stage")
        if record is None:
            cut = None
            async with anyio.create_task_group() as tg:

                async def request() -> None:
                    nonlocal cut
                    cut = await operator_side.request_splice(
                        state, operator, to_stage, args=args, actor=name
                    )
                    tg.cancel_scope.cancel()

                async def stopper() -> None:
                    await stop.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(request)
                tg.start_soon(stopper)
            if cut is None:  # stopped while waiting for the trainer
                took = await operator_side.abandon(
                    state, functools.partial(_own_request, to_stage), "the operator was stopped"
                )
                if took in (None, "abandoned", "refused"):
                    say("stopped before the trainer answered; nothing was spliced")
                    return "cancelled"
                record = await _wait_record(state, to_stage)  # the trainer took it meanwhile
                say(f"the trainer switched to exp.{to_stage} meanwhile; removing it again")
            else:
                say(
                    f"spliced in: reads exp.{cut.from_stage} from sequence {cut.start_seq}, "
                    f"writes exp.{to_stage}; the trainer reads exp.{to_stage} from now on"
                )
                record = await state.get(STAGE.of(stage=to_stage))
                if record is None:
                    raise RftError(
                        f"exp.{to_stage}: the trainer answered but wrote no stage record"
                    )
        else:
            if record.operator != operator:
                raise RftError(
                    f"exp.{to_stage} is spliced with operator {record.operator!r}, not "
                    f"{operator!r}; restart that one, or remove it first"
                )
            say(
                f"resuming exp.{to_stage}: reads exp.{record.from_stage} through its "
                f"durable {record.durable}"
            )
        claimed = await operator_side.claim_stage(state, to_stage, name)
        from_stage = record.from_stage
        pending = await _our_unsplice(state, to_stage)
        start_seq = record.start_seq
        control = DrainControl(len(pipelines))
        if pending is not None and pending.cut_seq is not None:
            # an unsplice under way: the hosts must not process past its cut, not even once
            cut_seq = pending.cut_seq
            start_seq = cut_seq + 1  # never re-create the durable before its cut
            if isinstance(pending, SpliceRequested | SpliceClaimed):
                control.stop()
            else:  # "cut" / "drained": the trainer reads from cut_seq + 1 already
                control.set_cut(cut_seq)
        outcome = "run ended"

        async with anyio.create_task_group() as tg:

            async def hosts() -> None:
                await run_hosts(
                    url,
                    n,
                    run.cfg,
                    pipelines,
                    name=name,
                    from_stage=from_stage,
                    to_stage=to_stage,
                    on_progress=on_progress,
                    start_seq=start_seq,
                    control=control,
                )
                if not control.stopping:  # the run ended
                    tg.cancel_scope.cancel()

            async def trigger() -> None:
                nonlocal outcome
                resume = pending
                while resume is None and not unsplice_now and not stop.is_set():
                    with anyio.move_on_after(0.3):
                        await stop.wait()
                    asked = await _our_unsplice(state, to_stage)
                    if isinstance(asked, SpliceAsked):
                        resume = asked
                        say(f"asked to remove exp.{to_stage} (rftstream operator --unsplice)")
                await unsplice(bus, state, control, operator, from_stage, to_stage, resume, say)
                outcome = "removed"
                tg.cancel_scope.cancel()

            tg.start_soon(hosts)
            tg.start_soon(operator_side.refresh_owner, state, to_stage, claimed.owner)
            tg.start_soon(trigger)
        if outcome == "removed":  # a removed stage's operator leaves no row in `status`
            for replica in replica_names(name, len(pipelines)):
                await state.delete(HEARTBEAT.of(actor=replica))
        return outcome


async def unsplice(
    bus: Bus,
    state: RunState,
    control: DrainControl,
    operator: str,
    from_stage: str,
    to_stage: str,
    resume: SpliceRecord | None,
    say: Callable[[str], None],
) -> None:
    """Take ``exp.<to_stage>`` out (steps 2 and 4 of :mod:`rftstream.control.splice`). Blocks.

    ``resume``: the ``splice`` record of an unsplice already under way for
    this stage (None: start one).
    """
    n = bus.names
    durable = n.stage_consumer(from_stage, to_stage)
    splice_id = resume.id if resume is not None else uuid.uuid4().hex[:12]
    if resume is None or isinstance(resume, SpliceAsked) or resume.cut_seq is None:
        control.stop()
        say(f"removing exp.{to_stage}: every replica finishes the batch in hand…")
        await control.all_parked.wait()
        info = await bus.consumer_state(n.exp_stream, durable)
        cut = info.delivered
        say(f"cut at sequence {cut} of exp.{from_stage}; asking the trainer to read it again")
        await operator_side.request_unsplice(
            state,
            splice_id,
            operator=operator,
            from_stage=from_stage,
            to_stage=to_stage,
            cut_seq=cut,
        )
    else:
        cut = resume.cut_seq
        say(f"resuming the removal of exp.{to_stage} (cut at sequence {cut} of exp.{from_stage})")
        if isinstance(resume, SpliceRequested | SpliceClaimed):
            control.stop()
            await operator_side.wait_unsplice_cut(state, splice_id, to_stage)
    control.set_cut(cut)
    say(
        f"the trainer reads exp.{from_stage} from sequence {cut + 1}; "
        f"processing what is left up to {cut}…"
    )
    t0 = time.monotonic()
    await control.all_drained.wait()
    end = await last_seq_on(bus, to_stage)
    try:
        await bus.delete_consumer(n.exp_stream, durable)
    except ConsumerNotFound:
        pass
    await operator_side.finish_unsplice(state, splice_id, to_stage, end)
    log.info("unsplice of exp.%s drained in %.1fs", to_stage, time.monotonic() - t0)
    say(
        f"removed: exp.{to_stage} ends at sequence {end}; the trainer drains it, then reads "
        f"only exp.{from_stage}"
    )


def _own_request(to_stage: str, record: SpliceRecord) -> bool:
    """Whether the ``splice`` record is this process's splice request for ``to_stage``."""
    return (
        record.kind == "splice"
        and record.to_stage == to_stage
        and record.owner is not None
        and record.owner.pid == os.getpid()
    )


async def _wait_record(state: RunState, to_stage: str, patience: float = 120.0) -> StageRecord:
    """The trainer took this process's splice request before it could be abandoned: wait for
    its cut and the ``stage.<to_stage>`` record (read at each write of either). Raises :class:`RftError` naming the
    stage and the request after ``patience`` s without them."""
    change: SpliceRecord | None = None
    stage_key = STAGE.of(stage=to_stage)

    async def attempt(now: float) -> StageRecord | None:
        nonlocal change
        change = await state.get(SPLICE)
        record = await state.get(stage_key)
        return record if record is not None and isinstance(change, SpliceCut) else None

    with anyio.move_on_after(patience):
        # the trainer writes both; looked at again every few s in case a notification is lost
        return await drive(state.kv, (SPLICE, stage_key), attempt, wake_s=LOOK_AGAIN_S)
    raise RftError(
        f"exp.{to_stage}: the trainer took splice {change and change.id!r} up (state "
        f"{protocol.state_of(change)!r}) but has not cut over within {patience:.0f}s; a "
        f"restarted trainer completes it: then remove the stage with `rftstream operator "
        f"{change and change.operator} --unsplice {to_stage}` (`rftstream status` shows the "
        "splice)"
    )
