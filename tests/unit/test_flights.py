"""Tasks in flight across explorers (``control.flights``) over the in-memory bucket: what
each explorer writes and when, and what another explorer's gate counts from it.

The real server's ordering (a reservation stored before the other gate's queue counts
come back) is checked in ``tests/integration/test_flights_nats.py``; the whole run, two
explorers under ``max_staleness: 0``, in ``tests/integration/test_two_explorers_staleness.py``.
"""

from __future__ import annotations

import logging

import anyio
import msgspec
import pytest

from rftstream.bus.memory import MemoryTransport
from rftstream.bus.transport import KeyValueStore
from rftstream.control.flights import FlightBoard, OwnFlight, PeerWork
from rftstream.wire import EXPLORER_FLIGHT, ExplorerFlight, encode_json

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def bucket() -> KeyValueStore:
    return await MemoryTransport().kv("S", create=True)


async def explorer(kv: KeyValueStore, name: str, **board_kw: object) -> OwnFlight:
    own, _ = await OwnFlight.open(kv, name, **board_kw)
    return own


async def test_a_lone_explorer_writes_its_record_at_its_start_and_end_only() -> None:
    kv = await bucket()
    own = await explorer(kv, "explorer")
    async with anyio.create_task_group() as tg:
        tg.start_soon(own.run)
        for _ in range(5):  # five steps: reserve, keep, fetch, finish
            await own.reserve(8)
            own.keep(6)
            own.started(5)
            own.finished(5)
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert (own.claimed, own.done, own.reserved, own.in_flight) == (40, 40, 0, 0)
    await own.close()
    assert own.writes == 2
    record = msgspec.json.decode(
        (await kv.get(EXPLORER_FLIGHT.of(name="explorer").name)).value, type=ExplorerFlight
    )
    assert record.closed and record.in_flight == 0


async def test_another_explorer_sees_a_reservation_once_reserve_returns() -> None:
    kv = await bucket()
    a = await explorer(kv, "explorer")
    b = await explorer(kv, "explorer-2")
    before = await a.board.snapshot()
    await b.reserve(8)  # stored before it returns: b is not alone
    after = await a.board.snapshot()
    counted = a.board.count(before, after, a.started_total)
    assert counted == PeerWork(tasks=8, reserved=8, yields=False)
    # b counts a's reservation the same way; neither started a task yet: the name that
    # sorts first ("explorer") goes first, and b yields to it
    await a.reserve(8)
    seen_by_b = await b.board.snapshot()
    counted = b.board.count(seen_by_b, seen_by_b, b.started_total)
    assert counted == PeerWork(tasks=8, reserved=8, yields=True)


async def test_of_two_contending_gates_the_one_that_started_fewer_goes_first() -> None:
    kv = await bucket()
    a = await explorer(kv, "explorer")
    b = await explorer(kv, "explorer-2")
    for _ in range(3):  # a took three batches; b looked three times and found no room
        await a.reserve(8)
        a.keep(8)
        a.started(8)
        a.finished(8)
        await b.reserve(8)
        b.release()
    await a.reserve(8)
    await b.reserve(8)
    seen_by_a, seen_by_b = await a.board.snapshot(), await b.board.snapshot()
    assert a.board.count(seen_by_a, seen_by_a, a.started_total).yields  # 24 started
    assert not b.board.count(seen_by_b, seen_by_b, b.started_total).yields  # none


async def test_tasks_started_without_a_look_are_claimed_and_a_short_fetch_gives_back() -> None:
    own = OwnFlight(await bucket(), "explorer", FlightBoard(await bucket(), "explorer"))
    own.started(3)  # no gate looked (the engine cannot load weights): claimed now
    assert (own.claimed, own.in_flight) == (3, 3)
    await own.reserve(8)
    own.keep(4)  # room for 4 of the 8
    assert (own.claimed, own.done, own.reserved, own.taken) == (11, 4, 0, 4)
    own.started(2)  # the queue had 2
    assert (own.claimed, own.done, own.in_flight) == (11, 6, 5)
    own.finished(5)
    assert own.in_flight == 0


