"""rftstream against TRL's synchronous ``GRPOTrainer``, side by side, on the same work.

The work (the embedded default, ``rftstream up``): the tiny model from
rftstream's cache (``rftstream.tiny_model``), the 100 built-in arithmetic
prompts in the same chat format, 8 prompts x 8 generations = 64 completions per
step, learning rate 2e-4 constant, no KL (TRL ``beta=0``), 6 new tokens,
temperature 1, the same reward (``math_reward``: 1 for the right number).

For each variant the runs go one after the other in this process's lifetime,
each as its own process (so every figure includes its own start-up):

* ``default``: TRL, then ``rftstream up`` as it ships (``dynamic_by_explorer``),
  then ``rftstream up --set synchronizer.sync_style=fixed`` (interval 1: strictly
  on-policy, the synchronous baseline inside rftstream).
* ``longtail``: the same, with a verifier that takes 20-200 ms per task
  (``benchmarks/plugins/longtail.py``; TRL's reward function waits for the
  slowest task of its batch, as a parallel verifier would).

Figure of merit: the trailing mean of 20 steps' reward (TRL: the mean reward of
the step's completions; rftstream: ``reward/mean``, the mean reward of the
rollouts published since the previous trainer step). For each threshold (0.6,
0.7): the first step where that mean reaches it, and the seconds to that step
from the process's start (what a user waits) and from its first step. A run
stops once it reached the last threshold (or at ``--max-steps``). Printed:
a table per variant, the ratios rftstream / TRL and the issue's targets
(default: seconds to 0.7 <= 0.7x TRL and steps <= 1.15x; long tail: seconds
<= 0.5x TRL and the default style >= 2x faster than ``fixed``), and
rftstream's trainer and explorer idle shares.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: TRL). Usage:
``python benchmarks/vs_trl.py [--variant default|longtail|all] [--max-steps N]
[--seed S] [--no-fixed]``. Exits 0 (130 when interrupted).
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rftstream.plot import idle_shares

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "benchmarks" / "plugins"
THRESHOLDS = (0.6, 0.7)
WINDOW = 20
LONGTAIL_WORKFLOW = "longtail_math_workflow"
EXPLORERS_FASTER = 0.10  # explorer idle share above which the explorers outpace the trainer


# ------------------------------------------------------------------ pure helpers


@dataclass
class Curve:
    """One run: per step ``(step, seconds since the process started, reward)``."""

    label: str
    points: list[tuple[int, float, float]] = field(default_factory=list)
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    error: str = ""

    def first_step_s(self) -> float | None:
        return self.points[0][1] if self.points else None

    def reached(self, threshold: float, window: int = WINDOW) -> tuple[int, float] | None:
        """``(step, seconds from process start)`` where the trailing mean of ``window``
        rewards first reaches ``threshold``; None if it never does."""
        return steps_to_threshold(self.points, threshold, window)

    def steps_per_s(self) -> float | None:
        if len(self.points) < 2:
            return None
        (s0, t0, _), (s1, t1, _) = self.points[0], self.points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def steps_to_threshold(
    points: Sequence[tuple[int, float, float]], threshold: float, window: int = WINDOW
) -> tuple[int, float] | None:
    """The first ``(step, seconds)`` at which the mean reward of the last ``window`` points
    is >= ``threshold`` (needs ``window`` points); None if never."""
    total = 0.0
    for i, (_step, _t, reward) in enumerate(points):
        total += reward
        if i >= window:
            total -= points[i - window][2]
        if i + 1 >= window and total / window >= threshold - 1e-12:
            return points[i][0], points[i][1]
    return None


def ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or base <= 0:
        return None
    return ours / base


def rftstream_points(
    records: Sequence[dict[str, Any]], start_ts: float
) -> list[tuple[int, float, float]]:
    """``(step, seconds since start_ts, reward/mean)`` of a ``metrics.jsonl``; steps without
    new rollouts (``reward/mean`` null) are left out."""
    out = []
    for r in records:
        reward = r.get("reward/mean")
        if reward is None:
            continue
        out.append((int(r["step"]), float(r["ts"]) - start_ts, float(reward)))
    return out


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
    return out


# ------------------------------------------------------------------ TRL child


def trl_child(out: Path, max_steps: int, seed: int, longtail: bool, stop_at: float) -> int:
    """Run TRL's GRPOTrainer on the workload; one JSON line per step to ``out``."""
    t_start = time.time()
    import torch  # noqa: F401 - imported first, as a TRL user's script would
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rftstream.tiny_model import arithmetic_problems, ensure_tiny_model
    from workflows.rewards import MathReward

    sys.path.insert(0, str(PLUGINS))
    from longtail import verifier_delay

    path = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = [
        {"prompt": [{"role": "user", "content": q}], "answer": a, "task_index": i}
        for i, (q, a) in enumerate(arithmetic_problems())
    ]
    math_reward = MathReward()
    rewards: list[float] = []
    log = out.open("w")

    def reward(
        completions: list[Any], answer: list[str], task_index: list[int], **_: Any
    ) -> list[float]:
        if longtail:  # the batch's tasks are verified in parallel: the slowest one counts
            time.sleep(max(verifier_delay(int(i)) for i in set(task_index)))
        scores = [
            math_reward(response=c[0]["content"], truth=a)["accuracy"]
            for c, a in zip(completions, answer, strict=True)
        ]
        mean = sum(scores) / len(scores)
        rewards.append(mean)
        log.write(json.dumps({"step": len(rewards), "t": time.time() - t_start, "reward": mean}))
        log.write("\n")
        log.flush()
        return scores

    class StopAtThreshold(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if len(rewards) >= WINDOW and sum(rewards[-WINDOW:]) / WINDOW >= stop_at:
                control.should_training_stop = True
            return control

    config = GRPOConfig(
        output_dir=str(out.parent / "trl_output"),
        per_device_train_batch_size=64,
        num_generations=8,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        beta=0.0,
        max_completion_length=6,
        temperature=1.0,
        max_steps=max_steps,
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[StopAtThreshold()],
    )
    trainer.train()
    log.close()
    return 0


# ------------------------------------------------------------------ runners


def _quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def run_trl(workdir: Path, max_steps: int, seed: int, longtail: bool, stop_at: float) -> Curve:
    label = "TRL GRPOTrainer (synchronous)"
    out = workdir / "trl.jsonl"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_trl",
        "--out",
        str(out),
        "--max-steps",
        str(max_steps),
        "--seed",
        str(seed),
        "--stop-at",
        str(stop_at),
    ]
    if longtail:
        argv.append("--longtail")
    t0 = time.time()
    with (workdir / "trl.log").open("w") as logf:
        proc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, env=_quiet_env())
    curve = Curve(label, wall_s=time.time() - t0)
    curve.points = [(r["step"], r["t"], r["reward"]) for r in _read_jsonl(out)]
    if proc.returncode != 0:
        curve.error = f"exit {proc.returncode}; see {workdir / 'trl.log'}"
    return curve


