"""Bounded streams: the limits of the run's streams, purging acked experience, back-pressure.

Pure parts (no I/O): :func:`purge_points`, :func:`experience_full`, :func:`fill_ratio`
(the config rules and the limits as stream fields: :mod:`rftstream.config.stream_limits`).
Bus parts (any transport): :func:`purge_acked`; :func:`purge_on_full`, the hook a
:class:`~rftstream.bus.client.Bus` of an experience publisher calls when a publish finds
the stream full; and :class:`ExperienceRoom`, which an explorer awaits before publishing
a group to ``exp.raw``.

What a limit does to un-consumed messages (see the README, "Bounded streams
and cleanup"):

* ``discard: new`` (the default of the tasks and experience streams): the
  server refuses a publish that would pass the limit; nothing stored is lost.
  The publish fails with "maximum bytes exceeded" (:class:`~rftstream.errors.StreamFullError`),
  and the publisher's retry path waits. Explorers wait *before* publishing
  (:class:`ExperienceRoom`) while the experience stream is above
  :data:`HIGH_WATER` of a limit, so operators and the trainer, which free
  room by consuming, always have the rest to publish their outputs into.
* ``purge_acked`` (experience): messages every durable consumer has acked are
  purged, but for the newest ``keep_acked_msgs`` of them and, while the stream is
  far from its limits, those stored after an operator's first unacked message
  (:func:`first_forwardable`) or younger than ``keep_acked_s``; a long run's
  experience stream then holds only the backlog and that window. Those stay for
  deduplication: a server killed before an operator's ack of its source was
  stored redelivers the source, the operator forwards it again with the same
  ``Nats-Msg-Id``, and a restarted server recognises the id only while the first
  copy is stored (it rebuilds its duplicate window from the stored messages); an
  explorer whose task ack was lost publishes the task's group again the same way.
* ``discard: old`` (dead letters and metrics by default): the oldest messages
  go. Those streams have no durable consumers, so what went is exactly the
  stream's first sequence less one (:func:`removed_by_limits`). ``discard: old`` or ``max_age`` on the
  experience stream can drop untrained experience: a config warning names the
  key, and :class:`ExperienceRoom` warns (naming the stream) whenever the
  stream's head passes a consumer's acked floor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import anyio

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import Transport
from rftstream.config.schema import ExperienceStreamConfig, StreamLimitsConfig
from rftstream.errors import BusError, SchemaError
from rftstream.fault_points import fault_point
from rftstream.retention.purged import record_purge
from rftstream.retention.reader_history import cut_seqs
from rftstream.subjects import reads_for_trainer
from rftstream.wire import TOPOLOGY, TRAINER_ACKED_BELOW, AckedBelow

log = logging.getLogger(__name__)

#: explorers wait while the experience stream is above this share of a limit
HIGH_WATER = 0.8
#: how often a waiting explorer re-checks the stream (and purges what was acked)
RECHECK_S = 0.25
#: how long one check of the stream's fill is reused by the next publishes
CHECK_TTL_S = 0.5


@dataclass(frozen=True)
class ConsumerFloor:
    """A durable consumer's position: every message on ``filter`` at or below ``ack_floor`` is acked."""

    name: str
    filter: str  # its filter subject ("" or a wildcard: it reads several subjects)
    ack_floor: int
    outstanding: int  # undelivered (num_pending) + delivered and unacked (num_ack_pending)
    # whether what it reads may be published again to the stream (an operator's durable;
    # the trainer's publishes nothing): see first_forwardable
    forwards: bool = True


def first_forwardable(consumers: Sequence[ConsumerFloor]) -> int | None:
    """The first stream sequence an operator may still forward, or publish a copy after:
    the lowest ``ack_floor + 1`` of the forwarding consumers with something outstanding
    (None: none). Every forward of a message is stored after it (one stream, one sequence),
    so a message from this sequence on may be the first copy of a forward that comes again
    (its source's ack lost with a killed server) and must stay for the server's
    deduplication, which a restarted server rebuilds from the messages it stores. Pure."""
    return min(
        (c.ack_floor + 1 for c in consumers if c.forwards and c.outstanding > 0), default=None
    )


