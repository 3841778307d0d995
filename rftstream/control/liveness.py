"""Heartbeats: which actors of a run are alive, and whether a name is free.

Every actor writes ``heartbeat.<actor>`` (:class:`~rftstream.wire.Heartbeat`) every
:data:`HEARTBEAT_S` s (:func:`heartbeat_loop`). ``status``, the splice's trainer check
and the live-name check read them. A heartbeat younger than :data:`LIVE_HEARTBEAT_S`
*may* have a live actor behind it, but a killed actor's last one is young too; only a
new write proves it alive. So the name check is a small machine
(:func:`name_verdict`, pure): a young heartbeat is watched until :data:`HEARTBEAT_WATCH_S`
has passed; rewritten in that time, the name is taken; not, it is free. Its loop
(:func:`refuse_a_live_name`) is :func:`~rftstream.control.driver.drive`, which wakes at the
key's write, not on a poll.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import anyio

from rftstream.bus.state import RunState
from rftstream.control.driver import Clock, drive, wall_clock
from rftstream.errors import RftError, SchemaError
from rftstream.wire import HEARTBEAT, Heartbeat

log = logging.getLogger(__name__)

#: how often an actor writes its heartbeat
HEARTBEAT_S = 5.0
#: a heartbeat older than this has no live actor behind it
LIVE_HEARTBEAT_S = 15.0
#: how long a younger one is watched for the next write: a killed actor writes none
HEARTBEAT_WATCH_S = 6.0


async def heartbeat_loop(
    state: RunState, beat: Callable[[], Heartbeat], interval: float = HEARTBEAT_S
) -> None:
    """Write ``beat()`` (``heartbeat.<actor>``) every ``interval`` s until cancelled.
    KV errors are logged, not raised: a missed heartbeat must not stop the actor."""
    while True:
        record = beat()
        try:
            await state.heartbeat(record)
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat must not kill the actor
            log.debug("%s: heartbeat failed: %s", record.actor, exc)
        await anyio.sleep(interval)


class NameVerdict(enum.Enum):
    """What the live-name check concludes: the name is ``FREE``, ``TAKEN``, or it must
    ``WATCH`` the heartbeat a while longer."""

    FREE = "free"
    TAKEN = "taken"
    WATCH = "watch"


def name_verdict(
    first_ts: float | None, latest_ts: float | None, now: float, until: float
) -> NameVerdict:
    """The live-name check at ``now``: ``first_ts``, the heartbeat's time when the check
    began; ``latest_ts``, its time now (``None``: none, or not a heartbeat); ``until``: the
    end of the watch. Pure."""
    if first_ts is None or not 0 <= now - first_ts < LIVE_HEARTBEAT_S:
        return NameVerdict.FREE  # no actor, or one long dead
    if latest_ts is not None and latest_ts > first_ts:
        return NameVerdict.TAKEN  # written again while we watched: alive
    return NameVerdict.WATCH if now < until else NameVerdict.FREE


async def _heartbeat_ts(state: RunState, name: str) -> float | None:
    try:
        beat = await state.get(HEARTBEAT.of(actor=name))
    except SchemaError:
        return None
    return None if beat is None else beat.ts


async def refuse_a_live_name(
    state: RunState,
    name: str,
    role: str,
    *,
    watch_s: float = HEARTBEAT_WATCH_S,
    clock: Clock = wall_clock,
) -> None:
    """Raise :class:`~rftstream.errors.RftError` when a live actor of the run is named
    ``name``: a second one would overwrite its heartbeat, its ``status`` row and its splice
    records. For the standalone actor commands (``up``'s restarted children keep their
    names). Blocks for KV reads and, while the heartbeat is young, until it is written
    again or ``watch_s`` s have passed (:func:`name_verdict`); it wakes at the key's write."""
    key = HEARTBEAT.of(actor=name)
    first = await _heartbeat_ts(state, name)
    start = clock()
    until = start + watch_s
    if name_verdict(first, first, start, until) is NameVerdict.FREE:
        return

    async def attempt(now: float) -> NameVerdict | None:
        latest = await _heartbeat_ts(state, name)
        verdict = name_verdict(first, latest, now, until)
        if verdict is NameVerdict.TAKEN:
            age = now - (latest or now)
            raise RftError(
                f"actor name {name!r} is taken: a live actor of this run has it (its "
                f"heartbeat was written {age:.0f}s ago); give this {role} another --name"
            )
        return None if verdict is NameVerdict.WATCH else verdict

    await drive(state.kv, [key], attempt, wake_s=lambda: max(0.0, until - clock()), clock=clock)
    log.info("%s: the earlier actor named %r is gone (no heartbeat since)", role, name)
