"""Start-up: how long a new user waits for the first trainer step, beside TRL's start-up.

Three figures, measured in one run of this script:

* **fresh clone**: the README's first quick-start command (``python3 -m venv .venv &&
  .venv/bin/pip install -qq rust-just && .venv/bin/just up``, with ``--steps 3``) in a
  new clone of this repository, from the command's start to the first trainer step
  (the first record of ``metrics.jsonl``): creating the venv, installing, building the
  tiny model (if this machine has no cached one) and starting the run. pip's cache is
  whatever this machine has (a new machine has none: the install then downloads).
* **warm start**: ``rftstream up --steps 3`` (a new run dir each time) in that clone once
  everything is installed and cached, from the process start to the first trainer step (median of
  ``--repeats``).
* **TRL**: TRL's ``GRPOTrainer`` on the same work, warm, from the process start to its
  first step (``benchmarks/vs_trl.py``'s TRL side; median of ``--repeats``).

Targets: the fresh clone within 120 s; the warm start within 5 s and at most TRL's.
Usage: ``python benchmarks/startup.py [--repeats N] [--no-fresh]``. Exits 0 when every
target passes, 1 on a MISS, 2 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
FRESH_TARGET_S = 120.0
WARM_TARGET_S = 5.0
README_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -qq rust-just && .venv/bin/just up"


def first_step_s(metrics: Path, t0: float) -> float | None:
    """Seconds from ``t0`` to the first trainer step of ``metrics`` (None: no step yet, or
    only steps from before ``t0``: a file an earlier run left)."""
    try:
        line = metrics.read_text().split("\n", 1)[0]
        ts = float(json.loads(line)["ts"]) if line.strip() else None
    except (OSError, ValueError, KeyError):
        return None
    return ts - t0 if ts is not None and ts >= t0 else None


def until_first_step(
    argv: list[str] | str, cwd: Path, run_dir: Path, log: Path, timeout: float
) -> float:
    """Start ``argv`` (a shell command when a string), wait for the first trainer step in
    ``run_dir/metrics.jsonl``, stop it with Ctrl-C and return the seconds to that step.
    Raises ``RuntimeError`` (naming ``log``) when it ends or times out first."""
    shell = isinstance(argv, str)
    metrics = run_dir / "metrics.jsonl"
    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, shell=shell, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                got = first_step_s(metrics, t0)
                if got is not None:
                    return got
                if proc.poll() is not None:
                    raise RuntimeError(f"exited {proc.returncode} before its first step; see {log}")
                if time.time() - t0 > timeout:
                    raise RuntimeError(f"no first step in {timeout:.0f} s; see {log}")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the run shuts down
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def trl_first_step(workdir: Path) -> float:
    """Seconds from the process start to TRL's first step on the default workload, warm."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_trl

    settings = vs_trl.Settings(workdir, 50, 1e9, 0.0, 1.0, len(os.sched_getaffinity(0)))
    curve = vs_trl.run_trl(settings, vs_trl.WORKLOADS["default"], 1, f"trl{time.time_ns()}")
    first = curve.first_step_s()
    if first is None:
        raise RuntimeError(f"TRL made no step: {curve.error}")
    return first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="warm starts and TRL starts (5)")
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-clone install")
    args = ap.parse_args(argv)

    from rich.console import Console

    console = Console()
    lines: list[tuple[str, float | None, str]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="rftstream-startup-") as tmp:
        base = Path(tmp)
        clone = base / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        if not args.no_fresh:
            with console.status(f"fresh clone: {README_COMMAND} --steps 3 …"):
                try:
                    s = until_first_step(
                        f"{README_COMMAND} --steps 3",
                        clone,
                        clone / "runs" / "default",
                        base / "fresh.log",
                        timeout=1800,
                    )
                    lines.append(("fresh clone to the first step (install included)", s, "fresh"))
                except RuntimeError as exc:
                    console.print(f"[red]fresh clone: {exc}[/]")
                    failed = True
        else:
            subprocess.run(
                [
                    "bash",
                    "-c",
                    "python3 -m venv .venv && .venv/bin/pip install -qq rust-just "
                    "&& .venv/bin/just setup-run",
                ],
                cwd=clone,
                check=True,
            )
        warm: list[float] = []
        trl: list[float] = []
        for i in range(args.repeats):  # interleaved: both under the same load
            with console.status(f"warm start {i + 1}/{args.repeats} …"):
                try:
                    warm.append(
                        until_first_step(
                            [
                                str(clone / ".venv" / "bin" / "rftstream"),
                                "up",
                                "--steps",
                                "3",
                                "--run-dir",
                                str(base / f"warm{i}"),  # a new run each time
                            ],
                            clone,
                            base / f"warm{i}",
                            base / f"warm{i}.log",
                            timeout=300,
                        )
                    )
                except RuntimeError as exc:
                    console.print(f"[red]warm start: {exc}[/]")
                    failed = True
            with console.status(f"TRL start {i + 1}/{args.repeats} …"):
                try:
                    trl.append(trl_first_step(base / "trl"))
                except RuntimeError as exc:
                    console.print(f"[red]TRL: {exc}[/]")
                    failed = True
        lines.append(
            ("warm start to the first step (median)", median(warm) if warm else None, "warm")
        )
        lines.append(("TRL, warm, to its first step (median)", median(trl) if trl else None, "trl"))
        if warm and trl:
            console.print(
                f"warm starts: {', '.join(f'{x:.1f}' for x in warm)} s; "
                f"TRL: {', '.join(f'{x:.1f}' for x in trl)} s"
            )
    figures = {key: value for _, value, key in lines}
    for label, value, _ in lines:
        console.print(f"{label}: {'—' if value is None else f'{value:.1f} s'}")
    verdicts: list[bool] = []

    def check(what: str, ok: bool) -> None:
        verdicts.append(ok)
        console.print(f"{what}: {'PASS' if ok else 'MISS'}")

    if "fresh" in figures:
        f = figures["fresh"]
        check(
            f"fresh clone {f:.0f} s (target <= {FRESH_TARGET_S:.0f} s)" if f else "fresh clone",
            f is not None and f <= FRESH_TARGET_S,
        )
    w, t = figures.get("warm"), figures.get("trl")
    if w is not None:
        check(f"warm start {w:.1f} s (target <= {WARM_TARGET_S:.0f} s)", w <= WARM_TARGET_S)
        if t is not None:
            check(f"warm start {w:.1f} s against TRL's {t:.1f} s (target: at most TRL's)", w <= t)
    if failed:
        return 2
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
