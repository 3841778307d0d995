"""The control plane's one loop (rftstream.control.drive) on the in-memory KV: it wakes on a
write of the keys it reads, never misses one that lands between a read and the wait, and
decides by the clock it is given."""

from __future__ import annotations

import anyio
import pytest

from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.control import KeyWrites, drive
from rftstream.errors import RftError
from rftstream.wire import STATUS, TRAINER_STEP

pytestmark = pytest.mark.anyio


async def _state() -> RunState:
    return RunState(await MemoryTransport().connection().kv("KV_control", create=True))


async def test_a_write_of_a_watched_key_wakes_the_loop_long_before_its_wake_time() -> None:
    state = await _state()
    looks: list[int | None] = []

    async def attempt(now: float) -> int | None:
        step = await state.get(TRAINER_STEP)
        looks.append(step)
        return step if step is not None and step >= 2 else None

    async def writer() -> None:
        await anyio.sleep(0.05)
        await state.put(STATUS, "running")  # not watched: no look
        await anyio.sleep(0.05)
        await state.put(TRAINER_STEP, 1)
        await anyio.sleep(0.05)
        await state.put(TRAINER_STEP, 2)

    with anyio.fail_after(5):  # wake_s is an hour: only the writes can wake it
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            got = await drive(state.kv, (TRAINER_STEP,), attempt, wake_s=3600.0)
    assert got == 2
    assert looks == [None, 1, 2]  # one look first, then one per write of the watched key


async def test_a_write_between_a_look_and_the_wait_is_not_missed() -> None:
    state = await _state()
    looks = 0

    async def attempt(now: float) -> str | None:
        nonlocal looks
        looks += 1
        if looks == 1:  # another party writes right after this look read the key
            await state.put(STATUS, "finished")
            return None
        return await state.get(STATUS)

    with anyio.fail_after(5):
        assert await drive(state.kv, (STATUS,), attempt, wake_s=3600.0) == "finished"
    assert looks == 2


async def test_the_machine_decides_by_the_injected_clock() -> None:
    """A patience of 100 s runs out in three looks of a clock that jumps 60 s each."""
    state = await _state()
    times = iter([1000.0, 1060.0, 1120.0])
    seen: list[float] = []

    async def attempt(now: float) -> bool | None:
        seen.append(now)
        if now - 1000.0 > 100.0:
            raise RftError("no answer within 100 s")
        return None

    with anyio.fail_after(5), pytest.raises(RftError, match="within 100 s"):
        await drive(state.kv, (STATUS,), attempt, wake_s=0.0, clock=lambda: next(times))
    assert seen == [1000.0, 1060.0, 1120.0]


async def test_key_writes_unsubscribe_when_the_loop_ends() -> None:
    state = await _state()
    writes = KeyWrites(state.kv, (STATUS,))
    async with writes:
        assert not await writes.wait(0.01)
        await state.put(STATUS, "running")
        assert await writes.wait(0.01)
        assert not await writes.wait(0.01)  # reported once
    await state.put(STATUS, "finished")  # after the end: nobody is told
    assert not await writes.wait(0.01)


async def test_key_writes_forget_and_poke() -> None:
    """``forget`` drops writes a reader is about to see anyway; ``poke`` wakes the waiter
    from this process; ``written`` tells without consuming."""
    state = await _state()
    async with KeyWrites(state.kv, [TRAINER_STEP]) as writes:
        await state.put(TRAINER_STEP, 1)
        with anyio.fail_after(5):
            while not writes.written:
                await anyio.sleep(0.01)
        assert writes.written  # not consumed by looking
        writes.forget()  # the reader reads now: what was written so far is seen
        assert not writes.written
        assert not await writes.wait(0.05)  # nothing new
        writes.poke()
        assert writes.written
        assert await writes.wait(5.0)  # at once
        assert not writes.written
