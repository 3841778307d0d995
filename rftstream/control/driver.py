"""One loop for every control-plane machine: look, step, act, then wait on a key write.

A machine reads KV records, decides by them and by the time, and writes. Between two
looks nothing it reads changes unless a key is written, or the time passes a
deadline of its own (a patience, an owner's age, a health check). So the loop waits
for a write of the keys it reads (:class:`KeyWrites`), at most until the machine's
next deadline, and never sleeps a fixed poll. The clock is a parameter
(:data:`wall_clock` by default), so a test can step time without waiting for it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

import anyio

from rftstream.bus.transport import KeyValueStore, Unsubscribe, unsubscribe_quietly
from rftstream.wire import Key

T = TypeVar("T")

#: the time a machine decides by: seconds since the epoch (KV records carry wall time)
Clock = Callable[[], float]
wall_clock: Clock = time.time

#: the longest a loop waits for a write before it reads again although none came: a
#: write notification is lost while the connection is down (one value for every loop)
LOOK_AGAIN_S = 5.0


class KeyWrites:
    """Wakes a waiter when one of ``keys`` of a KV bucket is written.

    A write notification (:meth:`KeyValueStore.on_write`; on NATS a plain subscription
    on ``$KV.<bucket>.<key>``): nothing is stored and values are not read (read them
    again). Start it before the first read (``async with``, or :meth:`start`): a write
    that lands between a read and the next :meth:`wait` is kept, so no change is
    missed. :meth:`stop` unsubscribes (errors ignored: the connection may be gone).
    """

    def __init__(self, kv: KeyValueStore, keys: Iterable[str | Key[Any]]) -> None:
        self.kv = kv
        self.keys = tuple(k.name if isinstance(k, Key) else k for k in keys)
        self._event = anyio.Event()
        self._subs: list[Unsubscribe] = []

    async def start(self) -> None:
        """Subscribe (one round trip). Blocks for it."""

        async def written() -> None:
            self._event.set()

        self._subs.append(await self.kv.on_write(self.keys, written))

    async def wait(self, timeout: float) -> bool:
        """True once a key was written since the previous :meth:`wait` returned (at once
        if one was meanwhile), False after ``timeout`` s without one."""
        with anyio.move_on_after(max(0.0, timeout)):
            await self._event.wait()
        fired = self._event.is_set()
        if fired:
            self._event = anyio.Event()
        return fired

    @property
    def written(self) -> bool:
        """Whether a key was written (or :meth:`poke` called) since the last :meth:`wait`
        returned or :meth:`forget`; does not consume it."""
        return self._event.is_set()

    def forget(self) -> None:
        """Drop the writes seen so far: call it just before reading the keys, so that
        :meth:`wait` then wakes only for a write the read may have missed."""
        if self._event.is_set():
            self._event = anyio.Event()

    def poke(self) -> None:
        """Wake the waiter as a write would: something in this process changed what the
        keys' reader decides by (a weight version staged)."""
        self._event.set()

    async def stop(self) -> None:
        for sub in self._subs:
            await unsubscribe_quietly(sub)
        self._subs = []

    async def __aenter__(self) -> KeyWrites:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.stop()


async def drive(
    kv: KeyValueStore,
    keys: Iterable[str | Key[Any]],
    attempt: Callable[[float], Awaitable[T | None]],
    *,
    wake_s: float | Callable[[], float],
    clock: Clock = wall_clock,
) -> T:
    """Run ``attempt(now)`` until it returns a value, and return that.

    ``attempt`` reads what it needs, steps its machine at ``now`` and does the
    actions; it returns None to go on, or raises to give up. Between two attempts
    the loop waits for a write of ``keys`` (subscribed before the first attempt), at
    most ``wake_s`` s (a number, or a function asked after each attempt: the time to
    the machine's next deadline). Blocks; cancelling it unsubscribes and leaves the
    KV as the last attempt left it.
    """
    async with KeyWrites(kv, keys) as writes:
        while True:
            done = await attempt(clock())
            if done is not None:
                return done
            await writes.wait(wake_s() if callable(wake_s) else wake_s)
