"""Curves of a run's ``metrics.jsonl`` as one figure (matplotlib, Agg backend).

Panels: the raw reward (each step faint, an exponential moving average bold), the
staleness of the trained experiences as a histogram, the trainer's and explorers' idle
shares, the throughput (experiences trained per second), the policy loss and the mean
response length. Lines carry no markers and the smoothing span grows with the number of
steps, so 2,000 steps read as well as 20. The series helpers are pure; the plotting
functions block (rendering, file I/O).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RAW_ALPHA = 0.25  # opacity of the unsmoothed points
MAX_SPAN = 100  # the most steps one EMA span covers


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file (skips blank lines)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def window_mean(records: list[dict[str, Any]], key: str, first: bool, n: int = 20) -> float | None:
    """Mean of ``key`` over the first (or last) ``n`` records that have a value."""
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    part = vals[:n] if first else vals[-n:]
    return sum(part) / len(part) if part else None


def idle_shares(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(trainer, explorer) idle shares of a run after its first step (the first includes
    everyone's start-up): the trainer's waits over the time from step 1 to the last step,
    and the explorers' idle time over theirs (each step's ``explorer/idle_share`` weighted
    by the step's period)."""
    steady = records[1:]
    if not steady:
        return None, None
    span = sum(float(r.get("time/trainer_step_period") or 0.0) for r in steady)
    if span <= 0:
        return None, None
    waits = sum(float(r.get("time/trainer_wait") or 0.0) for r in steady)
    weighted = [
        (float(r["explorer/idle_share"]), float(r.get("time/trainer_step_period") or 0.0))
        for r in steady
        if isinstance(r.get("explorer/idle_share"), (int, float))
    ]
    covered = sum(w for _, w in weighted)
    explorer = sum(s * w for s, w in weighted) / covered if covered > 0 else None
    return min(1.0, waits / span), explorer


def checkpoint_summary(records: list[dict[str, Any]]) -> str | None:
    """One line on the resumable checkpoints the trainer wrote (``checkpoint/seconds`` and
    ``checkpoint/trigger`` of its records): how many, by trigger, the seconds the trainer
    blocked for them and their share of its steps' time; None when none was written."""
    rows = [r for r in records if isinstance(r.get("checkpoint/seconds"), (int, float))]
    if not rows:
        return None
    seconds = sum(float(r["checkpoint/seconds"]) for r in rows)
    triggers: dict[str, int] = {}
    for r in rows:
        trigger = str(r.get("checkpoint/trigger") or "?")
        triggers[trigger] = triggers.get(trigger, 0) + 1
    period = sum(
        float(r["time/trainer_step_period"])
        for r in records
        if isinstance(r.get("time/trainer_step_period"), (int, float))
    )
    by = ", ".join(f"{n} by {t}" for t, n in sorted(triggers.items()))
    share = f" ({seconds / period:.0%} of the trainer's time)" if period > 0 else ""
    return f"{len(rows)} resumable ({by}), {seconds:.1f}s in all{share}"


