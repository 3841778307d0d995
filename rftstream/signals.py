"""Run an async main on the asyncio backend until it returns or a signal stops it.

Used by the commands that run actors in the foreground (``rftstream up``, the
actor commands, the child actor processes).
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import anyio


def run_with_signals(main: Callable[[], Awaitable[None]]) -> int:
    """Run ``main`` on the asyncio backend; SIGINT/SIGTERM cancel it. Returns an exit code."""
    stopped: list[int] = []

    async def wrapper() -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        stopped.append(signum)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            await main()
            tg.cancel_scope.cancel()

    anyio.run(wrapper, backend="asyncio")
    return 130 if stopped else 0
