"""Curves of a run's ``metrics.jsonl`` as a PNG (matplotlib, Agg backend). Blocks (file I/O)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PANELS = (
    ("reward/mean", "raw reward (mean, since previous step)"),
    ("staleness/mean", "staleness (trainer version - generating version)"),
    ("time/trainer_wait", "trainer wait for experience (s)"),
    ("actor/pg_loss", "policy loss"),
)


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


def plot_metrics(metrics_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Write ``metrics.png`` beside ``metrics.jsonl`` (or at ``out_path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out = Path(out_path) if out_path else Path(metrics_path).with_name("metrics.png")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        xs = [r["step"] for r in records if isinstance(r.get(key), (int, float))]
        ys = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        ax.plot(xs, ys, marker=".", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