def with_acked_below(
    floors: Sequence[ConsumerFloor], claim: AckedBelow | None
) -> list[ConsumerFloor]:
    """``floors`` with the named durable's ack floor raised to ``claim.below - 1`` where the
    server's lags (see :class:`~rftstream.wire.AckedBelow`: everything below it is acked)."""
    if claim is None:
        return list(floors)
    return [
        replace(c, ack_floor=claim.below - 1)
        if c.name == claim.durable and claim.below - 1 > c.ack_floor
        else c
        for c in floors
    ]


async def _acked_below(state: RunState) -> AckedBelow | None:
    """The trainer's ``trainer.acked_below`` record; None when absent or unreadable (a
    record of another shape: only a purge hint, so the server's floors stand)."""
    try:
        return await state.get(TRAINER_ACKED_BELOW)
    except SchemaError as exc:
        log.warning("%s: %s", TRAINER_ACKED_BELOW.name, exc)
        return None


def _exact(subject: str) -> bool:
    return bool(subject) and "*" not in subject and ">" not in subject


def purge_points(
    first_seq: int,
    last_seq: int,
    consumers: Sequence[ConsumerFloor],
    keep: int,
    min_batch: int = 1,
    stored: Mapping[str, int] | None = None,
    hold_from: int | None = None,
) -> dict[str, int]:
    """Per subject, the stream sequence below which its messages may be purged.

    A message may go when every durable consumer reading its subject has acked
    it: its sequence is at most that consumer's ack floor (a consumer reading
    several subjects bounds each of them). A consumer with nothing outstanding
    has acked everything it matches, so it bounds nothing. Only subjects some
    durable consumer reads (by exact filter) are purged: a stage nobody reads
    yet keeps everything. The newest ``keep`` sequences of the stream stay.
    Subjects with nothing to purge (point <= ``first_seq``) are left out, and
    so are those whose point is less than ``min_batch`` sequences above
    ``first_seq`` (purges are batched). With ``stored`` (messages per subject), so are
    subjects holding fewer than ``min_batch`` messages: ``first_seq`` is the slowest
    subject's, so a subject read ahead of it (``exp.raw``) would otherwise pass the
    batch test at every call with only a few messages to purge. ``hold_from``: the first
    sequence that must stay for deduplication (None: no such bound); nothing from it on goes.
    """
    if last_seq < first_seq:
        return {}
    cap = last_seq + 1 - max(0, keep)
    if hold_from is not None:
        cap = min(cap, hold_from)
    shared = min(
        (c.ack_floor for c in consumers if not _exact(c.filter) and c.outstanding > 0),
        default=last_seq,
    )
    points: dict[str, int] = {}
    for subject in sorted({c.filter for c in consumers if _exact(c.filter)}):
        floor = min(
            (c.ack_floor for c in consumers if c.filter == subject and c.outstanding > 0),
            default=last_seq,
        )
        point = min(min(floor, shared) + 1, cap)
        if point <= first_seq or point - first_seq < min_batch:
            continue
        if stored is None or stored.get(subject, 0) >= min_batch:
            points[subject] = point
    return points


def removed_by_limits(first_seq: int, last_seq: int) -> int:
    """Messages a stream with no consumers and no purges lost to its limits (``discard: old``
    or ``max_age``): every sequence below the first one stored is gone."""
    if last_seq == 0:
        return 0
    return max(0, first_seq - 1)


def lost_below_head(first_seq: int, consumers: Sequence[ConsumerFloor]) -> list[tuple[str, int]]:
    """Consumers with outstanding work whose acked floor the stream's head has passed, and by
    how many sequences, in a stream nothing purges (``purge_acked`` false): only its limits
    removed those messages, and the ones on the consumer's subject were unread."""
    return [
        (c.name, first_seq - 1 - c.ack_floor)
        for c in consumers
        if c.outstanding > 0 and first_seq - 1 > c.ack_floor
    ]


