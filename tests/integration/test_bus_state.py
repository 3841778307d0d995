"""RunState's conditional writes against a real nats-server: a lost race is None / False,
any other failure a BusError naming the key."""

from __future__ import annotations

import anyio
import nats
import pytest
from nats.js import api

from rftstream.bus.state import RunState
from rftstream.errors import BusError

pytestmark = pytest.mark.integration


async def _bucket(url: str, **cfg: object) -> tuple[nats.NATS, RunState]:
    nc = await nats.connect(url)
    kv = await nc.jetstream().create_key_value(api.KeyValueConfig(bucket="cas", **cfg))
    return nc, RunState(kv)


def test_compare_and_put_lost_race_is_none(nats_url: str) -> None:
    async def main() -> None:
        nc, state = await _bucket(nats_url)
        try:
            first = await state.compare_and_put("k", {"v": 1}, None)
            assert first is not None
            assert await state.compare_and_put("k", {"v": 2}, None) is None  # exists already
            second = await state.compare_and_put("k", {"v": 3}, first)
            assert second is not None and second > first
            assert await state.compare_and_put("k", {"v": 4}, first) is None  # stale revision
            assert await state.get_json("k") == {"v": 3}
            assert await state.claim("c", {"by": "a"})
            assert not await state.claim("c", {"by": "b"})
            assert await state.get_json("c") == {"by": "a"}
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")


def test_compare_and_put_other_failures_raise_bus_error(nats_url: str) -> None:
    async def main() -> None:
        nc, state = await _bucket(nats_url, max_value_size=128)
        try:
            big = {"value": "x" * 512}  # the server rejects it: not a lost race
            with pytest.raises(BusError, match="cas/big"):
                await state.compare_and_put("big", big, None)
            rev = await state.compare_and_put("big", {"v": 1}, None)
            with pytest.raises(BusError, match="cas/big"):
                await state.compare_and_put("big", big, rev)
            with pytest.raises(BusError, match="cas/claimed"):
                await state.claim("claimed", big)
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")
