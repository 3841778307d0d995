""":class:`~rftstream.bus.state.MirroredState` where the connection misbehaves: a write
handed on while the first read is under way wins over what the read returns, and a lost
connection (writes never handed on) makes the next read of a kept key read them all again."""

from __future__ import annotations

import pytest

from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import MirroredState, RunState
from rftstream.bus.transport import KeyValueStore, KvEntry
from rftstream.wire import STATUS, TRAINER_STEP

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Lossy:
    """A bucket whose write notifications can be cut (a lost connection) and whose
    ``get`` can run a hook first (a write that lands while the read is under way)."""

    def __init__(self, kv: KeyValueStore) -> None:
        self._kv = kv
        self.cut = False
        self.lost = False
        self.before_get: dict[str, object] = {}
        self.gets: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._kv, name)

    async def get(self, key: str) -> KvEntry:
        self.gets.append(key)
        hook = self.before_get.pop(key, None)
        if hook is not None:
            await hook()  # type: ignore[operator]
        return await self._kv.get(key)

    async def on_value(self, keys, callback):  # type: ignore[no-untyped-def]
        outer = self

        def passed_on(key: str, value: bytes | None) -> None:
            if not outer.cut:
                callback(key, value)

        inner = await self._kv.on_value(keys, passed_on)

        class Writes:
            def missed(self) -> bool:
                lost, outer.lost = outer.lost, False
                return lost

            async def unsubscribe(self) -> None:
                await inner.unsubscribe()

        return Writes()


async def test_a_write_during_the_first_read_wins_over_the_read() -> None:
    t = MemoryTransport()
    kv = await t.kv("S", create=True)
    writer = RunState(kv)
    await writer.put(TRAINER_STEP, 1)
    lossy = Lossy(kv)
    stale = KvEntry("trainer.step", b"1", 1)

    async def written_meanwhile() -> None:
        await writer.put(TRAINER_STEP, 2)  # handed on while the read is under way

    lossy.before_get["trainer.step"] = written_meanwhile
    real_get = kv.get

    async def stale_get(key: str) -> KvEntry:  # the read was answered before the write
        return stale if key == "trainer.step" else await real_get(key)

    kv.get = stale_get  # type: ignore[method-assign]
    async with MirroredState(lossy, (TRAINER_STEP,)) as state:  # type: ignore[arg-type]
        assert await state.get(TRAINER_STEP) == 2


async def test_a_lost_connection_makes_the_next_read_read_again() -> None:
    t = MemoryTransport()
    kv = await t.kv("S", create=True)
    writer = RunState(kv)
    await writer.set_status("running")
    lossy = Lossy(kv)
    async with MirroredState(lossy, (STATUS, TRAINER_STEP)) as state:  # type: ignore[arg-type]
        assert lossy.gets == ["status", "trainer.step"]
        lossy.cut = True
        await writer.set_status("stopped")  # never handed on
        assert await state.status() == "running"  # what was kept
        assert lossy.gets == ["status", "trainer.step"]
        lossy.cut, lossy.lost = False, True  # the connection came back
        assert await state.status() == "stopped"
        assert lossy.gets == ["status", "trainer.step"] * 2  # every kept key again
        assert await state.status() == "stopped"
        assert len(lossy.gets) == 4  # once per loss