def at_limit(stored_bytes: int, stored_msgs: int, limits: StreamLimitsConfig, slack: int) -> bool:
    """Whether a stream is within ``slack`` bytes of ``max_bytes`` or at ``max_msgs``."""
    if limits.max_bytes > 0 and stored_bytes + slack >= limits.max_bytes:
        return True
    return limits.max_msgs > 0 and stored_msgs >= limits.max_msgs


def fill_ratio(stored_bytes: int, stored_msgs: int, limits: StreamLimitsConfig) -> float:
    """The share of the tightest of ``max_bytes`` / ``max_msgs`` in use (0 with no limit)."""
    shares = [0.0]
    if limits.max_bytes > 0:
        shares.append(stored_bytes / limits.max_bytes)
    if limits.max_msgs > 0:
        shares.append(stored_msgs / limits.max_msgs)
    return max(shares)


def experience_full(
    stored_bytes: int, stored_msgs: int, limits: StreamLimitsConfig, high_water: float = HIGH_WATER
) -> bool:
    """Whether the experience stream is at or above ``high_water`` of its byte or message limit."""
    if limits.max_bytes > 0 and stored_bytes >= high_water * limits.max_bytes:
        return True
    return limits.max_msgs > 0 and stored_msgs >= high_water * limits.max_msgs


async def consumer_floors(transport: Transport, stream: str) -> list[ConsumerFloor]:
    """The durable consumers of ``stream`` and their acked floors (one API round trip)."""
    return [
        ConsumerFloor(
            c.name,
            c.filter_subject,
            c.ack_floor,
            c.num_pending + c.num_ack_pending,
            forwards=not reads_for_trainer(c.name, c.filter_subject, c.metadata),
        )
        for c in await transport.consumers(stream)
        if c.durable  # an ordered watch (tail, the trainer's header watch) keeps nothing
    ]


@dataclass
class PurgeResult:
    """What :func:`purge_acked` saw and did."""

    first_seq: int
    last_seq: int
    messages: int
    bytes: int
    purged: int  # messages purged now
    floors: list[ConsumerFloor]


