"""The trainer's experience source: a durable pull consumer on ``exp.train`` (or on the
stage a splice moved it to, see :mod:`rftstream.control.splice`).

:class:`ExperienceFeed` implements ``algorithms.sample_strategy.ExperienceSource``:
:meth:`read` blocks until ``n`` experiences are buffered, or returns fewer
only once the run's upstream is exhausted (every task done and every stage
drained). It fetches only about as many messages as the ``n`` asked for
still needs (a message carries one group: ``group_size`` experiences at
first, then the mean seen so far), so little is fetched ahead of a step.

Acks: a message is held (``in_progress()`` ticks keep it from redelivery during
long steps) until every experience it carried has been trained; then
:meth:`commit` acks it, or, with ``hold_trained`` (a trainer that writes resumable
checkpoints), keeps holding it until :meth:`release_trained` after the next
checkpoint: a trainer killed before that checkpoint gets it redelivered and trains
it again from the checkpoint's weights. :attr:`trained_unacked` and
:attr:`trained_unacked_bytes` say how much is held so (the trainer bounds it), and
:attr:`held_for_retired` whether a retired consumer (after a splice) waits for such
acks to be deleted. :meth:`trained_uids` lists what a checkpoint
must remember (experience trained from messages not acked yet), :meth:`mark_trained`
gives that list back to the feed of a resumed trainer, which then skips those
experiences when their messages come again. :meth:`trained_digests` goes further: a
digest of every experience trained since the run began, which a checkpoint also keeps
(8 bytes each), so a message that comes again after its ack was lost with a killed
server, or a copy republished after the stream's deduplication forgot the first (it was
purged, then the server restarted), is skipped as well. A message with an experience the trainer cannot use
(``validate`` returns the reason) goes to ``dlq.train`` instead of crash-looping
the trainer. Experiences are deduplicated by ``eid.uid``, so a
redelivered message is never trained twice. A body that does not decode goes
to ``dlq.train`` with the reason. Cancelling :meth:`read` loses nothing: held
messages are simply redelivered after ``ack_wait`` if the process dies.

After a splice or an unsplice the feed reads a new consumer and keeps
draining the *retired* one up to its cut (see :meth:`switch_to`); ``on_idle``
(the trainer's :class:`~rftstream.actors.topology.TrainerTopology`) runs
between two fetches, where a cut is exact, and at least once per :meth:`read`,
so a splice is answered before the next step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np

from rftstream.actors.common import InProgressTicker, drain_step
from rftstream.bus.client import Bus
from rftstream.bus.transport import ConsumerState, Delivery, PullSubscription
from rftstream.errors import BusError, SchemaError
from rftstream.experience import Experience, decode_group, uid_digests
from rftstream.subjects import TRAIN_STAGE
from rftstream.wire import RetiredConsumer

log = logging.getLogger(__name__)

ACK_CONFIRM_S = 2.0  # how long commit waits for the server to confirm its last ack


@dataclass
class _Held:
    msg: Delivery
    remaining: int
    stage: str = ""
    trained_uids: list[str] = field(default_factory=list)  # trained, the message not acked
    source: str = ""  # the durable consumer it was fetched from


@dataclass
class _Retired:
    """A consumer the trainer stopped reading: its messages up to ``cut_seq`` are still the
    trainer's. ``cut_seq`` None (an unsplice under way): everything on it, until the spliced
    operator has drained and says where its stage ends."""

    consumer: PullSubscription
    cut_seq: int | None
    splice_id: str | None = None


class ExperienceFeed:
    """Buffered, deduplicating reader of ``exp.train`` for the trainer."""

    def __init__(
        self,
        bus: Bus,
        consumer: PullSubscription,
        ticker: InProgressTicker,
        exhausted: Callable[[], Awaitable[bool]],
        *,
        fetch_batch: int = 64,
        fetch_timeout: float = 0.5,
        group_size: int = 1,
        starving: Callable[[bool, int], Awaitable[None]] | None = None,
        validate: Callable[[Experience], str | None] | None = None,
        hold_trained: bool = False,
        trained_counts: Callable[[int, int], Awaitable[None]] | None = None,
    ) -> None:
        self.hold_trained = hold_trained
        # told (messages trained and held in total, messages of those acked in total):
        # after the first grows, before the acks the second counts are sent
        self.trained_counts = trained_counts
        self._trained_unacked: list[_Held] = []
        self._trained_unacked_bytes = 0  # kept as they come and go: read every step
        self.trained_messages_total = 0
        self.released_messages_total = 0
        self._resumed_trained: set[str] = set()
        # digests of every experience trained before this trainer's checkpoint (sorted),
        # and of those trained since (folded in by trained_digests)
        self._trained_before = np.empty(0, dtype=np.uint64)
        self._trained_since: list[str] = []
        self.validate = validate
        self.starving = starving
        self.bus = bus
        self.consumer = consumer
        self.ticker = ticker
        self.exhausted = exhausted
        self.fetch_batch = fetch_batch  # the most messages one fetch takes
        self.group_size = max(1, group_size)  # experiences a message carries, until measured
        self.messages_accepted = 0
        self.fetch_timeout = fetch_timeout
        self._buffer: deque[tuple[Experience, _Held]] = deque()
        self._taken: list[_Held] = []
        self._taken_uids: list[str] = []
        self._seen: set[str] = set()
        self._held_by_uid: dict[str, _Held] = {}
        self.duplicates = 0
        self.dead_lettered = 0
        self.received = 0
        self.wait_time = 0.0
        self.retired: list[_Retired] = []
        self.on_idle: Callable[[], Awaitable[None]] | None = None  # splice polling
        self.on_retired_change: Callable[[], Awaitable[None]] | None = None  # persist them
        self._retired_changed = False
        self.taken_stages: dict[str, int] = {}
        self.last_received = time.monotonic()

    async def switch_to(
        self, consumer: PullSubscription, cut_seq: int | None, splice_id: str | None = None
    ) -> None:
        """Read ``consumer`` from now on; keep draining the current one up to ``cut_seq``.

        Messages already buffered or held stay as they are. The old consumer
        is deleted once its ack floor reaches ``cut_seq`` (see :mod:`rftstream.control.splice`);
        ``cut_seq`` None: not before :meth:`set_retired_cut` gave it one.
        """
        self.retired.append(_Retired(self.consumer, cut_seq, splice_id))
        self.consumer = consumer

    def retire(
        self, consumer: PullSubscription, cut_seq: int | None, splice_id: str | None
    ) -> None:
        """Drain ``consumer`` (not the one read now) up to ``cut_seq``: a trainer restart
        picks up where the previous process left its retired consumers."""
        self.retired.append(_Retired(consumer, cut_seq, splice_id))

    def set_retired_cut(self, splice_id: str, cut_seq: int) -> bool:
        """Close the open cut of the consumer retired by ``splice_id``. False: none."""
        for r in self.retired:
            if r.splice_id == splice_id:
                r.cut_seq = cut_seq
                return True
        return False

    def retired_records(self) -> list[RetiredConsumer]:
        """The retired consumers, as stored in the ``trainer.input`` KV record."""
        return [
            RetiredConsumer(consumer=r.consumer.durable, cut_seq=r.cut_seq, splice_id=r.splice_id)
            for r in self.retired
        ]

    @property
    def retired_names(self) -> set[str]:
        return {r.consumer.durable for r in self.retired}

    async def _drain_retired(self, batch: int) -> None:
        """Take redeliveries up to the cut from retired consumers; ack later ones; delete when done.

        A NATS error on one of them is logged and retried at the next fill.
        """
        for r in list(self.retired):
            try:
                step = await drain_step(r.consumer, r.cut_seq, batch=batch, timeout=0.05)
            except (TimeoutError, BusError) as exc:
                log.warning("draining retired consumer %s failed: %s", r.consumer.durable, exc)
                continue
            if not step.done:
                await self._accept(step.mine, r.consumer.durable)
                continue
            await r.consumer.unsubscribe()
            try:
                await self.bus.delete_consumer(r.consumer.stream, r.consumer.durable)
            except Exception as exc:  # noqa: BLE001 - best effort; it only costs space
                log.warning("could not delete retired consumer %s: %s", r.consumer.durable, exc)
            self.retired.remove(r)
            self._retired_changed = True
        if self._retired_changed:
            try:
                if self.on_retired_change is not None:
                    await self.on_retired_change()
                self._retired_changed = False
            except (TimeoutError, BusError) as exc:
                log.warning("could not record the retired consumers (retrying): %s", exc)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def held_messages(self) -> int:
        """Messages delivered to the trainer and not acked yet (buffered or in its batch)."""
        return len({id(h) for _, h in self._buffer} | {id(h) for h in self._taken})

    def _to_fetch(self, n: int) -> int:
        """Messages to fetch so that about ``n`` experiences are buffered (at least one)."""
        need = n - len(self._buffer)
        if self.messages_accepted:
            per = self.received / self.messages_accepted
        else:
            per = float(self.group_size)
        return max(1, min(self.fetch_batch, math.ceil(need / max(per, 1.0))))

    async def _fill_once(self, n: int) -> bool:
        batch = self._to_fetch(n)
        if self.retired or self._retired_changed:
            await self._drain_retired(batch)
            batch = self._to_fetch(n)
        msgs = await self.consumer.fetch(batch, timeout=self.fetch_timeout)
        await self._accept(msgs, self.consumer.durable)
        return bool(msgs)

    async def _accept(self, msgs: list[Delivery], source: str) -> None:
        """Decode, validate, deduplicate and buffer ``msgs`` (dead-lettering bad ones)."""
        for m in msgs:
            try:
                exps = decode_group(m.data)
            except SchemaError as exc:
                await self.bus.dead_letter(TRAIN_STAGE, m, f"trainer: {exc}")
                self.dead_lettered += 1
                continue
            problem = (
                next((p for p in map(self.validate, exps) if p), None) if self.validate else None
            )
            if problem:
                await self.bus.dead_letter(TRAIN_STAGE, m, f"trainer: {problem}")
                self.dead_lettered += 1
                continue
            self._forget_checkpointed(exps)
            fresh = [e for e in exps if e.eid.uid not in self._seen]
            already = [e.eid.uid for e in exps if e.eid.uid in self._resumed_trained]
            self.duplicates += len(exps) - len(fresh) - len(already)
            if not fresh:
                still_held = {
                    id(self._held_by_uid[e.eid.uid]): self._held_by_uid[e.eid.uid]
                    for e in exps
                    if e.eid.uid in self._held_by_uid
                }
                if still_held:
                    # a redelivery of a message whose experiences are not trained yet: ack this
                    # delivery only when they are, so a crash now still redelivers them
                    for held in still_held.values():
                        self.ticker.release(held.msg)
                        held.msg = m
                        self.ticker.hold(m)
                else:
                    # trained before (a checkpoint remembers it): acked with the server's
                    # confirmation, as a commit's acks are. A checkpoint written after this
                    # no longer remembers these experiences, so an ack lost with a killed
                    # process (sent, not yet applied) would have them trained again
                    await self._ack_all([m])
                continue
            held = _Held(
                m,
                len(fresh),
                stage=m.subject.rsplit(".", 1)[-1],
                trained_uids=already,
                source=source,
            )
            self.ticker.hold(m)
            for e in fresh:
                self._seen.add(e.eid.uid)
                self._held_by_uid[e.eid.uid] = held
                self._buffer.append((e, held))
            self.received += len(fresh)
            self.messages_accepted += 1
            self.last_received = time.monotonic()

    async def prefetch(self, n: int, timeout: float = 0.5) -> None:
        """Fetch until ``n`` experiences are buffered; meant to run beside a training step
        and be cancelled when the step ends. Blocks until then.

        Only the current consumer is read (retired ones and splice requests wait for
        :meth:`read`); nothing is acked. Cancelling loses nothing: a cancelled fetch
        takes no message, and fetched messages are always buffered (shielded).
        """
        while len(self._buffer) < n:
            consumer = self.consumer
            msgs = await consumer.fetch(self._to_fetch(n), timeout=timeout)
            with anyio.CancelScope(shield=True):
                await self._accept(msgs, consumer.durable)

    async def read(self, n: int) -> list[Experience]:
        """Take ``n`` experiences (fewer only when the upstream is exhausted). Blocks."""
        t0 = time.perf_counter()
        idle = 0
        announced: int | None = None  # messages held when the trainer last said it starves
        try:
            if self.on_idle is not None and len(self._buffer) >= n:
                await self.on_idle()  # a splice is answered at every step, however full
            while len(self._buffer) < n:
                if self.on_idle is not None:
                    await self.on_idle()
                if await self._fill_once(n):
                    idle = 0
                    continue
                idle += 1
                if self.starving is not None and announced != (held := self.held_messages):
                    # explorers must not pause for staleness now; the count of messages held
                    # lets them tell a stale flag (more has been delivered since) from a true one
                    await self.starving(True, held)
                    announced = held
                if idle % 2 == 0 and await self.exhausted():
                    # one last look: something may have landed after the check
                    if not await self._fill_once(n):
                        break
        finally:
            if announced is not None and self.starving is not None:
                with anyio.CancelScope(shield=True):
                    await self.starving(False, 0)
        self.wait_time += time.perf_counter() - t0
        out: list[Experience] = []
        while self._buffer and len(out) < n:
            exp, held = self._buffer.popleft()
            self.taken_stages[held.stage] = self.taken_stages.get(held.stage, 0) + 1
            out.append(exp)
            self._taken.append(held)
            self._taken_uids.append(exp.eid.uid)
        return out

    async def commit(self) -> int:
        """Ack every message whose experiences have all been trained. Returns acks sent.

        With ``hold_trained`` nothing is acked: those messages stay in progress until
        :meth:`release_trained`, and ``trained_counts`` is told how many there are now.

        The last ack waits for the server's confirmation (acks of one consumer are
        applied in order), so when this returns the consumer's counts no longer hold
        these messages: an explorer that reads them (``max_staleness``) sees the room
        this step made, not a stale backlog. A confirmation that times out is logged
        only; the ack itself was sent.
        """
        done: list[Delivery] = []
        grown = 0
        self._trained_since.extend(self._taken_uids)
        for uid, held in zip(self._taken_uids, self._taken, strict=True):
            held.trained_uids.append(uid)
            held.remaining -= 1
            if not self.hold_trained:
                self._held_by_uid.pop(uid, None)
            if held.remaining > 0:
                continue
            if self.hold_trained:  # kept in progress until the next checkpoint
                self._trained_unacked.append(held)
                self._trained_unacked_bytes += len(held.msg.data) + len(held.msg.subject)
                grown += 1
            else:
                self.ticker.release(held.msg)
                done.append(held.msg)
        self._taken_uids.clear()
        self._taken.clear()
        if grown:
            self.trained_messages_total += grown
            if self.trained_counts is not None:
                await self.trained_counts(self.trained_messages_total, self.released_messages_total)
        await self._ack_all(done)
        return len(done)

    @property
    def trained_unacked(self) -> int:
        """Messages fully trained and held until :meth:`release_trained`."""
        return len(self._trained_unacked)

    @property
    def trained_unacked_bytes(self) -> int:
        """What the messages of :attr:`trained_unacked` take in the experience stream,
        about: their payloads and subjects (headers not counted)."""
        return self._trained_unacked_bytes

    @property
    def held_for_retired(self) -> bool:
        """Whether a retired consumer (see :meth:`switch_to`) has trained messages held
        until :meth:`release_trained` and none buffered or taken any more: it waits for
        those acks only, to be drained and deleted (and the splice to be done)."""
        names = self.retired_names
        if not names or not any(h.source in names for h in self._trained_unacked):
            return False
        pending = [h for _, h in self._buffer] + self._taken
        return not any(h.source in names for h in pending)

    def trained_uids(self) -> list[str]:
        """Every experience trained from a message not acked yet (held until the next
        checkpoint, or partly trained): what a checkpoint written now must remember.

        Messages of a batch taken (:meth:`read`) but not committed count too: a trainer
        cancelled before training it checkpoints its previous step, and what those
        messages carried that was trained before must not be trained again."""
        out: list[str] = []
        seen: set[int] = set()
        for held in [*self._trained_unacked, *(h for _, h in self._buffer), *self._taken]:
            if id(held) not in seen:
                seen.add(id(held))
                out.extend(held.trained_uids)
        return out

    def acked_below(self, server: ConsumerState) -> int | None:
        """The stream sequence below which every message of the current consumer is acked,
        where ``server`` (its state, read while no fetch is in flight) puts the ack floor
        lower; None when that cannot be told or the floor is right.

        It can be told when the server counts exactly as many delivered, unacked messages
        as this feed holds from that consumer: they are then the same messages, every
        message delivered before the lowest of them is acked, and nothing below it is
        undelivered (a pull consumer hands out new messages in stream order). Acks sent
        but not yet applied make the counts differ: then nothing is claimed.
        """
        durable = self.consumer.durable
        held = [*self._trained_unacked, *(h for _, h in self._buffer), *self._taken]
        seqs: set[int] = set()
        for h in held:
            if h.source != durable:
                continue
            try:
                seqs.add(int(h.msg.metadata.sequence.stream))
            except Exception:  # noqa: BLE001 - not a JetStream delivery: nothing to claim
                return None
        if not seqs or server.num_ack_pending != len(seqs):
            return None
        lowest = min(seqs)
        return lowest if lowest - 1 > server.ack_floor else None

    def mark_trained(self, uids: list[str], digests: np.ndarray | None = None) -> None:
        """Experiences a checkpoint says were trained before it (a resumed trainer): skipped
        when their messages are delivered again, acked with the rest of their message.
        ``uids``: those whose messages were not acked; ``digests``: every one trained
        (:meth:`trained_digests` of the trainer that wrote the checkpoint)."""
        self._resumed_trained.update(uids)
        self._seen.update(uids)
        if digests is not None and len(digests):
            self._trained_before = np.union1d(self._trained_before, digests)

    def _forget_checkpointed(self, exps: list[Experience]) -> None:
        """Mark those of ``exps`` the checkpoint's digests list as trained before (as
        :meth:`mark_trained` does with its uids)."""
        if not len(self._trained_before):
            return
        new = [e.eid.uid for e in exps if e.eid.uid not in self._seen]
        if not new:
            return
        digests = uid_digests(new)
        at = np.searchsorted(self._trained_before, digests)
        inside = at < len(self._trained_before)
        hit = np.zeros(len(new), dtype=bool)
        hit[inside] = self._trained_before[at[inside]] == digests[inside]
        for uid, trained in zip(new, hit.tolist(), strict=True):
            if trained:
                self._resumed_trained.add(uid)
                self._seen.add(uid)

    def trained_digests(self) -> np.ndarray:
        """Sorted distinct digests of every experience trained since the run began (as far
        as the checkpoint this trainer resumed from knew, and since): what a checkpoint
        written now keeps in :data:`~rftstream.training.checkpoint.TRAINED_FILE`."""
        if self._trained_since:
            self._trained_before = np.union1d(
                self._trained_before, uid_digests(self._trained_since)
            )
            self._trained_since.clear()
        return self._trained_before

    async def release_trained(self) -> int:
        """Ack the messages held since they were trained (call once a checkpoint that
        contains them is committed). Tells ``trained_counts`` first. Returns acks sent."""
        held, self._trained_unacked = self._trained_unacked, []
        self._trained_unacked_bytes = 0
        if not held:
            return 0
        self.released_messages_total += len(held)
        if self.trained_counts is not None:
            await self.trained_counts(self.trained_messages_total, self.released_messages_total)
        for h in held:
            self.ticker.release(h.msg)
            for uid in h.trained_uids:
                self._held_by_uid.pop(uid, None)
        await self._ack_all([h.msg for h in held])
        return len(held)

    async def _ack_all(self, done: list[Delivery]) -> None:
        """Ack ``done``; the last ack waits for the server's confirmation (see :meth:`commit`)."""
        for msg in done[:-1]:
            await msg.ack()
        if done:
            try:
                await done[-1].ack_sync(timeout=ACK_CONFIRM_S)
            except Exception as exc:  # noqa: BLE001 - no confirmation: acked or redelivered
                log.debug("ack confirmation: %s", exc)
