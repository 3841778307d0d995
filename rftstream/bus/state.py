"""Typed access to the run's KV bucket ``rft_<run>_state``.

Keys (see :mod:`rftstream.subjects`): ``status``, ``taskset.published``,
``explorer.<name>.step``, ``trainer.step``, ``weights.latest``,
``heartbeat.<actor>``. Values are JSON, readable with ``nats kv get``.
Every method is one KV round trip (blocks for it).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from rftstream.errors import BusError, SchemaError
from rftstream.messages import WeightsPointer, decode_json, encode_json
from rftstream.subjects import KV_HEARTBEAT, KV_STATUS, KV_TASKSET, KV_TRAINER_STEP, KV_WEIGHTS
from rftstream.wire import Heartbeat, Key, TasksetRecord

T = TypeVar("T")


#: run statuses after which nothing more happens in the run
END_STATUSES = ("finished", "failed", "stopped")

# JSStreamWrongLastSequenceErrF / JSStreamWrongLastSequenceConstantErr: the key moved on
_WRONG_LAST_SEQUENCE = (10071, 10164)


def _lost_race(exc: Exception) -> bool:
    """Whether a failed conditional KV write failed only because another writer was first."""
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in _WRONG_LAST_SEQUENCE


def _encode(value: Any) -> bytes:
    """A KV value as JSON: structs through the project's encoder, the rest as plain JSON."""
    return encode_json(value) if isinstance(value, msgspec.Struct) else msgspec.json.encode(value)


