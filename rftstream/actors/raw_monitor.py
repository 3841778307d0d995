"""What happened upstream of the trainer between two of its steps: the raw rewards the
explorers published and their metrics (:class:`RawMonitor`)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rftstream.bus.client import Bus
from rftstream.experience import H_COUNT, H_REWARD_MEAN
from rftstream.subjects import RAW_STAGE
from rftstream.wire import MetricsMsg

ADVANTAGE_OP_PREFIX = "group_advantage/"  # the pipeline's group advantage metrics


class RawMonitor:
    """Accumulates what happened upstream between trainer steps.

    Eval results an explorer published (``eval/<taskset>/...``) are added to
    the next step's record. The pipeline's group advantage metrics (``group_advantage/<m>`` on the
    metrics stream, e.g. OPMD's ``group_baseline``) are reported as
    ``advantage/<m>``: averaged over the batches since the last step
    (``*_count`` ones summed), the same names the trainer uses when it
    computes the advantage itself.

    Raw rewards come from the summary headers of ``exp.raw`` (a headers-only
    ordered consumer from the stream's start: every raw group stored, counted
    once, nothing missed if the trainer starts late); operator and explorer
    figures (experiences filtered, failed tasks, the explorers' weight swaps: their
    count, longest pause and longest fetch) from the metrics stream.
    """

    def __init__(self) -> None:
        self.reward_sum = 0.0
        self.reward_count = 0.0
        self.raw_groups = 0.0
        self.filtered = 0.0
        self.failed_tasks = 0.0
        self.advantage: dict[str, list[float]] = {}
        self.evals: dict[str, float] = {}  # the latest eval/* results, reported once
        # the explorers' weight syncs since the last take(): swaps, the longest pause, the
        # longest fetch (sync/* of their step metrics)
        self.sync_swaps = 0.0
        self.sync_pause: float | None = None
        self.sync_fetch: float | None = None
        # per explorer: its cumulative (idle seconds, seconds) now and at the last take()
        self._explorer_time: dict[str, tuple[float, float]] = {}
        self._explorer_time_taken: dict[str, tuple[float, float]] = {}
        self._subs: list[Any] = []
        # stream sequences of the last raw / metrics message read, and as of the last take()
        self.read_through: dict[str, int] = {"raw": 0, "metrics": 0}
        self.taken_through: dict[str, int] = {"raw": 0, "metrics": 0}

    def on_raw_headers(self, headers: dict[str, str] | None) -> None:
        h = headers or {}
        try:
            count = int(h.get(H_COUNT, "0"))
            mean = float(h.get(H_REWARD_MEAN, "nan"))
        except ValueError:
            return
        self.raw_groups += 1
        if count and math.isfinite(mean):
            self.reward_sum += mean * count
            self.reward_count += count

    def on_metrics(self, data: bytes) -> None:
        try:
            m = msgspec.json.decode(data, type=MetricsMsg)
        except msgspec.DecodeError:
            return
        if m.role == "explorer":
            self.failed_tasks += m.values.get("rollout/failed_tasks", 0.0)
            idle = m.values.get("explorer/idle_seconds_total")
            total = m.values.get("explorer/seconds_total")
            if idle is not None and total is not None:
                self._explorer_time[m.actor] = (idle, total)
            self.evals.update({k: v for k, v in m.values.items() if k.startswith("eval/")})
            self.sync_swaps += m.values.get("sync/swaps", 0.0)
            pause = m.values.get("sync/explorer_pause_seconds")
            if pause is not None:
                self.sync_pause = max(self.sync_pause or 0.0, pause)
            fetch = m.values.get("sync/fetch_seconds")
            if fetch is not None:
                self.sync_fetch = max(self.sync_fetch or 0.0, fetch)
        elif m.role == "operator":
            self.filtered += m.values.get("operator/experiences_filtered", 0.0)
            for key, value in m.values.items():
                if key.startswith(ADVANTAGE_OP_PREFIX):
                    name = key[len(ADVANTAGE_OP_PREFIX) :]
                    self.advantage.setdefault(name, []).append(float(value))

    async def start(self, bus: Bus, after: dict[str, int] | None = None) -> None:
        """Subscribe to the raw experience headers and the metrics stream, from the
        streams' start, or (a resumed trainer) after the stream sequences ``after`` its
        checkpoint's step had read (:attr:`taken_through`), so the first resumed step
        reports what came since that step, not the whole run."""

        def _seen(kind: str, msg: Any) -> None:
            seq = int(getattr(getattr(msg.metadata, "sequence", None), "stream", 0) or 0)
            self.read_through[kind] = max(self.read_through[kind], seq)

        async def on_raw(msg: Any) -> None:
            self.on_raw_headers(msg.headers)
            _seen("raw", msg)

        async def on_metric(msg: Any) -> None:
            self.on_metrics(msg.data)
            _seen("metrics", msg)

        def since(kind: str) -> int | None:
            seq = int((after or {}).get(kind, 0))
            if seq <= 0:
                return None
            self.read_through[kind] = self.taken_through[kind] = seq
            return seq + 1

        n = bus.names
        self._subs.append(
            await bus.watch(
                n.exp_stream,
                n.exp_subject(RAW_STAGE),
                on_raw,
                start_seq=since("raw"),
                headers_only=True,
                description=f"run {n.run}: the trainer's monitor reads the headers of exp.raw "
                "(rewards, groups, failed tasks); acks nothing",
            )
        )
        self._subs.append(
            await bus.watch(
                n.metrics_stream,
                n.metrics_wildcard,
                on_metric,
                start_seq=since("metrics"),
                description=f"run {n.run}: the trainer's monitor reads the actors' metrics "
                "(filtered, advantages); acks nothing",
            )
        )

    def take(self) -> dict[str, float | None]:
        """The upstream figures since the last call; resets them."""
        out: dict[str, float | None] = {
            "reward/mean": self.reward_sum / self.reward_count if self.reward_count else None,
            "reward/raw_count": self.reward_count,
            "rollout/groups": self.raw_groups,
            "experience/filtered": self.filtered,
            "rollout/failed_tasks": self.failed_tasks,
        }
        for name, values in self.advantage.items():
            agg = sum(values) if name.endswith("_count") else sum(values) / len(values)
            out[f"advantage/{name}"] = agg
        idle = wall = 0.0
        for actor, (i, t) in self._explorer_time.items():
            i0, t0 = self._explorer_time_taken.get(actor, (0.0, 0.0))
            if t < t0:  # the explorer restarted: its counters began again
                i0, t0 = 0.0, 0.0
            idle, wall = idle + i - i0, wall + t - t0
        self._explorer_time_taken = dict(self._explorer_time)
        if wall > 0:
            out["explorer/idle_share"] = max(0.0, min(1.0, idle / wall))
        self.advantage = {}
        out.update(self.evals)
        self.evals = {}
        if self.sync_swaps:
            out["sync/explorer_swaps"] = self.sync_swaps
        if self.sync_pause is not None:
            out["sync/explorer_pause_seconds"] = self.sync_pause
        if self.sync_fetch is not None:
            out["sync/explorer_fetch_seconds"] = self.sync_fetch
        self.sync_swaps, self.sync_pause, self.sync_fetch = 0.0, None, None
        self.reward_sum = self.reward_count = self.raw_groups = self.filtered = (
            self.failed_tasks
        ) = 0.0
        self.taken_through = dict(self.read_through)
        return out

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