async def test_the_count_takes_done_from_before_and_claimed_from_after() -> None:
    board = FlightBoard(await bucket(), "me")
    before = {"x": ExplorerFlight(claimed=8, done=2, since=1.0)}
    # meanwhile x published 4 groups (maybe missed by the queue count) and reserved 4
    after = {"x": ExplorerFlight(claimed=12, done=6, reserved=4, since=1.0)}
    assert board.count(before, after) == PeerWork(tasks=10, reserved=4, yields=False)
    # a new run of x (its totals start again): counted by the new record alone
    restarted = {"x": ExplorerFlight(claimed=3, done=1, since=2.0)}
    assert board.count(before, restarted) == PeerWork(tasks=2)
    # a record that appeared between the two snapshots counts by itself
    assert board.count({}, after) == PeerWork(tasks=6, reserved=4, yields=False)


async def test_a_record_not_written_within_the_ttl_counts_nothing() -> None:
    kv = await bucket()
    clock = Clock()
    a = await explorer(kv, "explorer", clock=clock, ttl_s=30.0)
    b = await explorer(kv, "explorer-2")
    await b.reserve(8)
    assert await a.board.shared()
    assert a.board.count({}, await a.board.snapshot()).tasks == 8
    clock.t += 31  # b died: its tasks come back to the queue after ack_wait
    assert await a.board.snapshot() == {}
    assert not await a.board.shared()
    assert a.board.peers() == ["explorer-2"]  # known, not live


async def test_an_old_record_found_at_the_start_is_not_live() -> None:
    kv = await bucket()
    stale = ExplorerFlight(claimed=8, done=0, since=1.0, ts=1.0)  # written long ago
    await kv.put(EXPLORER_FLIGHT.of(name="gone").name, encode_json(stale))
    fresh = ExplorerFlight(claimed=4, done=0, since=2.0, ts=9999.0)
    await kv.put(EXPLORER_FLIGHT.of(name="here").name, encode_json(fresh))
    board = FlightBoard(kv, "me", wall=lambda: 10000.0)
    await board.start()
    assert set(await board.snapshot()) == {"here"}
    assert board.peers() == ["gone", "here"]


async def test_a_closed_explorer_counts_nothing_and_gives_room() -> None:
    kv = await bucket()
    rooms: list[str] = []
    joins: list[str] = []
    a = await explorer(kv, "explorer", on_room=rooms.append)
    a.board.on_join = joins.append
    b = await explorer(kv, "explorer-2")
    assert joins == ["explorer-2"]
    await b.reserve(8)
    await b.close()
    assert rooms == ["explorer-2"]
    assert await a.board.snapshot() == {}
    assert a.board.peers() == []
    b2 = await explorer(kv, "explorer-2")  # back again: a joins it anew
    assert joins == ["explorer-2", "explorer-2"]
    assert b2.in_flight == 0


async def test_a_reservation_given_back_wakes_the_others_and_a_finished_task_does_not() -> None:
    kv = await bucket()
    rooms: list[str] = []
    a = await explorer(kv, "explorer", on_room=rooms.append)
    b = await explorer(kv, "explorer-2")
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        await b.reserve(8)
        b.keep(8)
        b.started(8)  # all of it taken: no room given back
        await anyio.sleep(0.05)
        b.finished(3)  # published: from in flight to the queue, no room either
        await anyio.sleep(0.05)
        assert rooms == []
        await b.reserve(8)
        b.release()  # the gate found no room and waits
        await anyio.sleep(0.05)
        assert rooms == ["explorer-2"]
        record = (await a.board.snapshot())["explorer-2"]
        assert (record.claimed, record.done, record.reserved) == (16, 11, 0)
        tg.cancel_scope.cancel()


async def test_a_new_explorer_waits_for_the_others_to_answer() -> None:
    kv = await bucket()
    a = await explorer(kv, "explorer")
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run)
        await a.reserve(8)  # alone: not written
        a.keep(8)
        a.started(8)
        assert a.writes == 1
        b = await explorer(kv, "explorer-2")
        since = b.board.now()
        with anyio.fail_after(5):
            assert await b.board.wait_for_peers(since - 1e-9) == []  # a answered
        record = (await b.board.snapshot())["explorer"]
        assert record.claimed - record.done == 8  # what a had in flight before b came
        tg.cancel_scope.cancel()


