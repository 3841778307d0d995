"""Smoke: ``benchmarks/bus.py --quick --rounds 1`` (about 30 s on 2 cores) prints its
configuration, a row with both sides' rates and the ratio for every scenario and size,
and the verdict line; it exits 0 (PASS) or 1 (MISS: a one-round quick run may miss
on a loaded machine), never 2 (an error) or with a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[2]

SCENARIOS = (
    "HEADLINE: at once, arrays read",
    "publish alone",
    "consume alone, arrays read",
    "at once, bus only (no codec)",
)
SIZES = ("8 KiB", "64 KiB", "256 KiB", "1 MiB")
NUM = r"\d[\d,]*(?:\.\d+)?"


def test_bus_benchmark_quick_prints_every_row_and_a_verdict() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bus.py"), "--quick", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    text = out.stdout + out.stderr
    assert out.returncode in (0, 1), f"exit {out.returncode}:\n{text}"
    assert "Traceback" not in text, text
    for key in ("nats-py ", "window 256", "fetch batch:", "sizes:", "rounds: 1", "spawn"):
        assert key in out.stdout, f"configuration lacks {key!r}:\n{out.stdout}"
    lines = out.stdout.splitlines()
    # the headline's rows come first
    first = next(i for i, line in enumerate(lines) if SCENARIOS[0] in line)
    assert all(SCENARIOS[0] in lines[first + k] for k in range(len(SIZES))), out.stdout
    for scenario in SCENARIOS:
        for size in SIZES:
            row = next(
                (ln for ln in lines if scenario in ln and re.search(rf"│\s+{size} │", ln)), None
            )
            assert row is not None, f"no row {scenario!r} {size!r} in:\n{out.stdout}"
            cells = [c.strip() for c in row.strip("│ ").split("│")]
            # size, msgs/run, rftstream msg/s + MiB/s, raw msg/s + MiB/s, ratio (range)
            for cell in cells[2:7]:
                assert re.fullmatch(NUM, cell), (cell, row)
            assert re.fullmatch(rf"{NUM}x \({NUM}-{NUM}\)", cells[7]), row
            if scenario == SCENARIOS[0]:
                assert re.fullmatch(r">= 0\.8x: (PASS|MISS)", cells[8]), row
    for size in SIZES:
        assert re.search(
            rf"^bus, arrays read, {size}: rftstream / tuned raw = {NUM}x "
            r"\(target >= 0\.8x\): (PASS|MISS)$",
            out.stdout,
            re.M,
        ), out.stdout
    final = re.search(
        r"^bus, arrays read, .+ \(worst of 4 sizes\): rftstream / tuned raw = "
        rf"{NUM}x \(target >= 0\.8x at every size\): (PASS|MISS)$",
        out.stdout,
        re.M,
    )
    assert final is not None, out.stdout
    assert lines[-1] == final.group(0), "the verdict is the last line"
    assert out.returncode == (0 if final.group(1) == "PASS" else 1)
