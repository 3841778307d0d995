"""The explorer's staleness gate (``synchronizer.max_staleness``): the count it
decides by and the pure machine that decides.

:func:`experience_backlog` counts the experience waiting for (or in) the trainer
from the durable consumers of the experience stream (I/O: JetStream API round
trips; a started :class:`ConsumerListing` spares it the listing while they stay
the same). :class:`StalenessGate` is the pure machine: given one :class:`GateLook`
(the counts, the weight versions, the tasks in flight here and, by their KV
records, at the other explorers: :mod:`rftstream.control.flights`) it says how
many tasks the explorer's next step may take, or what to do first:
:class:`AwaitWeights` (the trainer's newest version is on its way to this
explorer), :class:`LoadNewest` (only this explorer's old weights stand in the
way), or :class:`Blocked`; a blocked look is settled by
:meth:`StalenessGate.settle` with the trainer's ``trainer.starving`` record and
the run's status: :class:`Take` or :class:`Pause` (wait for a write of the
trainer's keys, at most ``wake_s``). After a take that left no group's room
(:meth:`StalenessGate.room_after`, :meth:`StalenessGate.blocked_until_woken`) the
explorer waits for such a write before it looks again. The explorer's loop
(``actors/explorer.py``, ``Explorer._respect_staleness``) reads, asks and acts;
nothing here blocks, reads or sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from rftstream.bus.client import Bus
from rftstream.bus.transport import Notifications, unsubscribe_quietly
from rftstream.config.sync_policy import SyncPolicy
from rftstream.control.flights import PeerWork
from rftstream.errors import BusError, BusTimeout, ConsumerNotFound
from rftstream.wire import TrainerStarving

#: the longest a :class:`ConsumerListing` keeps a list without a change noticed
LISTING_MAX_AGE_S = 2.0
#: a pause taken while the counts moved (a group may have been counted twice) is
#: looked at again this soon
RECOUNT_S = 0.01
#: a pause with nothing moving ends at a write of the trainer's keys, or after this
IDLE_LOOK_S = 0.25


class Backlog(NamedTuple):
    """What :func:`experience_backlog` counts, in messages."""

    total: int  # waiting or being worked on, anywhere
    held_by_trainer: int  # delivered to the trainer and not yet acked (its batch, its buffer)
    held_by_operators: int = 0  # delivered to an operator stage and not acked yet

    @property
    def in_transit(self) -> int:
        """Messages the trainer will still receive (or that an operator still works on)."""
        return self.total - self.held_by_trainer

    def without_trained(self, trained: int) -> Backlog:
        """This backlog less ``trained`` messages the trainer holds already trained
        (acked at its next checkpoint); never less than nothing of what it holds."""
        n = max(0, min(trained, self.held_by_trainer))
        return Backlog(self.total - n, self.held_by_trainer - n, self.held_by_operators)


def _is_trainer_consumer(name: str) -> bool:
    return name == "trainer" or name.startswith("trainer_")


def pipeline_order(consumers: Sequence[tuple[str, str]]) -> list[str]:
    """Durable consumer names of the experience stream, upstream first.

    ``consumers`` are ``(name, filter subject)`` pairs. An operator consumer
    ``op_<from>_to_<to>`` reads stage ``<from>`` (the last token of its filter)
    and feeds ``<to>``; stages are ranked by their distance from ``raw``, and
    the trainer's consumers come last. Unknown consumers rank with ``raw``.
    """
    stage_of = {name: subject.rsplit(".", 1)[-1].replace("-", "_") for name, subject in consumers}
    depth = {"raw": 0}
    for _ in consumers:  # a chain of n operators needs at most n passes
        for name, stage in stage_of.items():
            prefix = f"op_{stage}_to_"
            if stage in depth and name.startswith(prefix):
                depth.setdefault(name[len(prefix) :], depth[stage] + 1)

    def rank(name: str) -> tuple[int, int, str]:
        return (_is_trainer_consumer(name), depth.get(stage_of[name], 0), name)

    return sorted(stage_of, key=rank)


class ConsumerListing:
    """The consumers of one stream as :func:`experience_backlog` needs them (name and
    filter subject), listed again only when they may have changed: a consumer of the
    stream created or deleted (:meth:`~rftstream.bus.transport.Transport.on_consumers_changed`),
    the connection lost and back, a listed consumer gone when its counts are read
    (:meth:`forget`), or the list older than ``max_age`` seconds (a change whose
    notice was lost). Not started, it lists them at every read: one JetStream API
    round trip a look, twice a trainer step.

    :meth:`start` subscribes to the changes (a round trip); :meth:`stop` unsubscribes
    (never raises). A change noticed while a listing is under way is listed again at
    the next read.
    """

    def __init__(self, bus: Bus, stream: str, *, max_age: float = LISTING_MAX_AGE_S) -> None:
        self.bus, self.stream, self.max_age = bus, stream, max_age
        self._listed: list[tuple[str, str]] | None = None
        self._listed_at = 0.0
        self._changes: Notifications | None = None
        self.listings = 0  # how many times the consumers were listed

    def _changed(self) -> None:
        self._listed = None

    def forget(self) -> None:
        """List again at the next read (a listed consumer was not found)."""
        self._listed = None

    async def start(self) -> None:
        self._changes = await self.bus.transport.on_consumers_changed(self.stream, self._changed)

    async def stop(self) -> None:
        changes, self._changes = self._changes, None
        await unsubscribe_quietly(changes)

    async def durables(self, exclude: tuple[str, ...] = ()) -> list[tuple[str, str]]:
        """``(name, filter subject)`` of the stream's durable consumers, less ``exclude``.
        Raises as :meth:`~rftstream.bus.client.Bus.consumers` does."""
        listed = self._listed
        now = time.monotonic()
        if (
            listed is None
            or self._changes is None
            or self._changes.missed()
            or now - self._listed_at > self.max_age
        ):
            self._listed = []  # a change noticed from now on lists again next time
            self._listed_at = now
            self.listings += 1
            try:
                found = await self.bus.consumers(self.stream)
            except BaseException:
                self._listed = None
                raise
            listed = [(c.name, c.filter_subject) for c in found if c.durable]
            if self._listed is not None:  # no change noticed while listing
                self._listed = listed
        return [c for c in listed if c[0] not in exclude]


async def experience_backlog(
    bus: Bus, stream: str, exclude: tuple[str, ...] = (), listing: ConsumerListing | None = None
) -> Backlog:
    """The backlog of the durable consumers of ``stream``, and the trainer's part of it.

    Ephemeral consumers (the trainer's ordered watch of ``exp.raw`` headers, a
    ``nats sub`` or ``rftstream tail`` from a terminal) do no work toward
    training: a message not yet pushed to one of them is not backlog. The
    trainer's consumers are ``trainer`` and, after a splice, ``trainer_<stage>``.

    Never too low: an operator publishes a message's output before it acks
    the input, so the message is in one count or both at every moment; the
    consumers are read one at a time, upstream first (:func:`pipeline_order`),
    so a message moving downstream while they are read is counted at least
    once (read downstream first, it could be missed by both). One JetStream
    API round trip for the list (none with a ``listing`` that has not seen the
    consumers change), then one per consumer.
    """
    listing = listing or ConsumerListing(bus, stream)  # not started: lists every time
    try:
        consumers = await listing.durables(exclude)
    except BusTimeout:
        raise
    except BusError:  # no such stream (yet), or the server refused the listing
        return Backlog(0, 0)
    total = held = working = 0
    for name in pipeline_order(consumers):
        try:
            info = await bus.consumer_state(stream, name)
        except ConsumerNotFound:
            listing.forget()
            continue  # deleted meanwhile (a splice retired it): its messages were handed on
        pending, unacked = info.num_pending, info.num_ack_pending
        total += pending + unacked
        if _is_trainer_consumer(name):
            held += unacked
        else:
            working += unacked
    return Backlog(total, held, working)


# ------------------------------------------------------------------ the machine


@dataclass(frozen=True)
class GateLook:
    """One look at what the gate decides by, read by the explorer in this order: its
    tasks in flight, then the queues (:func:`experience_backlog`, less what the trainer
    holds trained and unacked), then the trainer's versions (``weights.pending`` is
    written before the trainer acks, so a shrunk queue comes with its new version)."""

    in_flight: int  # this explorer's tasks started and not yet published
    queued: Backlog  # messages upstream of or inside the trainer
    newest: tuple[int, int]  # the trainer's newest (incarnation, version): pending or latest
    published: int  # the version ``weights.latest`` names (0 before the first)
    engine_version: int  # the version this explorer's engine runs now
    staged_version: int | None  # jetstream: the version its fetcher holds; None: no fetcher
    will_sync: bool  # the step about to start loads weights first (sync_style, interval)
    may_await: bool = True  # False once waiting for the newest version gave up
    may_load: bool = True  # False once loading the newest brought nothing newer
    # the other explorers' tasks in flight or reserved (rftstream.control.flights), read
    # around the queues: their groups may land ahead of this step's
    others: PeerWork = PeerWork()

    @property
    def backlog(self) -> int:
        """Groups ahead of this step's: queued, and in flight here or at another explorer."""
        return self.queued.total + self.in_flight + self.others.tasks


