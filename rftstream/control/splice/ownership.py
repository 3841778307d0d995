"""Who serves a spliced stage (``stage.<Y>``'s ``owner``), without I/O.

A stage's owner refreshes its claim every ``Timing.owner_refresh_s``; one not seen
for ``Timing.owner_stale_s`` (or whose pid is gone on this host) may be taken over,
and a process that finds another claim in place of its own stops serving, so two
processes never serve one stage. Time is passed in; the pid check is the caller's
(:func:`rftstream.control.splice.operator_side.local_pid_alive`).
"""

from __future__ import annotations

import json
import shlex

import msgspec

from rftstream.control.splice.protocol import DEFAULT_TIMING, Timing
from rftstream.errors import RftError
from rftstream.wire import Owner, StageRecord


def owner_alive(
    owner: Owner | None,
    now: float,
    pid_alive: bool | None = None,
    timing: Timing = DEFAULT_TIMING,
) -> bool:
    """Whether the process serving a stage still runs: ``pid_alive`` (its pid checked on
    this host; None: another host) decides when known, else its last refresh must be
    younger than :attr:`Timing.owner_stale_s`."""
    if owner is None or pid_alive is False:
        return False
    return now - owner.ts < timing.owner_stale_s


class StageTaken(RftError):
    """Another live process serves the stage."""


def claim_owner(
    record: StageRecord,
    me: Owner,
    now: float,
    pid_alive: bool | None = None,
    timing: Timing = DEFAULT_TIMING,
) -> StageRecord:
    """``record`` with ``me`` as its owner (write it compare-and-set); raises
    :class:`StageTaken` when another live process owns it (``pid_alive``: of the
    current owner, see :func:`owner_alive`). A stale owner is taken over."""
    current = record.owner
    mine = (current.pid, current.host) == (me.pid, me.host)
    if owner_alive(current, now, pid_alive, timing) and not mine:
        raise StageTaken(
            f"exp.{record.to_stage} is already served by {current.actor!r} (pid {current.pid} "
            f"on {current.host}, seen {now - current.ts:.0f}s ago); "
            "stop it first (Ctrl-C removes the stage, SIGKILL leaves it spliced)"
        )
    return msgspec.structs.replace(record, owner=me)


class TakenOver(RftError):
    """Another process claimed the stage while this one looked gone: stop serving it."""


def refresh_owner(
    record: StageRecord | None, mine: Owner, now: float, timing: Timing = DEFAULT_TIMING
) -> StageRecord | None:
    """The stage record with this process's claim refreshed to ``now`` (write it
    compare-and-set); None when the record is gone (unspliced: stop refreshing). Raises
    :class:`TakenOver` when another process owns it now."""
    if record is None:
        return None
    if not mine.same_claim(record.owner):
        other = record.owner
        raise TakenOver(
            f"exp.{record.to_stage}: {other.actor!r} (pid {other.pid} on {other.host}) took the "
            f"stage over while {mine.actor!r} (pid {mine.pid}) looked gone (no refresh for "
            f"{timing.owner_stale_s:.0f}s); this process stops serving it"
        )
    return msgspec.structs.replace(record, owner=msgspec.structs.replace(mine, ts=now))


def restart_hint(record: StageRecord) -> str:
    """The command that resumes the operator of a spliced stage."""
    parts = ["rftstream", "operator", record.operator]
    if record.args:
        parts += ["--args", json.dumps(record.args)]
    parts += ["--splice", "--to", record.to_stage]
    return " ".join(shlex.quote(p) for p in parts) + " --config C --nats-url U"


def dead_stage_message(record: StageRecord, now: float) -> str:
    """What ``trainer.waiting`` says while the operator of ``record`` is gone."""
    owner = record.owner
    seen = f"last seen {now - owner.ts:.0f}s ago" if owner.ts else "never started"
    return (
        f"the trainer waits for exp.{record.to_stage}, spliced in by operator "
        f"{record.operator!r}, whose process is gone ({seen}); restart it with "
        f"`{restart_hint(record)}` (it resumes where it stopped), then remove it "
        f"with Ctrl-C or `rftstream operator --unsplice {record.to_stage}` if you want it out"
    )
