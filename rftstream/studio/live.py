"""The live view of ``rftstream studio``: one run as NATS holds it.

Reads only (no durable consumer is created, nothing is acked): the runs on the
server (:func:`rftstream.clean.find_runs`), a run's streams with per-subject
depths and each consumer's lag (:func:`rftstream.operations.stream_view.streams_report`),
its KV bucket (steps, staleness, heartbeats, the stage chain:
:func:`rftstream.presentation.message_summaries.status_report`), the trainer's reward and staleness per
step from the metrics stream (the reward also smoothed as ``metrics.png`` smooths it:
:func:`smoothed_curve`), and the newest dead letters with their reasons.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import Transport
from rftstream.clean import find_runs
from rftstream.config.schema import NatsConfig
from rftstream.errors import BucketNotFound, BusError, MessageNotFound, StreamNotFound
from rftstream.operations.stream_view import streams_report
from rftstream.presentation.message_summaries import status_report, summarize_message
from rftstream.presentation.plot import RAW_ALPHA, ema, smoothing_alpha
from rftstream.subjects import RunNames
from rftstream.wire import MetricsMsg

__all__ = [
    "CURVE_KEYS",
    "SMOOTHED_KEYS",
    "MetricsReader",
    "list_runs",
    "run_snapshot",
    "smoothed_curve",
]

# trainer step metrics drawn as curves: key in the metrics record -> label
CURVE_KEYS: dict[str, str] = {
    "reward/mean": "reward (mean of the trained experiences' raw rewards)",
    "staleness/mean": "staleness (trainer version - generating version)",
}
# curves also drawn smoothed, raw faint (as metrics.png draws them)
SMOOTHED_KEYS: tuple[str, ...] = ("reward/mean",)
MAX_POINTS = 5000  # per curve (the newest)
DEAD_LETTERS_SHOWN = 20


@dataclass
class _Series:
    """The trainer's curves of one run, read so far up to stream sequence ``last_seq``."""

    last_seq: int = 0
    steps: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


class MetricsReader:
    """Reads a run's metrics stream incrementally: each call reads only what was
    published since the previous one (per run)."""

    def __init__(self) -> None:
        self._runs: dict[str, _Series] = {}

    def forget(self, run: str) -> None:
        """Drop what was read of ``run`` (it starts again: read its stream afresh)."""
        self._runs.pop(run, None)

    async def curves(self, transport: Transport, names: RunNames) -> dict[str, list[list[float]]]:
        """The trainer's ``CURVE_KEYS`` per step, ``{key: [[step, value], ...]}``, step order.

        Reads the metrics stream from the sequence after the last one read, with an
        ordered (ephemeral) consumer, until caught up. Blocks for at most about a
        second when nothing new is there. A run without a metrics stream gives no points.
        """
        series = self._runs.setdefault(names.run, _Series())
        try:
            last = (await transport.stream_state(names.metrics_stream)).last_seq
        except StreamNotFound:
            return {key: [] for key in CURVE_KEYS}
        if last < series.last_seq:  # the stream was made anew (a fresh run of that name)
            series = self._runs[names.run] = _Series()
        if last > series.last_seq:
            reader = await transport.read(
                names.metrics_stream,
                names.metrics_wildcard,
                start_seq=series.last_seq + 1,
                description=f"rftstream studio: reads the metrics of run {names.run} for its "
                "curves",
            )
            try:
                while series.last_seq < last:
                    msg = await reader.next(1.0)
                    if msg is None:
                        break
                    series.last_seq = int(msg.metadata.sequence.stream)
                    self._add(series, msg.data)
            finally:
                await reader.close()
        return {
            key: [[s, v] for s, v in sorted(series.steps.get(key, []))[-MAX_POINTS:]]
            for key in CURVE_KEYS
        }

    @staticmethod
    def _add(series: _Series, body: bytes) -> None:
        try:
            record = msgspec.json.decode(body, type=MetricsMsg)
        except msgspec.DecodeError:
            return  # not a metrics record: nothing to draw
        if record.role != "trainer":
            return
        for key in CURVE_KEYS:
            value = record.values.get(key)
            if isinstance(value, (int, float)):
                series.steps.setdefault(key, []).append((int(record.step), float(value)))


