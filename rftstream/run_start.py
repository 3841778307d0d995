"""How ``rftstream up`` takes a run directory: the lock, then continue or start over.

:func:`claim_run_dir` is the first thing ``up`` does in the directory, before any
file is written there (logs, ``config.yaml``, ``metrics.jsonl``, the embedded
server's config): it takes the directory's lock (:mod:`rftstream.run_lock`; a live
``up`` holding it is named and nothing is touched), waits for what a crashed ``up``
left running (its nats-server, its children), and decides:

* a directory no ``up`` used: a new run;
* ``--fresh``, or a run that finished (``done``): the earlier run's files move to a
  sibling ``<run_dir>.<timestamp>`` (never deleted) and a new run starts;
* any other earlier run (crashed, killed, stopped by Ctrl-C, failed): it continues
  where its newest resumable checkpoint left it (Trinity-RFT's
  ``continue_from_checkpoint``): the NATS store and its streams, ``metrics.jsonl``
  and the logs are kept, the trainer resumes (see :mod:`rftstream.actors.trainer`).

Then :func:`rftstream.runtime.start_fresh` does the same on the server's side.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rftstream.run_lock import LOCK_FILE, RunLock, move_aside

# what a run directory holds once an up ran in it (besides run.lock)
RUN_FILES = ("metrics.jsonl", "nats", "checkpoints", "logs", "config.yaml")


@dataclass
class RunClaim:
    """The outcome of :func:`claim_run_dir`: the lock (held), whether the earlier run
    continues, and a note for the console (None: a new run in an unused directory)."""

    lock: RunLock
    continuing: bool
    note: str | None = None
    aside: Path | None = None  # where an earlier run's files went
    finished: bool = False  # the earlier run finished and is kept as it is (a stage)


def _has_earlier_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


def runs_moved_aside(run_dir: Path) -> tuple[int, int]:
    """``(count, bytes)`` of the earlier runs of ``run_dir`` moved aside beside it (the
    ``<name>.<YYYYmmdd-HHMMSS>[-n]`` directories :func:`~rftstream.run_lock.move_aside`
    makes; nothing else is counted). Blocks on a walk of those directories; files that
    vanish or cannot be read meanwhile count as nothing."""
    pattern = re.compile(re.escape(run_dir.name) + r"\.\d{8}-\d{6}(-\d+)?")
    count = total = 0
    try:
        siblings = list(run_dir.parent.iterdir())
    except OSError:
        return 0, 0
    for entry in siblings:
        if not pattern.fullmatch(entry.name) or not entry.is_dir() or entry.is_symlink():
            continue
        count += 1
        for root, _, files in os.walk(entry):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass
    return count, total


def _aside_note(run_dir: Path) -> str:
    """What the runs moved aside beside ``run_dir`` hold, for the console; each
    ``up --fresh`` adds one and nothing ever deletes them."""
    count, size = runs_moved_aside(run_dir)
    if count < 2:
        return ""
    return (
        f" ({count} earlier runs moved aside there hold {size / 2**20:,.0f} MiB: delete the "
        f"{run_dir.name}.<time> directories you no longer need)"
    )


def _when(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "?"


def claim_run_dir(run_dir: Path, *, fresh: bool = False, keep_finished: bool = False) -> RunClaim:
    """Lock ``run_dir`` and decide how the run starts (see the module docstring).

    ``keep_finished``: a finished earlier run stays as it is (``finished`` in the claim:
    the stage of a multi-stage config that a continued ``up`` skips) instead of moving
    aside for a new one.

    Blocks: the lock is tried once (no wait); a crashed ``up``'s leftover processes get
    up to :data:`rftstream.run_lock.LEFTOVER_WAIT_S` to exit. Raises
    :class:`~rftstream.run_lock.RunDirBusy` (an ``RftError``) when a live ``up`` holds
    the directory: nothing has been written then.
    """
    lock = RunLock(run_dir).acquire()
    try:
        waited = lock.wait_for_leftovers()
        prev = lock.previous
        if not _has_earlier_run(run_dir):
            return RunClaim(lock, continuing=False)
        if keep_finished and not fresh and prev is not None and prev.status == "done":
            lock.update(status="done", ended=prev.ended)
            return RunClaim(
                lock,
                continuing=False,
                finished=True,
                note=f"finished earlier in {run_dir}: kept as it is (--fresh runs it again)",
            )
        if fresh or (prev is not None and prev.status == "done"):
            aside = move_aside(run_dir, lock)
            why = "--fresh" if fresh else "the earlier run had finished"
            return RunClaim(
                lock,
                continuing=False,
                note=(
                    f"a new run starts ({why}); the earlier run's files are in {aside}"
                    f"{_aside_note(run_dir)}"
                ),
                aside=aside,
            )
        how = {
            "running": "did not exit (killed or crashed)",
            "stopped": "was stopped",
            "failed": "failed",
        }
        ended = how.get(prev.status, prev.status) if prev is not None else "left files here"
        at = f" (pid {prev.pid}, last at {_when(prev.ended or prev.started)})" if prev else ""
        extra = f"; waited for {len(waited)} of its processes to exit" if waited else ""
        return RunClaim(
            lock,
            continuing=True,
            note=(
                f"continuing the run in {run_dir}: it {ended}{at}{extra}. Its newest "
                "checkpoint, streams and metrics are kept; pass --fresh to start over"
            ),
        )
    except BaseException:
        lock.release(lock.previous.status if lock.previous else "stopped")
        raise


__all__ = ["LOCK_FILE", "RunClaim", "claim_run_dir"]
