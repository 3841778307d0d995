"""RunState's conditional writes against a real nats-server: a lost race is None / False,
any other failure a BusError naming the key."""

from __future__ import annotations

import anyio
import nats
import pytest
from nats.js import api

from rftstream.bus.jetstream import JetStreamTransport
from rftstream.bus.state import RunState
from rftstream.errors import BusError
from rftstream.wire import EXPLORER_STEP, Heartbeat, Key

pytestmark = pytest.mark.integration


def _transport(nc: nats.NATS) -> JetStreamTransport:
    return JetStreamTransport(nc, retry_window=5.0, max_inflight_bytes=1 << 20)


async def _state(transport: JetStreamTransport, bucket: str, **cfg: object) -> RunState:
    """A bucket made with ``cfg`` (a KV setting the run's buckets do not use), as RunState."""
    await transport.js.create_key_value(api.KeyValueConfig(bucket=bucket, **cfg))
    return RunState(await transport.kv(bucket, create=False))


async def _bucket(url: str, **cfg: object) -> tuple[nats.NATS, RunState]:
    nc = await nats.connect(url)
    return nc, await _state(_transport(nc), "cas", **cfg)


K: Key[dict[str, int]] = Key("k", dict[str, int])
C: Key[dict[str, str]] = Key("c", dict[str, str])
BIG: Key[dict[str, str]] = Key("big", dict[str, str])


def test_compare_and_put_lost_race_is_none(nats_url: str) -> None:
    async def main() -> None:
        nc, state = await _bucket(nats_url)
        try:
            first = await state.cas(K, {"v": 1}, None)
            assert first is not None
            assert await state.cas(K, {"v": 2}, None) is None  # exists already
            second = await state.cas(K, {"v": 3}, first)
            assert second is not None and second > first
            assert await state.cas(K, {"v": 4}, first) is None  # stale revision
            assert await state.entry(K) == ({"v": 3}, second)
            assert await state.create(C, {"by": "a"})
            assert not await state.create(C, {"by": "b"})
            assert await state.get(C) == {"by": "a"}
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")


def test_compare_and_put_other_failures_raise_bus_error(nats_url: str) -> None:
    async def main() -> None:
        nc, state = await _bucket(nats_url, max_value_size=128)
        try:
            big = {"value": "x" * 512}  # the server rejects it: not a lost race
            with pytest.raises(BusError, match="cas/big"):
                await state.cas(BIG, big, None)
            rev = await state.cas(BIG, {"v": "1"}, None)
            with pytest.raises(BusError, match="cas/big"):
                await state.cas(BIG, big, rev)
            with pytest.raises(BusError, match="cas/claimed"):
                await state.create(Key("claimed", dict[str, str]), big)
            with pytest.raises(BusError, match="cas/put"):
                await state.put(Key("put", dict[str, str]), big)
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")


def test_keys_lists_every_stored_key_right_after_its_put(nats_url: str) -> None:
    """``keys`` sees a key as soon as its put returned (nats-py's watcher-based
    ``KeyValue.keys`` could report none here), leaves deleted keys out and
    filters by prefix, on a token boundary or not."""

    async def main() -> None:
        nc = await nats.connect(nats_url)
        try:
            transport = _transport(nc)
            # created first: the server's stream directory is never left empty by the
            # deletes below (nats-server removes it then, and a create at that moment fails)
            state = await _state(transport, "listing")
            # a fresh bucket, one put, one listing: the old watcher-based listing
            # missed the key here about once in 150 rounds
            for i in range(300):
                fresh = await _state(transport, f"one{i}")
                await fresh.heartbeat(Heartbeat(actor="trainer", role="trainer", ts=1.0, step=1))
                assert await fresh.keys() == ["heartbeat.trainer"], f"round {i}"
                await transport.delete_kv(f"one{i}")
            assert await state.keys() == []
            assert await state.heartbeats() == {}
            for i in range(40):  # put, then list at once: every round must see the new key
                await state.heartbeat(Heartbeat(actor=f"a{i}", role="explorer", ts=1.0, step=i))
                listed = await state.keys("heartbeat.")
                assert f"heartbeat.a{i}" in listed
                assert len(listed) == i + 1
            await state.put(EXPLORER_STEP.of(name="e1"), 3)
            await state.put(EXPLORER_STEP.of(name="e2"), 4)
            await state.delete(EXPLORER_STEP.of(name="e2"))
            assert await state.keys("explorer.") == ["explorer.e1.step"]
            assert await state.keys("explorer.e") == ["explorer.e1.step"]
            everything = await state.all()
            assert everything["explorer.e1.step"] == 3
            assert "explorer.e2.step" not in everything
            assert len([k for k in everything if k.startswith("heartbeat.")]) == 40
            assert (await state.heartbeats())["a7"].step == 7
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")
