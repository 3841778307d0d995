"""Tasks in flight across explorers: what the staleness gate of one explorer needs to
count the other explorers' work (``synchronizer.max_staleness`` with several explorers:
``explorer.rollout_model.engine_num`` above 1, or explorers started on other machines).

Each explorer keeps running totals of its tasks in an :class:`OwnFlight`: the tasks it
claimed (started, or reserved by its gate while it looks) and the tasks it is done
with (published, failed, given back, or a reservation released). It writes them to KV
``explorers.in_flight.<name>`` (:class:`~rftstream.wire.ExplorerFlight`) while another
explorer is about, and reads the other explorers' records through a
:class:`FlightBoard`: a subscription to their writes, so a look costs no round trip.

Why the count is never too low, for two explorers A and B:

* A's gate reserves a whole batch (a KV write it waits for) before it reads the
  queues, and B's likewise. The server orders the two writes; the explorer whose write
  came second reads the queues after it, and the first write comes down its connection
  ahead of those replies: of two gates that look at once, at least one sees the
  other's reservation.
* A reads B's record before the queues (its ``done``: a group B publishes while the
  queues are read is then counted twice, never missed) and again after them (its
  ``claimed``: every reservation B made before the queues' replies).

Two gates that see each other's reservation and find no room would both wait; the
explorer that has started fewer tasks so far (then the name that sorts first) goes on:
it keeps its reservation and looks again at once, the other gives its reservation back
and waits (:class:`PeerWork` ``yields``), so a window with room for one batch at a time
is shared in turn. A reservation given back wakes the others' waiting gates (``on_room``).

Groups reach the trainer in the order of the weights they were sampled with, across
explorers as within one: a record carries the oldest weights version of its tasks
started and not done (``oldest``), and an explorer publishes a group sampled with newer weights only
once no other explorer has older ones in flight (:meth:`FlightBoard.older_in_flight`).
Without it a step of one explorer could land ahead of another's older tasks, push them
back a batch, and have them trained a version past ``max_staleness``.

A record not refreshed for :data:`FLIGHT_TTL_S` counts nothing (its explorer died; its
tasks come back to the queue after ``nats.ack_wait``). A lone explorer writes its
record twice (at its start and its end): its gate costs what it did before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import anyio
import msgspec

from rftstream.bus.transport import KeyValueStore, Notifications, unsubscribe_quietly
from rftstream.errors import BusError, KeyNotFound
from rftstream.subjects import KV_EXPLORER_FLIGHT_PREFIX
from rftstream.wire import EXPLORER_FLIGHT, ExplorerFlight, encode_json

log = logging.getLogger(__name__)

#: a record not written for this long counts nothing in flight: its explorer died
FLIGHT_TTL_S = 30.0
#: an explorer with another explorer about writes its record at least this often
REFRESH_S = 5.0
#: a new explorer waits at most this long for the others' records before its first look
PEER_REPLY_S = 2.0

_decode = msgspec.json.Decoder(ExplorerFlight)


class PeerWork(NamedTuple):
    """The other explorers' work as one look counts it (:meth:`FlightBoard.count`)."""

    tasks: int = 0  # in flight or reserved: never too low
    reserved: int = 0  # of which reserved by a gate that is looking
    yields: bool = False  # an explorer that goes first (fewer tasks started) holds a reservation