class Take(NamedTuple):
    """Start the step with this many tasks."""

    tasks: int


class AwaitWeights(NamedTuple):
    """The trainer's newest version ``key`` is past the bound for the weights this
    explorer holds and is being fetched: wait for it to be staged, then look again."""

    key: tuple[int, int]


class LoadNewest(NamedTuple):
    """Only this explorer's old weights stand in the way (it started late, or runs
    slower than the others): load the newest now, then look again if it was newer."""

    mine: int


class Blocked(NamedTuple):
    """No room for one task's group: :meth:`StalenessGate.settle` it with the trainer's
    starving record (read only when ``ahead`` is 0) and the run's status."""

    ahead: int  # messages upstream of the trainer, with every explorer's tasks in flight
    held_by_trainer: int
    in_flight: int  # the in-flight count the look was made with
    hidden: bool  # a group moving while counted (counted twice) could hide room
    contended: bool = False  # another explorer's gate held a reservation (it is looking too)
    yields: bool = False  # ... and one that goes first did (fewer tasks started): this one waits


class Pause(NamedTuple):
    """Wait for a write of the trainer's keys (or another explorer's reservation given
    back), at most ``wake_s``, then look again; give this explorer's reservation back
    first unless ``keep_reservation`` (it goes first: the others give theirs back)."""

    wake_s: float
    keep_reservation: bool = False


