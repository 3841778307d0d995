"""The trainer's side of splicing: which stage it reads, and answering splice/unsplice requests.

:class:`TrainerTopology` owns the ``trainer.input`` KV record and the feed's
consumers (see :mod:`rftstream.control.splice` for the protocol). It is the I/O around
two pure decisions: :func:`~rftstream.control.splice.protocol.trainer_plan` (how to
answer a request) and :func:`~rftstream.control.splice.protocol.step` (the record's
next state). It acts only from :meth:`poll`, which the feed calls between two
fetches, so a cut taken there (the last sequence the trainer's consumer
delivered) is exact.

It also watches the stage the trainer reads: when that is a spliced stage
whose operator process is gone, it writes ``trainer.waiting`` with the
command that restarts it (``rftstream status`` shows it) and logs a warning,
instead of leaving the trainer waiting without a word. The key is deleted
once the stage runs again.

Every method does a few KV / JetStream API round trips (blocks for them);
cancelling one mid-way leaves the KV state consistent: a claimed request is
taken up again by the next :meth:`poll` (of this or a restarted trainer).
A NATS error inside :meth:`poll` (a KV timeout, a JetStream API error, a
lost connection) is logged and the poll retried 0.5 s later, the same way:
a hiccup never fails the training run. Errors of the protocol itself (the
``splice`` record replaced under the trainer's feet) propagate.
"""

from __future__ import annotations

import logging
import time

from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import PullSubscription
from rftstream.control import LOOK_AGAIN_S, KeyWrites
from rftstream.control.splice import protocol
from rftstream.control.splice.operator_side import apply, owner_alive
from rftstream.control.splice.ownership import dead_stage_message
from rftstream.control.splice.protocol import (
    AnswerAgain,
    Claim,
    Close,
    Event,
    Refuse,
    SwitchBack,
    SwitchIn,
    TrainerCut,
)
from rftstream.errors import BusError, ConsumerNotFound, RftError
from rftstream.subjects import TRAINER_ROLE
from rftstream.wire import (
    SPLICE,
    STAGE,
    TOPOLOGY,
    TRAINER_INPUT,
    TRAINER_WAITING,
    Owner,
    SpliceClaimed,
    SpliceDrained,
    SpliceKind,
    SpliceRecord,
    StageRecord,
    TopologyEdge,
    TrainerInput,
    TrainerWaiting,
)

log = logging.getLogger(__name__)

POLL_S = 0.5  # the least time between two looks at the splice record
WAITING_CHECK_S = 2.0
STARVED_S = 2.0  # nothing received for this long while a batch is short: the trainer waits


