"""Runs started from the studio's config page: ``rftstream up`` as a child process, one at a time.

:class:`Launcher` writes the checked config to a file in a studio folder (a temporary
directory, kept so the run can be continued later with the same file), starts
``python -m rftstream.cli up --config FILE --run-dir DIR`` with the studio's own
interpreter, environment and working directory, and tracks it: running, stopping
(SIGINT sent), or exited with a code. Its output (stdout and stderr) goes to a log
file beside the config; :meth:`Launch.tail` reads the end of it.

Stopping is Ctrl-C: one SIGINT to the ``up`` process, which stops its actors and
servers cleanly and exits 130 with its run dir's ``run.lock`` status ``stopped``;
a later ``up`` on the same run dir continues the run from its newest checkpoint.
The child runs in its own session, so a Ctrl-C in the studio's terminal reaches the
studio only (which then stops the run with one SIGINT, :meth:`Launcher.shutdown`);
on Linux the kernel sends it SIGINT when the studio dies without that.

Everything here blocks only briefly (a fork and exec, small file reads and writes);
nothing talks to NATS.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from rftstream.config.resolve import default_run_dir
from rftstream.config.schema import Config
from rftstream.config.validate import run_id_from_name
from rftstream.errors import RftError
from rftstream.run_lock import busy_message, last_owner, live_owner

__all__ = ["Launch", "LaunchBusy", "LaunchError", "Launcher", "NatsMode", "outcome_of"]

# where the run's NATS server is: the studio's (``--nats-url`` of the studio), the config's
# own (``nats.url`` / ``nats.servers``), or the embedded one ``up`` starts in the run dir
NatsMode = Literal["studio", "config", "embedded"]
TAIL_BYTES = 8000  # of the output shown on the page
SHUTDOWN_WAIT_S = 60.0  # the studio waits this long for its run to stop when it exits

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


class LaunchError(RftError):
    """A run could not be started or stopped; the message says why."""


class LaunchBusy(LaunchError):
    """A run started from the studio is still running: the studio runs one at a time."""


def outcome_of(code: int | None) -> str | None:
    """How an ``up`` that exited with ``code`` ended: ``finished`` (0), ``stopped`` (130,
    a SIGINT), ``failed`` (anything else; a negative code: killed by that signal).
    None while it runs."""
    if code is None:
        return None
    if code == 0:
        return "finished"
    if code == 130:
        return "stopped"
    return "failed"


def _pdeathsig_sigint() -> None:  # runs in the child between fork and exec
    """Ask the kernel for SIGINT (a clean stop) when the studio dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG


def _tail(path: Path, limit: int = TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``path`` as text from a line start, terminal escapes
    removed ("" when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    if size > limit and "\n" in text:
        text = text.split("\n", 1)[1]
    return _ANSI.sub("", text)


@dataclass
class Launch:
    """One ``rftstream up`` started by the studio.

    ``run``: the run id (what the live view is addressed by); ``nats``: where its NATS
    server is (:data:`NatsMode`), ``nats_url`` that server's URL (empty for the
    embedded one: it is in the run dir's ``run.lock`` while the run lives) and
    ``nats_note`` why that one was picked.
    """

    run: str
    name: str
    run_dir: Path
    config_path: Path
    log_path: Path
    command: list[str]
    nats: NatsMode
    nats_url: str
    nats_note: str
    config: Config
    proc: subprocess.Popen[bytes]
    started: float
    stop_sent: float | None = None
    ended: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        """The exit code, None while it runs (reaps the process once it exited)."""
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.time()
        return code

    def running(self) -> bool:
        return self.exit_code() is None

    def state(self) -> Literal["running", "stopping", "exited"]:
        if not self.running():
            return "exited"
        return "stopping" if self.stop_sent is not None else "running"

    def tail(self) -> str:
        """The end of its output (:data:`TAIL_BYTES`)."""
        return _tail(self.log_path)

    def continue_command(self) -> str:
        """The shell command that continues this run later (the same config and run dir)."""
        args = ["rftstream", *self.command[self.command.index("up") :]]
        return shlex.join([a for a in args if a != "--fresh"])

    def to_json(self) -> dict[str, Any]:
        """What ``/api/launch`` serves: where the run is, its state, exit code and output."""
        code = self.exit_code()
        owner = last_owner(self.run_dir)
        if owner is not None and owner.started < self.started - 1.0:
            owner = None  # an earlier up's record: this one has not taken the run dir yet
        return {
            "run": self.run,
            "name": self.name,
            "run_dir": str(self.run_dir),
            "config_path": str(self.config_path),
            "log_path": str(self.log_path),
            "pid": self.pid,
            "command": shlex.join(self.command),
            "continue_command": self.continue_command(),
            "nats": self.nats,
            "nats_url": self.nats_url or (owner.url if owner is not None else ""),
            "nats_note": self.nats_note,
            "started": self.started,
            "stop_sent": self.stop_sent,
            "ended": self.ended,
            "state": self.state(),
            "exit_code": code,
            "outcome": outcome_of(code),
            "lock_status": owner.status if owner is not None else None,
            "live_url": f"/live?run={self.run}",
            "tail": self.tail(),
        }


class Launcher:
    """Starts ``rftstream up`` for the studio, one run at a time, and tracks the newest.

    ``env``: the child's environment (default: the studio's); ``folder``: where config
    and output files go (default: a new ``rftstream-studio-*`` temporary directory,
    made on the first start and kept); ``python``: the interpreter (default: the
    studio's own).
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        folder: Path | None = None,
        python: str = sys.executable,
    ) -> None:
        self._env = dict(env) if env is not None else None
        self._folder = folder
        self._python = python
        self.current: Launch | None = None

    def running(self) -> Launch | None:
        """The launch whose ``up`` is still running, or None."""
        launch = self.current
        return launch if launch is not None and launch.running() else None

    def folder(self) -> Path:
        """Where config and output files go (made on first use)."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="rftstream-studio-"))
        self._folder.mkdir(parents=True, exist_ok=True)
        return self._folder

    def busy_message(self, launch: Launch) -> str:
        """The refusal of a second start while ``launch`` runs."""
        when = time.strftime("%H:%M:%S", time.localtime(launch.started))
        doing = "is stopping" if launch.stop_sent is not None else "is running"
        return (
            f"a run started from the studio {doing}: {launch.name} (run {launch.run}, "
            f"rftstream up pid {launch.pid}, started {when}, run dir {launch.run_dir}). "
            "The studio runs one at a time: stop it (Stop) or wait for it to end"
        )

    def start(
        self,
        config: Config,
        yaml_text: str,
        *,
        nats: NatsMode,
        nats_url: str = "",
        nats_note: str = "",
        fresh: bool = False,
    ) -> Launch:
        """Write ``yaml_text`` (the checked text of ``config``) to a file and start
        ``rftstream up`` on it, with ``--run-dir`` the config's run dir (``runs/<name>``
        when empty, made absolute against the studio's working directory), ``--nats-url
        nats_url`` when ``nats`` is ``studio``, ``--fresh`` when ``fresh``. Returns at
        once (the run goes on in the child; :meth:`Launch.state` tells how it does).

        Call it from a thread that lives as long as the studio (the event loop's): on
        Linux the child's SIGINT-on-parent-death is tied to the thread that forked it.
        Blocks briefly (a small file written, a fork and exec). Raises
        :class:`LaunchBusy` while an earlier launch runs, :class:`LaunchError` when a
        live ``up`` (not the studio's) holds the run dir or a file cannot be written or
        the child cannot be started; nothing is started then.
        """
        busy = self.running()
        if busy is not None:
            raise LaunchBusy(self.busy_message(busy))
        run = run_id_from_name(config.name)
        run_dir = Path(default_run_dir(config)).expanduser().absolute()
        owner = live_owner(run_dir)
        if owner is not None:
            raise LaunchError(busy_message(run_dir, owner))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        folder = self.folder()
        config_path = folder / f"{run}-{stamp}.yaml"
        log_path = folder / f"{run}-{stamp}.log"
        command = [
            self._python,
            "-m",
            "rftstream.cli",
            "up",
            "--config",
            str(config_path),
            "--run-dir",
            str(run_dir),
        ]
        if nats == "studio":
            command += ["--nats-url", nats_url]
        if fresh:
            command.append("--fresh")
        env = dict(self._env if self._env is not None else os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("COLUMNS", "160")  # rich wraps a pipe's output at 80 columns otherwise
        try:
            config_path.write_text(yaml_text, encoding="utf-8")
            out: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - the child holds it
        except OSError as exc:
            raise LaunchError(f"cannot write {exc.filename}: {exc.strerror or exc}") from exc
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the terminal's Ctrl-C reaches the studio only
                preexec_fn=_pdeathsig_sigint if sys.platform.startswith("linux") else None,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {shlex.join(command)}: {exc.strerror or exc}") from exc
        finally:
            out.close()  # the child has its own descriptor
        self.current = Launch(
            run=run,
            name=config.name,
            run_dir=run_dir,
            config_path=config_path,
            log_path=log_path,
            command=command,
            nats=nats,
            nats_url=nats_url,
            nats_note=nats_note,
            config=config,
            proc=proc,
            started=time.time(),
        )
        return self.current

    def stop(self) -> Launch:
        """Stop the running launch as Ctrl-C would: one SIGINT to its ``up``, which then
        shuts down cleanly (seconds) and exits 130. Returns at once; a launch already
        stopping gets no second signal (that would abort its shutdown). Raises
        :class:`LaunchError` when no launch runs."""
        launch = self.running()
        if launch is None:
            raise LaunchError("no run started from the studio is running")
        if launch.stop_sent is None:
            launch.proc.send_signal(signal.SIGINT)
            launch.stop_sent = time.time()
        return launch

    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S) -> int | None:
        """Stop the running launch (one SIGINT unless sent already) and wait up to
        ``timeout`` seconds for it to exit; its exit code, None when none ran or it is
        still stopping (the kernel sends it SIGINT again when the studio exits). Blocks."""
        launch = self.running()
        if launch is None:
            return None
        self.stop()
        try:
            return launch.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
