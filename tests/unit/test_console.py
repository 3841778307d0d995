"""rftstream.presentation.console: own loggers/warnings, the fd-level terminal guard, child records, summary."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from rich.console import Console

from rftstream.config.trinity import TrinityConfigWarning
from rftstream.launch.up import print_summary
from rftstream.presentation.console import (
    ChildConsole,
    OwnRecords,
    RecordForwarder,
    child_console_handler,
    is_own_logger,
    is_own_warning,
    parse_record,
    show_warning_via,
)


def test_own_loggers_and_warnings() -> None:
    for own in ("rftstream", "rftstream.actors.explorer", "operators.filter", "__main__"):
        assert is_own_logger(own), own
    for other in ("transformers.generation", "nats.aio.client", "py.warnings", "rftstreamx"):
        assert not is_own_logger(other), other
    assert is_own_warning(TrinityConfigWarning)
    assert not is_own_warning(FutureWarning) and not is_own_warning(UserWarning)
    f = OwnRecords()
    assert f.filter(logging.makeLogRecord({"name": "rftstream.launch.up"}))
    assert not f.filter(logging.makeLogRecord({"name": "deepspeed"}))


def test_show_warning_routes_own_to_console_and_others_to_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said: list[str] = []
    show = show_warning_via(said.append)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        warnings.warn("key `x` is ignored", TrinityConfigWarning, stacklevel=1)
        with caplog.at_level(logging.WARNING, logger="py.warnings"):
            warnings.warn("`past_key_values` is deprecated", FutureWarning, stacklevel=1)
    assert said == ["key `x` is ignored"]
    [record] = [r for r in caplog.records if r.name == "py.warnings"]
    assert "FutureWarning: `past_key_values` is deprecated" in record.getMessage()
    assert not OwnRecords().filter(record)  # so the console handler drops it


def test_child_records_cross_a_pipe_to_the_parent_console() -> None:
    """The child's side (:func:`child_console_handler` on the pipe's write end) and the
    parent's (:class:`RecordForwarder` reading it in its thread, :class:`ChildConsole`)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    handler.setLevel(logging.INFO)
    sink = ChildConsole(handler)
    got: list[logging.LogRecord] = []

    def emit(record: logging.LogRecord) -> None:
        got.append(record)
        sink.emit(record)

    forwarder = RecordForwarder(emit)
    child = child_console_handler(os.dup(forwarder.write_fd), logging.INFO)  # the child's copy
    forwarder.child_started()
    loggers = [logging.getLogger(n) for n in ("rftstream.actors.explorer", "transformers.gen")]
    for logger in loggers:
        logger.addHandler(child)
        logger.setLevel(logging.DEBUG)
    try:
        loggers[0].info("explorer: loaded weights v%d", 3)
        loggers[0].debug("below the console level")
        loggers[1].warning("a library's warning")
        loggers[0].error("reported by the parent", extra={"console": False})
        try:
            raise ValueError("boom")
        except ValueError:
            loggers[0].exception("failed")
    finally:
        for logger in loggers:
            logger.removeHandler(child)
            logger.setLevel(logging.NOTSET)
        child.close()
        child.stream.close()  # the child exits: the pipe ends
    forwarder.join(timeout=10)
    assert [(r.name, r.levelno) for r in got] == [
        ("rftstream.actors.explorer", logging.INFO),
        ("rftstream.actors.explorer", logging.ERROR),
    ]
    assert got[0].getMessage() == "explorer: loaded weights v3"
    assert "ValueError: boom" in got[1].getMessage()  # the traceback travels with it
    shown = stream.getvalue()
    assert shown.startswith("INFO rftstream.actors.explorer explorer: loaded weights v3\n")
    assert "library" not in shown and "below" not in shown
    # a console at WARNING shows the error, not the INFO line
    quiet = io.StringIO()
    strict = logging.StreamHandler(quiet)
    strict.setLevel(logging.WARNING)
    for record in got:
        ChildConsole(strict).emit(record)
    assert quiet.getvalue().startswith("failed\n") and "loaded weights" not in quiet.getvalue()


def test_parse_record_rejects_what_is_not_a_record() -> None:
    for line in ("", "not json", "[1, 2]", '{"name": "x"}'):
        assert parse_record(line) is None, line
    rec = parse_record('{"levelno": 30, "name": "rftstream.x", "msg": "50% done", "created": 5}')
    assert rec is not None and rec.getMessage() == "50% done" and rec.created == 5.0
    assert rec.levelname == "WARNING"


GUARDED = """
import os, sys
from pathlib import Path
from rich.console import Console
from rftstream.presentation.console import TerminalGuard
console = Console()
guard = TerminalGuard(console)
guard.start()
print("library print before the log exists", flush=True)
os.write(2, b"C extension on fd 2 before\\n")
console.print("own line 1")
guard.attach(Path(sys.argv[1]))
print("library print after", flush=True)
os.write(1, b"C extension on fd 1 after\\n")
console.print("own line 2")
guard.restore()
print("after restore", flush=True)
"""


def test_terminal_guard_moves_fd_output_to_the_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "rftstream.log"
    proc = subprocess.run(
        [sys.executable, "-c", GUARDED, str(log)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["own line 1", "own line 2", "after restore"]
    assert proc.stderr == ""
    assert log.read_text().splitlines() == [
        "library print before the log exists",  # spooled, then copied in by attach
        "C extension on fd 2 before",
        "library print after",
        "C extension on fd 1 after",
    ]


def test_summary_fits_80_columns_without_breaking_words() -> None:
    rows = [
        ("done in 18s:", "5 trainer steps"),
        (
            "idle after step 1:",
            "trainer 19% (waiting for experience), explorers 6% (no task running)",
        ),
        ("report:", "/tmp/" + "very-long-directory-name/" * 2 + "report.html"),
    ]
    out = io.StringIO()
    print_summary(Console(file=out, width=80, color_system=None), rows)
    lines = out.getvalue().splitlines()
    assert all(len(line) < 80 and line == line.rstrip() for line in lines), lines
    width = len("idle after step 1:") + 1
    # each row's value, read back off its column: words whole
    chunks: list[list[str]] = []
    for line in lines[:-2]:
        label, value = line[:width].strip(), line[width:]
        if label:
            chunks.append([])
        chunks[-1].append(value)
    assert [" ".join(c) for c in chunks] == [rows[0][1], rows[1][1]]
    # the path, longer than the value column, whole on a line of its own under its label
    assert lines[-2:] == ["report:", rows[2][1]]
    assert lines[1].startswith("idle after step 1: trainer 19%")
    assert lines[2] == " " * width + "running)"
    expected = textwrap.wrap(rows[1][1], 80 - 1 - width)
    assert [ln[width:] for ln in lines[1:3]] == expected