class RunState:
    """Run status, steps, weights pointer and heartbeats in the KV bucket."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    def _where(self, key: str) -> str:
        """``<bucket>/<key>`` for error messages."""
        return f"{getattr(self.kv, '_name', None) or 'bucket'}/{key}"

    async def get_raw(self, key: str) -> bytes | None:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except nats.js.errors.KeyDeletedError:
            return None
        return entry.value

    async def put_json(self, key: str, value: Any) -> None:
        """Write ``key`` (last value wins, so a retry is harmless). A bucket opened through a
        :class:`~rftstream.bus.client.Bus` retries timeouts and unavailable servers for
        ``nats.retry_window`` s (:class:`~rftstream.bus.resilient.ResilientJetStream`);
        what still fails raises :class:`BusError` naming the key."""
        try:
            await self.kv.put(key, _encode(value))
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"cannot write {self._where(key)}: {exc!r}") from exc

    async def get_json(self, key: str, typ: type[T] | None = None) -> T | Any | None:
        raw = await self.get_raw(key)
        if raw is None:
            return None
        if typ is None:
            return msgspec.json.decode(raw)
        return decode_json(raw, typ, f"KV key {key!r}")

    async def get_entry(self, key: str) -> tuple[Any | None, int | None]:
        """``(decoded value, revision)``; ``(None, None)`` when the key is absent or deleted."""
        try:
            entry = await self.kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, None
        if entry.value is None:
            return None, None
        return msgspec.json.decode(entry.value), entry.revision

    async def compare_and_put(self, key: str, value: Any, revision: int | None) -> int | None:
        """Put ``value`` only if ``key`` is still at ``revision`` (None: only if absent).

        Returns the new revision, or None when someone else wrote the key first
        (the server's "wrong last sequence"). Any other failure (a timeout, a
        rejected write, a lost connection) raises :class:`BusError` naming the key.
        """
        data = _encode(value)
        try:
            if revision is None:
                return await self.kv.create(key, data)
            return await self.kv.update(key, data, last=revision)
        except (nats.errors.Error, TimeoutError) as exc:
            if _lost_race(exc):
                return None
            raise BusError(f"KV {self._where(key)}: conditional write failed: {exc}") from exc

    async def delete(self, key: str) -> None:
        """Delete ``key`` (no error if absent)."""
        try:
            await self.kv.delete(key)
        except nats.js.errors.KeyNotFoundError:
            pass

    async def heartbeats(self) -> dict[str, dict[str, Any]]:
        """Every ``heartbeat.<actor>`` record, by actor."""
        prefix = "heartbeat."
        records = await self.all(prefix)
        return {k[len(prefix) :]: v for k, v in records.items() if isinstance(v, dict)}

    async def keys(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` that have a stored value, sorted."""
        return list(await self.all(prefix))

    async def _listed_keys(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` that the bucket's stream holds an entry for,
        sorted; the last entry may be a delete or purge marker.

        One stream-info request for the stream's subjects, rather than
        ``KeyValue.keys()``: that one runs a watcher whose "no more keys"
        marker can race ahead of a just-stored key and then reports none.
        """
        pre = self.kv._pre
        # a subject filter must end on a token boundary: "heartbeat.>" but not "explorer>"
        token_prefix = prefix if prefix.endswith(".") else ""
        try:
            info = await self.kv._js.stream_info(
                self.kv._stream, subjects_filter=f"{pre}{token_prefix}>"
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"KV {self._where(prefix + '*')}: listing keys failed: {exc}") from exc
        keys = (s[len(pre) :] for s in (info.state.subjects or {}))
        return sorted(k for k in keys if k.startswith(prefix))

    async def claim(self, key: str, value: Any) -> bool:
        """Atomically create ``key``; False if it already exists (someone else claimed it).

        Any other failure raises :class:`BusError` naming the key (see :meth:`compare_and_put`).
        """
        return await self.compare_and_put(key, value, None) is not None

    # -- typed helpers -------------------------------------------------------
    async def status(self) -> str:
        return str(await self.get_json(KV_STATUS) or "")

    async def set_status(self, status: str) -> None:
        await self.put_json(KV_STATUS, status)

    async def taskset(self) -> TasksetRecord | None:
        return await self.get_json(KV_TASKSET, TasksetRecord)

    async def latest_weights(self) -> WeightsPointer | None:
        return await self.get_json(KV_WEIGHTS, WeightsPointer)

    async def set_latest_weights(self, ptr: WeightsPointer) -> None:
        await self.put_json(KV_WEIGHTS, ptr)

    async def trainer_step(self) -> int:
        return int(await self.get_json(KV_TRAINER_STEP) or 0)

    async def heartbeat(self, actor: str, role: str, **info: Any) -> None:
        await self.put_json(
            KV_HEARTBEAT.format(actor=actor), Heartbeat.now(actor, role, **info).to_value()
        )

    async def all(self, prefix: str = "") -> dict[str, Any]:
        """Every key starting with ``prefix`` and its decoded value, sorted by key;
        deleted keys left out (for ``rftstream status``). One ``get`` per key."""
        out: dict[str, Any] = {}
        for key in await self._listed_keys(prefix):
            raw = await self.get_raw(key)
            if raw is not None:
                out[key] = msgspec.json.decode(raw)
        return out

    # -- typed records: rftstream.wire key handles ----------------------------------
    def _decode(self, key: Key[T], raw: bytes) -> T:
        try:
            return msgspec.json.decode(raw, type=key.type)  # type: ignore[no-any-return]
        except msgspec.DecodeError as exc:
            raise SchemaError(f"KV {self._where(key.name)}: not a {key.type}: {exc}") from exc

    async def get(self, key: Key[T]) -> T | None:
        """The record at ``key`` (None: absent); :class:`SchemaError` when it has another shape."""
        raw = await self.get_raw(key.name)
        return None if raw is None else self._decode(key, raw)

    async def entry(self, key: Key[T]) -> tuple[T | None, int | None]:
        """``(record, revision)`` at ``key``; ``(None, None)`` when absent or deleted."""
        try:
            got = await self.kv.get(key.name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, None
        if got.value is None:
            return None, None
        return self._decode(key, got.value), got.revision

    async def put(self, key: Key[T], value: T) -> None:
        """Write the record at ``key`` (see :meth:`put_json`)."""
        await self.put_json(key.name, value)

    async def cas(self, key: Key[T], value: T, revision: int | None) -> int | None:
        """Write the record only if ``key`` is at ``revision`` (see :meth:`compare_and_put`)."""
        return await self.compare_and_put(key.name, value, revision)
