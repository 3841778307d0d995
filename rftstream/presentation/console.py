"""The terminal shows rftstream's own lines; third-party output goes to the run's log.

``rftstream up`` and the actor commands train with libraries that talk a lot:
transformers ``FutureWarning`` s, DeepSpeed banners and op-builder probes (``ld:
cannot find -laio`` straight from gcc), tqdm bars, nats-py error logs, C
extensions writing to fd 1/2. None of that is for the person at the terminal.

* :class:`TerminalGuard` points file descriptors 1 and 2 of this process at the
  run's log file (``<run_dir>/logs/rftstream.log``), so whatever a library or a C
  extension prints lands there, while rftstream's rich :class:`~rich.console.Console`
  keeps writing to a duplicate of the terminal. Until the run directory is known
  (plugins and the model load before it) the output waits in a spool file, which
  :meth:`TerminalGuard.attach` copies into the log.
* :class:`OwnRecords` lets only rftstream's loggers (``rftstream``, ``operators``,
  ``algorithms``, ``workflows``) reach the console handler; the file handler gets
  every record.
* :func:`show_warning_via` makes the ``warnings.showwarning`` of these commands: a warning
  whose category rftstream defines (config warnings, stream-limit warnings) is one
  ``warning:`` line on the console; any other goes to the ``py.warnings`` logger,
  that is to the log file only.
* Child processes (:mod:`rftstream.launch.actor_process`) already write fds 1/2 to their
  own log; their own log records at or above the console level also travel to the
  parent as JSON lines on a pipe (:func:`child_console_handler`,
  :class:`RecordForwarder`), which shows them through its console handler.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape

OWN_PACKAGES = ("rftstream", "operators", "algorithms", "workflows")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def is_own_logger(name: str) -> bool:
    """Whether the logger ``name`` is one of rftstream's (its packages, or ``__main__``)."""
    return name == "__main__" or name.split(".", 1)[0] in OWN_PACKAGES


def is_own_warning(category: type[Warning]) -> bool:
    """Whether ``category`` is a warning class rftstream defines (not Python's or a library's)."""
    return str(getattr(category, "__module__", "")).split(".", 1)[0] in OWN_PACKAGES


class OwnRecords(logging.Filter):
    """Passes only records of rftstream's own loggers (see :func:`is_own_logger`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_own_logger(record.name)


def print_warning_on(console: Console) -> Callable[[str], None]:
    """What shows one of rftstream's own warnings on ``console``: one ``warning:`` line."""

    def say(text: str) -> None:
        console.print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True)

    return say


