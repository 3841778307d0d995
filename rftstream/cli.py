"""The ``rftstream`` command line.

::

    rftstream up [--config C] [--steps N] [--run-dir D] [--nats-url U] [--plugin-dir D] [--set k=v]
    rftstream explorer|operator|trainer --config C --nats-url U [--run-dir D] [--name N]
    rftstream operator NAME|module:Class --from STAGE --to STAGE [--args JSON] [--replicas N] ...
    rftstream status|streams --config C --nats-url U
    rftstream tail STAGE [-n N] [--no-follow] [--dlq] [--json] --config C --nats-url U
    rftstream decode < body    # nats stream view ... --translate "rftstream decode"
    rftstream debug workflow [--config C] [--task N] [--taskset NAME] [--plugin-dir D] [--json]

Errors derived from :class:`rftstream.errors.RftError` are printed as one
readable line (exit code 2); anything else is a bug and shows a traceback.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.markup import escape

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
    op = sub.choices["operator"]
    op.add_argument(
        "operator",
        nargs="?",
        help="run this one operator (registered name or module:Class) instead of the configured pipeline",
    )
    op.add_argument(
        "--args", default="{}", help="JSON object of the operator's constructor arguments"
    )
    op.add_argument(
        "--from", dest="from_stage", help="stage to read (default: the pipeline's input_stage)"
    )
    op.add_argument(
        "--to", dest="to_stage", help="stage to write (default: the pipeline's output_stage)"
    )
    op.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas in this process, sharing one durable consumer",
    )
    op.add_argument(
        "--splice",
        action="store_true",
        help="insert this operator in front of the running trainer: it takes over the stage the "
        "trainer reads, from the next message on, and writes --to, which the trainer reads instead",
    )
    st = sub.add_parser("status", help="print the run's state from its KV bucket")
    _common(st, need_url=True)
    sm = sub.add_parser(
        "streams", help="the run's streams, subject depths, consumers and their lag"
    )
    _common(sm, need_url=True)
    sm.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    tl = sub.add_parser("tail", help="decoded messages of one stage (exp.<stage>), newest last")
    _common(tl, need_url=True)
    tl.add_argument(
        "stage",
        help="stage name: raw, train, or any operator stage; with --dlq a dead-letter stage",
    )
    tl.add_argument(
        "-n", "--lines", type=int, default=10, help="how many of the latest messages to show first"
    )
    tl.add_argument("--no-follow", action="store_true", help="exit after the latest messages")
    tl.add_argument("--dlq", action="store_true", help="tail rft.<run>.dlq.<stage> instead")
    tl.add_argument("--json", action="store_true", help="one JSON object per line")
    sub.add_parser("decode", help="read one message body on stdin, print a one-line JSON summary")
    dbg = sub.add_parser(
        "debug",
        help="run one piece locally, without NATS: `debug workflow` runs one task through its workflow",
    )
    dbg.add_argument(
        "module",
        nargs="?",
        choices=["workflow"],
        help="what to debug: `workflow` (one task of the training taskset through its workflow)",
    )
    dbg.add_argument(
        "--module",
        dest="module_opt",
        choices=["workflow"],
        help="same as the positional (Trinity-RFT's spelling)",
    )
    dbg.add_argument(
        "--config", "-c", help="YAML config (Trinity-RFT keys); default: the embedded default run"
    )
    dbg.add_argument(
        "--task", type=int, default=0, help="row index in the training taskset (default 0)"
    )
    dbg.add_argument(
        "--taskset",
        help="name of the training taskset when `tasksets` lists several (default: the first)",
    )
    dbg.add_argument(
        "--plugin-dir",
        action="append",
        default=[],
        help="import every *.py in this directory (repeatable)",
    )
    dbg.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. algorithm.repeat_times=2",
    )
    dbg.add_argument("--json", action="store_true", help="one JSON document instead of panels")
    dbg.add_argument(
        "--max-chars", type=int, default=2000, help="clip prompt/response texts (0: never)"
    )
    dbg.add_argument(
        "--traceback",
        action="store_true",
        help="also print the workflow's traceback when it raises",
    )
    dbg.add_argument("--log-level", default="WARNING", help="console log level (stderr)")
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


def _operator_pipeline(args: argparse.Namespace) -> Any:
    """``rftstream operator NAME --args JSON``: a pipeline of that one operator (None: the configured one)."""
    if not getattr(args, "operator", None):
        return None
    from operators import EXPERIENCE_OPERATORS, ExperiencePipeline

    try:
        op_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise RftError(f"--args: not valid JSON ({exc})") from exc
    if not isinstance(op_args, dict):
        raise RftError(f"--args: expected a JSON object, got {type(op_args).__name__}")
    if not args.to_stage:
        raise RftError("--to: a single operator needs the stage it writes to (e.g. --to filtered)")
    cls = EXPERIENCE_OPERATORS.get(args.operator)
    try:
        op = cls(**op_args)
    except TypeError as exc:
        raise RftError(f"--args for operator {args.operator!r}: {exc}") from exc
    return ExperiencePipeline([op])


def cmd_actor(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rftstream import runtime
    from rftstream.up import run_with_signals

    run = _prepare(args)
    url = args.nats_url
    weights_travel = args.command == "explorer" or (
        args.command == "trainer" and run.cfg.mode != "train"
    )  # operators never touch weights; a train-mode trainer is the only actor
    if run.cfg.synchronizer.sync_method == "memory" and weights_travel:
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
            pipelines = [_operator_pipeline(args) for _ in range(max(1, args.replicas))]
            from_stage, to_stage, start_seq = args.from_stage, args.to_stage, None
            if args.splice:
                if not args.operator or not args.to_stage:
                    raise RftError("--splice needs an operator NAME and the stage it writes (--to)")
                progress.update(task, info="asking the trainer to splice this operator in…")
                cut = await runtime.splice_in(run, url, args.operator, args.to_stage)
                from_stage, to_stage, start_seq = cut.from_stage, cut.to_stage, cut.start_seq
                progress.console.print(
                    f"spliced in: reads exp.{from_stage} from sequence {start_seq}, writes "
                    f"exp.{to_stage}; the trainer reads exp.{to_stage} from now on"
                )
            async with anyio.create_task_group() as tg:
                for i, pipeline in enumerate(pipelines):
                    tg.start_soon(
                        functools.partial(
                            runtime.run_operator,
                            run,
                            url,
                            name=args.name if len(pipelines) == 1 else f"{args.name}-{i}",
                            pipeline=pipeline,
                            from_stage=from_stage,
                            to_stage=to_stage,
                            on_progress=operator_progress,
                            start_seq=start_seq,
                        )
                    )
        else:
            await runtime.run_trainer(run, url, name=args.name, on_step=trainer_step)

    with progress:
        return run_with_signals(main)


def cmd_status(args: argparse.Namespace) -> int:

    from rftstream.bus.client import Bus
    from rftstream.bus.state import RunState
    from rftstream.config.validate import run_id_from_name
    from rftstream.subjects import RunNames

    cfg, _ = load_run_config(args)
    names = RunNames(run_id_from_name(cfg.name))

    async def main() -> None:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "status") as bus:
            state = RunState(await bus.kv())
            values = await state.all()
            for key, value in values.items():
                console.print(f"[cyan]{key}[/] = {value}")
            current = cfg.data_processor.experience_pipeline.output_stage
            chain = ["raw", current]
            for edge in values.get("topology") or []:
                if isinstance(edge, dict) and edge.get("from") == current:
                    current = str(edge.get("to"))
                    chain.append(f"{current} ({edge.get('by')})")
            console.print("stages: " + " -> ".join(chain) + " -> trainer", markup=False)

    anyio.run(main)
    return 0


def _names(args: argparse.Namespace) -> tuple[Any, Any]:
    from rftstream.config.validate import run_id_from_name
    from rftstream.subjects import RunNames

    cfg, _ = load_run_config(args)
    return cfg, RunNames(run_id_from_name(cfg.name))


def cmd_streams(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rftstream.bus.client import Bus
    from rftstream.bus.inspect import streams_report

    cfg, names = _names(args)

    async def main() -> list[Any]:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "inspector") as bus:
            return await streams_report(bus)

    rows = anyio.run(main, backend="asyncio")
    if args.json:
        print(json.dumps({"run": names.run, "streams": [dataclasses.asdict(r) for r in rows]}))
        return 0
    streams = Table(title=f"run {names.run}: streams")
    for col in ("stream", "messages", "bytes", "subjects (messages)", "description"):
        streams.add_column(col, overflow="fold")
    consumers = Table(title=f"run {names.run}: consumers")
    for col in ("stream", "consumer", "filter", "lag (pending)", "unacked", "redelivered"):
        consumers.add_column(col, overflow="fold")
    for r in rows:
        subjects = ", ".join(f"{k} ({v})" for k, v in r.subjects.items()) or "-"
        streams.add_row(r.name, str(r.messages), f"{r.bytes:,}", subjects, r.description)
        for c in r.consumers:
            consumers.add_row(
                r.name, c.name, c.filter, str(c.pending), str(c.ack_pending), str(c.redelivered)
            )
    console.print(streams)
    console.print(consumers)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from rftstream.bus.client import Bus
    from rftstream.bus.inspect import tail
    from rftstream.up import run_with_signals

    cfg, names = _names(args)
    subject = names.dlq_subject(args.stage) if args.dlq else names.exp_subject(args.stage)

    def emit(item: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(item), flush=True)
            return
        head = f"[dim]#{item.get('seq', '?')}[/] [cyan]{item['subject']}[/]"
        if "undecodable" in item:
            console.print(f"{head} [red]undecodable[/] {item['undecodable']}")
        else:
            body = {k: v for k, v in item.items() if k not in ("subject", "seq", "schema")}
            console.print(f"{head} {json.dumps(body)}", highlight=False, soft_wrap=True)

    async def main() -> None:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "tail") as bus:
            await tail(bus, subject, lines=args.lines, follow=not args.no_follow, emit=emit)

    if not args.json:
        console.print(
            f"tailing [cyan]{subject}[/] on {args.nats_url}"
            + ("" if args.no_follow else " (Ctrl-C to stop)")
        )
    code = run_with_signals(main)
    return 0 if code == 130 else code


def cmd_decode() -> int:
    from rftstream.errors import SchemaError
    from rftstream.inspect import summarize_body

    body = sys.stdin.buffer.read()
    try:
        print(json.dumps(summarize_body(body)))
    except SchemaError as exc:
        print(json.dumps({"undecodable": str(exc), "bytes": len(body)}))
        return 1
    return 0


def cmd_debug(args: argparse.Namespace) -> int:
    """``rftstream debug workflow``: see :mod:`rftstream.debug`. No NATS."""
    from rich.logging import RichHandler

    from rftstream.debug import debug_workflow
    from rftstream.plugins import load_plugins
    from rftstream.runtime import prepare_run

    module = args.module or args.module_opt
    if module is None:
        raise RftError("debug: say what to debug, e.g. `rftstream debug workflow --config C`")
    if args.module and args.module_opt and args.module != args.module_opt:
        raise RftError(f"debug: {args.module!r} and --module {args.module_opt!r} disagree")
    err = Console(stderr=True)
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if args.traceback else logging.INFO)
    handler = RichHandler(
        console=err,
        show_path=False,
        rich_tracebacks=True,
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
    )
    root.addHandler(handler)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not args.traceback:  # one attempt: the runner's warning would repeat the error line
        logging.getLogger("workflows.runner").setLevel(logging.ERROR)
    else:  # the runner logs a raising workflow's traceback at DEBUG
        tb = RichHandler(console=err, show_path=False, rich_tracebacks=True, level=logging.DEBUG)
        tb.addFilter(lambda r: r.exc_info is not None)
        logging.getLogger("workflows.runner").addHandler(tb)
    load_plugins(args.plugin_dir)
    cfg, source = load_run_config(args)
    status = err.status("preparing (config, model)…") if not args.json else None
    if status is not None:
        status.start()
    try:
        run = prepare_run(cfg, progress=lambda msg: err.log(msg), source=source)
    finally:
        if status is not None:
            status.stop()
    debug_workflow(
        run,
        task_index=args.task,
        taskset=args.taskset,
        console=console,
        as_json=args.json,
        max_chars=args.max_chars,
    )
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
        if args.command == "streams":
            return cmd_streams(args)
        if args.command == "tail":
            return cmd_tail(args)
        if args.command == "decode":
            return cmd_decode()
        if args.command == "debug":
            return cmd_debug(args)
    except RftError as exc:  # one line, never re-wrapped, brackets in it kept (not markup)
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the actors started (model build, config)
        console.print("[yellow]interrupted[/]")
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
