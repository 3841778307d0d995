"""Typed access to the run's KV bucket ``rft_<run>_state``.

Keys (see :mod:`rftstream.subjects`): ``status``, ``taskset.published``,
``explorer.<name>.step``, ``trainer.step``, ``weights.latest``,
``heartbeat.<actor>``. Values are JSON, readable with ``nats kv get``.
Every method is one KV round trip (blocks for it), except the reads of the keys a
:class:`MirroredState` keeps. The bucket is a
:class:`~rftstream.bus.transport.KeyValueStore` of any transport.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec

from rftstream.bus.transport import KeyValueStore, KvEntry, Notifications, unsubscribe_quietly
from rftstream.errors import BusError, CasConflict, KeyNotFound, SchemaError
from rftstream.subjects import KV_HEARTBEAT_PREFIX
from rftstream.wire import (
    HEARTBEAT,
    STATUS,
    TASKSET_PUBLISHED,
    TRAINER_STEP,
    WEIGHTS_LATEST,
    Heartbeat,
    Key,
    TasksetRecord,
    WeightsPointer,
    encode_json,
)

T = TypeVar("T")
log = logging.getLogger(__name__)


#: run statuses after which nothing more happens in the run
END_STATUSES = ("finished", "failed", "stopped")


def _encode(value: Any) -> bytes:
    """A KV value as JSON: structs through the project's encoder, the rest as plain JSON."""
    return encode_json(value) if isinstance(value, msgspec.Struct) else msgspec.json.encode(value)


