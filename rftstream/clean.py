"""``rftstream clean``: remove the NATS resources of finished runs.

A run's resources are its streams (``RFT_<RUN>_TASKS|EXP|DLQ|METRICS|WEIGHTS``,
with their consumers), its KV bucket ``rft_<run>_state`` and, left by earlier
releases, an object store ``rft_<run>_weights``. :func:`find_runs` lists every run on a server (by those
names) with its status, newest heartbeat and size; :func:`refusal` says why a
run must not go (not finished, or live) and :func:`remove_run` deletes it.
Parsing ages (``7d``) and the refusal rules are pure.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import msgspec

from rftstream.bus.state import END_STATUSES
from rftstream.bus.transport import Transport
from rftstream.errors import BucketNotFound, BusError, KeyNotFound, RftError, StreamNotFound
from rftstream.subjects import KV_HEARTBEAT_PREFIX

#: a run whose newest heartbeat is younger than this is live (the actors beat every few seconds)
LIVE_HEARTBEAT_S = 30.0

_STREAM_RE = re.compile(r"^RFT_([A-Z0-9_]{1,16})_(TASKS|EXP|DLQ|METRICS|WEIGHTS)$")
_KV_RE = re.compile(r"^KV_rft_([a-z0-9_]{1,16})_state$")
_OBJ_RE = re.compile(r"^OBJ_rft_([a-z0-9_]{1,16})_weights$")
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_age(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` as seconds; ValueError naming the text."""
    m = _AGE_RE.match(text)
    if not m:
        raise ValueError(f"--older-than {text!r}: expected a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_of_stream(name: str) -> str | None:
    """The run id a JetStream stream belongs to (its streams, KV bucket, object store), or None."""
    for pattern in (_STREAM_RE, _KV_RE, _OBJ_RE):
        m = pattern.match(name)
        if m:
            return m.group(1).lower()
    return None


@dataclass
class RunResources:
    """One run's resources on a server, and what its KV bucket says about it."""

    run: str
    streams: dict[str, int] = field(default_factory=dict)  # JetStream stream name -> bytes
    consumers: int = 0
    status: str = ""
    last_heartbeat: float | None = None  # unix time of its newest heartbeat
    last_activity: float | None = None  # newest heartbeat or status write

    @property
    def bytes(self) -> int:
        return sum(self.streams.values())


def refusal(res: RunResources, now: float, *, force: bool, older_than: float | None) -> str | None:
    """Why ``res`` is not removed (None: it goes). ``--force`` overrides status and liveness,
    never ``--older-than``."""
    if older_than is not None:
        if res.last_activity is not None and now - res.last_activity < older_than:
            return f"active {now - res.last_activity:.0f}s ago, not older than {older_than:.0f}s"
    if force:
        return None
    if res.last_heartbeat is not None and now - res.last_heartbeat < LIVE_HEARTBEAT_S:
        return (
            f"live: last heartbeat {now - res.last_heartbeat:.0f}s ago (status "
            f"{res.status or 'unknown'}); stop it first, or --force"
        )
    if res.status not in END_STATUSES:
        return (
            f"not finished (status {res.status or 'unknown'}); it may be resumed: --force "
            "removes it anyway"
        )
    return None


async def _kv_state(transport: Transport, run: str, res: RunResources) -> None:
    """Fill status and heartbeat times from the run's KV bucket (absent: left empty)."""
    try:
        kv = await transport.kv(f"rft_{run}_state", create=False)
    except BucketNotFound:
        return
    times: list[float] = []
    try:
        entry = await kv.get("status")
        res.status = str(msgspec.json.decode(entry.value or b'""'))
        if entry.created is not None:
            times.append(entry.created.timestamp())
    except KeyNotFound:
        pass
    beats: list[float] = []
    for key in await kv.keys(KV_HEARTBEAT_PREFIX):
        try:
            value = msgspec.json.decode((await kv.get(key)).value or b"null")
        except KeyNotFound:
            continue
        if isinstance(value, dict) and isinstance(value.get("ts"), (int, float)):
            beats.append(float(value["ts"]))
    res.last_heartbeat = max(beats) if beats else None
    times.extend(beats)
    res.last_activity = max(times) if times else None


async def find_runs(transport: Transport) -> dict[str, RunResources]:
    """Every run with resources on the server, by run id (a few API round trips per run).

    Raises :class:`BusError` when the server cannot be listed.
    """
    runs: dict[str, RunResources] = {}
    try:
        for name, state in (await transport.streams()).items():
            run = run_of_stream(name)
            if run is None:
                continue
            res = runs.setdefault(run, RunResources(run))
            res.streams[name] = state.bytes
            res.consumers += state.consumer_count
        for run, res in runs.items():
            await _kv_state(transport, run, res)
    except (BusError, TimeoutError) as exc:
        raise BusError(f"listing the server's streams failed: {exc}") from exc
    return runs


async def remove_run(transport: Transport, res: RunResources) -> None:
    """Delete every stream of ``res`` (consumers go with their stream; the KV bucket and
    object store are streams too). A stream already gone is skipped. Raises
    :class:`RftError` naming the run and stream on any other failure."""
    for stream in sorted(res.streams):
        try:
            await transport.delete_stream(stream)
        except StreamNotFound:
            continue
        except (BusError, TimeoutError) as exc:
            raise RftError(f"run {res.run!r}: deleting stream {stream} failed: {exc}") from exc


def now() -> float:
    return time.time()