def sync_summary(records: list[dict[str, Any]], method: str = "") -> str | None:
    """One line on the run's weight syncs after step 1 (``sync/*`` of the trainer's
    records): versions sent, bytes each, the trainer's wait per step and its share of
    the step, the explorers' longest pause and their typical fetch; None without syncs."""
    steady = records[1:] or records

    def col(key: str, rows: list[dict[str, Any]] = steady) -> list[float]:
        return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]

    sizes = col("sync/bytes", records)
    blocking = col("sync/trainer_blocking_seconds")
    if not sizes and not any(blocking):
        return None
    handed = sum(1 for v in col("sync/trainer_blocking_seconds", records) if v > 0)
    versions = handed or len(sizes)  # the last may go out after the last record
    totals = col("sync/versions_total", records)
    each = None
    if totals and max(totals) > 0:  # jetstream: what went out, over the versions it was
        each = max(col("sync/bytes_total", records) or [0.0]) / max(totals)
    elif sizes:
        each = sorted(sizes)[len(sizes) // 2]
    shares = [
        float(r["sync/trainer_blocking_seconds"]) / float(r["time/trainer_step_period"])
        for r in steady
        if r.get("time/trainer_step_period") and "sync/trainer_blocking_seconds" in r
    ]
    parts = [f"{method + ': ' if method else ''}{versions} versions"]
    if each:
        parts[0] += f", {each / 1e6:.2f} MB each"
        raw = col("sync/raw_bytes", records)
        if raw:
            parts[0] += f" ({each / max(raw):.0%} of their raw bytes)"
    if blocking:
        wait = sorted(blocking)[len(blocking) // 2]
        share = sorted(shares)[len(shares) // 2] if shares else None
        parts.append(
            f"trainer blocked {wait * 1000:.0f} ms a step"
            + (f" ({share:.0%} of it)" if share is not None else "")
        )
    pauses = col("sync/explorer_pause_seconds", records)
    if pauses:
        parts.append(f"explorers paused at most {max(pauses) * 1000:.2f} ms")
    fetches = col("sync/explorer_fetch_seconds", records)
    if fetches:
        parts.append(f"fetched in {sorted(fetches)[len(fetches) // 2] * 1000:.0f} ms")
    return "; ".join(parts)


# ------------------------------------------------------------------ series (pure)


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average: ``s[0] = v[0]``, ``s[i] = alpha*v[i] + (1-alpha)*s[i-1]``.

    Raises ValueError unless ``0 < alpha <= 1``."""
    if not 0 < alpha <= 1:
        raise ValueError(f"ema: alpha must be in (0, 1], got {alpha}")
    out: list[float] = []
    for v in values:
        out.append(float(v) if not out else alpha * float(v) + (1 - alpha) * out[-1])
    return out


def smoothing_alpha(n: int) -> float:
    """The EMA weight for ``n`` points: ``2 / (span + 1)`` with a span of ``n / 30``
    steps, at least 1 (no smoothing) and at most :data:`MAX_SPAN`."""
    span = min(MAX_SPAN, max(1.0, n / 30))
    return 2.0 / (span + 1.0)


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where ``key`` has a numeric value."""
    xs: list[int] = []
    ys: list[float] = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def throughput(records: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(steps, experiences trained per second): each step's ``experience/trained`` over
    its ``time/trainer_step_period`` (steps without a positive period are left out)."""
    xs: list[int] = []
    ys: list[float] = []
    for r in records:
        n, period = r.get("experience/trained"), r.get("time/trainer_step_period")
        if isinstance(n, (int, float)) and isinstance(period, (int, float)) and period > 0:
            xs.append(int(r["step"]))
            ys.append(float(n) / float(period))
    return xs, ys


def staleness_counts(records: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Trained experiences per staleness value over the run, from ``staleness/counts``;
    records without it (older runs) count their ``experience/trained`` at their rounded
    ``staleness/mean``."""
    total: Counter[int] = Counter()
    for r in records:
        counts = r.get("staleness/counts")
        if isinstance(counts, dict):
            for k, n in counts.items():
                total[int(k)] += int(n)
        elif isinstance(r.get("staleness/mean"), (int, float)):
            total[round(float(r["staleness/mean"]))] += int(r.get("experience/trained") or 1)
    return dict(sorted(total.items()))


# ------------------------------------------------------------------ figure (blocks)


def _smoothed(ax: Any, xs: list[int], ys: list[float], label: str, color: str) -> None:
    """Raw points as a faint thin line, their EMA as a bold one; no markers."""
    if not xs:
        return
    ax.plot(xs, ys, color=color, alpha=RAW_ALPHA, linewidth=0.8)
    ax.plot(xs, ema(ys, smoothing_alpha(len(ys))), color=color, linewidth=2.0, label=label)


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def render_metrics(records: Sequence[dict[str, Any]]) -> Any:
    """A matplotlib Figure of the run's panels (caller closes it with ``plt.close``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (rew, stale, idle), (thr, loss, length) = axes
    n = len(records)
    span = round(min(MAX_SPAN, max(1.0, n / 30)))
    smooth_note = f"EMA span {span} steps, raw faint" if span > 1 else "raw"

    xs, ys = series(records, "reward/mean")
    _smoothed(rew, xs, ys, "reward/mean", "tab:blue")
    rew.set_title(f"raw reward, mean since previous step ({smooth_note})", fontsize=10)
    if not xs:
        _empty(rew, "rollout reward")

    counts = staleness_counts(records)
    if counts:
        total = sum(counts.values())
        stale.bar(list(counts), [c / total for c in counts.values()], color="tab:purple")
        stale.set_xticks(list(counts))
        stale.set_xlabel("staleness (trainer version - generating version)")
        stale.set_ylabel("share of trained experiences")
    else:
        _empty(stale, "staleness")
    stale.set_title("staleness of trained experiences", fontsize=10)

    for key, label, color in (
        ("trainer/idle_share", "trainer (waiting for experience)", "tab:red"),
        ("explorer/idle_share", "explorers (no task running)", "tab:green"),
    ):
        xs, ys = series(records, key)
        _smoothed(idle, xs, ys, label, color)
    idle.set_ylim(-0.02, 1.02)
    idle.set_title(f"idle share ({smooth_note})", fontsize=10)
    if idle.lines:
        idle.legend(fontsize=8, loc="upper right")
    else:
        _empty(idle, "idle shares")

    xs, ys = throughput(records)
    _smoothed(thr, xs, ys, "experiences/s", "tab:orange")
    thr.set_title("throughput: experiences trained per second", fontsize=10)
    if not xs:
        _empty(thr, "throughput")

    xs, ys = series(records, "actor/pg_loss")
    if not xs:
        xs, ys = series(records, "actor/loss")
    _smoothed(loss, xs, ys, "loss", "tab:gray")
    loss.set_title("policy loss", fontsize=10)
    if not xs:
        _empty(loss, "policy loss")

    xs, ys = series(records, "response_length/mean")
    _smoothed(length, xs, ys, "tokens", "tab:brown")
    length.set_title("response length (tokens, mean)", fontsize=10)
    if not xs:
        _empty(length, "response length")

    for ax in axes.flat:
        if ax is not stale and ax.lines:
            ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def metrics_png(records: Sequence[dict[str, Any]], dpi: int = 100) -> bytes:
    """The figure of :func:`render_metrics` as PNG bytes. Blocks (rendering)."""
    import matplotlib.pyplot as plt

    fig = render_metrics(records)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()
    finally:
        plt.close(fig)


def plot_metrics(metrics_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Write ``metrics.png`` beside ``metrics.jsonl`` (or at ``out_path``). Blocks."""
    out = Path(out_path) if out_path else Path(metrics_path).with_name("metrics.png")
    out.write_bytes(metrics_png(read_metrics(metrics_path)))
    return out
