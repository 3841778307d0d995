"""Streams, durable pull consumers, ordered reads and watches of the in-memory transport.

Pure data structures on the caller's event loop: a :class:`Stream` stores
messages by sequence and wakes whoever waits for one; a :class:`Consumer`
hands them out with JetStream's ack, nak, in-progress and redelivery rules;
:class:`Pull`, :class:`Reader` and :class:`PushWatch` are what
:class:`~rftstream.bus.memory.MemoryTransport` gives its callers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio

from rftstream.bus.transport import (
    ConsumerSpec,
    ConsumerState,
    Delivery,
    PubAck,
    StreamSpec,
    StreamState,
)
from rftstream.errors import BusError, StreamFullError
from rftstream.headers import H_MSG_ID, headers_size

log = logging.getLogger(__name__)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches ``pattern`` (NATS wildcards: ``*`` one token, ``>`` the rest)."""
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


# ------------------------------------------------------------------ deliveries
@dataclass(frozen=True, slots=True)
class Sequence:
    stream: int
    consumer: int


@dataclass(frozen=True, slots=True)
class Metadata:
    sequence: Sequence
    num_delivered: int
    num_pending: int
    timestamp: datetime


@dataclass(slots=True)
class Stored:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    size: int
    stamp: datetime


class Message:
    """A message handed to a consumer (:class:`Delivery`); settling it calls back its consumer."""

    __slots__ = ("subject", "data", "headers", "metadata", "_consumer")

    def __init__(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        metadata: Metadata,
        consumer: Consumer | None,
    ) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers
        self.metadata = metadata
        self._consumer = consumer

    @property
    def _seq(self) -> int:
        return self.metadata.sequence.stream

    async def ack(self) -> None:
        if self._consumer is not None:
            self._consumer.settle(self._seq)

    async def ack_sync(self, timeout: float = 1.0) -> Message:
        await self.ack()
        return self

    async def nak(self, delay: float | None = None) -> None:
        if self._consumer is not None:
            self._consumer.nak(self._seq, delay or 0.0)

    async def in_progress(self) -> None:
        if self._consumer is not None:
            self._consumer.touch(self._seq)

    async def term(self) -> None:
        if self._consumer is not None:
            self._consumer.settle(self._seq)


