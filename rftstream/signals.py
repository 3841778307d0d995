"""Run an async main on the asyncio backend until it returns or a signal stops it.

Used by the commands that run actors in the foreground (``rftstream up``, the
actor commands, the child actor processes). :func:`exit_process` ends such a
process; one that was a trainer rank ends without the interpreter's teardown.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn

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


#: set once this process left a torch.distributed group of several ranks
_skip_teardown = False


def skip_teardown_at_exit() -> None:
    """Make :func:`exit_process` end this process by :func:`end_without_teardown`
    (:func:`rftstream.training.ranks.leave_ranks` calls it)."""
    global _skip_teardown
    _skip_teardown = True


def end_without_teardown(code: int) -> NoReturn:
    """Flush the output and logs, then ``os._exit(code)``, skipping the interpreter's
    teardown. For a process that was a rank of a torch.distributed group (any rank, 0
    too, once it has nothing left to do): in the teardown gloo's and the store's C++
    threads and destructors can race and abort it ("terminate called without an active
    exception", seen under load on followers and, more rarely, on rank 0), which the
    launcher reports as the rank failing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)`` at the end of a command's process, or
    :func:`end_without_teardown` in one that was a trainer rank. For ``__main__`` blocks
    and console entry points only: never from code a test calls in its own process."""
    if _skip_teardown:
        end_without_teardown(code)
    sys.exit(code)
