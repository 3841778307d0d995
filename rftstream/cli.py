"""The ``rftstream`` command line.

::

    rftstream up [--config C] [--steps N] [--run-dir D] [--nats-url U] [--plugin-dir D] [--set k=v]
    rftstream explorer|operator|trainer --config C --nats-url U [--run-dir D] [--name N]
    rftstream status --config C --nats-url U

Errors derived from :class:`rftstream.errors.RftError` are printed as one
readable line (exit code 2); anything else is a bug and shows a traceback.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from rftstream.errors import RftError

console = Console(stderr=False)


def _common(p: argparse.ArgumentParser, *, need_url: bool) -> None:
    p.add_argument(
        "--config", "-c", help="YAML config (Trinity-RFT keys); default: the embedded default run"
    )
    p.add_argument(
        "--nats-url",
        required=need_url,
        help="use this NATS server instead of starting an embedded one",
    )
    p.add_argument(
        "--run-dir",
        help="run directory (NATS store, checkpoints, logs, metrics.jsonl); default runs/<name>",
    )
    p.add_argument(
        "--plugin-dir",
        action="append",
        default=[],
        help="import every *.py in this directory (repeatable)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. buffer.total_steps=3",
    )
    p.add_argument("--steps", type=int, help="override buffer.total_steps")
    p.add_argument(
        "--log-level", default="WARNING", help="console log level (the run log always gets INFO)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rftstream", description="Reinforcement fine-tuning of LLMs over NATS JetStream"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up", help="start NATS (unless --nats-url) and every actor; train until done"
    )
    _common(up, need_url=False)
    for role in ("explorer", "operator", "trainer"):
        p = sub.add_parser(role, help=f"run the {role} actor alone against an existing NATS server")
        _common(p, need_url=True)
        p.add_argument("--name", default=role, help="actor name (unique per replica)")
    st = sub.add_parser("status", help="print the run's state (KV bucket) and streams")
    _common(st, need_url=True)
    return parser


def load_run_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The config named by ``--config`` (or the embedded default), with ``--set`` overrides."""
    from rftstream.config import apply_overrides, config_from_dict, load_config
    from rftstream.defaults import DEFAULT_CONFIG

    if args.config:
        return load_config(args.config, list(args.set), validate=False), args.config
    data = apply_overrides(copy.deepcopy(DEFAULT_CONFIG), list(args.set))
    return config_from_dict(data, source="<embedded default>"), "<embedded default>"


def _setup_logging(run_dir: Path, level: str) -> None:
    run_dir.joinpath("logs").mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fh = logging.FileHandler(run_dir / "logs" / "rftstream.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
    from rich.logging import RichHandler

    ch = RichHandler(
        console=console, show_path=False, level=getattr(logging, level.upper(), logging.WARNING)
    )
    root.addHandler(ch)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _prepare(args: argparse.Namespace) -> Any:
    from rftstream.plugins import load_plugins
    from rftstream.runtime import prepare_run

    load_plugins(args.plugin_dir)
    cfg, source = load_run_config(args)
    with console.status("preparing the run (model, algorithm, pipeline)…"):
        run = prepare_run(
            cfg,
            steps=args.steps,
            run_dir=args.run_dir,
            nats_url=args.nats_url,
            progress=lambda msg: console.log(msg),
            source=source,
        )
    _setup_logging(run.run_dir, args.log_level)
    return run


def cmd_up(args: argparse.Namespace) -> int:
    from rftstream.up import run_up

    run = _prepare(args)
    return run_up(run, console=console)


def cmd_actor(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rftstream import runtime
    from rftstream.up import run_with_signals

    run = _prepare(args)
    url = args.nats_url
    if run.cfg.synchronizer.sync_method == "memory":
        raise RftError(
            "config key `synchronizer.sync_method`: `memory` needs all actors in one process; "
            "use `checkpoint` when running actors separately"
        )
    console.print(
        f"[bold]{args.command}[/] [cyan]{args.name}[/] of run [cyan]{run.names.run}[/] on {url}"
    )
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task(args.name, total=None, info="starting…")

    def explorer_progress(info: dict[str, Any]) -> None:
        mean = info.get("rollout/reward_mean")
        progress.update(
            task,
            info=f"step {info['step']}  groups {info.get('groups', 0)}  failed {info.get('failed_tasks', 0)}  "
            f"weights v{info.get('model_version', 0)}  reward {_fmt(mean if mean == mean else None)}",
        )

    def operator_progress(c: dict[str, Any]) -> None:
        progress.update(
            task,
            info=f"in {int(c.get('messages_in', 0))} msgs / {int(c.get('experiences_in', 0))} exps  "
            f"out {int(c.get('experiences_out', 0))} exps  dead-lettered {int(c.get('dead_lettered_messages', 0))}",
        )

    def trainer_step(r: dict[str, Any]) -> None:
        progress.console.print(_step_line(r))
        progress.update(task, info=f"step {r['step']}/{run.cfg.buffer.total_steps or '?'}")

    async def main() -> None:
        await runtime.provision(run, url)
        if args.command == "explorer":
            await runtime.run_explorer(run, url, name=args.name, on_progress=explorer_progress)
        elif args.command == "operator":
            await runtime.run_operator(run, url, name=args.name, on_progress=operator_progress)
        else:
            await runtime.run_trainer(run, url, name=args.name, on_step=trainer_step)

    with progress:
        return run_with_signals(main)


def cmd_status(args: argparse.Namespace) -> int:
    import anyio

    from rftstream.bus.client import Bus
    from rftstream.bus.state import RunState
    from rftstream.config.validate import run_id_from_name
    from rftstream.subjects import RunNames

    cfg, _ = load_run_config(args)
    names = RunNames(run_id_from_name(cfg.name))

    async def main() -> None:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "status") as bus:
            state = RunState(await bus.kv())
            for key, value in (await state.all()).items():
                console.print(f"[cyan]{key}[/] = {value}")

    anyio.run(main)
    return 0


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _step_line(r: dict[str, Any]) -> str:
    return (
        f"step {r['step']:>4}  reward {_fmt(r.get('reward/mean'))}  "
        f"filtered {int(r.get('experience/filtered') or 0):>4}  "
        f"staleness {_fmt(r.get('staleness/mean'), '.2f')}  "
        f"wait {_fmt(r.get('time/trainer_wait'), '.2f')}s  "
        f"loss {_fmt(r.get('actor/pg_loss'), '.4f')}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            return cmd_up(args)
        if args.command in ("explorer", "operator", "trainer"):
            return cmd_actor(args)
        if args.command == "status":
            return cmd_status(args)
    except RftError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the actors started (model build, config)
        console.print("[yellow]interrupted[/]")
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
