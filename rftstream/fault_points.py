"""Named points where a chaos test can freeze a process, to kill the run exactly there.

``RFTSTREAM_FREEZE_AT=<point>:<marker file>`` in a process's environment (``rftstream
up`` hands its environment to its children): the first time that process reaches
``<point>`` while ``<marker file>`` does not exist, it creates the marker and sleeps
until it is killed. A test waits for the marker, then SIGKILLs the whole run: a crash in
the middle of that operation, every time. Without the variable (every real run) a point
costs one dictionary lookup.

Points: ``purge`` (the purge of acked experience is recorded in the run's ledger, the
purge itself not done yet: :func:`rftstream.retention.limits.purge_acked`), ``checkpoint``
(DeepSpeed wrote a resumable checkpoint, its state file not yet:
:func:`rftstream.training.checkpoint.save_resumable`).
"""

from __future__ import annotations

import os
import time

ENV = "RFTSTREAM_FREEZE_AT"


def fault_point(point: str) -> None:
    """Freeze here (sleep until killed) when the environment asks for ``point`` and its
    marker file does not exist yet (it is created first). Blocks only then."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, marker = wanted.partition(":")
    if name != point or not marker:
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # frozen once already: the run continues normally from now on
    os.write(fd, f"{point} {os.getpid()}\n".encode())
    os.close(fd)
    while True:  # the test kills the run now
        time.sleep(3600)


__all__ = ["ENV", "fault_point"]