Decision = Take | AwaitWeights | LoadNewest | Blocked


@dataclass(frozen=True)
class StalenessGate:
    """How many tasks an explorer's next step may take within ``max_staleness``.

    The experience a step generates lands behind everything already upstream of
    (or inside) the trainer; :meth:`SyncPolicy.explorer_quota` says how many
    experiences fit before the newest of them would be trained more than
    ``max_staleness`` versions after the weights they were sampled with. The count
    is never too low (:func:`experience_backlog`); a message moving between two
    consumers while they are read is in both, so a pause that such a double count
    could have caused is looked at again after :data:`RECOUNT_S`; any other pause
    lasts until the trainer writes (at most :data:`IDLE_LOOK_S`). Pure.
    """

    policy: SyncPolicy
    batch_size: int  # buffer.batch_size: the tasks a step takes when there is room
    train_batch_size: int
    group: int  # the experiences one task yields (repeat_times)

    @property
    def enforced(self) -> bool:
        return self.policy.max_staleness is not None

    def mine(self, look: GateLook) -> int:
        """The version the step's tasks will run with: the engine's if the step does not
        sync; else what the fetcher staged (jetstream) or ``weights.latest`` names."""
        if not look.will_sync:
            return look.engine_version
        if look.staged_version is not None:
            return look.staged_version
        return look.published

    def _room(self, backlog: int, version_lag: int) -> int | None:
        return self.policy.explorer_quota(
            backlog * self.group, self.train_batch_size, version_lag=max(0, version_lag)
        )

    def decide(self, look: GateLook) -> Decision:
        """What the explorer does with this look (see the decisions' docstrings)."""
        if self.policy.max_staleness is None:
            return Take(self.batch_size)
        newest = look.newest[1]
        mine = self.mine(look)
        if (
            look.will_sync
            and look.staged_version is not None
            and look.may_await
            and newest - mine > self.policy.max_staleness
        ):
            return AwaitWeights(look.newest)
        backlog = look.backlog
        room = self._room(backlog, newest - mine)
        if room is None or room >= self.group:
            return Take(
                self.batch_size if room is None else min(self.batch_size, room // self.group)
            )
        if not look.will_sync and newest > mine and look.may_load:
            fresh = self._room(backlog, 0)
            if fresh is None or fresh >= self.group:
                return LoadNewest(mine)
        # a message an operator holds may be counted in its output stage too: at most
        # that many could be counted twice, and only then may looking again find room
        settled = self._room(backlog - look.queued.held_by_operators, newest - mine)
        return Blocked(
            ahead=look.queued.in_transit + look.in_flight + look.others.tasks,
            held_by_trainer=look.queued.held_by_trainer,
            in_flight=look.in_flight,
            hidden=look.queued.held_by_operators > 0 and (settled is None or settled >= self.group),
            contended=look.others.reserved > 0,
            yields=look.others.yields,
        )

    def room_after(self, look: GateLook, tasks: int) -> int | None:
        """The room (in experiences) ``look`` leaves once this explorer takes ``tasks``
        more; None: unbounded. Only a later write of the trainer's keys, or a version
        staged here, can make more (see :meth:`blocked_until_woken`)."""
        room = self._room(look.backlog, look.newest[1] - self.mine(look))
        return None if room is None else room - tasks * self.group

    def blocked_until_woken(self, spare: int | None) -> bool:
        """Whether the next look is sure to be :class:`Blocked` unless something happened
        since the last one: its room after the take (``spare``, :meth:`room_after`) has no
        group's worth left. The count only grows by this explorer's own tasks; room is
        made by the trainer (its step record follows its acks), a starving record, the
        run's end, or a version staged here. So the explorer waits for one of those (at
        most :data:`IDLE_LOOK_S`) before it looks, instead of looking to be told no."""
        return spare is not None and spare < self.group

    def settle(
        self,
        blocked: Blocked,
        starving: TrainerStarving | None,
        *,
        ended: bool,
        in_flight_now: int,
    ) -> Take | Pause:
        """A blocked look, given the trainer's ``trainer.starving`` record (None when
        unread or absent), whether the run ended, and the tasks in flight now: a
        starving trainer is never stalled (nothing is ahead of it, at any explorer), an
        ended run takes its batch (and stops at the run's end), else pause. Briefly when
        the counts were moving, or when another explorer's gate looked at the same time
        and this one goes first (it keeps its reservation; the other gives its back and
        waits: two gates that see each other never both wait for the trainer; which goes
        first: :meth:`rftstream.control.flights.FlightBoard.count`)."""
        if self.policy.starving_trainer_overrides(
            starving, held_by_trainer=blocked.held_by_trainer, ahead_of_trainer=blocked.ahead
        ):
            return Take(self.batch_size)
        if ended:
            return Take(self.batch_size)
        if blocked.contended and not blocked.yields:
            return Pause(RECOUNT_S, keep_reservation=True)
        moving = in_flight_now != blocked.in_flight or blocked.hidden
        return Pause(RECOUNT_S if moving else IDLE_LOOK_S)
