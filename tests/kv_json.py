"""Raw JSON in a run's KV bucket, for tests that play another writer.

:class:`~rftstream.bus.state.RunState` reads and writes typed records only. A test
that writes what no rftstream actor would (a record of another shape, a record of an
older release, half a record) or reads a record as the plain JSON ``nats kv get``
shows goes through these, straight to the bucket.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rftstream.bus.state import RunState
from rftstream.errors import CasConflict, KeyNotFound


async def write_json(state: RunState, key: str, value: Any) -> int:
    """Put ``value`` as JSON at ``key``; its new revision."""
    return await state.kv.put(key, msgspec.json.encode(value))


async def read_json(state: RunState, key: str) -> Any:
    """The JSON at ``key``, decoded without a type (None: absent or deleted)."""
    value, _ = await json_entry(state, key)
    return value


async def json_entry(state: RunState, key: str) -> tuple[Any, int | None]:
    """``(decoded JSON, revision)`` at ``key``; ``(None, None)`` when absent or deleted."""
    try:
        got = await state.kv.get(key)
    except KeyNotFound:
        return None, None
    if got.value is None:
        return None, None
    return msgspec.json.decode(got.value), got.revision


async def update_json(state: RunState, key: str, value: Any, revision: int) -> int | None:
    """Compare-and-set ``value`` at ``key``; None when it is no longer at ``revision``."""
    try:
        return await state.kv.update(key, msgspec.json.encode(value), last=revision)
    except CasConflict:
        return None