def show_warning_via(say: Callable[[str], None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that hands rftstream's own warnings to ``say`` (see
    :func:`print_warning_on`) and logs every other one to ``py.warnings``: file handlers
    only, since :class:`OwnRecords` keeps it off the console."""

    def show_warning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: IO[str] | None = None,
        line: str | None = None,
    ) -> None:
        if is_own_warning(category):
            say(str(message))
            return
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        logging.getLogger("py.warnings").warning("%s", text)

    return show_warning


class TerminalGuard:
    """Fds 1 and 2 of this process go to a file; ``console`` keeps the terminal.

    :meth:`start` (first) spools fds 1/2 into an anonymous temporary file and gives
    ``console`` a duplicate of the original stdout; :meth:`attach` copies the spool
    into a log file and points fds 1/2 at it (again for each stage of a staged run);
    :meth:`restore` puts the original fds back (before a traceback that a person must
    see). Does nothing when stdout has no file descriptor (an in-process caller whose
    stdout is captured). Not thread-safe; call from the main thread.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.active = False
        self.log_path: Path | None = None
        self._saved: tuple[int, int] | None = None
        self._terminal: IO[str] | None = None
        self._sink: IO[bytes] | None = None

    def start(self) -> None:
        """Point fds 1/2 at a spool file; the console writes to the terminal from now on."""
        if self.active:
            return
        try:
            out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
        except (AttributeError, ValueError, OSError):  # captured or replaced streams
            return
        if (out_fd, err_fd) != (1, 2):
            return
        _flush_std_streams()
        self._saved = (os.dup(1), os.dup(2))
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        self._terminal = os.fdopen(os.dup(1), "w", buffering=1, encoding=encoding, errors="replace")
        if not os.isatty(0) and os.isatty(self._saved[0]) and "COLUMNS" not in os.environ:
            # rich measures fds 0..2; only the saved one is the terminal now
            with contextlib.suppress(OSError):
                self.console.width = os.get_terminal_size(self._saved[0]).columns
        self.console.file = self._terminal
        self._point_at(tempfile.TemporaryFile())
        self.active = True

    def attach(self, log_path: Path) -> None:
        """Append what was spooled (or written to the previous log) since :meth:`start` to
        ``log_path`` and point fds 1/2 there. Creates its directory. No-op when inactive."""
        if not self.active or self._sink is None:
            return
        log_path.parent.mkdir(parents=True, exist_ok=True)
        _flush_std_streams()
        sink = log_path.open("ab")
        if self.log_path is None:  # the spool: its bytes belong to this run's log
            self._sink.seek(0)
            shutil.copyfileobj(self._sink, sink)
            sink.flush()
        self._point_at(sink)
        self.log_path = log_path

    def restore(self) -> None:
        """Give fds 1/2 back to the terminal (and ``console`` to ``sys.stdout``). Idempotent."""
        if not self.active or self._saved is None:
            return
        _flush_std_streams()
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self.console.file = sys.stdout
        if self._terminal is not None:
            self._terminal.close()
        if self._sink is not None:
            self._sink.close()
        self._saved = self._terminal = self._sink = None
        self.active = False

    def _point_at(self, sink: IO[bytes]) -> None:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        if self._sink is not None:
            self._sink.close()
        self._sink = sink


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _JsonRecord(logging.Formatter):
    """One log record as a JSON line: level, logger name, message (traceback appended)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return json.dumps(
            {
                "levelno": record.levelno,
                "levelname": record.levelname,
                "name": record.name,
                "msg": message,
                "created": record.created,
            }
        )


def child_console_handler(fd: int, level: int) -> logging.StreamHandler[IO[str]]:
    """In a child process: a handler writing its own records at ``level`` or above to
    ``fd`` (the write end of the parent's pipe) as JSON lines, for :class:`RecordForwarder`;
    not those logged with ``extra={"console": False}``."""
    stream = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
    handler = logging.StreamHandler(stream)
    handler.setLevel(level)
    handler.setFormatter(_JsonRecord())
    handler.addFilter(OwnRecords())
    # a record logged with extra={"console": False} stays in the child's log (the parent
    # reports that failure itself, with the log's tail)
    handler.addFilter(lambda record: bool(getattr(record, "console", True)))
    return handler


def parse_record(line: str) -> logging.LogRecord | None:
    """A record written by :func:`child_console_handler`; None for a line that is not one."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not {"levelno", "name", "msg"} <= data.keys():
        return None
    fields: dict[str, Any] = {
        "name": str(data["name"]),
        "levelno": int(data["levelno"]),
        "levelname": str(data.get("levelname") or logging.getLevelName(data["levelno"])),
        "msg": str(data["msg"]),
        "args": None,
    }
    if isinstance(data.get("created"), (int, float)):
        fields["created"] = float(data["created"])
    return logging.makeLogRecord(fields)


class RecordForwarder:
    """Reads a child's record pipe in a daemon thread and hands each record to ``emit``.

    :attr:`write_fd` goes to the child (``pass_fds``); call :meth:`child_started`
    once it runs (closes the parent's copy, so the pipe ends when the child does),
    and :meth:`join` at the end (waits up to ``timeout`` s for the last records).
    """

    def __init__(self, emit: Callable[[logging.LogRecord], Any]) -> None:
        self.emit = emit
        self.read_fd, self.write_fd = os.pipe()
        self._write_open = True
        self._thread = threading.Thread(target=self._read, name="child-records", daemon=True)
        self._thread.start()

    def child_started(self) -> None:
        """Close the parent's write end (the child holds its own copy). Once: a second
        close could hit another file that reused the descriptor's number."""
        if not self._write_open:
            return
        self._write_open = False
        with contextlib.suppress(OSError):
            os.close(self.write_fd)

    def join(self, timeout: float = 2.0) -> None:
        """Wait for the reader to see the end of the pipe (the child exited)."""
        self.child_started()
        self._thread.join(timeout)

    def _read(self) -> None:
        with os.fdopen(self.read_fd, "r", encoding="utf-8", errors="replace") as pipe:
            for line in pipe:
                record = parse_record(line)
                if record is not None:
                    with contextlib.suppress(Exception):  # a closed console at exit
                        self.emit(record)


class ChildConsole:
    """Where child processes send their own log records: ``handler`` (the parent's console
    handler), which shows those at or above its level. :attr:`level` tells a child which to
    send at all."""

    def __init__(self, handler: logging.Handler) -> None:
        self.handler = handler

    @property
    def level(self) -> int:
        return self.handler.level

    def emit(self, record: logging.LogRecord) -> None:
        """Show ``record`` (from a child) if the console's level and filters let it through."""
        if record.levelno >= self.handler.level:
            self.handler.handle(record)