class TrainerTopology:
    """The trainer's input stage and the splice protocol's trainer side."""

    def __init__(self, bus: Bus, state: RunState, name: str) -> None:
        self.bus = bus
        self.state = state
        self.name = name
        self.names = bus.names
        self.stage = "train"
        self.record: TrainerInput | None = None
        self.feed: ExperienceFeed | None = None
        self._polled = 0.0
        self._looked = 0.0
        self._look_again = True  # look at the first poll: a request may wait already
        self._writes: KeyWrites | None = None
        self._waiting_checked = 0.0
        self.waiting: str | None = None
        self._warned: str | None = None
        self.poll_errors = 0

    async def open(self) -> PullSubscription:
        """Bind the consumer ``trainer.input`` names (``trainer`` on ``exp.train`` if none)."""
        self.record = await self.state.get(TRAINER_INPUT)
        self.stage, durable = protocol.input_of(self.record)
        return await self.bus.pull(self.names.exp_stream, durable)

    async def attach(self, feed: ExperienceFeed) -> None:
        """Hook into ``feed``; re-attach the consumers a previous trainer still had to drain."""
        self.feed = feed
        self._writes = KeyWrites(self.state.kv, (SPLICE,))
        await self._writes.start()
        feed.on_idle = self.poll
        feed.on_retired_change = self.persist
        retired = self.record.retired if self.record is not None else []
        for r in retired:
            try:
                consumer = await self.bus.pull(self.names.exp_stream, r.consumer)
            except Exception:  # noqa: BLE001 - already drained and deleted
                continue
            feed.retire(consumer, r.cut_seq, r.splice_id)
        if retired:
            await self.persist()

    async def persist(
        self,
        splice_id: str | None = None,
        from_stage: str | None = None,
        start_seq: int | None = None,
    ) -> None:
        """Write ``trainer.input`` (the stage read now, retired consumers; the last switch's
        ``splice_id``, ``from_stage`` and ``start_seq`` when given, else kept)."""
        assert self.feed is not None
        record = TrainerInput(
            stage=self.stage,
            consumer=self.feed.consumer.durable,
            retired=self.feed.retired_records(),
            splice_id=splice_id,
            from_stage=from_stage,
            start_seq=start_seq,
            ts=time.time(),
        )
        if splice_id is None and self.record is not None:  # no new switch: keep the last one's
            record.splice_id = self.record.splice_id
            record.from_stage = self.record.from_stage
            record.start_seq = self.record.start_seq
        self.record = record
        await self.state.put(TRAINER_INPUT, self.record)

    # ------------------------------------------------------------------ polling

    async def close(self) -> None:
        """Stop watching the ``splice`` record (at the trainer's end; errors ignored)."""
        if self._writes is not None:
            await self._writes.stop()

    async def poll(self) -> None:
        """Act on a pending request; watch the stage read. At most every :data:`POLL_S`.

        The ``splice`` record is read only after it was written (a KV write
        notification, :class:`~rftstream.control.KeyWrites`), after a failed poll, and
        every :data:`LOOK_AGAIN_S` s; the stage read is checked every
        :data:`WAITING_CHECK_S` s. A NATS failure is logged and retried at the next poll
        (see the module docstring).
        """
        now = time.monotonic()
        if now - self._polled < POLL_S or self.feed is None:
            return
        self._polled = now
        written = self._writes is None or await self._writes.wait(0)
        look = written or self._look_again or now - self._looked >= LOOK_AGAIN_S
        if not look and now - self._waiting_checked < WAITING_CHECK_S:
            return
        self._look_again = True  # until this look succeeds
        try:
            await self._poll(now)
            self._looked = now
            self._look_again = False
        except (TimeoutError, BusError) as exc:
            self.poll_errors += 1
            log.warning(
                "%s: splice polling failed (%s: %s); retrying at the next poll",
                self.name,
                type(exc).__name__,
                exc,
            )

    async def _poll(self, now: float) -> None:
        record, rev = await self.state.entry(SPLICE)
        if now - self._waiting_checked >= WAITING_CHECK_S:
            self._waiting_checked = now
            await self._check_waiting(record)
        match protocol.trainer_to_act(record):
            case Close():
                assert isinstance(record, SpliceDrained)
                await self._drained(record)
            case Claim():
                claimed = await apply(self.state, record, rev, Claim())
                if claimed is None:
                    return  # abandoned (or moved on) meanwhile
                assert isinstance(claimed, SpliceClaimed)
                await self._answer_claimed(claimed)

    async def _answer(self, request: SpliceRecord, event: Event) -> None:
        """Move ``request`` on by ``event`` (compare-and-set on the record read now)."""
        record, rev = await self.state.entry(SPLICE)
        if record is None or record.id != request.id:
            raise RftError(f"the splice record changed while the trainer answered it: {record}")
        if await apply(self.state, record, rev, event) is None:
            raise RftError(f"the splice record {request.id} changed while the trainer answered it")

    async def _answer_claimed(self, request: SpliceClaimed) -> None:
        assert self.feed is not None
        plan = protocol.trainer_plan(request, self.stage, self.record)
        if isinstance(plan, Refuse):
            await self._answer(request, plan)
        elif request.kind == "splice":
            await self._splice_in(request, plan)
        else:
            await self._unsplice(request, plan)

    async def _new_durable(self, stage: str, start_seq: int, why: str) -> PullSubscription:
        """A fresh trainer durable on ``exp.<stage>`` delivering from ``start_seq``."""
        assert self.feed is not None
        n = self.names
        name = protocol.trainer_durable(stage)
        in_use = {self.feed.consumer.durable} | self.feed.retired_names
        try:
            await self.bus.consumer_state(n.exp_stream, name)
            if name in in_use:
                name = f"{name}_{start_seq}"
            else:  # left over (e.g. by a trainer that died mid-switch): nobody reads it
                await self.bus.delete_consumer(n.exp_stream, name)
        except ConsumerNotFound:
            pass
        await self.bus.ensure_consumer(
            n.exp_stream,
            name,
            n.exp_subject(stage),
            description=f"run {n.run}: the trainer reads exp.{stage} ({why})",
            role=TRAINER_ROLE,
            start_seq=max(1, start_seq),
        )
        return await self.bus.pull(n.exp_stream, name)

    async def _record_topology(
        self, op: SpliceKind, from_stage: str, to_stage: str, request: SpliceRecord, seq: int
    ) -> None:
        """Append the change to ``topology`` (once per splice id: a retried answer adds none)."""
        edge = TopologyEdge(
            op=op,
            from_stage=from_stage,
            to_stage=to_stage,
            by=request.operator,
            seq=seq,
            ts=time.time(),
            splice_id=request.id,
        )
        edges = protocol.with_edge(await self.state.get(TOPOLOGY) or [], edge)
        if edges is not None:
            await self.state.put(TOPOLOGY, edges)

    async def _splice_in(
        self, request: SpliceClaimed, plan: SwitchIn | AnswerAgain | SwitchBack
    ) -> None:
        assert self.feed is not None
        to_stage = request.to_stage
        if isinstance(plan, AnswerAgain):
            # switched already (a poll that failed, or a trainer that died, before answering):
            # write what may be missing, then answer again
            await self.persist()
            from_stage, start_seq = plan.from_stage, plan.start_seq
            stage_missing = await self.state.get(STAGE.of(stage=to_stage)) is None
        else:
            from_stage = self.stage
            info = await self.feed.consumer.info()
            cut = info.delivered
            start_seq = cut + 1
            last = (await self.bus.stream_state(self.names.exp_stream)).last_seq
            new = await self._new_durable(to_stage, last + 1, f"spliced by {request.operator}")
            await self.feed.switch_to(new, cut, splice_id=request.id)
            self.stage = to_stage
            await self.persist(splice_id=request.id, from_stage=from_stage, start_seq=start_seq)
            stage_missing = True
        if stage_missing:  # stage.<Y> exists from the moment the trainer reads it
            await self.state.put(
                STAGE.of(stage=to_stage),
                StageRecord(
                    operator=request.operator,
                    args=request.args,
                    from_stage=from_stage,
                    to_stage=to_stage,
                    durable=self.names.stage_consumer(from_stage, to_stage),
                    start_seq=start_seq,
                    splice_id=request.id,
                    owner=request.owner or Owner(actor=request.operator),
                ),
            )
        await self._record_topology("splice", from_stage, to_stage, request, start_seq)
        await self._answer(
            request,
            TrainerCut(
                consumer=self.feed.consumer.durable, from_stage=from_stage, start_seq=start_seq
            ),
        )
        log.info(
            "%s: spliced %s in: exp.%s from seq %d belongs to it; reading exp.%s now",
            self.name,
            request.operator,
            from_stage,
            start_seq,
            to_stage,
        )

    async def _unsplice(
        self, request: SpliceClaimed, plan: SwitchIn | AnswerAgain | SwitchBack
    ) -> None:
        assert self.feed is not None
        assert request.from_stage is not None and request.cut_seq is not None
        to_stage, from_stage = request.to_stage, request.from_stage
        start_seq = request.cut_seq + 1
        if isinstance(plan, SwitchBack):
            new = await self._new_durable(
                from_stage, start_seq, f"{request.operator} removed from exp.{to_stage}"
            )
            await self.feed.switch_to(new, None, splice_id=request.id)
            self.stage = from_stage
            await self.persist(splice_id=request.id, from_stage=to_stage, start_seq=start_seq)
        else:  # switched already (a poll that failed, or a trainer that died, before answering)
            await self.persist()
        await self._record_topology("unsplice", to_stage, from_stage, request, start_seq)
        await self._answer(request, TrainerCut(consumer=self.feed.consumer.durable))
        log.info(
            "%s: removed %s: reading exp.%s from seq %d again; draining exp.%s",
            self.name,
            request.operator,
            from_stage,
            start_seq,
            to_stage,
        )

    async def _drained(self, request: SpliceDrained) -> None:
        """The removed operator is done: drain its stage up to where it ended."""
        assert self.feed is not None
        if not self.feed.set_retired_cut(request.id, request.drain_until):
            log.warning(
                "%s: no consumer retired by unsplice %s to close; nothing to drain",
                self.name,
                request.id,
            )
        await self.persist()
        await self._answer(request, Close())

    # ------------------------------------------------------------------ a stage that died

    async def _check_waiting(self, request: SpliceRecord | None) -> None:
        """Say so (KV ``trainer.waiting``, a warning) when a dead spliced operator starves us.

        ``request``: the ``splice`` record as this poll read it.
        """
        assert self.feed is not None
        stages = [self.stage]
        if request is not None and protocol.unsplice_in_flight(request):
            stages.append(request.to_stage)  # an unsplice that must still drain
        message = None
        dead = None
        for stage in stages:
            record = await self.state.get(STAGE.of(stage=stage))
            if record is None or owner_alive(record):
                continue
            starving = time.monotonic() - self.feed.last_received > STARVED_S
            if stage == self.stage and not starving:
                continue
            message = dead_stage_message(record, time.time())
            dead = stage
            break
        if dead is not None and dead != self._warned:
            log.warning("%s: %s", self.name, message)
        self._warned = dead
        if message and dead:
            await self.state.put(
                TRAINER_WAITING, TrainerWaiting(stage=dead, message=message, ts=time.time())
            )
        elif self.waiting:
            await self.state.delete(TRAINER_WAITING)
        self.waiting = message
