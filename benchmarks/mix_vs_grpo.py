"""MIX against GRPO: raw reward per trainer step from the same untrained start.

Both runs start from the embedded default (``rftstream.default_run``): the tiny
model (built with fixed seeds, so both start from the same weights), the
built-in arithmetic task, the same learning rate, batch sizes, repeat times,
seed and number of trainer steps. The MIX run changes only what MIX needs:
``algorithm_type: mix``, ``sample_strategy_args.expert_data_ratio``,
``policy_loss_fn_args.mu`` and the expert data
(``buffer.trainer_input.auxiliary_buffers.sft_dataset``, by default
``examples/seed_mix/expert_data.jsonl``). GRPO is the baseline.

Each run gets its own private nats-server and run directory. The figure of
merit is the trainer's ``reward/mean`` (the mean raw reward of the rollouts
published since the previous step; steps without new rollouts are skipped);
"steps to 0.5" is the first step at which the mean of the last 10 such values
reaches 0.5. Prints a table (and the ratio GRPO steps / MIX steps) and writes
a PNG of both curves.

Usage: ``python benchmarks/mix_vs_grpo.py [--steps N] [--mu MU]
[--expert-ratio R] [--out PNG] [--quick]``. Exits 0 (130 when interrupted).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rftstream.config import apply_overrides, config_from_dict
from rftstream.default_run import DEFAULT_CONFIG
from rftstream.nats_server.embedded import EmbeddedNatsServer
from rftstream.presentation.plot import read_metrics, window_mean
from rftstream.runtime import PreparedRun, prepare_run, run_actors, start_fresh
from rftstream.signals import run_with_signals

ROOT = Path(__file__).resolve().parents[1]
EXPERT_DATA = ROOT / "examples" / "seed_mix" / "expert_data.jsonl"
TARGET = 0.5
WINDOW = 10  # "steps to 0.5": trailing mean of this many reward/mean values

console = Console()


@dataclass
class Result:
    label: str
    steps: int  # trainer steps the run was asked for
    wall_s: float
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def curve(self) -> tuple[list[int], list[float]]:
        """(step, reward/mean) of the steps that had new rollouts."""
        pts = [
            (int(r["step"]), float(r["reward/mean"]))
            for r in self.records
            if isinstance(r.get("reward/mean"), (int, float))
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    @property
    def steps_to_target(self) -> int | None:
        return steps_to_reach(*self.curve)

    def window(self, first: bool) -> float | None:
        return window_mean(self.records, "reward/mean", first, n=20)


def trailing_mean(values: list[float], n: int = WINDOW) -> list[float]:
    """Mean of the last ``n`` values at each index (fewer at the start)."""
    return [sum(values[max(0, i + 1 - n) : i + 1]) / min(i + 1, n) for i in range(len(values))]


def steps_to_reach(
    steps: list[int], values: list[float], target: float = TARGET, n: int = WINDOW
) -> int | None:
    """First step at which the mean of the last ``n`` values (a full window) reaches ``target``."""
    for i, mean in enumerate(trailing_mean(values, n)):
        if i + 1 >= n and mean >= target:
            return steps[i]
    return None


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    """The embedded default, shortened to ``args.steps`` trainer steps (the GRPO baseline)."""
    data = copy.deepcopy(DEFAULT_CONFIG)
    data["model"]["model_path"] = "builtin:tiny"
    data["buffer"]["total_steps"] = args.steps
    data["monitor"]["plot"] = False
    data["seed"] = args.seed
    data["buffer"]["explorer_input"]["taskset"]["seed"] = args.seed
    data["explorer"]["rollout_model"]["seed"] = args.seed
    if args.quick:
        data["buffer"]["batch_size"] = 2
        data["explorer"]["runner_num"] = 2
    return apply_overrides(data, list(args.set))


def grpo_config(args: argparse.Namespace) -> dict[str, Any]:
    data = base_config(args)
    data["name"] = "bench_grpo"
    return data


def mix_config(args: argparse.Namespace) -> dict[str, Any]:
    """The baseline with only the MIX algorithm and its expert data changed."""
    data = base_config(args)
    data["name"] = "bench_mix"
    algo = data["algorithm"]
    algo["algorithm_type"] = "mix"
    algo["repeat_times"] = int(algo["repeat_times"])  # GRPO's, whatever the mix preset says
    algo["sample_strategy_args"] = {"expert_data_ratio": args.expert_ratio}
    algo["policy_loss_fn_args"] = {"mu": args.mu}
    data["buffer"].setdefault("trainer_input", {})["auxiliary_buffers"] = {
        "sft_dataset": {
            "path": str(args.expert_data),
            "format": {"prompt_type": "messages", "messages_key": "messages"},
        }
    }
    return data


def run_one(label: str, data: dict[str, Any], run_dir: Path) -> Result | None:
    """Train one run to its end on a private nats-server. None: stopped by a signal."""
    cfg = config_from_dict(data, source=f"<benchmark: {label}>")
    with console.status(f"{label}: preparing the run (model, algorithm)…"):
        run: PreparedRun = prepare_run(cfg, run_dir=str(run_dir))
    for old in ("metrics.jsonl", "metrics.png"):
        (run.run_dir / old).unlink(missing_ok=True)
    total = run.cfg.buffer.total_steps
    progress = Progress(
        TextColumn(f"[bold]{label:<5}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )
    server = EmbeddedNatsServer(run.run_dir / "nats", max_payload=run.cfg.nats.max_payload)
    url = server.start()
    t0 = time.perf_counter()
    try:
        with progress:
            task = progress.add_task(label, total=total, info="waiting for experience…")
            rewards: list[float] = []

            def on_step(record: dict[str, Any]) -> None:
                if isinstance(record.get("reward/mean"), (int, float)):
                    rewards.append(float(record["reward/mean"]))
                info = (
                    f"reward {rewards[-1]:.3f}  mean of last {WINDOW} "
                    f"{sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]):.3f}"
                    if rewards
                    else "no rollouts yet"
                )
                progress.update(task, completed=record["step"], info=info)

            async def main() -> None:
                await start_fresh(run, url)
                await run_actors(run, url, on_step=on_step)

            code = run_with_signals(main)
    finally:
        server.stop()
    wall = time.perf_counter() - t0
    if code:
        return None
    metrics = run.run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    return Result(label, total, wall, records)


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _reached(res: Result) -> str:
    n = res.steps_to_target
    return str(n) if n is not None else f"not reached in {res.steps} steps"


def steps_ratio(base: Result, other: Result) -> str:
    """GRPO steps / MIX steps to the target (a bound when one did not reach it)."""
    b, o = base.steps_to_target, other.steps_to_target
    if b is not None and o is not None:
        return f"{b / o:.2f}x"
    if b is None and o is not None:
        return f"> {base.steps / o:.2f}x"  # GRPO would need more than all its steps
    if b is not None and o is None:
        return f"< {b / other.steps:.2f}x"
    return "n/a"


def print_table(grpo: Result, mix: Result, args: argparse.Namespace) -> None:
    table = Table(
        title=(
            f"MIX (mu {args.mu}, expert ratio {args.expert_ratio}) vs GRPO (baseline): "
            f"{args.steps} trainer steps each, same start"
        )
    )
    table.add_column("algorithm")
    table.add_column(f"steps to trailing mean {TARGET}", justify="right")
    table.add_column("reward first 20", justify="right")
    table.add_column("reward last 20", justify="right")
    table.add_column("wall time", justify="right")
    table.add_column("GRPO steps / steps", justify="right")
    for res, ratio in ((grpo, "1.00x (baseline)"), (mix, steps_ratio(grpo, mix))):
        reached = res.steps_to_target
        table.add_row(
            res.label,
            str(reached) if reached is not None else f"not in {res.steps}",
            _fmt(res.window(True)),
            _fmt(res.window(False)),
            f"{res.wall_s:.1f} s",
            ratio,
        )
    console.print(table)
    console.print(
        f"steps to {TARGET} as a trailing mean (the first step at which the mean of "
        f"the last {WINDOW} reward/mean values reaches it): GRPO {_reached(grpo)}, "
        f"MIX {_reached(mix)}; GRPO steps / MIX steps = {steps_ratio(grpo, mix)}",
        soft_wrap=True,
    )


def plot(results: list[Result], out: Path, title: str) -> Path:
    """Both reward curves (raw, faint; trailing mean, solid), the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5))
    for res, color in zip(results, ("tab:blue", "tab:orange"), strict=False):
        xs, ys = res.curve
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
        reached = res.steps_to_target
        note = f"reaches {TARGET} at step {reached}" if reached is not None else f"never {TARGET}"
        ax.plot(
            xs,
            trailing_mean(ys),
            color=color,
            linewidth=2,
            label=f"{res.label} (mean of last {WINDOW}; {note})",
        )
        if reached is not None:
            ax.axvline(reached, color=color, linestyle=":", linewidth=1)
    ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1, label=f"reward {TARGET}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("raw rollout reward (reward/mean)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (300)")
    ap.add_argument("--mu", type=float, default=0.1, help="MIX weight of the SFT loss (0.1)")
    ap.add_argument(
        "--expert-ratio",
        type=float,
        default=0.25,
        help="MIX share of each train batch taken from the expert data (0.25)",
    )
    ap.add_argument("--expert-data", type=Path, default=EXPERT_DATA, help="MIX expert jsonl")
    ap.add_argument("--seed", type=int, default=42, help="seed of both runs (42)")
    ap.add_argument(
        "--run-dir", type=Path, default=Path("runs/bench_mix"), help="runs go in grpo/ and mix/"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="PNG (default <run-dir>/mix_vs_grpo.png)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied to both runs (repeatable)",
    )
    ap.add_argument("--quick", action="store_true", help="6 steps each, small batch (a smoke run)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 6 if args.quick else 300
    out = args.out or args.run_dir / "mix_vs_grpo.png"
    if not args.expert_data.exists():
        console.print(f"[red]no expert data at {args.expert_data}[/]")
        return 2

    results: list[Result] = []
    for label, data in (("GRPO", grpo_config(args)), ("MIX", mix_config(args))):
        res = run_one(label, data, args.run_dir / label.lower())
        if res is None:
            console.print("[yellow]stopped by signal[/]")
            return 130
        console.print(
            f"{label}: {len(res.records)} trainer steps in {res.wall_s:.1f}s, "
            f"steps to {TARGET} (trailing mean of the last {WINDOW} reward/mean): "
            f"{_reached(res)}"
        )
        results.append(res)
    grpo, mix = results
    print_table(grpo, mix, args)
    title = (
        f"MIX (mu {args.mu}, expert ratio {args.expert_ratio}) vs GRPO, builtin:arithmetic, "
        f"tiny model, seed {args.seed}"
    )
    png = plot(results, out, title)
    console.print(f"plot: {png}", soft_wrap=True, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
