"""KV buckets of the in-memory transport: keys as subjects of a stream ``KV_<bucket>``,
revisions as its sequences, deletes as marker messages (as JetStream keeps them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from rftstream.bus.memory.streams import Stored, Stream, subject_matches
from rftstream.bus.transport import H_KV_OPERATION, KvEntry
from rftstream.errors import CasConflict, KeyNotFound

C = TypeVar("C")
ValueCallback = Callable[[str, bytes | None], None]


class WriteListeners:
    """A callback for writes of some keys (:meth:`MemoryKV.on_write`)."""

    def __init__(self, kv: MemoryKV, keys: tuple[str, ...], cb: Callable[[], Awaitable[None]]):
        self._kv = kv
        self.keys = keys
        self.cb = cb

    async def unsubscribe(self) -> None:
        if self in self._kv.listeners:
            self._kv.listeners.remove(self)


class Listener(Generic[C]):
    """A callback for what happens to some names (keys written, a stream's consumers
    coming and going), kept in ``registry`` until :meth:`unsubscribe`: what
    :meth:`MemoryKV.on_value` and ``MemoryTransport.on_consumers_changed`` return."""

    def __init__(self, registry: list[Listener[C]], names: tuple[str, ...], callback: C) -> None:
        self._registry = registry
        self.names = names
        self.callback = callback
        registry.append(self)

    def missed(self) -> bool:
        """Never: in memory every change reaches every listener."""
        return False

    async def unsubscribe(self) -> None:
        if self in self._registry:
            self._registry.remove(self)


class MemoryKV:
    """A KV bucket over the stream ``KV_<bucket>`` (:class:`~rftstream.bus.transport.KeyValueStore`)."""

    def __init__(self, stream: Stream, bucket: str) -> None:
        self._stream = stream  # KV_<bucket>, subjects $KV.<bucket>.>
        self.bucket = bucket
        self._pre = f"$KV.{bucket}."
        self.listeners: list[WriteListeners] = []
        self.value_listeners: list[Listener[ValueCallback]] = []

    def _last(self, key: str) -> tuple[int, Stored] | None:
        subject = self._pre + key
        for seq, m in reversed(self._stream.msgs.items()):
            if m.subject == subject:
                return seq, m
        return None

    @staticmethod
    def _deleted(stored: Stored) -> bool:
        return (stored.headers or {}).get(H_KV_OPERATION) in ("DEL", "PURGE")

    async def _write(self, key: str, value: bytes, headers: dict[str, str] | None = None) -> int:
        ack = self._stream.store(self._pre + key, value, headers)
        deleted = (headers or {}).get(H_KV_OPERATION) in ("DEL", "PURGE")
        for value_listener in list(self.value_listeners):
            if any(subject_matches(name, key) for name in value_listener.names):
                value_listener.callback(key, None if deleted else value)
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
        found = {m.subject[len(self._pre) :] for m in self._stream.msgs.values()}
        return sorted(k for k in found if k.startswith(prefix))

    async def on_write(
        self, keys: tuple[str, ...], callback: Callable[[], Awaitable[None]]
    ) -> WriteListeners:
        listener = WriteListeners(self, tuple(keys), callback)
        self.listeners.append(listener)
        return listener

    async def on_value(
        self, keys: tuple[str, ...], callback: Callable[[str, bytes | None], None]
    ) -> Listener[ValueCallback]:
        return Listener(self.value_listeners, tuple(keys), callback)