async def purge_acked(
    transport: Transport,
    stream: str,
    cfg: ExperienceStreamConfig,
    state: RunState | None = None,
    subject_prefix: str = "",
) -> PurgeResult:
    """Purge, subject by subject, the messages of ``stream`` every durable consumer of that
    subject acked (but the newest ``cfg.keep_acked_msgs``); with ``cfg.purge_acked`` false
    only read the stream's state.

    The stream is read before its consumers: a consumer that has nothing
    outstanding then has acked every message up to the last sequence read (a
    message stored after that read is above it, so never purged), and floors
    only grow; a durable's floor is the higher of the server's and the trainer's
    ``trainer.acked_below`` record (with ``state``: one KV read more). While the stream is
    far from its limits, purges are batched: a
    subject is purged once ``keep_acked_msgs`` sequences can go and it holds at
    least that many messages itself, and what may be the first copy of a repeated
    publish stays (after an operator's first unacked message, or younger than
    ``keep_acked_s``: one API round trip more when something could go); near them,
    whatever can go. With ``state``
    (the run's KV), each subject's purge is first recorded under
    ``purged.<stage>`` (``<stage>``: the subject less ``subject_prefix``;
    :mod:`rftstream.retention.purged`) so the run's account can count what it no
    longer finds. Blocks for two JetStream API round trips,
    and two more per purged subject (with ``state``: a headers-only read and
    a KV write more). Raises :class:`BusError` naming the stream on failure.
    """
    try:
        st = await transport.stream_state(stream, subjects_filter=f"{subject_prefix}>")
        floors = await consumer_floors(transport, stream)
        if state is not None and cfg.purge_acked:  # a lagging floor the trainer corrected
            floors = with_acked_below(floors, await _acked_below(state))
    except BusError as exc:
        raise BusError(f"stream {stream}: reading its state failed: {exc}") from exc
    first, last = st.first_seq, st.last_seq
    result = PurgeResult(first, last, st.messages, st.bytes, 0, floors)
    if not cfg.purge_acked or not st.messages:
        return result
    unreachable = transport.unreachable_durables(stream)
    if unreachable:  # one of them may be a durable whose floor is lower: purge nothing
        log.warning("stream %s: not purging while consumers %s do not answer", stream, unreachable)
        return result
    # Batched while far from the limits, at once when room is getting short: each purge
    # costs a headers-only read, a KV write and the purge, and purging a few messages
    # twice a second made a default run's explorer half as fast.
    far = fill_ratio(result.bytes, result.messages, cfg) < HIGH_WATER / 2
    batch = max(1, cfg.keep_acked_msgs) if far else 1
    points = purge_points(first, last, floors, cfg.keep_acked_msgs, batch, st.subjects)
    if points and far:
        # what may be the first copy of a forward that comes again stays, so that the
        # server deduplicates the repeat (a restarted server knows only the ids it
        # stores): everything from an operator's first unacked message on, and what is
        # younger than keep_acked_s (a group an explorer may publish again)
        hold = [first_forwardable(floors)]
        if cfg.keep_acked_s > 0:
            since = datetime.now(UTC) - timedelta(seconds=cfg.keep_acked_s)
            try:
                hold.append(await transport.first_seq_since(stream, since))
            except BusError as exc:
                raise BusError(
                    f"stream {stream}: reading its young messages failed: {exc}"
                ) from exc
        held = [h for h in hold if h is not None]
        if held:
            points = purge_points(
                first, last, floors, cfg.keep_acked_msgs, batch, st.subjects, hold_from=min(held)
            )
    if not points:
        return result
    try:
        # read after the floors: a cut below a point they allow was recorded before them
        edges = (await state.get(TOPOLOGY) or []) if state is not None else []
        for subject, point in points.items():
            if state is not None:
                stored = int(st.subjects.get(subject, 0))
                stage = subject[len(subject_prefix) :]
                await record_purge(
                    state,
                    transport,
                    stream,
                    subject,
                    stage,
                    first,
                    point,
                    stored,
                    cut_seqs(edges, stage),
                )
                fault_point("purge")  # chaos tests kill the run here
            await transport.purge(stream, subject, point)
        after = await transport.stream_state(stream)
    except BusError as exc:
        raise BusError(f"stream {stream}: purging acked messages failed: {exc}") from exc
    result.purged = max(0, result.messages - after.messages)
    result.messages, result.bytes = after.messages, after.bytes
    result.first_seq = after.first_seq or first
    return result


async def purge_on_full(bus: Bus, subject: str) -> None:
    """The :data:`~rftstream.bus.client.StreamFullHook` of an actor that publishes experience:
    a publish to ``subject`` found its stream full; when it is the experience stream, purge
    what every consumer acked (``nats.streams.experience.purge_acked``) before the bus
    retries. Best effort: a failure is logged (naming the actor) and the retry waits as
    usual. Blocks for :func:`purge_acked`'s round trips; cancelling it may leave a purge
    recorded but not done (the account allows for that)."""
    prefix = bus.names.exp_wildcard[:-1]
    exp = bus.cfg.streams.experience
    if not subject.startswith(prefix) or not exp.purge_acked:
        return
    try:
        await purge_acked(bus.transport, bus.names.exp_stream, exp, await bus.state(), prefix)
    except BusError as exc:
        log.warning("%s: %s", bus.actor, exc)


