"""Smoke: ``benchmarks/bus.py`` runs as ``just bench`` runs it, on a few groups, and prints
every scenario with both sides' rates and the ratio against raw nats-py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[2]


def test_bus_benchmark_prints_every_scenario_against_raw_nats() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bus.py"), "--groups", "150", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for label in (
        "producer + consumer at once",
        "publish alone",
        "consume alone",
        "at once, bus only (no codec)",
        "at once, reading every array",
    ):
        row = next((line for line in text.splitlines() if label in line), None)
        assert row is not None, f"no row {label!r} in:\n{text}"
        rates = re.findall(r"\d[\d,]*(?:\.\d+)?x? ", row)
        assert len(rates) >= 3, row  # rftstream rate, raw rate, ratio
    assert re.search(r">= 0\.8x: (PASS|MISS)", text), text