async def test_a_peer_that_does_not_answer_is_named_after_the_wait() -> None:
    kv = await bucket()
    silent = ExplorerFlight(claimed=0, done=0, since=1.0, ts=1.0)
    await kv.put(EXPLORER_FLIGHT.of(name="old").name, encode_json(silent))
    b = await explorer(kv, "new")
    assert await b.board.wait_for_peers(b.board.now(), timeout=0.1) == ["old"]


async def test_a_record_that_is_not_one_is_left_out_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = await bucket()
    board = FlightBoard(kv, "me")
    await board.start()
    with caplog.at_level(logging.WARNING, logger="rftstream.control.flights"):
        await kv.put(EXPLORER_FLIGHT.of(name="odd").name, b"not json")
        await kv.put(EXPLORER_FLIGHT.of(name="odd").name, b'{"claimed": "many"}')
    assert await board.snapshot() == {}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "explorers.in_flight.odd" in warnings[0], warnings


async def test_a_pattern_of_keys_is_handed_on_with_the_key_written() -> None:
    kv = await bucket()
    seen: list[tuple[str, bytes | None]] = []
    await kv.on_value(("explorers.in_flight.>",), lambda k, v: seen.append((k, v)))
    await kv.put("explorers.in_flight.a", b"1")
    await kv.put("explorers.in_flight.b.c", b"2")
    await kv.put("explorer.a.step", b"3")  # another key
    await kv.delete("explorers.in_flight.a")
    assert seen == [
        ("explorers.in_flight.a", b"1"),
        ("explorers.in_flight.b.c", b"2"),
        ("explorers.in_flight.a", None),
    ]


async def test_a_group_waits_for_another_explorers_older_tasks_and_not_for_newer_ones() -> None:
    kv = await bucket()
    started: dict[str, list[int]] = {"explorer": [], "explorer-2": []}  # versions of tasks started
    a, _ = await OwnFlight.open(kv, "explorer", lambda: min(started["explorer"], default=-1))
    b, _ = await OwnFlight.open(kv, "explorer-2", lambda: min(started["explorer-2"], default=-1))
    await a.reserve(8)  # stored at once (shared), with no version: nothing started yet
    assert (await b.board.snapshot())["explorer"].oldest == -1
    assert not await b.board.older_in_flight(9)  # a reservation holds no publish back
    a.keep(8)
    started["explorer"] = [5] * 8  # a's step samples with version 5
    a.started(8)
    started["explorer-2"] = [7] * 8
    await b.reserve(8)
    b.keep(8)
    b.started(8)

    waited: list[str] = []

    async def publish_b_group() -> None:
        await b.board.wait_for_older(7, recheck_s=60)  # woken by a's write, not by the clock
        waited.append("published")

    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run)
        tg.start_soon(b.run)
        with anyio.fail_after(5):
            while (await b.board.snapshot())["explorer"].oldest != 5:
                await anyio.sleep(0.01)
        tg.start_soon(publish_b_group)
        assert await b.board.older_in_flight(6)
        assert not await b.board.older_in_flight(5)  # the same version is not ordered
        with anyio.fail_after(5):
            while (await a.board.snapshot())["explorer-2"].oldest != 7:
                await anyio.sleep(0.01)
        assert not await a.board.older_in_flight(5)  # b's tasks are newer: a never waits
        await anyio.sleep(0.05)
        assert waited == []  # a's version-5 tasks are in flight
        started["explorer"] = [5]
        a.finished(7)
        await anyio.sleep(0.05)
        assert waited == []  # one of them still is
        started["explorer"] = []
        a.finished(1)  # nothing in flight at a: its record says oldest -1
        with anyio.fail_after(5):
            while not waited:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert (await b.board.snapshot())["explorer"].oldest == -1


async def test_an_older_record_that_ages_past_the_ttl_holds_nothing_back() -> None:
    kv = await bucket()
    clock = Clock()
    a, _ = await OwnFlight.open(kv, "explorer", lambda: 3)
    b = await explorer(kv, "explorer-2", clock=clock, ttl_s=30.0)
    await a.reserve(8)  # in flight (reserved), with a task of version 3 started
    assert await b.board.older_in_flight(4)
    clock.t += 31  # a died with tasks in flight: they come back after ack_wait
    with anyio.fail_after(5):
        await b.board.wait_for_older(4, recheck_s=0.01)
