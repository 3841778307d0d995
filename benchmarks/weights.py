"""Weight sync at a realistic size: ``jetstream`` (the bus) against ``checkpoint`` (files).

Each run is ``rftstream up`` as a user starts it, against a nats-server this script
starts (with its monitoring endpoint, so the bytes every connection sent and
received can be read afterwards), with two explorer processes
(``engine_num: 2``), GRPO, ``max_staleness: 1``, for ``--steps`` trainer steps:

* ``0.5B``: ``builtin:qwen2.5-0.5b-shape`` (Qwen2.5-0.5B's 24 blocks, 358M
  parameters, random weights; :mod:`rftstream.shaped_models`), explorers in bf16
  (``model.dtype: bfloat16``; the trainer in DeepSpeed bf16 with fp32 master
  weights), batches of 2 tasks x 4 rollouts of 16 tokens, lr 1e-6, rewarded by
  the share of digits in the response (``plugins/digits.py``: random weights
  never answer right, and a reward that is always 0 gives no gradient, no
  update and an empty delta);
* ``tiny``: the embedded default model (fp32), batches of 8 x 8, lr 2e-4.

Both models are built before anything is timed. Per run, from the trainer's
``metrics.jsonl`` (steps after the first, which holds everyone's start-up) and
the server's connection counters:

* bytes per sync: what one version puts on the wire (``sync/bytes``: the payload
  of keyframes and deltas; ``checkpoint``: the file), and as a share of the model
  in float32;
* sync seconds: from the trainer's step to the version ready on an explorer
  (``jetstream``: publish, then the explorer's fetch and stage; ``checkpoint``:
  the trainer's save, then the explorer's read, check and load);
* explorer pause: the longest time a sync stopped generation (the swap; for
  ``checkpoint`` the copy into the model);
* trainer share: the time the trainer's step waited for its sync over the step's
  period (``sync/trainer_blocking_seconds`` / ``time/trainer_step_period``);
* sent by the trainer: the bytes its connection sent to the server over the
  whole run, against what each explorer's connection received (``/connz``).

Targets (the 0.5B model, ``jetstream``): trainer share <= 5% of its step,
explorer pause <= 0.1 s, bytes per sync <= 50% of the float32 model, and each
version leaving the trainer once with 2 explorers (the trainer sent less than
1.2x one version set, each explorer received at least 0.8x of it). ``checkpoint``
is the baseline, measured in the same run of this script, on the same machine.

Usage: ``python benchmarks/weights.py [--steps N] [--models 0.5b,tiny]
[--methods checkpoint,jetstream] [--seeds 1]``. Prints a table per model and the
targets; exits 1 when a target is missed or a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from rftstream.nats_server.embedded import EmbeddedNatsServer, free_port

PLUGINS = Path(__file__).resolve().parent / "plugins"
console = Console(width=150)  # the tables stay whole in logs and pipes
RUN = "wbench"

TARGET_SHARE = 0.05
TARGET_PAUSE_S = 0.1
TARGET_BYTES = 0.50
LEAVE_ONCE = 1.2  # the trainer sends at most this many version sets


@dataclass
class RunResult:
    model: str
    method: str
    seed: int
    wall_s: float = 0.0
    steps: int = 0
    bytes_per_sync: float | None = None
    fp32_bytes: int = 0
    sync_s: float | None = None
    pause_s: float | None = None
    share: float | None = None
    blocking_s: float | None = None
    train_s: float | None = None
    period_s: float | None = None
    trainer_sent: int = 0
    explorers_received: list[int] = field(default_factory=list)
    versions_bytes: float = 0.0  # the bytes of every version published, once
    error: str = ""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def model_config(model: str, path: str, method: str, steps: int, seed: int) -> dict[str, Any]:
    """The run config of ``model`` (``0.5b`` | ``tiny``) with ``method``."""
    big = model == "0.5b"
    return {
        "mode": "both",
        "name": RUN,
        "seed": seed,
        "model": {
            "model_path": path,
            "dtype": "bfloat16" if big else "float32",
            "max_prompt_tokens": 64,
            "max_response_tokens": 16 if big else 6,
        },
        "buffer": {
            "batch_size": 2 if big else 8,
            "total_steps": steps,
            "total_epochs": 100,
            "explorer_input": {
                "taskset": {
                    "path": "builtin:arithmetic",
                    "default_workflow_type": "math_workflow",
                    # random weights never answer right: a reward they earn some of, so the
                    # trainer's updates (and the deltas) are a real run's (plugins/digits.py)
                    "default_reward_fn_type": "digit_share_reward" if big else "math_reward",
                    "rollout_args": {"temperature": 1.0, "max_tokens": 16 if big else 6},
                }
            },
        },
        "explorer": {
            "runner_num": 4 if big else 16,
            "rollout_model": {"engine_type": "transformers", "engine_num": 2, "seed": seed},
        },
        "synchronizer": {
            "sync_method": method,
            "sync_style": "dynamic_by_explorer",
            "sync_interval": 1,
            "max_staleness": 1,
        },
        "algorithm": {
            "algorithm_type": "grpo",
            "repeat_times": 4 if big else 8,
            "kl_loss_fn": "none",
            "optimizer": {"lr": 1e-6 if big else 2e-4, "weight_decay": 0.0},
        },
        "trainer": {
            "save_interval": 0,
            "ppo_micro_batch_size_per_gpu": 8 if big else 64,
            "mixed_precision": "bf16" if big else "fp32",
        },
        "monitor": {"monitor_type": "jsonl", "plot": False},
    }


def _connz(port: int) -> list[dict[str, Any]]:
    """Every connection the server saw (open and closed), with its byte counters."""
    url = f"http://127.0.0.1:{port}/connz?state=all&limit=4096"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return list(json.loads(resp.read()).get("connections") or [])


def run_one(model: str, path: str, method: str, steps: int, seed: int, work: Path) -> RunResult:
    """One ``rftstream up`` of ``model`` with ``method``, against a server of its own."""
    res = RunResult(model, method, seed)
    res.fp32_bytes = 4 * _parameters(path)
    run_dir = work / f"{model}-{method}-{seed}"
    monitor = free_port()
    server = EmbeddedNatsServer(run_dir / "nats", monitor_port=monitor)
    cfg_path = run_dir / "run.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(model_config(model, path, method, steps, seed)))
    url = server.start()
    try:
        t0 = time.perf_counter()
        with open(run_dir / "up.log", "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "rftstream.cli", "up", "--config", str(cfg_path)]
                + ["--nats-url", url, "--run-dir", str(run_dir / "run")]
                + ["--plugin-dir", str(PLUGINS)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                timeout=3600,
            )
        res.wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (run_dir / "up.log").read_text(errors="replace")[-1500:]
            res.error = f"exit {proc.returncode}: {tail}"
            return res
        conns = _connz(monitor)
    finally:
        server.stop()
    records = [
        json.loads(line)
        for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    _fill(res, records, conns, method)
    return res


def _parameters(path: str) -> int:
    """Parameters of the model at ``path`` (from its safetensors headers)."""
    from safetensors import safe_open

    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= int(d)
                total += n
    return total


def _fill(res: RunResult, records: list[dict[str, Any]], conns: list[dict], method: str) -> None:
    res.steps = len(records)
    steady = records[1:] or records

    def col(key: str, rows: list[dict[str, Any]] = steady) -> list[float]:
        return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]

    if method == "jetstream":
        total = max(col("sync/bytes_total", records) or [0.0])
        versions = max(col("sync/versions_total", records) or [0.0])
        res.bytes_per_sync = total / versions if versions else None
        res.versions_bytes = total
        publish = _median(col("sync/publish_seconds"))
    else:
        sizes = col("sync/bytes", records)
        res.bytes_per_sync = _median(sizes)
        res.versions_bytes = sum(sizes)
        publish = _median(col("sync/trainer_blocking_seconds"))
    fetch = _median(col("sync/explorer_fetch_seconds"))
    res.sync_s = publish + fetch if publish is not None and fetch is not None else None
    pauses = col("sync/explorer_pause_seconds")
    res.pause_s = max(pauses) if pauses else None
    shares = [
        float(r["sync/trainer_blocking_seconds"]) / float(r["time/trainer_step_period"])
        for r in steady
        if r.get("time/trainer_step_period")
    ]
    res.share = _median(shares)
    res.blocking_s = _median(col("sync/trainer_blocking_seconds"))
    res.train_s = _median(col("time/train_step"))
    res.period_s = _median(col("time/trainer_step_period"))
    for c in conns:
        name = str(c.get("name") or "")
        if name == f"rftstream:{RUN}:trainer":
            res.trainer_sent += int(c.get("in_bytes") or 0)  # the server's in = the client's out
        elif name.startswith(f"rftstream:{RUN}:explorer"):
            res.explorers_received.append(int(c.get("out_bytes") or 0))


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f} MB"


def _s(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.2f} ms" if unit == "ms" or x < 1.0 else f"{x:.2f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def report(results: list[RunResult]) -> list[str]:
    """Print a table per model; returns the missed targets (empty: all met)."""
    misses: list[str] = []
    for model in dict.fromkeys(r.model for r in results):
        rows = [r for r in results if r.model == model]
        table = Table(title=f"weight sync, {model} model (2 explorers)")
        table.add_column("method")
        for col in (
            "bytes/sync",
            "of fp32",
            "sync",
            "pause",
            "trainer blocked",
            "share of step",
            "train step",
            "step period",
            "trainer sent",
            "explorers got",
        ):
            table.add_column(col, justify="right")
        for r in rows:
            if r.error:
                table.add_row(f"{r.method} (seed {r.seed})", f"[red]failed: {r.error[:60]}")
                misses.append(f"{model}/{r.method}: the run failed")
                continue
            table.add_row(
                f"{r.method} (seed {r.seed})",
                _mb(r.bytes_per_sync),
                _pct((r.bytes_per_sync or 0) / r.fp32_bytes if r.fp32_bytes else None),
                _s(r.sync_s),
                _s(r.pause_s, "ms"),
                _s(r.blocking_s),
                _pct(r.share),
                _s(r.train_s),
                _s(r.period_s),
                _mb(r.trainer_sent),
                " / ".join(_mb(x) for x in r.explorers_received),
            )
        console.print(table)
        base = [r for r in rows if r.method == "checkpoint" and not r.error]
        ours = [r for r in rows if r.method == "jetstream" and not r.error]
        if base and ours:
            b, o = base[0], ours[0]
            if b.share and o.share is not None:
                console.print(
                    f"  trainer share: jetstream {_pct(o.share)} vs checkpoint {_pct(b.share)}; "
                    f"bytes/sync {((o.bytes_per_sync or 0) / (b.bytes_per_sync or 1)):.2f}x "
                    "checkpoint's"
                )
        if model == "0.5b":
            misses += _targets(ours)
    return misses


def _targets(ours: list[RunResult]) -> list[str]:
    misses: list[str] = []
    if not ours:
        return ["0.5b/jetstream: no run"]
    for r in ours:
        checks = [
            ("trainer share of its step", r.share, TARGET_SHARE, _pct),
            ("explorer pause per sync", r.pause_s, TARGET_PAUSE_S, _s),
            (
                "bytes per sync / fp32 model",
                (r.bytes_per_sync / r.fp32_bytes) if r.bytes_per_sync is not None else None,
                TARGET_BYTES,
                _pct,
            ),
        ]
        sent_sets = r.trainer_sent / r.versions_bytes if r.versions_bytes else None
        got = [x / r.versions_bytes for x in r.explorers_received] if r.versions_bytes else []
        for name, value, limit, fmt in checks:
            ok = value is not None and value <= limit
            console.print(
                f"  target {name}: {fmt(value)} <= {fmt(limit)}: "
                + ("[green]PASS[/]" if ok else "[red]MISS[/]")
            )
            if not ok:
                misses.append(f"{name} {fmt(value)} > {fmt(limit)} (seed {r.seed})")
        once = (
            sent_sets is not None and sent_sets <= LEAVE_ONCE and len(got) == 2 and min(got) >= 0.8
        )
        console.print(
            f"  target each version leaves the trainer once: the trainer sent "
            f"{sent_sets or 0:.2f}x the versions' bytes, the explorers received "
            + ", ".join(f"{g:.2f}x" for g in got)
            + (": [green]PASS[/]" if once else ": [red]MISS[/]")
        )
        if not once:
            misses.append(f"versions left the trainer {sent_sets or 0:.2f}x (seed {r.seed})")
    return misses


def build_models(models: list[str]) -> dict[str, str]:
    """Every model's local path, built before anything is timed."""
    from rftstream.shaped_models import ensure_shaped_model
    from rftstream.tiny_model import ensure_tiny_model

    paths = {}
    if "tiny" in models:
        paths["tiny"] = str(ensure_tiny_model(progress=console.print))
    if "0.5b" in models:
        paths["0.5b"] = str(ensure_shaped_model("qwen2.5-0.5b-shape", progress=console.print))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="trainer steps per 0.5B run")
    ap.add_argument("--tiny-steps", type=int, default=300, help="trainer steps per tiny run")
    ap.add_argument("--models", default="0.5b,tiny")
    ap.add_argument("--methods", default="checkpoint,jetstream")
    ap.add_argument("--seeds", type=int, default=1, help="runs of each model and method")
    ap.add_argument(
        "--quick", action="store_true", help="the tiny model only (`just bench --quick`)"
    )
    ap.add_argument("--keep", default="", help="keep the runs' directories here (else a temp dir)")
    args = ap.parse_args(argv)
    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    paths = build_models(models)
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="rft-weights-bench-") as scratch:
        tmp = args.keep or scratch
        for model in models:
            steps = args.steps if model == "0.5b" else args.tiny_steps
            for seed in range(args.seeds):
                for method in methods:  # interleaved: the same machine state for both
                    with console.status(f"{model} model, {method}, seed {seed}: {steps} steps…"):
                        r = run_one(model, paths[model], method, steps, seed, Path(tmp))
                    console.print(
                        f"{model}/{method} seed {seed}: "
                        + (f"[red]{r.error[-300:]}" if r.error else f"{r.wall_s:.0f} s")
                    )
                    results.append(r)
    misses = report(results)
    if misses:
        console.print("[red]MISSED:[/] " + "; ".join(misses))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
