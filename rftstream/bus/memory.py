"""An in-memory :class:`~rftstream.bus.transport.Transport`, for unit tests of the logic above the bus.

What it keeps of JetStream's semantics (what the actors rely on):

* streams with subjects (``*`` and ``>`` wildcards), stream sequences from 1,
  deduplication by ``Nats-Msg-Id`` within the duplicate window, ``max_msgs`` /
  ``max_bytes`` / ``max_msg_size`` limits with ``discard: new`` (the publish
  raises :class:`~rftstream.errors.StreamFullError`) or ``discard: old`` (the
  oldest go), work-queue retention (an acked message leaves the stream), purges;
* durable pull consumers with a filter subject, delivery from the start or
  from a sequence, explicit acks, ``nak`` (with a delay), ``in_progress``,
  ``term``, redelivery once ``ack_wait`` passes (up to ``max_deliver``
  deliveries), ``max_ack_pending``, an ack floor and pending counts as
  ``consumer info`` shows them; replicas binding one durable share its messages;
* ordered reads and watches (ephemeral, nothing acked);
* KV buckets as streams ``KV_<bucket>`` with revisions (stream sequences),
  create / compare-and-set conflicts (:class:`~rftstream.errors.CasConflict`),
  delete markers and write notifications.

Not modelled: ``max_age``, replicas, interest retention (kept as limits),
headers counted toward ``max_payload`` on the server side (the
:class:`~rftstream.bus.client.Bus` checks them itself).

Everything runs on the caller's event loop (asyncio or trio): a publish wakes
waiting fetches and readers, and calls watch callbacks before it returns. Time
is ``clock`` (``time.monotonic`` by default): pass another to move ack waits
and nak delays forward without sleeping.
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
    KvEntry,
    PubAck,
    StoredMsg,
    StreamSpec,
    StreamState,
)
from rftstream.errors import (
    BucketNotFound,
    BusError,
    BusTimeout,
    CasConflict,
    ConsumerNotFound,
    KeyNotFound,
    MessageNotFound,
    StreamFullError,
    StreamNotFound,
)
from rftstream.experience import H_MSG_ID, headers_size

log = logging.getLogger(__name__)

H_KV_OPERATION = "KV-Operation"  # JetStream's marker of a deleted (or purged) key
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


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
class _Sequence:
    stream: int
    consumer: int


@dataclass(frozen=True, slots=True)
class _Metadata:
    sequence: _Sequence
    num_delivered: int
    num_pending: int
    timestamp: datetime


@dataclass(slots=True)
class _Stored:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    size: int
    stamp: datetime


class _Message:
    """A message handed to a consumer (:class:`Delivery`); settling it calls back its consumer."""

    __slots__ = ("subject", "data", "headers", "metadata", "_consumer")

    def __init__(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        metadata: _Metadata,
        consumer: _Consumer | None,
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

    async def ack_sync(self, timeout: float = 1.0) -> _Message:
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
class _Stream:
    def __init__(self, spec: StreamSpec, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.clock = clock
        self.msgs: dict[int, _Stored] = {}  # insertion order is sequence order
        self.last_seq = 0
        self.bytes = 0
        self.dedup: dict[str, tuple[int, float]] = {}
        self.consumers: dict[str, _Consumer] = {}
        self.ephemeral: dict[int, str] = {}  # id -> subject of live readers and watches
        self.watches: list[_Watch] = []
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
        self.msgs[self.last_seq] = _Stored(subject, data, headers, size, datetime.now(UTC))
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
class _Pending:
    deadline: float
    deliveries: int


@dataclass
class _Consumer:
    """A durable pull consumer's state (shared by every binding)."""

    stream: _Stream
    spec: ConsumerSpec
    next_seq: int
    delivered: int = 0
    consumer_seq: int = 0
    pending: dict[int, _Pending] = field(default_factory=dict)
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

    def _message(self, seq: int, deliveries: int) -> _Message:
        stored = self.stream.msgs[seq]
        self.consumer_seq += 1
        meta = _Metadata(
            _Sequence(seq, self.consumer_seq),
            deliveries,
            len(self.stream.matching(self.spec.filter_subject, self.next_seq)),
            stored.stamp,
        )
        return _Message(stored.subject, stored.data, stored.headers, meta, self)

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
            self.pending[seq] = _Pending(now + self.spec.ack_wait, 1)
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


class _Pull:
    """A binding of a durable (:class:`~rftstream.bus.transport.PullSubscription`)."""

    def __init__(self, consumer: _Consumer, stream: str) -> None:
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


class _Reader:
    """An ordered read (:class:`~rftstream.bus.transport.OrderedReader`)."""

    def __init__(self, stream: _Stream, subject: str, start: int, headers_only: bool) -> None:
        self._stream = stream
        self._subject = subject
        self._next = start
        self._headers_only = headers_only
        self._delivered = 0
        stream.ephemeral[id(self)] = subject

    def _take(self) -> Delivery | None:
        seqs = self._stream.matching(self._subject, self._next)
        if not seqs:
            return None
        seq = seqs[0]
        self._next = seq + 1
        self._delivered += 1
        stored = self._stream.msgs[seq]
        meta = _Metadata(_Sequence(seq, self._delivered), 1, len(seqs) - 1, stored.stamp)
        data = b"" if self._headers_only else stored.data
        return _Message(stored.subject, data, stored.headers, meta, None)

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


