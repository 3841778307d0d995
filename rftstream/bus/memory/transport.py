"""The in-memory :class:`~rftstream.bus.transport.Transport` (see :mod:`rftstream.bus.memory`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import datetime

from rftstream.bus.memory.kv import Listener, MemoryKV
from rftstream.bus.memory.streams import Consumer, Pull, PushWatch, Reader, Stream, subject_matches
from rftstream.bus.transport import (
    ConsumerSpec,
    ConsumerState,
    Delivery,
    PubAck,
    StoredMsg,
    StreamSpec,
    StreamState,
)
from rftstream.errors import (
    BucketNotFound,
    BusError,
    BusTimeout,
    ConsumerNotFound,
    MessageNotFound,
    StreamNotFound,
)

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


class MemoryTransport:
    """Streams, consumers and KV buckets in this process (see the module docstring).

    Several :class:`~rftstream.bus.client.Bus` objects sharing one transport act as
    actors on one server; :meth:`connection` gives each its own connection to close.
    Nothing blocks but fetches and reads waiting for messages.
    """

    def __init__(
        self, *, max_payload: int = DEFAULT_MAX_PAYLOAD, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_payload = max_payload
        self.clock = clock
        self._streams: dict[str, Stream] = {}
        self._buckets: dict[str, MemoryKV] = {}
        self._consumer_listeners: list[Listener[Callable[[], None]]] = []
        self._closed = False

    def connection(self) -> MemoryTransport:
        """Another client of the same in-memory server (as a second ``nats.connect``):
        it sees and changes the same streams, consumers and buckets, and closing it
        closes only itself. Blocks never."""
        other = MemoryTransport(max_payload=self._max_payload, clock=self.clock)
        other._streams = self._streams
        other._buckets = self._buckets
        other._consumer_listeners = self._consumer_listeners
        return other

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

    def _stream(self, name: str) -> Stream:
        stream = self._streams.get(name)
        if stream is None:
            raise StreamNotFound(f"stream {name}: not found")
        return stream

    def _consumer(self, stream: str, durable: str) -> Consumer:
        found = self._streams.get(stream)
        consumer = found.consumers.get(durable) if found is not None else None
        if consumer is None:
            raise ConsumerNotFound(f"consumer {stream}/{durable}: not found")
        return consumer

    def _holding(self, subject: str) -> Stream | None:
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

    async def pull(self, stream: str, durable: str) -> Pull:
        return Pull(self._consumer(stream, durable), stream)

    async def read(
        self,
        stream: str | None,
        subject: str,
        *,
        start_seq: int = 1,
        headers_only: bool = False,
        description: str = "",
    ) -> Reader:
        found = self._holding(subject) if stream is None else self._streams.get(stream)
        if found is None:
            raise StreamNotFound(f"reading {subject}: no stream {stream or 'holds it'}")
        return Reader(found, subject, max(1, start_seq), headers_only, description)

    async def watch(
        self,
        stream: str,
        subject: str,
        callback: Callable[[Delivery], Awaitable[None]],
        *,
        start_seq: int | None = None,
        start_time: datetime | None = None,
        headers_only: bool = False,
        description: str = "",
    ) -> PushWatch:
        found = self._stream(stream)
        start = max(1, start_seq or 1)
        if start_seq is None and start_time is not None:
            start = next(
                (seq for seq, m in found.msgs.items() if m.stamp >= start_time), found.last_seq + 1
            )
        watch = PushWatch(found, subject, callback, start, headers_only, description)
        found.watches.append(watch)
        await watch.push()
        return watch

    # -- provisioning
    async def ensure_stream(self, spec: StreamSpec, key: str) -> None:
        found = self._streams.get(spec.name)
        if found is None:
            self._streams[spec.name] = Stream(spec, self.clock)
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
            found.consumers[spec.durable] = Consumer(found, spec, next_seq=start)
            self._consumers_changed(stream)

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

    async def first_seq_since(self, stream: str, since: datetime) -> int | None:
        for seq, m in self._stream(stream).msgs.items():
            if m.stamp >= since:
                return seq
        return None

    async def get_msg(self, stream: str, seq: int, *, direct: bool = False) -> StoredMsg:
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
            ConsumerState(
                name=f"ordered-{key}",
                durable=False,
                filter_subject=subject,
                description=description,
            )
            for key, (subject, description) in found.ephemeral.items()
        ]
        return durables + ephemeral

    def unreachable_durables(self, stream: str) -> list[str]:
        return []

    async def delete_consumer(self, stream: str, durable: str) -> None:
        self._consumer(stream, durable)
        del self._streams[stream].consumers[durable]
        self._consumers_changed(stream)

    async def on_consumers_changed(
        self, stream: str, callback: Callable[[], None]
    ) -> Listener[Callable[[], None]]:
        return Listener(self._consumer_listeners, (stream,), callback)

    def _consumers_changed(self, stream: str) -> None:
        for listener in list(self._consumer_listeners):
            if stream in listener.names:
                listener.callback()

    # -- KV
    async def kv(
        self, bucket: str, *, create: bool, description: str = "", replicas: int = 1
    ) -> MemoryKV:
        found = self._buckets.get(bucket)
        if found is not None:
            return found
        if not create:
            raise BucketNotFound(f"KV bucket {bucket}: not found")
        spec = StreamSpec(
            name=f"KV_{bucket}", subjects=(f"$KV.{bucket}.>",), description=description
        )
        await self.ensure_stream(spec, f"KV {bucket}")
        found = self._buckets[bucket] = MemoryKV(self._stream(spec.name), bucket)
        return found

    async def delete_kv(self, bucket: str) -> None:
        if bucket not in self._buckets:
            raise BucketNotFound(f"KV bucket {bucket}: not found")
        await self.delete_stream(f"KV_{bucket}")
