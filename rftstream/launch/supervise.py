"""``rftstream up`` keeps its parts alive: dead explorer / operator processes and a dead
embedded nats-server are started again, so a crash of one part costs seconds, not the run.

Why restarting is safe: every piece of work is durable on the bus. A restarted explorer
takes its tasks from the tasks stream again (those the dead one held come back after the
tasks' ack wait), a restarted operator host reads its durable consumer from where it
acked, and the embedded server comes back on the same store and port, where the
actors' connections find it again (they retry for ``nats.reconnect_window`` s).

A part is restarted at most :data:`MAX_RESTARTS` times, after a backoff of 1, 2, 4, ...
s (at most 30 s); each restart is one console line and is counted in the end-of-run
summary (:meth:`Supervisor.summary`). Past the limit, the part's error ends the run
with one line naming the part and why it died. Trainer rank processes are not
restarted (their collective with rank 0 cannot be rejoined): their death ends the run.
Nor is a part that exited with :data:`~rftstream.launch.actor_process.EXIT_NOT_MENDABLE` (a
config error or missing credentials: it would fail the same way again).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from rftstream.errors import RftError
from rftstream.launch.actor_process import EXIT_NOT_MENDABLE, how_it_ended

if TYPE_CHECKING:
    from rftstream.launch.actor_process import ActorProcess
    from rftstream.nats_server.embedded import EmbeddedNatsServer

log = logging.getLogger(__name__)

MAX_RESTARTS = 5  # per part, in one up
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
SERVER_POLL_S = 0.25  # how often the embedded server's process is looked at


class Supervisor:
    """Restarts the parts of one ``up``; ``say`` prints one console line per event and
    ``on_change`` is called after each restart (``up`` records the new pids in the run
    dir's lock). Its coroutines run in ``up``'s task group and are cancelled with it."""

    def __init__(
        self,
        say: Callable[[str], None],
        on_change: Callable[[], None] | None = None,
        *,
        max_restarts: int = MAX_RESTARTS,
    ) -> None:
        self.say = say
        self.on_change = on_change or (lambda: None)
        self.max_restarts = max_restarts
        self.restarts: Counter[str] = Counter()

    def _backoff(self, part: str) -> float:
        return BACKOFF_S[min(self.restarts[part], len(BACKOFF_S) - 1)]

    async def child(self, proc: ActorProcess, *, restart: bool = True) -> None:
        """Watch ``proc`` until it exits for good: returns on a clean exit; restarts it
        after a failure (``restart``); raises its :class:`RftError` when it failed and may
        not (or no longer) be restarted."""
        while True:
            code = await proc.wait()
            if not proc.failed(code):
                return
            part = proc.name
            if code == EXIT_NOT_MENDABLE:  # a config error, missing credentials: the same again
                raise proc.failure(code)
            if not restart or self.restarts[part] >= self.max_restarts:
                error = proc.failure(code)
                if restart:
                    raise RftError(
                        f"{self.restarts[part]} restarts did not keep it up: {error}"
                    ) from None
                raise error
            wait = self._backoff(part)
            self.restarts[part] += 1
            self.say(
                f"the {part} process (pid {proc.process.pid if proc.process else '?'}) "
                f"{how_it_ended(code)}; starting it again in {wait:.0f}s (restart "
                f"{self.restarts[part]} of {self.max_restarts}; its work waits on the bus; "
                f"log {proc.log_path})"
            )
            log.info("%s exited (%s); restart %d", part, how_it_ended(code), self.restarts[part])
            await anyio.sleep(wait)
            await proc.restart()
            self.on_change()

    async def server(self, server: EmbeddedNatsServer) -> None:
        """Watch the embedded nats-server; when its process dies, start it again on the
        same store and port (the clients reconnect). Runs until cancelled; raises
        :class:`RftError` naming why it died when it cannot be brought back."""
        part = "nats-server"
        while True:
            await anyio.sleep(SERVER_POLL_S)
            code = server.exit_code()
            if code is None:
                continue
            pid = server.pid
            tail = server.log_tail()
            while True:
                if self.restarts[part] >= self.max_restarts:
                    raise RftError(
                        f"the embedded nats-server (pid {pid}) {how_it_ended(code)} and "
                        f"{self.restarts[part]} restarts did not keep it up; its log "
                        f"{server.store_dir / 'nats-server.log'} ends with:\n{tail}"
                    )
                self.restarts[part] += 1
                t0 = time.monotonic()
                self.say(
                    f"the embedded nats-server (pid {pid}) {how_it_ended(code)}; starting it "
                    f"again on its store {server.store_dir} (restart {self.restarts[part]} of "
                    f"{self.max_restarts})"
                )
                try:
                    # on this (the event loop's) thread, never a worker thread: the server
                    # gets PR_SET_PDEATHSIG, which fires when the thread that started it
                    # ends. Blocks the loop while it starts (0.1 s; the bus is down anyway)
                    server.start()
                except RftError as exc:  # BusError: it did not come up
                    tail = str(exc)
                    await anyio.sleep(self._backoff(part))
                    continue
                self.say(
                    f"the embedded nats-server is back (pid {server.pid}, "
                    f"{time.monotonic() - t0:.1f}s); the actors reconnect"
                )
                self.on_change()
                break

    def summary(self) -> str | None:
        """``explorer 1, nats-server 1`` (None: nothing was restarted)."""
        if not self.restarts:
            return None
        return ", ".join(f"{part} {n}" for part, n in sorted(self.restarts.items()))
