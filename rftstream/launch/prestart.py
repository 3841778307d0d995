"""Actor processes started before the run is prepared: the first seconds of ``rftstream up``.

A child process (:mod:`rftstream.launch.actor_process`) spends its first seconds importing
torch, transformers and rftstream; the parent spends its own first second validating
the config (which imports torch too) and starting NATS, while the machine's other cores
wait. :func:`prestart` starts the explorer children (the start-up's critical path) as
soon as the config is read; each imports what its role needs while the parent prepares,
then waits.
:class:`~rftstream.launch.actor_process.ActorProcess` :func:`take` s one on its first start
and hands it its command line instead of starting a new process.

The hand-over: one JSON line on the child's stdin, ``{"argv": [...], "env": {...},
"log": path}``. The child points its stdout and stderr at ``log``, adds ``env`` (the
NATS secrets an actor process gets in its environment) and runs
:func:`rftstream.launch.actor_process.main` with ``argv``. A child whose stdin closes without
a line exits 0: :func:`discard` (also at the parent's exit, say after a config error)
ends every child not taken, and a child dies with its parent anyway
(``PR_SET_PDEATHSIG``). In ``ps`` a waiting child reads ``python -m
rftstream.launch.actor_process --await-args --roles explorer --parent-pid <pid>``.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from rftstream.presentation.console import RecordForwarder

__all__ = ["PRELOAD", "PopenProcess", "Prestarted", "discard", "prestart", "take"]

#: what a waiting child of each role imports before its command line comes
PRELOAD: dict[str, tuple[str, ...]] = {
    "explorer": (
        "torch",
        "transformers",
        "rftstream.runtime",
        "rftstream.actors.explorer",
        "rftstream.engines.transformers_engine",
    ),
}
_POLL_S = 0.05


class PopenProcess:
    """What :class:`~rftstream.launch.actor_process.ActorProcess` uses of an
    :class:`anyio.abc.Process`, over a :class:`subprocess.Popen` started before the event
    loop ran. :meth:`wait` polls (every 50 ms); cancelling it leaves the child alone."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        while (code := self.popen.poll()) is None:
            await anyio.sleep(_POLL_S)
        return code

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


class Prestarted:
    """One waiting child of ``role``: its process and the pipe its log records will come
    back on (``--console-fd``), read from the start, shown once :meth:`hand_over` names
    where."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._emit: Any = None
        self.forwarder = RecordForwarder(self._show)
        self.popen = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [
                sys.executable,
                "-m",
                "rftstream.launch.actor_process",
                "--await-args",
                *("--roles", role, "--parent-pid", str(os.getpid())),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,  # the terminal's Ctrl-C reaches the parent, which stops it
            pass_fds=(self.forwarder.write_fd,),
        )

    def _show(self, record: Any) -> None:
        if self._emit is not None:
            self._emit(record)

    def hand_over(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, emit: Any = None
    ) -> PopenProcess:
        """Send the child its command line (``argv`` after ``python -m
        rftstream.launch.actor_process``), extra environment and log file; its log records go to
        ``emit`` (None: dropped). Returns the running process. Blocks for one pipe write."""
        self._emit = emit
        line = json.dumps({"argv": list(argv), "env": dict(env), "log": str(log_path)})
        assert self.popen.stdin is not None
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.close()
        self.forwarder.child_started()
        return PopenProcess(self.popen)

    def close(self) -> None:
        """End a child never handed over (it holds nothing: SIGTERM, mid-import or
        waiting) and reap it. Blocks up to 5 s."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.forwarder.child_started()


_waiting: list[Prestarted] = []


def prestart(roles: Mapping[str, int]) -> None:
    """Start ``roles[role]`` waiting children of each role (a role of :data:`PRELOAD`).
    Returns at once."""
    for role, count in roles.items():
        for _ in range(count):
            _waiting.append(Prestarted(role))


def take(role: str) -> Prestarted | None:
    """A waiting child of ``role`` that is still alive, or None."""
    for i, child in enumerate(_waiting):
        if child.role == role and child.popen.poll() is None:
            return _waiting.pop(i)
    return None


@atexit.register
def discard() -> None:
    """End every waiting child not taken. Blocks until they exited (about at once)."""
    while _waiting:
        _waiting.pop().close()
