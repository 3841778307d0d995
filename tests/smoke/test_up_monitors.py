"""Smoke: `rftstream up --steps 2` with every monitor at once, read back from each backend's
files, and the run's report.html (written at the end, written again by `rftstream report`)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._util import user_env
from tests.monitor_readback import mlflow_run, tensorboard_scalars, wandb_offline_run

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]
KEYS = ("reward/mean", "staleness/mean", "experience/trained")


def test_up_writes_the_same_steps_to_every_monitor_and_a_report(
    tmp_path: Path, tiny_model_path: str
) -> None:
    run_dir = tmp_path / "run"
    env = user_env(tiny_model_path)
    for var in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)  # no key: wandb runs offline; mlflow: the run dir's file store
    proc = subprocess.run(
        [*RFTSTREAM, "up", "--steps", "2", "--run-dir", str(run_dir)]
        + ["--set", "monitor.monitor_type=[jsonl, tensorboard, wandb, mlflow]"]
        + ["--set", "group=smoke", "--set", "name=montest"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "wandb:" not in out and "mlflow" not in out.lower()  # their noise stays off

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # a step whose window saw no new rollouts has no reward/mean (null): monitors skip it
    expected = {
        k: [(r["step"], float(r[k])) for r in records if r.get(k) is not None] for k in KEYS
    }
    assert all(expected[k] for k in KEYS) and len(expected["experience/trained"]) == 2

    tb = tensorboard_scalars(run_dir / "tensorboard" / "trainer")
    for key in KEYS:
        assert [s for s, _ in tb[key]] == [s for s, _ in expected[key]]
        assert [v for _, v in tb[key]] == pytest.approx([v for _, v in expected[key]], rel=1e-6)

    wb = wandb_offline_run(run_dir)
    assert (wb["project"], wb["group"], wb["name"]) == ("rftstream", "smoke", "montest_trainer")
    for key in KEYS:
        assert [(row["_step"], row[key]) for row in wb["history"] if key in row] == expected[key]

    ml = mlflow_run(run_dir / "mlruns", "rftstream")
    assert ml["status"] == "FINISHED" and ml["tags"]["group"] == "smoke"
    for key in KEYS:
        assert ml["metrics"][key] == expected[key]

    report = run_dir / "report.html"
    assert f"report: {report}" in " ".join(out.split())
    _check_report(report.read_text(), steps=2)

    report.unlink()
    again = subprocess.run(
        [*RFTSTREAM, "report", str(run_dir)], capture_output=True, text=True, timeout=120, env=env
    )
    assert again.returncode == 0, again.stdout + again.stderr
    _check_report(report.read_text(), steps=2)


def _check_report(page: str, *, steps: int) -> None:
    """The page embeds a real PNG of the curves, the summary and the resolved config."""
    png = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert png is not None
    data = base64.b64decode(png.group(1))
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert f"<th>trainer steps</th><td>{steps}</td>" in page
    config = re.search(r'<pre id="config">(.*?)</pre>', page, re.S)
    assert config is not None
    assert "monitor_type:" in config.group(1) and "- tensorboard" in config.group(1)
    assert "name: montest" in config.group(1) and "total_steps: 2" in config.group(1)
