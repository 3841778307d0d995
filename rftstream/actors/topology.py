"""The trainer's side of splicing: which stage it reads, and answering splice/unsplice requests.

:class:`TrainerTopology` owns the ``trainer.input`` KV record and the feed's
consumers (see :mod:`rftstream.splice` for the protocol). It acts only from
:meth:`poll`, which the feed calls between two fetches, so a cut taken there
(the last sequence the trainer's consumer delivered) is exact.

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
from typing import Any

from rftstream import splice
from rftstream.actors.feed import ExperienceFeed
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import PullSubscription
from rftstream.errors import BusError, ConsumerNotFound
from rftstream.subjects import KV_SPLICE, KV_TRAINER_INPUT, KV_TRAINER_WAITING

log = logging.getLogger(__name__)

POLL_S = 0.5
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
        self.record: dict[str, Any] = {}
        self.feed: ExperienceFeed | None = None
        self._polled = 0.0
        self._waiting_checked = 0.0
        self.waiting: str | None = None
        self._warned: str | None = None
        self.poll_errors = 0

    async def open(self) -> PullSubscription:
        """Bind the consumer ``trainer.input`` names (``trainer`` on ``exp.train`` if none)."""
        self.record = await splice.trainer_input_record(self.state)
        self.stage, durable = splice.input_of(self.record)
        return await self.bus.pull(self.names.exp_stream, durable)

    async def attach(self, feed: ExperienceFeed) -> None:
        """Hook into ``feed``; re-attach the consumers a previous trainer still had to drain."""
        self.feed = feed
        feed.on_idle = self.poll
        feed.on_retired_change = self.persist
        for r in self.record.get("retired") or []:
            try:
                consumer = await self.bus.pull(self.names.exp_stream, str(r["consumer"]))
            except Exception:  # noqa: BLE001 - already drained and deleted
                continue
            cut = r.get("cut_seq")
            feed.retire(consumer, None if cut is None else int(cut), r.get("splice_id"))
        if self.record.get("retired"):
            await self.persist()

    async def persist(self, **extra: Any) -> None:
        """Write ``trainer.input`` (the stage read now, retired consumers)."""
        assert self.feed is not None
        self.record = {
            **{k: v for k, v in self.record.items() if k not in ("retired",)},
            **extra,
            "stage": self.stage,
            "consumer": self.feed.consumer.durable,
            "retired": self.feed.retired_records(),
            "ts": time.time(),
        }
        await self.state.put_json(KV_TRAINER_INPUT, self.record)

    # ------------------------------------------------------------------ polling

    async def poll(self) -> None:
        """Act on a pending request; watch the stage read. At most every 0.5 s.

        A NATS failure is logged and retried at the next poll (see the module docstring).
        """
        now = time.monotonic()
        if now - self._polled < POLL_S or self.feed is None:
            return
        self._polled = now
        try:
            await self._poll(now)
        except (TimeoutError, BusError) as exc:
            self.poll_errors += 1
            log.warning(
                "%s: splice polling failed (%s: %s); retrying at the next poll",
                self.name,
                type(exc).__name__,
                exc,
            )

    async def _poll(self, now: float) -> None:
        value, rev = await self.state.get_entry(KV_SPLICE)
        if now - self._waiting_checked >= WAITING_CHECK_S:
            self._waiting_checked = now
            await self._check_waiting(value)
        pending = splice.pending_for_trainer(value, rev)
        if pending is None:
            return
        request, rev = pending
        if request.get("kind") == "unsplice" and request.get("state") == "drained":
            await self._drained(request)
            return
        if await splice.claim(self.state, request, rev) is None:
            return  # abandoned (or moved on) meanwhile
        if request.get("kind", "splice") == "splice":
            await self._splice_in(request)
        else:
            await self._unsplice(request)

    async def _new_durable(self, stage: str, start_seq: int, why: str) -> PullSubscription:
        """A fresh trainer durable on ``exp.<stage>`` delivering from ``start_seq``."""
        assert self.feed is not None
        n = self.names
        name = splice.trainer_durable(stage)
        in_use = {self.feed.consumer.durable} | self.feed.retired_names
        try:
            await self.bus.transport.consumer_state(n.exp_stream, name)
            if name in in_use:
                name = f"{name}_{start_seq}"
            else:  # left over (e.g. by a trainer that died mid-switch): nobody reads it
                await self.bus.transport.delete_consumer(n.exp_stream, name)
        except ConsumerNotFound:
            pass
        await self.bus.ensure_consumer(
            n.exp_stream,
            name,
            n.exp_subject(stage),
            description=f"run {n.run}: the trainer reads exp.{stage} ({why})",
            role="trainer",
            start_seq=max(1, start_seq),
        )
        return await self.bus.pull(n.exp_stream, name)

    async def _splice_in(self, request: dict[str, Any]) -> None:
        assert self.feed is not None
        to_stage = str(request["to_stage"])
        if self.record.get("splice_id") == request["id"] and self.stage == to_stage:
            # switched already (a poll that failed, or a trainer that died, before answering):
            # write what may be missing, then answer again
            await self.persist()
            from_stage = str(self.record.get("from_stage"))
            start_seq = int(self.record.get("start_seq") or 1)
            stage_missing = await splice.stage_record(self.state, to_stage) is None
        elif to_stage == self.stage:
            await splice.answer(
                self.state,
                request,
                state="refused",
                reason=f"the trainer already reads exp.{to_stage}",
            )
            return
        else:
            from_stage = self.stage
            info = await self.feed.consumer.info()
            cut = info.delivered
            start_seq = cut + 1
            last = (await self.bus.transport.stream_state(self.names.exp_stream)).last_seq
            new = await self._new_durable(
                to_stage, last + 1, f"spliced by {request.get('operator')}"
            )
            await self.feed.switch_to(new, cut, splice_id=str(request["id"]))
            self.stage = to_stage
            await self.persist(splice_id=request["id"], from_stage=from_stage, start_seq=start_seq)
            stage_missing = True
        if stage_missing:
            await splice.put_stage_record(
                self.state,
                request,
                from_stage,
                self.names.stage_consumer(from_stage, to_stage),
                start_seq,
            )
        await splice.record_topology(
            self.state,
            "splice",
            from_stage,
            to_stage,
            request.get("operator"),
            start_seq,
            str(request["id"]),
        )
        await splice.answer(
            self.state,
            request,
            state="cut",
            from_stage=from_stage,
            start_seq=start_seq,
            consumer=self.feed.consumer.durable,
        )
        log.info(
            "%s: spliced %s in: exp.%s from seq %d belongs to it; reading exp.%s now",
            self.name,
            request.get("operator"),
            from_stage,
            start_seq,
            to_stage,
        )

    async def _unsplice(self, request: dict[str, Any]) -> None:
        assert self.feed is not None
        to_stage, from_stage = str(request["to_stage"]), str(request["from_stage"])
        cut = int(request["cut_seq"])
        if self.record.get("splice_id") == request["id"] and self.stage == from_stage:
            # switched already (a poll that failed, or a trainer that died, before answering)
            await self.persist()
        elif self.stage != to_stage:
            await splice.answer(
                self.state,
                request,
                state="refused",
                reason=f"the trainer reads exp.{self.stage}, not exp.{to_stage}",
            )
            return
        else:
            new = await self._new_durable(
                from_stage, cut + 1, f"{request.get('operator')} removed from exp.{to_stage}"
            )
            await self.feed.switch_to(new, None, splice_id=str(request["id"]))
            self.stage = from_stage
            await self.persist(splice_id=request["id"], from_stage=to_stage, start_seq=cut + 1)
        await splice.record_topology(
            self.state,
            "unsplice",
            to_stage,
            from_stage,
            request.get("operator"),
            cut + 1,
            str(request["id"]),
        )
        await splice.answer(self.state, request, state="cut", consumer=self.feed.consumer.durable)
        log.info(
            "%s: removed %s: reading exp.%s from seq %d again; draining exp.%s",
            self.name,
            request.get("operator"),
            from_stage,
            cut + 1,
            to_stage,
        )

    async def _drained(self, request: dict[str, Any]) -> None:
        """The removed operator is done: drain its stage up to where it ended."""
        assert self.feed is not None
        if not self.feed.set_retired_cut(str(request["id"]), int(request["drain_until"])):
            log.warning(
                "%s: no consumer retired by unsplice %s to close; nothing to drain",
                self.name,
                request["id"],
            )
        await self.persist()
        await splice.answer(self.state, request, state="done")

    # ------------------------------------------------------------------ a stage that died

    async def _check_waiting(self, request: Any) -> None:
        """Say so (KV ``trainer.waiting``, a warning) when a dead spliced operator starves us.

        ``request``: the ``splice`` record as this poll read it.
        """
        assert self.feed is not None
        stages = [self.stage]
        if splice.unsplice_in_flight(request):
            stages.append(str(request.get("to_stage")))  # an unsplice that must still drain
        message = None
        dead = None
        for stage in stages:
            record = await splice.stage_record(self.state, stage)
            if record is None or splice.owner_alive(record):
                continue
            starving = time.monotonic() - self.feed.last_received > STARVED_S
            if stage == self.stage and not starving:
                continue
            owner = record.get("owner") or {}
            age = time.time() - float(owner.get("ts", 0) or 0)
            seen = f"last seen {age:.0f}s ago" if owner.get("ts") else "never started"
            message = (
                f"the trainer waits for exp.{stage}, spliced in by operator "
                f"{record.get('operator')!r}, whose process is gone ({seen}); restart it with "
                f"`{splice.restart_hint(record)}` (it resumes where it stopped), then remove it "
                f"with Ctrl-C or `rftstream operator --unsplice {stage}` if you want it out"
            )
            dead = stage
            break
        if dead is not None and dead != self._warned:
            log.warning("%s: %s", self.name, message)
        self._warned = dead
        if message:
            await self.state.put_json(KV_TRAINER_WAITING, {"message": message, "ts": time.time()})
        elif self.waiting:
            await self.state.delete(KV_TRAINER_WAITING)
        self.waiting = message