class FlightBoard:
    """The other explorers' :class:`~rftstream.wire.ExplorerFlight` records, kept in this
    process from their writes (:meth:`~rftstream.bus.transport.KeyValueStore.on_value`
    on ``explorers.in_flight.>``), with the time each was seen.

    A record read after a reply from the server holds every write that reached the
    server before that reply (see :class:`~rftstream.bus.state.MirroredState`). A
    record that cannot be decoded is logged once and left out. Callbacks (run in the
    event loop; they must not block): ``on_join(name)`` when an explorer not seen
    before, or back after it closed, writes its record (answer it with this explorer's
    own); ``on_room(name)`` when one gave back a reservation or closed (a waiting gate
    may find room now).

    :meth:`start` subscribes, then reads every record once (round trips); a write
    handed on meanwhile wins over the read. After the connection was lost and came
    back, the next :meth:`snapshot` reads them all again. :meth:`stop` never raises.
    """

    def __init__(
        self,
        kv: KeyValueStore,
        me: str,
        *,
        on_join: Callable[[str], None] | None = None,
        on_room: Callable[[str], None] | None = None,
        ttl_s: float = FLIGHT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.kv, self.me, self.ttl_s = kv, me, ttl_s
        self.on_join, self.on_room = on_join, on_room
        self._clock, self._wall = clock, wall
        self._records: dict[str, tuple[ExplorerFlight, float]] = {}  # name -> record, seen at
        self._written_since_read: set[str] = set()
        self._bad: set[str] = set()
        self._writes: Notifications | None = None
        self._changed = anyio.Event()

    # ----------------------------------------------------------- keeping records
    def _keep(self, name: str, record: ExplorerFlight | None, seen: float) -> None:
        old = self._records.get(name)
        old_record = old[0] if old is not None else None
        if record is None:
            self._records.pop(name, None)
        else:
            self._records[name] = (record, seen)
        if record is not None and not record.closed:
            if (old_record is None or old_record.closed) and self.on_join is not None:
                self.on_join(name)
        if old_record is not None and not old_record.closed and self.on_room is not None:
            released = record is not None and (
                record.reserved < old_record.reserved and record.done > old_record.done
            )
            if record is None or record.closed or released:
                self.on_room(name)
        self._changed.set()
        self._changed = anyio.Event()

    def _decoded(self, key: str, raw: bytes) -> ExplorerFlight | None:
        try:
            return _decode.decode(raw)
        except msgspec.DecodeError as exc:
            if key not in self._bad:
                self._bad.add(key)
                log.warning(
                    "KV %s/%s: not an explorer's flight record, left out: %s",
                    self.kv.bucket,
                    key,
                    exc,
                )
            return None

    def _written(self, key: str, raw: bytes | None) -> None:
        name = key[len(KV_EXPLORER_FLIGHT_PREFIX) :]
        if name == self.me:
            return
        self._written_since_read.add(name)
        self._keep(name, None if raw is None else self._decoded(key, raw), self._clock())

    async def _read_all(self) -> None:
        self._written_since_read.clear()
        for key in await self.kv.keys(KV_EXPLORER_FLIGHT_PREFIX):
            name = key[len(KV_EXPLORER_FLIGHT_PREFIX) :]
            if name == self.me:
                continue
            try:
                raw: bytes | None = (await self.kv.get(key)).value
            except KeyNotFound:
                raw = None
            if name in self._written_since_read:  # a notified write is newer than the read
                continue
            record = None if raw is None else self._decoded(key, raw)
            # seen when it was written, as far as this clock can tell: a record left by
            # an explorer that died before this one started counts nothing
            age = 0.0 if record is None else max(0.0, self._wall() - record.ts)
            self._keep(name, record, self._clock() - age)

    async def start(self) -> None:
        """Subscribe to the records' writes, then read each record once. Blocks (round
        trips); raises ``BusError``."""
        self._writes = await self.kv.on_value((KV_EXPLORER_FLIGHT_PREFIX + ">",), self._written)
        await self._read_all()

    async def stop(self) -> None:
        """Unsubscribe. Never raises."""
        writes, self._writes = self._writes, None
        await unsubscribe_quietly(writes)

    # ----------------------------------------------------------------- reading
    def now(self) -> float:
        """This board's clock (what :meth:`wait_for_peers` takes)."""
        return self._clock()

    async def snapshot(self) -> dict[str, ExplorerFlight]:
        """The records of the other explorers that are live (written within the TTL)
        and not closed. No round trip, unless the connection came back from a loss
        since the last read (then every record is read again)."""
        if self._writes is not None and self._writes.missed():
            try:
                await self._read_all()
            except BusError as exc:  # the subscription has the newest writes anyway
                log.warning("could not read the explorers' flight records again: %s", exc)
        oldest = self._clock() - self.ttl_s
        return {
            name: record
            for name, (record, seen) in self._records.items()
            if seen >= oldest and not record.closed
        }

    def peers(self) -> list[str]:
        """The other explorers whose last record is not closed, live or not."""
        return sorted(name for name, (record, _) in self._records.items() if not record.closed)

    async def shared(self) -> bool:
        """Whether another explorer is about (a live record that is not closed)."""
        return bool(await self.snapshot())

    async def wait_for_peers(self, since: float, timeout: float = PEER_REPLY_S) -> list[str]:
        """Wait until every explorer in :meth:`peers` has written its record after
        ``since`` (this board's clock), at most ``timeout`` s; returns those that did
        not (they died, or run a release without these records). Blocks."""
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed
                if not self._silent(since):
                    return []
                await changed.wait()
        return self._silent(since)

    async def older_in_flight(self, version: int) -> bool:
        """Whether another live explorer has tasks started and not done that were sampled
        with weights older than ``version`` (its record's ``oldest``; a reservation counts
        no version). No round trip, as :meth:`snapshot`."""
        return any(
            record.in_flight > 0 and 0 <= record.oldest < version
            for record in (await self.snapshot()).values()
        )

    async def wait_for_older(self, version: int, recheck_s: float = REFRESH_S) -> None:
        """Wait until no other live explorer has tasks in flight sampled with weights
        older than ``version`` (:meth:`older_in_flight`): each record write wakes it, and
        it looks again every ``recheck_s`` s (a record that ages past the TTL counts
        nothing). Never waits on an explorer with nothing older, so two explorers never
        wait on each other. Blocks; cancelling it changes nothing."""
        while True:
            changed = self._changed  # taken before the look: a write during it wakes us
            if not await self.older_in_flight(version):
                return
            with anyio.move_on_after(recheck_s):
                await changed.wait()

    def _silent(self, since: float) -> list[str]:
        return sorted(
            name
            for name, (record, seen) in self._records.items()
            if not record.closed and seen < since
        )

    def count(
        self,
        before: Mapping[str, ExplorerFlight],
        after: Mapping[str, ExplorerFlight],
        started_here: int = 0,
    ) -> PeerWork:
        """The other explorers' work, never too low, from two :meth:`snapshot` s taken
        around a count of the queues: ``claimed`` and ``reserved`` from ``after`` (every
        reservation made before the count), ``done`` from ``before`` (a group published
        during the count is counted twice, not missed). A record of a new run of its
        explorer (another ``since``) counts by itself. ``started_here``: the tasks this
        explorer started so far; an explorer holding a reservation goes first if it
        started fewer (then by name)."""
        tasks = reserved = 0
        yields = False
        for name, record in after.items():
            old = before.get(name)
            done = old.done if old is not None and old.since == record.since else record.done
            tasks += max(0, record.claimed - done)
            if record.reserved > 0:
                reserved += record.reserved
                first = (record.started, name) < (started_here, self.me)
                yields = yields or first
        return PeerWork(tasks, min(reserved, tasks), yields)


class OwnFlight:
    """This explorer's running totals of its tasks, and its record
    (``explorers.in_flight.<name>``), written while another explorer is about.

    The gate's calls, in order: :meth:`reserve` a batch before a look (written at once
    when shared; blocks until stored), then :meth:`keep` the tasks it takes or
    :meth:`release` it all before it waits (for the trainer, or for weights), and
    :meth:`started` once the step's tasks are fetched; :meth:`finished` as each task is
    done. The record's ``reserved`` is the reservation of a look under way only: what
    another gate contends with. Every call but :meth:`reserve` only marks the record
    out of date, and :meth:`run` writes it in the background (one write carries every
    change made before it). Writes are made one at a time, each with the totals of the
    moment it is sent, so the bucket never goes back to older totals. A failed
    background write is logged and made again at the next change or refresh: others
    then count on the last record they saw, which is never too low.
    """

    def __init__(
        self,
        kv: KeyValueStore,
        name: str,
        board: FlightBoard,
        oldest_version: Callable[[], int] = lambda: -1,
    ) -> None:
        """Use :meth:`open` (it also starts the board and announces this explorer).
        ``oldest_version()``: the oldest weights version of the tasks started here and not
        done (-1: none, or unknown). Tasks reserved or taken and not started count no
        version: the gates that look after they were taken count them ahead of their
        own, and a version read before the start could be far behind the weights the
        step loads when it starts (other explorers would wait on it for nothing)."""
        self.kv, self.name, self.board = kv, name, board
        self.oldest_version = oldest_version
        self.key = EXPLORER_FLIGHT.of(name=name).name
        self.claimed = 0
        self.done = 0
        self.reserved = 0  # claimed by the gate while it looks
        self.taken = 0  # claimed for the step being fetched (the gate took them)
        self.started_total = 0  # tasks started (which of two contending gates goes first)
        self.since = time.time()
        self.writes = 0
        self._lock = anyio.Lock()
        self._dirty = anyio.Event()

    @classmethod
    async def open(
        cls,
        kv: KeyValueStore,
        name: str,
        oldest_version: Callable[[], int] = lambda: -1,
        **board_kw: Any,
    ) -> tuple[OwnFlight, float]:
        """Explorer ``name``'s totals, with a started :class:`FlightBoard` of the others'
        records (``board_kw``: its keyword arguments) that answers a joining explorer with
        this one's record; the record written (:meth:`announce`). ``oldest_version``: as
        for the constructor. Returns it and when it was written, for
        :meth:`FlightBoard.wait_for_peers`. Blocks; raises ``BusError``."""
        board = FlightBoard(kv, name, **board_kw)
        own = cls(kv, name, board, oldest_version)
        board.on_join = own.answer
        await board.start()
        return own, await own.announce()

    @property
    def in_flight(self) -> int:
        """Tasks in flight here, or reserved."""
        return self.claimed - self.done

    def record(self, *, closed: bool = False) -> ExplorerFlight:
        return ExplorerFlight(
            claimed=self.claimed,
            done=self.done,
            reserved=self.reserved,
            started=self.started_total,
            oldest=self.oldest_version() if self.in_flight > 0 else -1,
            since=self.since,
            ts=time.time(),
            closed=closed,
        )

    async def _write(self, *, closed: bool = False) -> None:
        async with self._lock:  # the totals are taken when the write is sent, in order
            await self.kv.put(self.key, encode_json(self.record(closed=closed)))
            self.writes += 1

    async def announce(self) -> float:
        """Write this explorer's record (nothing in flight yet) and return when, on the
        board's clock: then :meth:`FlightBoard.wait_for_peers` with it. Raises ``BusError``."""
        await self._write()
        return self.board.now()

    async def reserve(self, tasks: int) -> None:
        """Claim ``tasks`` before a look at the queues (a reservation held is given back
        first); with another explorer about, stored before this returns. Blocks;
        raises ``BusError``."""
        self.done += self.reserved
        self.claimed += tasks
        self.reserved = tasks
        if await self.board.shared():
            await self._write()

    def keep(self, tasks: int) -> None:
        """Of the reservation, keep ``tasks`` for the step to fetch; give back the rest."""
        self._give_back(self.reserved - tasks)
        self.reserved, self.taken = 0, tasks

    def started(self, tasks: int) -> None:
        """The step's ``tasks`` started (fetched): what was taken and not found goes back;
        tasks started without a look (no gate) are claimed now."""
        self.started_total += tasks
        unclaimed = tasks - self.taken
        if unclaimed > 0:
            self.claimed += unclaimed
        else:
            self._give_back(-unclaimed)
        self.taken = 0
        if tasks > 0:  # the record's oldest version may be these tasks'
            self._dirty.set()

    def release(self) -> None:
        """Give back the whole reservation (the gate found no room and waits)."""
        self._give_back(self.reserved)
        self.reserved = 0

    def _give_back(self, tasks: int) -> None:
        if tasks > 0:
            self.done += tasks
            self._dirty.set()

    def finished(self, tasks: int = 1) -> None:
        """``tasks`` are done (their groups published, or they failed or went back)."""
        self.done += tasks
        self._dirty.set()

    def answer(self, _name: str = "") -> None:
        """Another explorer joined: write this record soon (:meth:`run`), so its first look
        counts what is in flight here (:class:`FlightBoard` ``on_join``)."""
        self._dirty.set()

    async def run(self) -> None:
        """Write the record when it changed, and every :data:`REFRESH_S` s, while another
        explorer is about. Runs until cancelled (a write under way is abandoned)."""
        while True:
            with anyio.move_on_after(REFRESH_S):
                await self._dirty.wait()
            self._dirty = anyio.Event()
            if not await self.board.shared():
                continue
            try:
                await self._write()
            except BusError as exc:
                log.warning("%s: could not write %s: %s", self.name, self.key, exc)

    async def close(self) -> None:
        """Write a closed record: nothing in flight here any more. Never raises."""
        self.done, self.reserved, self.taken = self.claimed, 0, 0
        try:
            with anyio.fail_after(5):
                await self._write(closed=True)
        except (BusError, TimeoutError) as exc:
            log.warning("%s: could not close %s: %s", self.name, self.key, exc)