class ExperienceRoom:
    """An explorer's gate to ``exp.raw``: purges acked experience and waits while the
    experience stream is above :data:`HIGH_WATER` of its limits.

    Two ways to drive it. With :meth:`keep` running beside the publishes (the
    explorer does so), the stream is read and purged in that task, every
    :data:`CHECK_TTL_S` (every :data:`RECHECK_S` once it is half way to
    :data:`HIGH_WATER`), and :meth:`wait` costs no round trip while the last check
    found room: a purge (a headers-only read of up to ``keep_acked_msgs`` messages,
    a KV write and the purge itself) never delays a publish. Without it, :meth:`wait`
    checks inline when its last check is older than :data:`CHECK_TTL_S` or found the
    stream past half of :data:`HIGH_WATER`. Between two checks it counts the
    publishes it let through (each the size of the stream's average message, or
    ``message_bytes`` while the stream was empty) and checks again before they
    could reach :data:`HIGH_WATER`: a stale check never lets an explorer fill the
    room the operators and the trainer publish into. Either way a full stream makes
    :meth:`wait` block, warning once per wait (naming the stream and the config
    key), until a check finds room. The server's own limit (``discard: new``) stays
    the hard bound: a check a fraction of a second old only decides whether to wait
    first. Cancelling either leaves nothing behind.
    """

    def __init__(
        self,
        transport: Transport | None,
        stream: str,
        cfg: ExperienceStreamConfig,
        actor: str,
        *,
        state: RunState | None = None,
        subject_prefix: str = "",
        message_bytes: int = 0,
    ) -> None:
        self.transport = transport
        # the most one publish may add (max_payload): the size assumed for each publish
        # while the last check saw an empty stream (0: a 64th of max_bytes)
        self.message_bytes = message_bytes
        self.stream = stream
        self.cfg = cfg
        self.actor = actor
        # the run's KV, where each purge is recorded first (the run's account reads it);
        # an explorer sets it once it has the bucket
        self.state = state
        self.subject_prefix = subject_prefix
        self.waited_s = 0.0  # total time spent waiting for room (a metric)
        self.lost = 0  # sequences removed under a consumer before it acked them (reported)
        self.purged = 0  # messages purged by this explorer's checks
        self.check_s = 0.0  # total time spent reading and purging the stream (a metric)
        self.limit_hits = 0  # checks that found a discard-old stream at its limit with work left
        self._checked_at = -1e9
        self._fill = 1.0  # share of the tightest limit in use at the last check
        self._stored = (0, 0)  # (bytes, messages) in the stream at the last check
        self._since = 0  # publishes let through since the last check
        self._room = False  # whether the last check found room
        self._reported_head = 0
        self._keeping = False  # a keep() loop is running: wait() reads its results
        self._keep_error: BusError | None = None  # the keep() loop's last check failed so
        self._checked: anyio.Event | None = None  # set after each check of the keep() loop

    @property
    def bounded(self) -> bool:
        """Whether there is anything to do: a limit to respect or acked messages to purge."""
        return self.transport is not None and (
            self.cfg.purge_acked or self.cfg.max_bytes > 0 or self.cfg.max_msgs > 0
        )

    async def check(self) -> bool:
        """Read the stream (purging what every consumer acked); True if there is room."""
        assert self.transport is not None
        started = time.monotonic()
        try:
            res = await purge_acked(
                self.transport, self.stream, self.cfg, self.state, self.subject_prefix
            )
        finally:
            self.check_s += time.monotonic() - started
        self._checked_at = time.monotonic()
        self._fill = fill_ratio(res.bytes, res.messages, self.cfg)
        self._stored, self._since = (res.bytes, res.messages), 0
        self.purged += res.purged
        self._report_loss(res)
        self._room = not experience_full(res.bytes, res.messages, self.cfg)
        return self._room

    async def keep(self) -> None:
        """Check (and purge) the stream in the background until cancelled, so that
        :meth:`wait` never reads the stream itself: every :data:`CHECK_TTL_S` while it is
        far from its limits, every :data:`RECHECK_S` from half of :data:`HIGH_WATER` on.
        A failed check is logged and kept for :meth:`wait` to raise; the next one is tried
        after :data:`RECHECK_S`. Returns at once when there is nothing to bound. Blocks;
        cancel to stop (a check cut short purges a prefix or not: either is recorded)."""
        if not self.bounded:
            return
        self._keeping = True
        self._checked = anyio.Event()
        try:
            while True:
                try:
                    await self.check()
                    self._keep_error = None
                except BusError as exc:
                    if self._keep_error is None:
                        log.warning("%s: %s", self.actor, exc)
                    self._keep_error = exc
                self._checked.set()
                self._checked = anyio.Event()
                far = self._keep_error is None and self._fill < HIGH_WATER / 2
                await anyio.sleep(CHECK_TTL_S if far else RECHECK_S)
        finally:
            self._keeping = False

    async def _next_check(self) -> bool:
        """True if there is room: the next check's answer (the keep() loop's, or one made
        now). Raises the keep() loop's :class:`BusError` when its check failed."""
        if not self._keeping or self._checked is None:
            return await self.check()
        await self._checked.wait()
        if self._keep_error is not None:
            raise self._keep_error
        return self._room

    def _projected(self) -> float:
        """The fill the last check saw, plus the publishes let through since, each the
        size of the stream's average message then (an explorer's own groups cannot
        fill the stream behind a stale check: the operators and the trainer need the
        room above :data:`HIGH_WATER` to publish into)."""
        stored_bytes, stored_msgs = self._stored
        if stored_msgs:
            each = stored_bytes / stored_msgs
        else:  # nothing seen to go by: the largest message there may be
            each = float(self.message_bytes or max(self.cfg.max_bytes, 0) / 64)
        return fill_ratio(
            int(stored_bytes + self._since * each), stored_msgs + self._since, self.cfg
        )

    def _room_known(self) -> bool:
        """Whether the last check answers for a publish now, without a round trip."""
        if self._keeping:
            if self._keep_error is not None:
                raise self._keep_error
            return self._room and self._checked_at > 0 and self._projected() < HIGH_WATER
        return (
            self._projected() < HIGH_WATER / 2 and time.monotonic() - self._checked_at < CHECK_TTL_S
        )

    def _report_loss(self, res: PurgeResult) -> None:
        """Warn (naming the stream and key) when its limits may have removed unread experience."""
        if self.cfg.discard != "old" and self.cfg.max_age <= 0:
            return  # discard new: the server refuses, it never removes
        busy = [c for c in res.floors if c.outstanding > 0]
        if not self.cfg.purge_acked:
            lost = lost_below_head(res.first_seq, busy)
            if not lost or res.first_seq <= self._reported_head:
                return
            self._reported_head = res.first_seq
            self.lost = max(self.lost, max(n for _, n in lost))
            detail = ", ".join(f"{name} ({n})" for name, n in lost)
            why = (
                f"removed messages below sequence {res.first_seq} before every consumer acked them"
            )
        elif busy and at_limit(res.bytes, res.messages, self.cfg, slack=0):
            self.limit_hits += 1
            detail = ", ".join(c.name for c in busy)
            why = "is at its limit: the server removes its oldest messages, read or not"
        else:
            return
        log.warning(
            "%s: stream %s %s (untrained experience may be lost; consumers with work: %s): "
            "nats.streams.experience has discard %s, max_age %gs",
            self.actor,
            self.stream,
            why,
            detail,
            self.cfg.discard,
            self.cfg.max_age,
        )

    async def wait(self, ended: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """Block until the experience stream has room for more raw experience: True; or
        until ``ended()`` (asked at each re-check) says the run is over: False.

        Raises :class:`BusError` when the stream cannot be read.
        """
        if not self.bounded:
            return True
        if self._room_known():
            self._since += 1
            return True  # room when last seen: no round trip
        if await self._next_check():
            self._since += 1
            return True
        started = time.monotonic()
        log.warning(
            "%s: stream %s is above %.0f%% of its limits (nats.streams.experience.max_bytes %d, "
            "max_msgs %d): waiting for the pipeline and the trainer to consume experience",
            self.actor,
            self.stream,
            HIGH_WATER * 100,
            self.cfg.max_bytes,
            self.cfg.max_msgs,
        )
        try:
            while True:
                if not self._keeping:
                    await anyio.sleep(RECHECK_S)
                if await self._next_check():
                    self._since += 1
                    return True
                if ended is not None and await ended():
                    return False
        finally:
            self.waited_s += time.monotonic() - started
