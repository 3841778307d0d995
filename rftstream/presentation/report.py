"""``report.html``: one self-contained page per run (plots, summary table, resolved config).

:func:`save_run_config` writes ``<run_dir>/config.yaml`` (the resolved config, secrets
masked) when a run starts; :func:`write_report` reads that file, ``metrics.jsonl`` and
``eval.jsonl`` (if any) and writes ``<run_dir>/report.html`` with the curves of
:mod:`rftstream.presentation.plot` embedded as a base64 PNG. ``rftstream up`` writes it at the end of
a run; ``rftstream report RUN_DIR`` writes it again. Everything here blocks (file I/O,
rendering).
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import Any

import yaml

from rftstream.config.masking import masked_config
from rftstream.errors import ReportError
from rftstream.presentation.plot import (
    idle_shares,
    metrics_png,
    read_metrics,
    staleness_counts,
    sync_summary,
    throughput,
    window_mean,
)

CONFIG_FILE = "config.yaml"
REPORT_FILE = "report.html"


def save_run_config(cfg: Any, run_dir: str | Path) -> Path:
    """Write the resolved ``cfg`` (secrets masked) to ``<run_dir>/config.yaml``."""
    from rftstream.run_lock import write_private

    path = Path(run_dir) / CONFIG_FILE
    return write_private(path, yaml.safe_dump(masked_config(cfg), sort_keys=False).encode())


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_rows(records: list[dict[str, Any]], config: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows describing a run: names, steps, duration, reward, staleness,
    idle shares, throughput, experiences."""
    rows: list[tuple[str, str]] = []
    algorithm = (config.get("algorithm") or {}).get("algorithm_type")
    model = (config.get("model") or {}).get("model_path")
    for label, value in (
        ("run", config.get("name")),
        ("project / group", f"{config.get('project', '')} / {config.get('group') or ''}"),
        ("algorithm", algorithm),
        ("model", model),
    ):
        if value:
            rows.append((label, str(value)))
    rows.append(("trainer steps", str(len(records))))
    stamps = [float(r["ts"]) for r in records if isinstance(r.get("ts"), (int, float))]
    if len(stamps) > 1:
        rows.append(("first to last step", f"{stamps[-1] - stamps[0]:.1f} s"))
    first, last = (
        window_mean(records, "reward/mean", True),
        window_mean(records, "reward/mean", False),
    )
    if first is not None:
        rows.append(("reward/mean, first 20 -> last 20 steps", f"{first:.3f} -> {_fmt(last)}"))
    counts = staleness_counts(records)
    if counts:
        total = sum(counts.values())
        mean = sum(k * n for k, n in counts.items()) / total
        rows.append(("staleness, mean (max)", f"{mean:.2f} ({max(counts)})"))
    trainer_idle, explorer_idle = idle_shares(records)
    if trainer_idle is not None:
        rows.append(("trainer idle after step 1", f"{trainer_idle:.0%}"))
    if explorer_idle is not None:
        rows.append(("explorers idle after step 1", f"{explorer_idle:.0%}"))
    sync = sync_summary(records, str((config.get("synchronizer") or {}).get("sync_method", "")))
    if sync is not None:
        rows.append(("weights sync after step 1", sync))
    _, rates = throughput(records[1:])
    if rates:
        rows.append(("experiences/s after step 1 (mean)", f"{sum(rates) / len(rates):.1f}"))
    trained = [r.get("experience/trained_total") for r in records]
    trained = [t for t in trained if isinstance(t, (int, float))]
    if trained:
        rows.append(("experiences trained", str(int(trained[-1]))))
    return rows


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _eval_table(evals: list[dict[str, Any]]) -> str:
    keys = sorted({k for r in evals for k in r if k.startswith("eval/") and k.endswith("/mean")})
    if not keys:
        return ""
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["step", *keys])
    lines = []
    for r in evals:
        cells = [str(r.get("step", ""))] + [
            _fmt(r[k]) if isinstance(r.get(k), (int, float)) else "" for k in keys
        ]
        lines.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<h2>Evaluations</h2><table><tr>{head}</tr>{''.join(lines)}</table>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
th { background: #f4f4f4; font-weight: 600; }
img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f8f8f8; padding: 1em; overflow-x: auto; font-size: 90%; }
"""


def render_report(
    records: list[dict[str, Any]],
    config_text: str | None,
    evals: list[dict[str, Any]] | None = None,
    title: str = "rftstream run",
) -> str:
    """The HTML page of a run: summary table, the metrics figure (base64 PNG), the
    evaluations and the resolved config (``config_text``: YAML, secrets already masked)."""
    config = (yaml.safe_load(config_text) or {}) if config_text else {}
    png = base64.b64encode(metrics_png(records)).decode("ascii") if records else ""
    plots = (
        f'<img id="metrics" alt="metrics of {len(records)} trainer steps" '
        f'src="data:image/png;base64,{png}">'
        if png
        else "<p>no trainer steps</p>"
    )
    conf = (
        f'<pre id="config">{html.escape(config_text)}</pre>'
        if config_text
        else f"<p>no {CONFIG_FILE} in the run directory</p>"
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>report written {stamp}</p>"
        f"<h2>Summary</h2>{_table(summary_rows(records, config))}"
        f"<h2>Curves</h2>{plots}"
        f"{_eval_table(evals or [])}"
        f"<h2>Resolved config</h2>{conf}</body></html>\n"
    )


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write ``report.html`` for the run in ``run_dir`` (or at ``out_path``); returns its path.

    Raises :class:`ReportError` when ``run_dir`` has no ``metrics.jsonl`` (not a run
    directory, or a run that never finished a trainer step)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(
            f"{run_dir}: no metrics.jsonl here; give the run directory of a run with at "
            "least one trainer step (`rftstream up --run-dir DIR` wrote it there)"
        )
    records = read_metrics(metrics)
    config_path = run_dir / CONFIG_FILE
    config_text = config_path.read_text() if config_path.is_file() else None
    eval_path = run_dir / "eval.jsonl"
    evals = read_metrics(eval_path) if eval_path.is_file() else []
    name = (yaml.safe_load(config_text) or {}).get("name") if config_text else None
    page = render_report(records, config_text, evals, title=f"rftstream run {name or run_dir.name}")
    out = Path(out_path) if out_path else run_dir / REPORT_FILE
    out.write_text(page)
    return out


__all__ = [
    "CONFIG_FILE",
    "REPORT_FILE",
    "render_report",
    "save_run_config",
    "summary_rows",
    "write_report",
]