def run_rftstream(
    workdir: Path,
    name: str,
    label: str,
    max_steps: int,
    seed: int,
    overrides: Sequence[str],
    stop_at: float,
    plugin_dir: Path | None = None,
) -> Curve:
    run_dir = workdir / name
    argv = [
        sys.executable,
        "-m",
        "rftstream.cli",
        "up",
        "--steps",
        str(max_steps),
        "--run-dir",
        str(run_dir),
        "--set",
        f"seed={seed}",
    ]
    for o in overrides:
        argv += ["--set", o]
    if plugin_dir is not None:
        argv += ["--plugin-dir", str(plugin_dir)]
    metrics = run_dir / "metrics.jsonl"
    t0 = time.time()
    stopped = False
    with (workdir / f"{run_dir.name}.log").open("w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=_quiet_env())
        while proc.poll() is None:
            time.sleep(0.5)
            points = rftstream_points(_read_jsonl(metrics), t0)
            if not stopped and steps_to_threshold(points, stop_at) is not None:
                proc.send_signal(signal.SIGINT)  # reached: stop (Ctrl-C; everything shuts down)
                stopped = True
        proc.wait()
    records = _read_jsonl(metrics)
    curve = Curve(label, points=rftstream_points(records, t0), wall_s=time.time() - t0)
    if proc.returncode not in (0, 130) or (proc.returncode == 130 and not stopped):
        curve.error = f"exit {proc.returncode}; see {workdir / (run_dir.name + '.log')}"
    trainer_idle, explorer_idle = idle_shares(records)
    if trainer_idle is not None:
        curve.extra["trainer idle"] = trainer_idle
    if explorer_idle is not None:
        curve.extra["explorer idle"] = explorer_idle
    stale = [float(r.get("staleness/mean") or 0.0) for r in records[1:]]
    if stale:
        curve.extra["staleness"] = sum(stale) / len(stale)
    return curve


# ------------------------------------------------------------------ report


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def report(
    title: str, trl: Curve, ours: list[Curve], targets: dict[str, float], console: Any
) -> list[str]:
    """Print the table of one variant; return the target lines (PASS / MISS)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("run")
    for th in THRESHOLDS:
        table.add_column(f"steps to {th}", justify="right")
        table.add_column(f"s to {th}", justify="right")
    table.add_column("s to 0.7 from 1st step", justify="right")
    table.add_column("steps/s", justify="right")
    table.add_column("idle trainer / explorer", justify="right")
    table.add_column("staleness", justify="right")
    for c in [trl, *ours]:
        cells = []
        for th in THRESHOLDS:
            hit = c.reached(th)
            cells += [str(hit[0]) if hit else "—", _fmt(hit[1] if hit else None, ".1f")]
        hit7 = c.reached(0.7)
        first = c.first_step_s()
        cells.append(_fmt(hit7[1] - first if hit7 and first is not None else None, ".1f"))
        cells.append(_fmt(c.steps_per_s(), ".1f"))
        idle = ""
        if "trainer idle" in c.extra:
            idle = f"{c.extra['trainer idle']:.0%} / {_fmt(c.extra.get('explorer idle'), '.0%')}"
        cells.append(idle)
        cells.append(_fmt(c.extra.get("staleness"), ".2f"))
        label = c.label + (f" [red]({c.error})[/]" if c.error else "")
        table.add_row(label, *cells)
    console.print(table)
    lines = []
    default = ours[0]
    t_base, t_ours = trl.reached(0.7), default.reached(0.7)
    sec = ratio(t_ours[1] if t_ours else None, t_base[1] if t_base else None)
    steps = ratio(t_ours[0] if t_ours else None, t_base[0] if t_base else None)
    if "seconds" in targets:
        ok = sec is not None and sec <= targets["seconds"]
        lines.append(
            f"{title}: seconds to 0.7, rftstream / TRL = {_fmt(sec, '.2f')}x "
            f"(target <= {targets['seconds']}x): {'PASS' if ok else 'MISS'}"
        )
    if "steps" in targets:
        ok = steps is not None and steps <= targets["steps"]
        lines.append(
            f"{title}: steps to 0.7, rftstream / TRL = {_fmt(steps, '.2f')}x "
            f"(target <= {targets['steps']}x): {'PASS' if ok else 'MISS'}"
        )
    if "vs_fixed" in targets and len(ours) > 1:
        t_fixed = ours[1].reached(0.7)
        speed = ratio(t_fixed[1] if t_fixed else None, t_ours[1] if t_ours else None)
        ok = speed is not None and speed >= targets["vs_fixed"]
        lines.append(
            f"{title}: default style {_fmt(speed, '.2f')}x faster than fixed to 0.7 "
            f"(target >= {targets['vs_fixed']}x): {'PASS' if ok else 'MISS'}"
        )
    if "trainer idle" in default.extra:
        idle = default.extra["trainer idle"]
        explorer_idle = default.extra.get("explorer idle", 0.0)
        if explorer_idle >= EXPLORERS_FASTER:
            verdict = "PASS" if idle <= 0.05 else "MISS"
        else:
            verdict = f"n/a: the explorers are the bottleneck here (idle {explorer_idle:.0%})"
        lines.append(
            f"{title}: rftstream trainer idle {idle:.1%} (target <= 5% when explorers are "
            f"faster): {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    child = sub.add_parser("_trl", help=argparse.SUPPRESS)
    child.add_argument("--out", required=True)
    child.add_argument("--max-steps", type=int, required=True)
    child.add_argument("--seed", type=int, default=42)
    child.add_argument("--stop-at", type=float, default=THRESHOLDS[-1])
    child.add_argument("--longtail", action="store_true")
    ap.add_argument("--variant", choices=("default", "longtail", "all"), default="all")
    ap.add_argument("--max-steps", type=int, default=1200, help="cap per run (default 1200)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-fixed", action="store_true", help="skip the sync_style: fixed runs")
    ap.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.cmd == "_trl":
        return trl_child(Path(args.out), args.max_steps, args.seed, args.longtail, args.stop_at)

    from rich.console import Console

    console = Console(width=max(150, Console().width))
    try:
        import trl  # noqa: F401
    except ImportError:
        console.print("[red]TRL is not installed: pip install -e '.[bench]'[/]")
        return 1
    stop_at = THRESHOLDS[-1]
    variants = ("default", "longtail") if args.variant == "all" else (args.variant,)
    summary: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.workdir or tmp)
        try:
            for variant in variants:
                workdir = base / variant
                workdir.mkdir(parents=True, exist_ok=True)
                longtail = variant == "longtail"
                overrides = (
                    [f"buffer.explorer_input.taskset.default_workflow_type={LONGTAIL_WORKFLOW}"]
                    if longtail
                    else []
                )
                plugin = PLUGINS if longtail else None
                with console.status(f"{variant}: TRL GRPOTrainer…"):
                    trl_curve = run_trl(workdir, args.max_steps, args.seed, longtail, stop_at)
                with console.status(f"{variant}: rftstream up…"):
                    ours = [
                        run_rftstream(
                            workdir,
                            "default",
                            "rftstream default (dynamic_by_explorer)",
                            args.max_steps,
                            args.seed,
                            overrides,
                            stop_at,
                            plugin,
                        )
                    ]
                if not args.no_fixed:
                    with console.status(f"{variant}: rftstream up, sync_style fixed…"):
                        ours.append(
                            run_rftstream(
                                workdir,
                                "fixed",
                                "rftstream sync_style fixed, interval 1",
                                args.max_steps,
                                args.seed,
                                [*overrides, "synchronizer.sync_style=fixed"],
                                stop_at,
                                plugin,
                            )
                        )
                targets = (
                    {"seconds": 0.5, "vs_fixed": 2.0}
                    if longtail
                    else {"seconds": 0.7, "steps": 1.15}
                )
                title = "long tail (20-200 ms verifier)" if longtail else "default workload"
                summary += report(title, trl_curve, ours, targets, console)
        except KeyboardInterrupt:
            return 130
    for line in summary:
        console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
