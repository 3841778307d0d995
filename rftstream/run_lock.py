"""Who owns a run directory: the ``flock`` a live ``rftstream up`` holds, and what it says.

A live ``up`` holds an exclusive :func:`fcntl.flock` on ``<run_dir>/run.lock`` from
before it writes anything in the directory until it exits; the kernel drops the lock
when the process dies, however it dies (SIGKILL, OOM killer, a crash), so liveness is
known at once, never by waiting for heartbeats to age. The locked file holds a small
JSON record (:class:`RunOwner`): the ``up``'s pid and host, its NATS server's URL (no
secret) and pid, the pids of its child processes, and the run's status
(``running``, ``done``, ``failed``, ``stopped``). The record stays after the ``up``
exits: the next ``up`` on the directory reads from it how the last one ended (a run
that did not end ``done`` is continued) and which of its processes may still be
shutting down (:meth:`RunLock.wait_for_leftovers`).

The embedded nats-server's credential lives beside it in ``<run_dir>/nats/password``
(mode 0600, :func:`write_embedded_auth`): commands that inspect a live embedded run
(``status``, ``account``, ``tail``) read it from there.

Everything here is plain file I/O and blocks briefly; nothing talks to NATS.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import msgspec

from rftstream.errors import RftError

if TYPE_CHECKING:
    from rftstream.config.schema import Config

LOCK_FILE = "run.lock"
AUTH_FILE = "password"  # under <run_dir>/nats: the embedded server's password (0600)
EMBEDDED_USER = "rftstream"
LEFTOVER_WAIT_S = 10.0  # a crashed up's children and server get this long to exit

RunStatus = Literal["running", "done", "failed", "stopped"]


class RunDirBusy(RftError):
    """Another live ``rftstream up`` holds the run directory."""


class RunOwner(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The record in ``run.lock``: the ``up`` that holds (or last held) the directory."""

    pid: int
    host: str
    started: float
    status: RunStatus = "running"
    url: str = ""  # its NATS server (no credential in it)
    server_pid: int | None = None  # the embedded nats-server's, when it started one
    children: list[int] = msgspec.field(default_factory=list)  # explorer / operator processes
    ended: float | None = None


class EmbeddedAuth(msgspec.Struct, kw_only=True):
    """The embedded nats-server's credential: user :data:`EMBEDDED_USER`, the password in
    ``<run_dir>/nats/password`` (mode 0600; ``NATS_PASSWORD=$(cat ...)`` for the NATS CLI)."""

    user: str
    password: str

    def on(self, cfg: Config) -> Config:
        """``cfg`` connecting with this credential (and no other)."""
        nats = msgspec.structs.replace(
            cfg.nats, user=self.user, password=self.password, token="", creds=""
        )
        return msgspec.structs.replace(cfg, nats=nats)


def _read_record(path: Path) -> RunOwner | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.strip():
        return None
    try:
        return msgspec.json.decode(data, type=RunOwner)
    except msgspec.DecodeError:
        return None


def _alive(pid: int | None) -> bool:
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not reaped) counts as gone
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return False
    return True