def smoothed_curve(points: list[list[float]]) -> dict[str, Any]:
    """``points`` (``[[step, value], ...]``) smoothed as ``metrics.png`` smooths its curves
    (:func:`rftstream.presentation.plot.ema` with :func:`rftstream.presentation.plot.smoothing_alpha` of the
    number of points): ``{"points": [[step, smoothed], ...], "span": EMA span in steps
    (1: not smoothed), "raw_alpha": the raw line's opacity there}``. Pure."""
    alpha = smoothing_alpha(len(points))
    values = ema([v for _, v in points], alpha)
    return {
        "points": [[p[0], v] for p, v in zip(points, values, strict=True)],
        "span": round(2.0 / alpha - 1.0),
        "raw_alpha": RAW_ALPHA,
    }


async def list_runs(transport: Transport) -> list[dict[str, Any]]:
    """Every run on the server: id, status, seconds since its newest heartbeat, bytes.
    Raises :class:`BusError` when the server cannot be listed."""
    now = time.time()
    runs = await find_runs(transport)
    return [
        {
            "run": res.run,
            "status": res.status or "unknown",
            "heartbeat_age": None if res.last_heartbeat is None else now - res.last_heartbeat,
            "bytes": res.bytes,
        }
        for res in sorted(runs.values(), key=lambda r: -(r.last_activity or 0.0))
    ]


async def _dead_letters(transport: Transport, names: RunNames) -> dict[str, Any]:
    """The run's dead-letter count and its newest :data:`DEAD_LETTERS_SHOWN` messages,
    each summarised with its reason headers (direct gets of the last sequences)."""
    try:
        info = await transport.stream_state(names.dlq_stream)
    except StreamNotFound:
        return {"count": 0, "messages": []}
    shown = []
    seq = info.last_seq
    while seq >= max(info.first_seq, 1) and len(shown) < DEAD_LETTERS_SHOWN:
        try:
            raw = await transport.get_msg(names.dlq_stream, seq)
        except MessageNotFound:
            seq -= 1
            continue
        item = summarize_message(raw.subject, seq, raw.headers, raw.data)
        shown.append(item)
        seq -= 1
    return {"count": info.messages, "messages": shown}


async def run_snapshot(transport: Transport, run: str, metrics: MetricsReader) -> dict[str, Any]:
    """Everything the live page shows of ``run`` now: ``status`` (steps, staleness,
    heartbeats, stage chain), ``streams`` (depths, consumers' lag), ``curves``,
    ``smoothed`` (:func:`smoothed_curve` of the :data:`SMOOTHED_KEYS` curves) and
    ``dead_letters``. Raises :class:`BusError` naming the run when it has no KV bucket
    on the server, or when the server does not answer."""
    try:
        names = RunNames(run)
    except ValueError as exc:
        raise BusError(str(exc)) from exc
    bus = Bus(transport, names, NatsConfig(), "studio")  # shares the studio's connection
    try:
        kv = await transport.kv(names.kv_bucket, create=False)
    except BucketNotFound as exc:
        raise BusError(
            f"run {run!r}: no KV bucket {names.kv_bucket} on this server (no such run)"
        ) from exc
    except (BusError, TimeoutError) as exc:
        raise BusError(f"run {run!r}: reading it from NATS failed: {exc}") from exc
    try:
        values = await RunState(kv).all()
        report = status_report(values, time.time())
        streams = [asdict(row) for row in await streams_report(bus)]
        curves = await metrics.curves(transport, names)
        dead = await _dead_letters(transport, names)
    except (BusError, TimeoutError) as exc:
        raise BusError(f"run {run!r}: reading it from NATS failed: {exc}") from exc
    return {
        "run": run,
        "status_value": values.get("status"),
        "status": report,
        "streams": streams,
        "curves": curves,
        "curve_labels": CURVE_KEYS,
        "smoothed": {key: smoothed_curve(curves[key]) for key in SMOOTHED_KEYS},
        "dead_letters": dead,
    }