# ------------------------------------------------------------------ streams
class Stream:
    def __init__(self, spec: StreamSpec, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.clock = clock
        self.msgs: dict[int, Stored] = {}  # insertion order is sequence order
        self.last_seq = 0
        self.bytes = 0
        self.dedup: dict[str, tuple[int, float]] = {}
        self.consumers: dict[str, Consumer] = {}
        # id -> (subject, description) of live readers and watches
        self.ephemeral: dict[int, tuple[str, str]] = {}
        self.watches: list[PushWatch] = []
        self.changed = anyio.Event()

    @property
    def first_seq(self) -> int:
        return next(iter(self.msgs), self.last_seq + 1)

    def holds(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.spec.subjects)

    def wake(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def remove(self, seq: int) -> None:
        stored = self.msgs.pop(seq, None)
        if stored is not None:
            self.bytes -= stored.size

    def store(self, subject: str, data: bytes, headers: dict[str, str] | None) -> PubAck:
        spec = self.spec
        now = self.clock()
        msg_id = (headers or {}).get(H_MSG_ID)
        if msg_id is not None:
            seen = self.dedup.get(msg_id)
            if seen is not None and now - seen[1] < spec.duplicate_window:
                return PubAck(spec.name, seen[0], duplicate=True)
        size = len(subject) + len(data) + (headers_size(headers) if headers else 0)
        if 0 < spec.max_msg_size < len(data):
            raise BusError(f"publish to {subject} rejected: message size exceeds maximum allowed")
        if spec.discard == "new":
            if (0 < spec.max_msgs <= len(self.msgs)) or (0 < spec.max_bytes < self.bytes + size):
                raise StreamFullError(f"stream {spec.name}: maximum messages or bytes exceeded")
        else:
            while self.msgs and (
                0 < spec.max_msgs <= len(self.msgs) or 0 < spec.max_bytes < self.bytes + size
            ):
                self.remove(next(iter(self.msgs)))
        self.last_seq += 1
        self.msgs[self.last_seq] = Stored(subject, data, headers, size, datetime.now(UTC))
        self.bytes += size
        if msg_id is not None:
            self.dedup[msg_id] = (self.last_seq, now)
        self.wake()
        return PubAck(spec.name, self.last_seq)

    def matching(self, pattern: str, start: int) -> list[int]:
        """Sequences from ``start`` on whose subject matches ``pattern`` ("" matches all)."""
        return [
            seq
            for seq, m in self.msgs.items()
            if seq >= start and (not pattern or subject_matches(pattern, m.subject))
        ]

    def state(self, subjects_filter: str | None) -> StreamState:
        subjects: dict[str, int] = {}
        if subjects_filter:
            for m in self.msgs.values():
                if subject_matches(subjects_filter, m.subject):
                    subjects[m.subject] = subjects.get(m.subject, 0) + 1
        return StreamState(
            first_seq=self.first_seq,
            last_seq=self.last_seq,
            messages=len(self.msgs),
            bytes=self.bytes,
            consumer_count=len(self.consumers) + len(self.ephemeral),
            subjects=subjects,
            description=self.spec.description,
        )


@dataclass(slots=True)
class Pending:
    deadline: float
    deliveries: int


@dataclass
class Consumer:
    """A durable pull consumer's state (shared by every binding)."""

    stream: Stream
    spec: ConsumerSpec
    next_seq: int
    delivered: int = 0
    consumer_seq: int = 0
    pending: dict[int, Pending] = field(default_factory=dict)
    settled_through: int = 0  # the ack floor: every delivered message up to it is settled

    def state(self) -> ConsumerState:
        return ConsumerState(
            name=self.spec.durable,
            durable=True,
            filter_subject=self.spec.filter_subject,
            description=self.spec.description,
            metadata=dict(self.spec.metadata),
            delivered=self.delivered,
            ack_floor=self.settled_through,
            num_pending=len(self.stream.matching(self.spec.filter_subject, self.next_seq)),
            num_ack_pending=len(self.pending),
            num_redelivered=sum(1 for p in self.pending.values() if p.deliveries > 1),
        )

    def _advance_floor(self) -> None:
        below = min(self.pending, default=None)
        if below is None:
            self.settled_through = self.delivered
            return
        settled = [s for s in range(self.settled_through + 1, below) if self._was_delivered(s)]
        if settled:
            self.settled_through = max(settled)

    def _was_delivered(self, seq: int) -> bool:
        stored = self.stream.msgs.get(seq)
        if stored is None:  # gone (acked from a work queue, purged): it was this consumer's
            return seq <= self.delivered
        return seq <= self.delivered and (
            not self.spec.filter_subject
            or subject_matches(self.spec.filter_subject, stored.subject)
        )

    def settle(self, seq: int) -> None:
        """Ack or term: the message will not come again."""
        if self.pending.pop(seq, None) is None:
            return
        if self.stream.spec.retention == "work_queue":
            self.stream.remove(seq)
        self._advance_floor()

    def nak(self, seq: int, delay: float) -> None:
        p = self.pending.get(seq)
        if p is not None:
            p.deadline = self.stream.clock() + delay
            self.stream.wake()

    def touch(self, seq: int) -> None:
        p = self.pending.get(seq)
        if p is not None:
            p.deadline = self.stream.clock() + self.spec.ack_wait

    def _message(self, seq: int, deliveries: int) -> Message:
        stored = self.stream.msgs[seq]
        self.consumer_seq += 1
        meta = Metadata(
            Sequence(seq, self.consumer_seq),
            deliveries,
            len(self.stream.matching(self.spec.filter_subject, self.next_seq)),
            stored.stamp,
        )
        return Message(stored.subject, stored.data, stored.headers, meta, self)

    def take(self, batch: int) -> list[Delivery]:
        """What is due now: expired or nak'd messages first, then new ones, up to ``batch``."""
        now = self.stream.clock()
        out: list[Delivery] = []
        for seq, p in sorted(self.pending.items()):
            if len(out) >= batch:
                return out
            if p.deadline > now:
                continue
            if seq not in self.stream.msgs:  # purged meanwhile
                self.settle(seq)
                continue
            if 0 < self.spec.max_deliver <= p.deliveries:
                continue  # delivered as often as allowed: left unacked, never again
            p.deliveries += 1
            p.deadline = now + self.spec.ack_wait
            out.append(self._message(seq, p.deliveries))
        room = self.spec.max_ack_pending - len(self.pending)
        for seq in self.stream.matching(self.spec.filter_subject, self.next_seq):
            if len(out) >= batch or room <= 0:
                break
            self.next_seq = seq + 1
            self.delivered = seq
            self.pending[seq] = Pending(now + self.spec.ack_wait, 1)
            room -= 1
            out.append(self._message(seq, 1))
        return out

    def next_deadline(self) -> float | None:
        due = [
            p.deadline
            for p in self.pending.values()
            if not (0 < self.spec.max_deliver <= p.deliveries)
        ]
        return min(due, default=None)


class Pull:
    """A binding of a durable (:class:`~rftstream.bus.transport.PullSubscription`)."""

    def __init__(self, consumer: Consumer, stream: str) -> None:
        self._consumer = consumer
        self.stream = stream
        self.durable = consumer.spec.durable
        self._closed = False

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        if batch < 1:
            raise ValueError(f"fetch: batch must be >= 1, got {batch}")
        if timeout <= 0:
            raise ValueError(f"fetch: timeout must be > 0, got {timeout}")
        stream = self._consumer.stream
        deadline = time.monotonic() + timeout
        while True:
            if self._closed:
                raise BusError(f"consumer {self.stream}/{self.durable}: unsubscribed")
            got = self._consumer.take(batch)
            if got:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            due = self._consumer.next_deadline()
            if due is not None:
                left = min(left, max(0.001, due - stream.clock()))
            changed = stream.changed
            with anyio.move_on_after(left):
                await changed.wait()

    async def info(self) -> ConsumerState:
        return self._consumer.state()

    async def unsubscribe(self) -> None:
        self._closed = True


class Reader:
    """An ordered read (:class:`~rftstream.bus.transport.OrderedReader`)."""

    def __init__(
        self, stream: Stream, subject: str, start: int, headers_only: bool, description: str = ""
    ) -> None:
        self._stream = stream
        self._subject = subject
        self._next = start
        self._headers_only = headers_only
        self._delivered = 0
        stream.ephemeral[id(self)] = (subject, description)

    def _take(self) -> Delivery | None:
        seqs = self._stream.matching(self._subject, self._next)
        if not seqs:
            return None
        seq = seqs[0]
        self._next = seq + 1
        self._delivered += 1
        stored = self._stream.msgs[seq]
        meta = Metadata(Sequence(seq, self._delivered), 1, len(seqs) - 1, stored.stamp)
        data = b"" if self._headers_only else stored.data
        return Message(stored.subject, data, stored.headers, meta, None)

    async def next(self, timeout: float) -> Delivery | None:
        with anyio.move_on_after(timeout):
            while True:
                msg = self._take()
                if msg is not None:
                    return msg
                await self._stream.changed.wait()
        return None

    async def close(self) -> None:
        self._stream.ephemeral.pop(id(self), None)


class PushWatch:
    """An ordered push to a callback (:class:`~rftstream.bus.transport.Watch`): messages
    stored when it starts are pushed by :meth:`MemoryTransport.watch`, later ones by
    the publish that stores them."""

    def __init__(
        self,
        stream: Stream,
        subject: str,
        callback: Callable[[Delivery], Awaitable[None]],
        start: int,
        headers_only: bool,
        description: str = "",
    ) -> None:
        self._reader = Reader(stream, subject, start, headers_only, description)
        self._stream = stream
        self._callback = callback
        self._last = 0

    async def push(self) -> None:
        while (msg := self._reader._take()) is not None:
            self._last = msg.metadata.sequence.stream
            try:
                await self._callback(msg)
            except Exception:  # noqa: BLE001 - as a NATS subscription: logged, the watch goes on
                log.exception("watch callback failed on %s", msg.subject)

    async def info(self) -> ConsumerState:
        pending = len(self._stream.matching(self._reader._subject, self._reader._next))
        return ConsumerState(
            name=f"ordered-{id(self)}",
            durable=False,
            filter_subject=self._reader._subject,
            delivered=self._last,
            ack_floor=self._last,
            num_pending=pending,
        )

    async def unsubscribe(self) -> None:
        if self in self._stream.watches:
            self._stream.watches.remove(self)
        await self._reader.close()