class RunState:
    """Run status, steps, weights pointer and heartbeats in the KV bucket.

    Every value goes through a typed :class:`~rftstream.wire.Key`: ``get`` /
    ``entry`` decode it as the key's record (a :class:`SchemaError` names the key
    when it has another shape) and ``put`` / ``create`` / ``cas`` write it as JSON.
    :meth:`all` is the one untyped read: every key's JSON for ``rftstream status``.
    """

    def __init__(self, kv: KeyValueStore) -> None:
        self.kv = kv

    def _where(self, key: str) -> str:
        """``<bucket>/<key>`` for error messages."""
        return f"{self.kv.bucket}/{key}"

    async def _stored(self, key: str) -> KvEntry | None:
        """The entry at ``key``; None when it is absent or deleted."""
        try:
            got = await self.kv.get(key)
        except KeyNotFound:
            return None
        return None if got.value is None else got

    async def _raw(self, key: str) -> bytes | None:
        got = await self._stored(key)
        return None if got is None else got.value

    def _decode(self, key: Key[T], raw: bytes) -> T:
        try:
            return msgspec.json.decode(raw, type=key.type)  # type: ignore[no-any-return]
        except msgspec.DecodeError as exc:
            raise SchemaError(f"KV {self._where(key.name)}: not a {key.type}: {exc}") from exc

    async def get(self, key: Key[T]) -> T | None:
        """The record at ``key`` (None: absent); :class:`SchemaError` when it has another shape."""
        raw = await self._raw(key.name)
        return None if raw is None else self._decode(key, raw)

    async def revision(self, key: Key[Any]) -> int | None:
        """The revision of ``key``'s value, whatever its shape (None: absent or deleted)."""
        got = await self._stored(key.name)
        return None if got is None else got.revision

    async def present(self, key: Key[Any]) -> bool:
        """Whether ``key`` holds a value (of any shape)."""
        return await self._raw(key.name) is not None

    async def entry(self, key: Key[T]) -> tuple[T | None, int | None]:
        """``(record, revision)`` at ``key``; ``(None, None)`` when absent or deleted."""
        got = await self._stored(key.name)
        if got is None or got.value is None:
            return None, None
        return self._decode(key, got.value), got.revision

    async def put(self, key: Key[T], value: T) -> None:
        """Write the record at ``key`` (last value wins, so a retry is harmless). A bucket
        opened through a :class:`~rftstream.bus.client.Bus` on NATS retries timeouts and
        unavailable servers for ``nats.retry_window`` s; what still fails raises
        :class:`BusError` naming the key."""
        try:
            await self.kv.put(key.name, _encode(value))
        except BusError as exc:
            raise BusError(f"cannot write {self._where(key.name)}: {exc}") from exc

    async def create(self, key: Key[T], value: T) -> bool:
        """Write the record only if ``key`` is absent; False when someone else was first."""
        return await self.cas(key, value, None) is not None

    async def cas(self, key: Key[T], value: T, revision: int | None) -> int | None:
        """Write the record only if ``key`` is still at ``revision`` (None: only if absent).

        Returns the new revision, or None when someone else wrote the key first
        (the server's "wrong last sequence"). Any other failure (a timeout, a
        rejected write, a lost connection) raises :class:`BusError` naming the key.
        """
        data = _encode(value)
        try:
            if revision is None:
                return await self.kv.create(key.name, data)
            return await self.kv.update(key.name, data, last=revision)
        except CasConflict:
            return None

    async def delete(self, key: Key[Any]) -> None:
        """Delete ``key`` (no error if absent)."""
        await self.kv.delete(key.name)

    # -- the records every actor reads ------------------------------------------------
    async def status(self) -> str:
        """The run's status (``running``, ``finished``, ...); "" before it is set."""
        return await self.get(STATUS) or ""

    async def set_status(self, status: str) -> None:
        await self.put(STATUS, status)

    async def taskset(self) -> TasksetRecord | None:
        return await self.get(TASKSET_PUBLISHED)

    async def latest_weights(self) -> WeightsPointer | None:
        return await self.get(WEIGHTS_LATEST)

    async def set_latest_weights(self, ptr: WeightsPointer) -> None:
        await self.put(WEIGHTS_LATEST, ptr)

    async def trainer_step(self) -> int:
        """The trainer's last finished step (0 before the first)."""
        return await self.get(TRAINER_STEP) or 0

    async def heartbeat(self, beat: Heartbeat) -> None:
        """Write ``heartbeat.<beat.actor>``."""
        await self.put(HEARTBEAT.of(actor=beat.actor), beat)

    async def heartbeats(self) -> dict[str, Heartbeat]:
        """Every actor's heartbeat, by actor. A record of another shape (written by
        something else than rftstream) is logged and left out."""
        out: dict[str, Heartbeat] = {}
        for key in await self.kv.keys(KV_HEARTBEAT_PREFIX):
            actor = key[len(KV_HEARTBEAT_PREFIX) :]
            try:
                beat = await self.get(HEARTBEAT.of(actor=actor))
            except SchemaError as exc:
                log.warning("%s", exc)
                continue
            if beat is not None:
                out[actor] = beat
        return out

    async def keys(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` that have a stored value, sorted."""
        return list(await self.all(prefix))

    async def all(self, prefix: str = "") -> dict[str, Any]:
        """Every key starting with ``prefix`` and its decoded JSON, sorted by key;
        deleted keys left out (``rftstream status`` shows them all). One ``get`` per key."""
        out: dict[str, Any] = {}
        for key in await self.kv.keys(prefix):
            raw = await self._raw(key)
            if raw is not None:
                out[key] = msgspec.json.decode(raw)
        return out


class MirroredState(RunState):
    """A :class:`RunState` whose reads of some keys cost no round trip: this process
    keeps their newest values, written into it by the bucket's write notifications
    (:meth:`~rftstream.bus.transport.KeyValueStore.on_value`). Every other key, and
    :meth:`entry` / :meth:`revision` of any key, is read from the bucket as usual.

    How new a kept value is: every write that reached the server before a reply this
    process has since received (a consumer's counts, a publish's ack) is in it, since
    the write comes down the same connection ahead of the reply. That is what a read
    ordered after another read needs (the explorer's staleness gate reads the
    trainer's ``weights.pending`` after the experience queues: see
    :meth:`rftstream.actors.explorer.Explorer._look`). A value read before any reply
    may be older than the bucket's, never newer than what was written. Only for keys
    written unconditionally (a refused conditional write would be kept too).

    :meth:`start` subscribes, then reads each key once; a value written meanwhile
    wins over the read. When the connection was lost and came back (writes made
    meanwhile were never handed on), the next read of a kept key reads them all
    again first. :meth:`stop` unsubscribes (never raises). Use ``async with``.
    """

    def __init__(self, kv: KeyValueStore, keys: Iterable[Key[Any]]) -> None:
        super().__init__(kv)
        self.kept = tuple(dict.fromkeys(k.name for k in keys))
        self._values: dict[str, bytes | None] = {}
        self._written_since_read: set[str] = set()
        self._writes: Notifications | None = None

    def _written(self, key: str, value: bytes | None) -> None:
        self._values[key] = value
        self._written_since_read.add(key)

    async def start(self) -> None:
        """Subscribe to the kept keys, then read each once (a round trip each). Blocks."""
        self._writes = await self.kv.on_value(self.kept, self._written)
        await self._read_kept()

    async def _read_kept(self) -> None:
        self._written_since_read.clear()
        for key in self.kept:
            raw = await super()._raw(key)
            if key not in self._written_since_read:  # a notified write is newer than the read
                self._values[key] = raw

    async def stop(self) -> None:
        """Unsubscribe; reads then go to the bucket again. Never raises."""
        writes, self._writes = self._writes, None
        await unsubscribe_quietly(writes)

    async def __aenter__(self) -> MirroredState:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _raw(self, key: str) -> bytes | None:
        if self._writes is None or key not in self.kept:
            return await super()._raw(key)
        if self._writes.missed():
            await self._read_kept()
        return self._values.get(key)