def live_owner(run_dir: str | os.PathLike[str]) -> RunOwner | None:
    """The live ``up`` holding ``run_dir`` (its record), or None when none holds it.

    Tries the lock without waiting and releases it at once: never blocks a starting ``up``
    for longer than that."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return _read_record(path) or RunOwner(pid=0, host="?", started=0.0)
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def last_owner(run_dir: str | os.PathLike[str]) -> RunOwner | None:
    """The record the last ``up`` on ``run_dir`` left (None: no ``up`` ever held it)."""
    return _read_record(Path(run_dir) / LOCK_FILE)


def busy_message(run_dir: Path, owner: RunOwner) -> str:
    """The refusal: which live run holds ``run_dir``, its pid and its server."""
    server = owner.url or "its NATS server"
    if owner.server_pid:
        server += f" (nats-server pid {owner.server_pid})"
    age = f", started {time.time() - owner.started:.0f}s ago" if owner.started else ""
    return (
        f"run dir {run_dir} is held by a live `rftstream up` (pid {owner.pid or '?'} on "
        f"{owner.host}{age}, server {server}); nothing was written. Stop that run first, "
        "or pass another --run-dir"
    )


class RunLock:
    """The exclusive lock of one run directory, held by a live ``up``.

    :meth:`acquire` takes it without waiting (raises :class:`RunDirBusy` naming the
    holder); :meth:`update` rewrites the record in place; :meth:`release` writes the
    final status and drops the lock (the kernel drops it anyway when the process dies).
    The lock's file descriptor is not inherited by child processes (``O_CLOEXEC``).
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._file: IO[bytes] | None = None
        self.record: RunOwner | None = None
        self.previous: RunOwner | None = None  # what the last up left (None: the first)

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, *, record: bool = True) -> RunLock:
        """Take the lock; the first thing an ``up`` does in the directory (it creates the
        directory and ``run.lock``, nothing else). ``record`` False: a reader (``rftstream
        account`` on a finished run) that leaves the last ``up``'s record as it is.
        Raises :class:`RunDirBusy`."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                owner = _read_record(self.path) or RunOwner(pid=0, host="?", started=0.0)
                raise RunDirBusy(busy_message(self.run_dir, owner)) from None
            raise
        self._file = os.fdopen(fd, "r+b")
        self.previous = _read_record(self.path)
        if record:
            self.record = RunOwner(pid=os.getpid(), host=socket.gethostname(), started=time.time())
            self._write()
        return self

    def _write(self) -> None:
        assert self._file is not None and self.record is not None
        data = msgspec.json.encode(self.record) + b"\n"
        self._file.seek(0)
        self._file.write(data)
        self._file.truncate()
        self._file.flush()
        os.fsync(self._file.fileno())

    def update(self, **changes: object) -> None:
        """Change fields of the record (``url``, ``server_pid``, ``children``, ``status``) and write it. No-op when the lock is not held."""
        if self._file is None or self.record is None:
            return
        self.record = msgspec.structs.replace(self.record, **changes)  # type: ignore[arg-type]
        self._write()

    def wait_for_leftovers(self, timeout: float = LEFTOVER_WAIT_S) -> list[int]:
        """Wait for the processes the previous ``up`` recorded (its nats-server, its
        children) to exit: they get SIGTERM from the kernel when their parent dies and may
        still be writing the store. After ``timeout`` s those left are SIGKILLed. Returns
        the pids that had to be waited for. Blocks."""
        prev = self.previous
        if prev is None:
            return []
        pids = [p for p in [prev.server_pid, *prev.children] if p and _alive(p)]
        pids = [p for p in pids if _same_owner(p)]
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
        return pids

    def release(self, status: RunStatus) -> None:
        """Write ``status`` and the end time, then drop the lock. Idempotent."""
        if self._file is None:
            return
        try:
            if self.record is not None:
                self.update(status=status, ended=time.time(), children=[])
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _same_owner(pid: int) -> bool:
    """Whether ``pid`` runs as this user (a recycled pid of another user is left alone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def new_embedded_auth(run_dir: str | os.PathLike[str]) -> EmbeddedAuth:
    """A fresh random credential for the embedded server of ``run_dir``, written to
    ``<run_dir>/nats/password`` with mode 0600 (created so: never readable by others,
    not even for an instant)."""
    auth = EmbeddedAuth(user=EMBEDDED_USER, password=secrets.token_urlsafe(24))
    write_private(Path(run_dir) / "nats" / AUTH_FILE, auth.password.encode() + b"\n")
    return auth


def read_embedded_auth(run_dir: str | os.PathLike[str]) -> EmbeddedAuth | None:
    """The embedded server's credential of ``run_dir`` (None: none written)."""
    try:
        password = (Path(run_dir) / "nats" / AUTH_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return EmbeddedAuth(user=EMBEDDED_USER, password=password) if password else None


def write_private(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` readable by this user only (0600 from creation on;
    an existing file is made 0600 first). Through a temp file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def move_aside(run_dir: Path, lock: RunLock, keep_out: Iterable[str] = ()) -> Path:
    """Move the contents of ``run_dir`` (an earlier run; ``lock`` held) into a sibling
    ``<name>.<YYYYmmdd-HHMMSS>`` directory, never deleting anything; ``run.lock`` and the
    names in ``keep_out`` stay. Returns the new directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime())
    aside = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}")
    aside.mkdir(parents=True)
    stay = {LOCK_FILE, *keep_out}
    for entry in sorted(run_dir.iterdir()):
        if entry.name in stay:
            continue
        entry.rename(aside / entry.name)
    if lock.previous is not None:  # how the moved run ended, for whoever reads it there
        (aside / LOCK_FILE).write_bytes(msgspec.json.encode(lock.previous))
    return aside
