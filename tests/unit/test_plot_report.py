"""The run's curves (rftstream.presentation.plot) on synthetic series, and report.html (rftstream.presentation.report)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rftstream.config import config_from_dict
from rftstream.errors import ReportError
from rftstream.presentation.plot import (
    RAW_ALPHA,
    ema,
    render_metrics,
    smoothing_alpha,
    staleness_counts,
    throughput,
)
from rftstream.presentation.report import save_run_config, summary_rows, write_report


def synthetic(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "step": i + 1,
            "ts": 1000.0 + 0.5 * i,
            "reward/mean": float(0.2 + 0.5 * (1 - math.exp(-i / 300)) + rng.normal(0, 0.1)),
            "staleness/counts": {"1": 40, "2": 24} if i % 2 else {"0": 8, "1": 56},
            "staleness/mean": 1.0,
            "trainer/idle_share": 0.1,
            "explorer/idle_share": 0.4,
            "time/trainer_wait": 0.05,
            "experience/trained": 64,
            "experience/trained_total": 64 * (i + 1),
            "time/trainer_step_period": 0.5,
            "actor/pg_loss": float(rng.normal(0, 0.03)),
            "response_length/mean": 20.0,
        }
        for i in range(n)
    ]


def test_ema_matches_the_recursive_formula_and_pandas_style_weights() -> None:
    values = np.random.default_rng(1).normal(size=50)
    alpha = 0.2
    # the closed form of s[i] = a*v[i] + (1-a)*s[i-1], s[0] = v[0]:
    # s[i] = (1-a)^i v[0] + sum_{j=1..i} a (1-a)^(i-j) v[j]
    closed = [
        (1 - alpha) ** i * values[0]
        + sum(alpha * (1 - alpha) ** (i - j) * values[j] for j in range(1, i + 1))
        for i in range(len(values))
    ]
    assert ema(values.tolist(), alpha) == pytest.approx(closed, rel=1e-12, abs=1e-12)
    assert ema([3.0, 5.0], 1.0) == [3.0, 5.0]  # alpha 1: no smoothing
    with pytest.raises(ValueError, match="alpha"):
        ema([1.0], 0.0)


def test_smoothing_span_grows_with_the_steps_and_is_capped() -> None:
    assert smoothing_alpha(10) == 1.0  # span 1: raw
    assert smoothing_alpha(600) == pytest.approx(2 / 21)  # span 600 / 30 = 20
    assert smoothing_alpha(100_000) == pytest.approx(2 / 101)  # capped at 100


def test_staleness_histogram_and_throughput_series() -> None:
    records = synthetic(4)
    assert staleness_counts(records) == {0: 16, 1: 192, 2: 48}
    old = [{"step": 1, "staleness/mean": 1.6, "experience/trained": 10}]  # before counts
    assert staleness_counts(old) == {2: 10}
    records[2]["time/trainer_step_period"] = 0.0  # no period: no point
    assert throughput(records) == ([1, 2, 4], [128.0, 128.0, 128.0])


def test_two_thousand_steps_plot_smoothed_without_markers() -> None:
    import matplotlib.pyplot as plt

    records = synthetic(2000)
    fig = render_metrics(records)
    try:
        reward_ax, stale_ax = fig.axes[0], fig.axes[1]
        raw, smooth = reward_ax.lines
        assert raw.get_marker() in ("None", None, "") and smooth.get_marker() in ("None", None, "")
        assert raw.get_alpha() == RAW_ALPHA and smooth.get_alpha() is None
        ys = [r["reward/mean"] for r in records]
        assert list(smooth.get_ydata()) == pytest.approx(ema(ys, smoothing_alpha(2000)))
        # the smoothed curve is calmer than the raw one
        assert np.std(np.diff(smooth.get_ydata())) < np.std(np.diff(ys)) / 10
        # staleness is a histogram: one bar per value, heights the share of experiences
        heights = [p.get_height() for p in stale_ax.patches]
        assert heights == pytest.approx([8000 / 128000, 96000 / 128000, 24000 / 128000])
        assert not stale_ax.lines
        assert len(fig.axes[2].lines) == 4  # trainer and explorer idle: raw + smoothed each
    finally:
        plt.close(fig)


def test_summary_rows_from_records() -> None:
    rows = dict(summary_rows(synthetic(30), {"name": "r", "algorithm": {"algorithm_type": "grpo"}}))
    assert rows["trainer steps"] == "30"
    assert rows["algorithm"] == "grpo"
    assert rows["first to last step"] == "14.5 s"
    assert rows["experiences/s after step 1 (mean)"] == "128.0"
    assert rows["experiences trained"] == str(64 * 30)
    assert (
        rows["staleness, mean (max)"]
        == f"{(15 * (1 * 40 + 2 * 24) + 15 * (0 * 8 + 1 * 56)) / (30 * 64):.2f} (2)"
    )


def test_report_embeds_the_curves_and_the_masked_config(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in synthetic(12)))
    cfg = config_from_dict(
        {
            "name": "rep",
            "monitor": {"monitor_type": "wandb", "monitor_args": {"api_key": "sk-secret-1"}},
        }
    )
    save_run_config(cfg, tmp_path)
    page = write_report(tmp_path).read_text()
    assert "<title>rftstream run rep</title>" in page
    assert "data:image/png;base64,iVBORw0KGgo" in page  # a PNG
    assert "api_key: &#x27;***&#x27;" in page or "api_key: &#39;***&#39;" in page
    assert "sk-secret-1" not in page and "sk-secret-1" not in (tmp_path / "config.yaml").read_text()