class _Watch:
    """An ordered push to a callback (:class:`~rftstream.bus.transport.Watch`): messages
    stored when it starts are pushed by :meth:`MemoryTransport.watch`, later ones by
    the publish that stores them."""

    def __init__(
        self,
        stream: _Stream,
        subject: str,
        callback: Callable[[Delivery], Awaitable[None]],
        start: int,
        headers_only: bool,
    ) -> None:
        self._reader = _Reader(stream, subject, start, headers_only)
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


# ------------------------------------------------------------------ KV
class _WriteListeners:
    def __init__(self, kv: _MemoryKV, keys: tuple[str, ...], cb: Callable[[], Awaitable[None]]):
        self._kv = kv
        self.keys = keys
        self.cb = cb

    async def unsubscribe(self) -> None:
        if self in self._kv.listeners:
            self._kv.listeners.remove(self)


class _MemoryKV:
    """A KV bucket over the stream ``KV_<bucket>`` (:class:`~rftstream.bus.transport.KeyValueStore`)."""

    def __init__(self, transport: MemoryTransport, bucket: str) -> None:
        self._transport = transport
        self.bucket = bucket
        self._stream_name = f"KV_{bucket}"
        self._pre = f"$KV.{bucket}."
        self.listeners: list[_WriteListeners] = []

    def _stream(self) -> _Stream:
        return self._transport._stream(self._stream_name)

    def _last(self, key: str) -> tuple[int, _Stored] | None:
        subject = self._pre + key
        for seq, m in reversed(self._stream().msgs.items()):
            if m.subject == subject:
                return seq, m
        return None

    @staticmethod
    def _deleted(stored: _Stored) -> bool:
        return (stored.headers or {}).get(H_KV_OPERATION) in ("DEL", "PURGE")

    async def _write(self, key: str, value: bytes, headers: dict[str, str] | None = None) -> int:
        ack = self._stream().store(self._pre + key, value, headers)
        for listener in list(self.listeners):
            if key in listener.keys:
                await listener.cb()
        return ack.seq

    async def get(self, key: str) -> KvEntry:
        last = self._last(key)
        if last is None or self._deleted(last[1]):
            raise KeyNotFound(f"KV {self.bucket}/{key}: no value")
        return KvEntry(key, last[1].data, last[0], last[1].stamp)

    async def put(self, key: str, value: bytes) -> int:
        return await self._write(key, value)

    async def create(self, key: str, value: bytes) -> int:
        last = self._last(key)
        if last is not None and not self._deleted(last[1]):
            raise CasConflict(f"KV {self.bucket}/{key}: exists already")
        return await self._write(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        now = self._last(key)
        if (now[0] if now is not None else 0) != last:
            raise CasConflict(f"KV {self.bucket}/{key}: not at revision {last}")
        return await self._write(key, value)

    async def delete(self, key: str) -> None:
        if self._last(key) is not None:
            await self._write(key, b"", {H_KV_OPERATION: "DEL"})

    async def keys(self, prefix: str = "") -> list[str]:
        found = {m.subject[len(self._pre) :] for m in self._stream().msgs.values()}
        return sorted(k for k in found if k.startswith(prefix))

    async def on_write(
        self, keys: tuple[str, ...], callback: Callable[[], Awaitable[None]]
    ) -> _WriteListeners:
        listener = _WriteListeners(self, tuple(keys), callback)
        self.listeners.append(listener)
        return listener


# ------------------------------------------------------------------ transport
class MemoryTransport:
    """Streams, consumers and KV buckets in this process (see the module docstring).

    Several :class:`~rftstream.bus.client.Bus` objects sharing one transport act as
    actors on one server. Nothing blocks but fetches and reads waiting for messages.
    """

    def __init__(
        self, *, max_payload: int = DEFAULT_MAX_PAYLOAD, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_payload = max_payload
        self.clock = clock
        self._streams: dict[str, _Stream] = {}
        self._buckets: dict[str, _MemoryKV] = {}
        self._closed = False

    @property
    def max_payload(self) -> int:
        return self._max_payload

    @property
    def server_url(self) -> str:
        return "memory://"

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        self._closed = True

    def _stream(self, name: str) -> _Stream:
        stream = self._streams.get(name)
        if stream is None:
            raise StreamNotFound(f"stream {name}: not found")
        return stream

    def _consumer(self, stream: str, durable: str) -> _Consumer:
        found = self._streams.get(stream)
        consumer = found.consumers.get(durable) if found is not None else None
        if consumer is None:
            raise ConsumerNotFound(f"consumer {stream}/{durable}: not found")
        return consumer

    def _holding(self, subject: str) -> _Stream | None:
        return next((s for s in self._streams.values() if s.holds(subject)), None)

    # -- publishing and reading
    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> PubAck:
        if self._closed:
            raise BusError(f"publish to {subject}: connection closed")
        stream = self._holding(subject)
        if stream is None:
            raise BusTimeout(f"publish to {subject}: no stream answered")
        ack = stream.store(subject, data, headers)
        if not ack.duplicate:
            for watch in list(stream.watches):
                await watch.push()
        return ack

    async def pull(self, stream: str, durable: str) -> _Pull:
        return _Pull(self._consumer(stream, durable), stream)

    async def read(
        self, stream: str | None, subject: str, *, start_seq: int = 1, headers_only: bool = False
    ) -> _Reader:
        found = self._holding(subject) if stream is None else self._streams.get(stream)
        if found is None:
            raise StreamNotFound(f"reading {subject}: no stream {stream or 'holds it'}")
        return _Reader(found, subject, max(1, start_seq), headers_only)

    async def watch(
        self,
        stream: str,
        subject: str,
        callback: Callable[[Delivery], Awaitable[None]],
        *,
        start_seq: int | None = None,
        start_time: datetime | None = None,
        headers_only: bool = False,
    ) -> _Watch:
        found = self._stream(stream)
        start = max(1, start_seq or 1)
        if start_seq is None and start_time is not None:
            start = next(
                (seq for seq, m in found.msgs.items() if m.stamp >= start_time), found.last_seq + 1
            )
        watch = _Watch(found, subject, callback, start, headers_only)
        found.watches.append(watch)
        await watch.push()
        return watch

    # -- provisioning
    async def ensure_stream(self, spec: StreamSpec, key: str) -> None:
        found = self._streams.get(spec.name)
        if found is None:
            self._streams[spec.name] = _Stream(spec, self.clock)
            return
        if found.spec.retention != spec.retention:
            raise BusError(
                f"stream {spec.name} exists with retention {found.spec.retention}, this run "
                f"needs {spec.retention}: delete the stream first"
            )
        found.spec = spec

    async def ensure_consumer(self, stream: str, spec: ConsumerSpec) -> None:
        found = self._stream(stream)
        if spec.durable not in found.consumers:
            start = spec.start_seq if spec.start_seq is not None else found.first_seq
            found.consumers[spec.durable] = _Consumer(found, spec, next_seq=start)

    # -- streams
    async def stream_state(self, stream: str, subjects_filter: str | None = None) -> StreamState:
        return self._stream(stream).state(subjects_filter)

    async def streams(self) -> dict[str, StreamState]:
        return {name: s.state(None) for name, s in self._streams.items()}

    async def delete_stream(self, stream: str) -> None:
        self._stream(stream)
        del self._streams[stream]
        if stream.startswith("KV_"):
            self._buckets.pop(stream[3:], None)

    async def purge(self, stream: str, subject: str, below_seq: int) -> None:
        found = self._stream(stream)
        for seq in found.matching(subject, 0):
            if seq < below_seq:
                found.remove(seq)

    async def last_msg(self, stream: str, subject: str) -> StoredMsg:
        found = self._stream(stream)
        for seq, m in reversed(found.msgs.items()):
            if subject_matches(subject, m.subject):
                return StoredMsg(m.subject, seq, m.data, m.headers)
        raise MessageNotFound(f"stream {stream}: no message on {subject}")

    async def get_msg(self, stream: str, seq: int) -> StoredMsg:
        m = self._stream(stream).msgs.get(seq)
        if m is None:
            raise MessageNotFound(f"stream {stream}: no message {seq}")
        return StoredMsg(m.subject, seq, m.data, m.headers)

    # -- consumers
    async def consumer_state(self, stream: str, durable: str) -> ConsumerState:
        return self._consumer(stream, durable).state()

    async def consumers(self, stream: str) -> list[ConsumerState]:
        found = self._stream(stream)
        durables = [c.state() for c in found.consumers.values()]
        ephemeral = [
            ConsumerState(name=f"ordered-{key}", durable=False, filter_subject=subject)
            for key, subject in found.ephemeral.items()
        ]
        return durables + ephemeral

    def unreachable_consumers(self, stream: str) -> list[str]:
        return []

    async def delete_consumer(self, stream: str, durable: str) -> None:
        self._consumer(stream, durable)
        del self._streams[stream].consumers[durable]

    # -- KV
    async def kv(
        self, bucket: str, *, create: bool, description: str = "", replicas: int = 1
    ) -> _MemoryKV:
        found = self._buckets.get(bucket)
        if found is not None:
            return found
        if not create:
            raise BucketNotFound(f"KV bucket {bucket}: not found")
        await self.ensure_stream(
            StreamSpec(name=f"KV_{bucket}", subjects=(f"$KV.{bucket}.>",), description=description),
            f"KV {bucket}",
        )
        found = self._buckets[bucket] = _MemoryKV(self, bucket)
        return found

    async def delete_kv(self, bucket: str) -> None:
        if bucket not in self._buckets:
            raise BucketNotFound(f"KV bucket {bucket}: not found")
        await self.delete_stream(f"KV_{bucket}")
