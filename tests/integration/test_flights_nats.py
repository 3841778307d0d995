"""Tasks in flight across explorers (``control.flights``) over a real nats-server, each
explorer on its own connection: a reservation ``reserve`` has stored is in the other
explorer's board once any reply the server sent after it (here a count of the
experience queues) has come back; records written before a board started are read."""

from __future__ import annotations

import anyio
import pytest

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig
from rftstream.control.flights import OwnFlight, PeerWork
from rftstream.control.staleness import experience_backlog
from rftstream.subjects import RunNames

pytestmark = pytest.mark.integration


async def _explorer(bus: Bus, name: str) -> tuple[OwnFlight, float]:
    """An explorer's flights, announced; and when (what ``wait_for_peers`` takes)."""
    return await OwnFlight.open(await bus.kv(), name)


async def _two_explorers(url: str) -> None:
    names = RunNames("flights")
    async with (
        await Bus.connect(url, names, NatsConfig(), "explorer") as bus_a,
        await Bus.connect(url, names, NatsConfig(), "explorer-2") as bus_b,
    ):
        await bus_a.provision()
        a, _ = await _explorer(bus_a, "explorer")
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.run)
            await a.reserve(8)  # alone: kept in this process only
            a.keep(8)
            a.started(8)
            assert a.writes == 1
            b, since = await _explorer(bus_b, "explorer-2")  # reads a's announcement
            tg.start_soon(b.run)
            # a answers b's announcement with its totals (within 10 s: the explorer's own
            # 2 s wait can pass on a loaded machine, the answer still coming)
            with anyio.fail_after(15):
                assert await b.board.wait_for_peers(since, timeout=10) == []
            seen = await b.board.snapshot()
            assert seen["explorer"].claimed - seen["explorer"].done == 8
            for _ in range(20):  # no sleep between b's write and a's read
                before = await a.board.snapshot()
                await b.reserve(8)
                await experience_backlog(bus_a, names.exp_stream)  # replies sent after it
                counted = a.board.count(before, await a.board.snapshot(), a.started_total)
                # a started 8 tasks, b none: b's reservation goes first
                assert counted == PeerWork(tasks=8, reserved=8, yields=True), counted
                b.release()  # written in the background
                with anyio.fail_after(10):
                    while (await a.board.snapshot())["explorer-2"].reserved:
                        await anyio.sleep(0.005)
            b_sees = await b.board.snapshot()
            assert b.board.count(b_sees, b_sees, 0).tasks == 8  # a's tasks, still in flight
            a.finished(8)
            with anyio.fail_after(10):
                while (await b.board.snapshot())["explorer"].in_flight:
                    await anyio.sleep(0.01)
            await b.close()
            with anyio.fail_after(10):
                while await a.board.shared():
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        await a.board.stop()
        await b.board.stop()


def test_a_reservation_is_seen_by_the_other_explorers_next_count(nats_url: str) -> None:
    anyio.run(_two_explorers, nats_url, backend="asyncio")
