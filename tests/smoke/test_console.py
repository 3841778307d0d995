"""Smoke: what a person sees on the terminal is rftstream's own lines; libraries' output goes
to the run's log files (``rftstream up`` and its child processes, and an actor command)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._util import sft_config, user_env, write_config

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]

# a "library" loaded with --plugin-dir (in `up` and in each child process): it warns, prints,
# writes to fd 2 as a C extension would and logs through a third-party logger
NOISY_LIBRARY = """
import logging, os, warnings
warnings.warn("noisy-library: `past_key_values` is deprecated", FutureWarning, stacklevel=1)
print("noisy-library: Writing model shards: 100%|##########| 1/1", flush=True)
os.write(2, b"noisy-library: [WARNING] [real_accelerator.py:1] fd 2 from C\\n")
logging.getLogger("transformers.noisy").warning("noisy-library: a library logger's warning")
"""
NOISE = (
    "noisy-library: `past_key_values` is deprecated",
    "noisy-library: Writing model shards",
    "noisy-library: [WARNING] [real_accelerator.py:1] fd 2 from C",
    "noisy-library: a library logger's warning",
)
FORBIDDEN = ("Warning", "warn(", "DeepSpeed", "[WARNING]", "ld:", "%|", "noisy-library")

RICH_LOG = r"(\[\d\d/\d\d/\d\d \d\d:\d\d:\d\d\]| {19}) (INFO|WARNING) +\S.*"  # RichHandler
STEP = r"step +\d+  reward +\S+  filtered +\d+  staleness +\S+  wait +\S+s  loss \S+"
SUMMARY_LABELS = (
    "done in",
    "reward/mean:",
    "idle after step 1:",
    "weights sync:",
    "checkpoints:",
    "curves:",
    "report:",
    "logs:",
)
UP_LINES = [
    r"NATS listening on nats://127\.0\.0\.1:\d+ \(JetStream store .*\)",
    r"run \S+  algorithm \S+  model \S+",
    r"run dir \S+  \(metrics\.jsonl, checkpoints/, logs/: library warnings and child .*\)",
    r"inspect the run with the NATS CLI:",
    r"  \$ export NATS_URL=nats://127\.0\.0\.1:\d+ NATS_USER=rftstream "
    r"NATS_PASSWORD=\$\(cat \S+/nats/password\)",
    r"  \$ nats (stream|consumer|sub|kv) .*",
    r"explorer and operator host run in processes .*; the trainer runs here",
    STEP,
    RICH_LOG,
    r" {29}\S.*",  # a wrapped log message
    r"(done in \d+s:|reward/mean:|idle after step 1:|weights sync:|checkpoints:|curves:|"
    r"report:|logs:)"
    r"( +\S.*)?",
    r" {19}\S.*",  # a wrapped summary value
    r"/\S+",  # a path too long for the value column, on a line of its own
]


def _foreign(lines: list[str], shapes: list[str]) -> list[str]:
    """The lines that are none of rftstream's ``shapes``, or that carry library noise."""
    return [
        line
        for line in lines
        if not any(re.fullmatch(shape, line.rstrip()) for shape in shapes)
        or any(word in line for word in FORBIDDEN)
    ]


@pytest.fixture
def noisy_plugins(tmp_path: Path) -> Path:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "noisy_library.py").write_text(NOISY_LIBRARY)
    return plugins


def test_up_console(tmp_path: Path, tiny_model_path: str, noisy_plugins: Path) -> None:
    """The terminal of ``rftstream up`` shows only rftstream's lines (short test name: the
    summary's paths, under tmp_path, fit 80 columns)."""
    run_dir = tmp_path / "run"
    env = user_env(tiny_model_path) | {"COLUMNS": "80"}
    proc = subprocess.run(
        [*RFTSTREAM, "up", "--steps", "5", "--run-dir", str(run_dir), "--log-level", "INFO"]
        + ["--plugin-dir", str(noisy_plugins)],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert _foreign(lines, UP_LINES) == [], proc.stdout
    assert sum(bool(re.fullmatch(STEP, line)) for line in lines) == 5
    # --log-level INFO: the explorer's own INFO lines, from its child process, are shown
    assert re.search(r"explorer: loaded weights v[1-5] ", proc.stdout), proc.stdout
    # the library noise of this process and of each child is in its log file
    logs = run_dir / "logs"
    for name in ("rftstream.log", "explorer.log", "operator.log"):
        text = (logs / name).read_text()
        for noise in NOISE:
            assert noise in text, f"{noise!r} not in {name}"
    # one trainer rank: DeepSpeed's shared-memory op is not built (no gcc at start-up)
    assert "shm_comm_op built successfully" not in (logs / "rftstream.log").read_text()
    # the summary: every line fits an 80-column terminal, without trailing padding
    start = next(i for i, line in enumerate(lines) if line.startswith("done in"))
    summary = lines[start:]
    labels = [line.split(":")[0] for line in summary if not line.startswith((" ", "/"))]
    assert [label + ":" for label in labels[1:]] == list(SUMMARY_LABELS[1:])
    for label in ("curves", "report", "logs"):  # each path whole, copyable
        assert f"{label}: {run_dir}" in " ".join(proc.stdout.split())
    assert all(len(line) < 80 and line == line.rstrip() for line in summary), summary
    assert "idle after step 1: trainer" in " ".join(proc.stdout.split())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]


def test_trainer_console(
    tmp_path: Path, tiny_model_path: str, nats_url: str, noisy_plugins: Path
) -> None:
    """The terminal of ``rftstream trainer`` alone (SFT on a file, ``mode: train``) against a running server."""
    cfg = sft_config(tmp_path, tiny_model_path, "console_sft", rows=8, batch=4)
    path = write_config(cfg, tmp_path / "sft.yaml")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*RFTSTREAM, "trainer", "--config", str(path), "--nats-url", nats_url]
        + ["--run-dir", str(run_dir), "--plugin-dir", str(noisy_plugins)],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(tiny_model_path) | {"COLUMNS": "80"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr == ""
    shapes = [
        r"trainer trainer of run console_sft on nats://\S+; library output in \S+",
        STEP,
        RICH_LOG,
        r" {29}\S.*",
    ]
    lines = proc.stdout.splitlines()
    assert _foreign(lines, shapes) == [], proc.stdout
    assert sum(line.startswith("step ") for line in lines) == 2
    log = (run_dir / "logs" / "rftstream.log").read_text()
    for noise in NOISE:
        assert noise in log, noise
