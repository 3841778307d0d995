"""The bus's in-flight byte cap: immediate while there is room, FIFO when there is not,
one oversize message alone, synchronous release, cancellation takes nothing."""

from __future__ import annotations

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from rftstream.bus.jetstream.publish import InflightLimiter

pytestmark = pytest.mark.anyio


async def _acquire(lim: InflightLimiter, n: int, got: list[int]) -> None:
    await lim.acquire(n)
    got.append(n)


async def test_acquire_with_room_does_not_block() -> None:
    lim = InflightLimiter(10)
    with anyio.fail_after(5):
        await lim.acquire(4)
        await lim.acquire(6)
    assert lim.inflight == 10 and lim.waiting == 0
    assert lim.release(6) is None  # synchronous
    assert lim.inflight == 4


async def test_acquire_blocks_until_release_makes_room() -> None:
    lim = InflightLimiter(10)
    await lim.acquire(8)
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_acquire, lim, 5, got)
        await wait_all_tasks_blocked()
        assert got == [] and lim.waiting == 1 and lim.inflight == 8
        lim.release(8)
    assert got == [5] and lim.inflight == 5 and lim.waiting == 0


async def test_waiters_are_served_in_order() -> None:
    lim = InflightLimiter(10)
    await lim.acquire(5)
    await lim.acquire(5)
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_acquire, lim, 8, got)
        await wait_all_tasks_blocked()
        tg.start_soon(_acquire, lim, 1, got)
        await wait_all_tasks_blocked()
        lim.release(5)  # room for the 1, not for the 8 ahead of it: both wait
        await wait_all_tasks_blocked()
        assert got == [] and lim.waiting == 2
        lim.release(5)
    assert sorted(got) == [1, 8] and lim.inflight == 9  # granted together


async def test_a_message_larger_than_the_limit_goes_alone() -> None:
    lim = InflightLimiter(10)
    with anyio.fail_after(5):
        await lim.acquire(50)
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_acquire, lim, 1, got)
        await wait_all_tasks_blocked()
        assert got == []
        lim.release(50)
    assert got == [1] and lim.inflight == 1


async def test_cancelled_waiter_takes_nothing_and_lets_the_next_one_through() -> None:
    lim = InflightLimiter(10)
    await lim.acquire(5)
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        head = anyio.CancelScope()
        tg.start_soon(_cancellable, lim, 8, got, head)
        await wait_all_tasks_blocked()
        tg.start_soon(_acquire, lim, 5, got)
        await wait_all_tasks_blocked()
        assert got == [] and lim.waiting == 2  # the 5 would fit, but waits behind the 8
        head.cancel()
    assert got == [5] and lim.inflight == 10 and lim.waiting == 0


async def _cancellable(
    lim: InflightLimiter, n: int, got: list[int], scope: anyio.CancelScope
) -> None:
    with scope:
        await lim.acquire(n)
        got.append(n)


async def test_cancel_after_the_grant_gives_the_bytes_back() -> None:
    lim = InflightLimiter(10)
    await lim.acquire(10)
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        tg.start_soon(_cancellable, lim, 4, got, scope)
        await wait_all_tasks_blocked()
        lim.release(10)  # grants the 4 ...
        scope.cancel()  # ... which is cancelled before it runs
    # no leak either way: the grant was given back, or the acquire returned before the cancel
    assert (got, lim.inflight) in (([], 0), ([4], 4))
