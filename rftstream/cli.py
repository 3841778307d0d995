"""The ``rftstream`` command line.

::

    rftstream up [--config C] [--steps N] [--run-dir D] [--nats-url U] [--plugin-dir D] [--set k=v]
    rftstream explorer|operator|trainer --config C --nats-url U [--run-dir D] [--name N]
    rftstream operator NAME|module:Class --from STAGE --to STAGE [--args JSON] [--replicas N] ...
    rftstream operator NAME|module:Class --splice --to STAGE [--args JSON] ...   # Ctrl-C removes it
    rftstream operator --unsplice STAGE --config C --nats-url U
    rftstream status [--json] [--all]|streams --config C --nats-url U
    rftstream tail STAGE [-n N] [--no-follow] [--dlq] [--json] --config C --nats-url U
    rftstream account [--json] --config C --nats-url U   # exit 0 balanced, 1 not
    rftstream clean [RUN ...|--all] [--dry-run] [--force] [--older-than 7d] [--files] --nats-url U
    rftstream decode < body    # nats stream view ... --translate "rftstream decode"
    rftstream report RUN_DIR [--out FILE]   # report.html: curves, summary, resolved config
    rftstream studio [--port P] [--nats-url U]   # web page: config generator, live view of a run
    rftstream debug workflow [--config C] [--task N] [--taskset NAME] [--plugin-dir D] [--json]

Errors derived from :class:`rftstream.errors.RftError` are printed as one
readable line (exit code 2); anything else is a bug and shows a traceback.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from rich.console import Console
from rich.markup import escape

from rftstream.bus.state import RunState
from rftstream.config.secrets import redact_url
from rftstream.config.validate import run_id_from_name
from rftstream.errors import BusError, ConfigError, RftError, SchemaError, first_leaf
from rftstream.presentation.console import (
    LOG_FORMAT,
    ChildConsole,
    OwnRecords,
    TerminalGuard,
    print_warning_on,
    show_warning_via,
)
from rftstream.presentation.step_lines import format_number, step_line
from rftstream.signals import run_with_signals
from rftstream.subjects import RunNames
from rftstream.wire import SpliceDone, SpliceDrained

if TYPE_CHECKING:
    from rftstream.config.schema import Config

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

console = Console(stderr=False)
# `up` and the actor commands: third-party output to the run's log, the terminal to `console`
terminal = TerminalGuard(console)


SUBJECTS_SHOWN = 6  # `rftstream streams`: a stream's first subjects by name, the rest counted


def _config_args(p: argparse.ArgumentParser, *, log_help: str) -> None:
    """``--config``, ``--plugin-dir``, ``--set`` and ``--log-level``: what names a run's config."""
    p.add_argument(
        "--config", "-c", help="YAML config (Trinity-RFT keys); default: the embedded default run"
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
    p.add_argument("--log-level", default="WARNING", help=log_help)


def _common(p: argparse.ArgumentParser, *, need_url: bool) -> None:
    _config_args(p, log_help="console log level (the run log always gets INFO)")
    p.add_argument(
        "--nats-url",
        help="use this NATS server (several: comma-separated) instead of "
        + ("the config's nats.url / nats.servers" if need_url else "starting an embedded one"),
    )
    p.add_argument(
        "--run-dir",
        help="run directory (NATS store, checkpoints, logs, metrics.jsonl); default runs/<name>; "
        "with `stages`, each stage runs in <run-dir>/<stage_name>",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="override buffer.total_steps (of every stage, when the config has `stages`)",
    )


UP_EPILOG = """\
continue, start over, watch:
  rftstream up ...             the same command again continues a run that did not finish
                               (Ctrl-C, a crash, a kill) from its newest checkpoint
  rftstream up --fresh ...     starts over; the earlier run's files move to <run-dir>.<time>
  rftstream studio             a web page: the run's curves live, a config form, Run / Stop
  rftstream status --run-dir D steps, weight versions, heartbeats of a run (live or ended)
  <run-dir>/metrics.png        the curves; <run-dir>/report.html, <run-dir>/logs/
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rftstream", description="Reinforcement fine-tuning of LLMs over NATS JetStream"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="start NATS (unless --nats-url) and every actor; train until done",
        description="Start NATS (unless --nats-url) and every actor of the run; train until "
        "done. Without --config: the embedded default (the tiny local model, GRPO on the "
        "built-in arithmetic taskset).",
        epilog=UP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(up, need_url=False)
    up.add_argument(
        "--fresh",
        action="store_true",
        help="start the run over: the earlier run's files in the run dir move to "
        "<run-dir>.<timestamp> (never deleted). Without it, an earlier run that did not "
        "finish (killed, crashed, stopped) continues from its newest checkpoint",
    )
    for role in ("explorer", "operator", "trainer"):
        p = sub.add_parser(role, help=f"run the {role} actor alone against an existing NATS server")
        _common(p, need_url=True)
        p.add_argument(
            "--name",
            default=None,
            help=f"actor name, unique in the run (default: {role}; a spliced operator: "
            "<operator>-<stage>); an explorer or operator is refused while a live actor has it",
        )
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
        "trainer reads, from the next message on, and writes --to, which the trainer reads "
        "instead. Ctrl-C / SIGTERM removes it again (a second Ctrl-C aborts, leaving it spliced); "
        "after a crash, the same command resumes it",
    )
    op.add_argument(
        "--unsplice",
        metavar="STAGE",
        help="remove the operator spliced in as exp.STAGE: the running one drains and exits, "
        "and the trainer reads the stage before it again. With an operator NAME, this process "
        "resumes that stage only to remove it (when its own process is gone)",
    )
    st = sub.add_parser(
        "status",
        help="steps, weight versions, staleness, heartbeats and the stage chain, from the KV bucket",
    )
    _common(st, need_url=True)
    st.add_argument("--json", action="store_true", help="one JSON document")
    st.add_argument("--all", action="store_true", help="also every KV key and value")
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
    _clean_parser(sub)
    acc = sub.add_parser(
        "account",
        help="where every explored experience and task went, per stage; BALANCED or NOT "
        "BALANCED (exit 0 / 1)",
    )
    _common(acc, need_url=True)
    acc.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    from rftstream.studio.command import add_studio_parser

    add_studio_parser(sub)
    cfg_cmd = sub.add_parser("config", help="inspect a config file")
    cfg_sub = cfg_cmd.add_subparsers(dest="config_command", required=True)
    explain = cfg_sub.add_parser(
        "explain",
        help="for each key of a (Trinity-RFT or rftstream) config file: the key it becomes here "
        "and its value, or why it is ignored; then the errors (exit 1 if any)",
    )
    explain.add_argument("file", help="YAML config file")
    explain.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    sub.add_parser("decode", help="read one message body on stdin, print a one-line JSON summary")
    sub.add_parser(
        "schema",
        help="print the JSON Schema of an experience message body (rft.experience.v1: fields, "
        "dtypes, shapes, headers)",
    )
    rep = sub.add_parser(
        "report", help="write RUN_DIR/report.html again (curves, summary, resolved config)"
    )
    rep.add_argument("run_dir", help="the run directory (has metrics.jsonl)")
    rep.add_argument("--out", help="write the page here instead of RUN_DIR/report.html")
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
    _config_args(dbg, log_help="console log level (stderr)")
    dbg.add_argument(
        "--task", type=int, default=0, help="row index in the training taskset (default 0)"
    )
    dbg.add_argument(
        "--taskset",
        help="name of the training taskset when `tasksets` lists several (default: the first)",
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
    return parser


def _clean_parser(sub: Any) -> None:
    """``rftstream clean``: remove finished runs' streams (weights included), consumers, KV bucket."""
    cl = sub.add_parser(
        "clean",
        help="remove the NATS resources of finished runs (streams, the weights stream included, "
        "consumers, KV bucket, an earlier release's object store); refuses live or unfinished "
        "runs unless --force",
    )
    _common(cl, need_url=True)
    cl.add_argument("runs", nargs="*", metavar="RUN", help="run ids (default: the run of --config)")
    cl.add_argument("--all", action="store_true", help="every run on the server")
    cl.add_argument("--dry-run", action="store_true", help="list what would go, with sizes")
    cl.add_argument("--force", action="store_true", help="also remove live or unfinished runs")
    cl.add_argument(
        "--older-than", metavar="AGE", help="only runs idle longer than AGE (90s, 15m, 12h, 7d)"
    )
    cl.add_argument(
        "--files",
        action="store_true",
        help="also delete the checkpoints of the run of --config (its checkpoint directory)",
    )


def load_run_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The config named by ``--config`` (or the embedded default), with ``--set`` overrides."""
    from rftstream.config import apply_overrides, config_from_dict, load_config
    from rftstream.default_run import DEFAULT_CONFIG

    if args.config:
        return load_config(args.config, list(args.set), validate=False), args.config
    data = apply_overrides(copy.deepcopy(DEFAULT_CONFIG), list(args.set))
    return config_from_dict(data, source="<embedded default>"), "<embedded default>"


def _quiet_noisy_loggers() -> None:
    """DeepSpeed, torch.distributed and nats-py log only warnings and errors."""
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _setup_logging(run_dir: Path, level: str) -> Callable[[], None]:
    """Log to ``<run_dir>/logs/rftstream.log`` (INFO, every logger) and the console
    (``level``, rftstream's loggers only); with :data:`terminal` active, fds 1/2 (what
    libraries and C extensions print) go to that log file too. Returns what removes (and
    closes) the two handlers again."""
    log_path = run_dir / "logs" / "rftstream.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fh = logging.FileHandler(log_path)
    fh.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(fh)
    terminal.attach(log_path)
    from rich.logging import RichHandler

    ch = RichHandler(
        console=console, show_path=False, level=getattr(logging, level.upper(), logging.WARNING)
    )
    ch.addFilter(OwnRecords())
    root.addHandler(ch)
    global child_console
    child_console = ChildConsole(ch)
    _quiet_noisy_loggers()

    def stop() -> None:
        for handler in (fh, ch):
            root.removeHandler(handler)
            handler.close()

    return stop


# where `up`'s child processes (explorers, operator host, trainer ranks) send their own
# log records for the console; set by _setup_logging
child_console: ChildConsole | None = None


def _prepare(
    args: argparse.Namespace,
    *,
    start_logging: bool = True,
    roles: tuple[str, ...] | None = None,
    prestart_children: bool = False,
) -> Any:
    """The prepared run of ``args`` (config, overrides, validation, model path). Blocks.

    ``prestart_children`` (``up``): the explorer processes are started as soon as the
    config is read, to import torch and transformers while the run is
    prepared here (:mod:`rftstream.launch.prestart`)."""
    from rftstream.plugins.loader import load_plugins

    if prestart_children:
        _prestart_explorers(args)
    load_plugins(args.plugin_dir)
    cfg, source = load_run_config(args)
    if prestart_children:
        from rftstream.launch.actor_process import split_roles
        from rftstream.launch.prestart import discard

        if not split_roles(cfg):
            discard()
    from rftstream.runtime import prepare_run

    with console.status("preparing the run (model, algorithm, pipeline)…"):
        run = prepare_run(
            cfg,
            steps=args.steps,
            run_dir=args.run_dir,
            nats_url=args.nats_url,
            progress=lambda msg: console.log(msg),
            source=source,
            roles=roles,
        )
    run.plugin_dirs = tuple(str(Path(d).resolve()) for d in args.plugin_dir or ())
    run.log_dir = run.run_dir / "logs"
    if roles == ("operator",) and not (args.run_dir or cfg.run_dir):
        # an operator joining a run from here writes nothing of the run: no runs/<name>/
        # in the working directory, its log under the user's state directory
        state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        run.log_dir = state / "rftstream" / run.names.run / "operator" / "logs"
    if start_logging:
        _setup_logging(run.log_dir.parent, args.log_level)
    return run


def _prestart_explorers(args: argparse.Namespace) -> None:
    """Start ``up``'s explorer processes early (:mod:`rftstream.launch.prestart`), from the config
    as read before the plugins (which may import torch and more) are loaded: a config
    that needs a plugin to load starts none here, and its explorers start as usual."""
    import warnings

    from rftstream.launch.actor_process import split_roles
    from rftstream.launch.prestart import prestart

    try:
        with warnings.catch_warnings():  # its warnings are given by the load that counts
            warnings.simplefilter("ignore")
            cfg, _source = load_run_config(args)
    except Exception:  # noqa: BLE001 - loaded again after the plugins, and reported then
        return
    if split_roles(cfg):
        prestart({"explorer": max(1, int(cfg.explorer.rollout_model.engine_num))})


def _one_node(cfg: Config) -> None:
    """``up`` runs the trainer's ranks on this machine: ``trainer.nnodes`` > 1 is refused,
    with the way to run them."""
    if cfg.mode in ("both", "train") and cfg.trainer.nnodes > 1:
        raise ConfigError(
            "trainer.nnodes",
            "rftstream up starts the trainer's ranks on this machine only; for several "
            "nodes run the trainer under a launcher on each (`torchrun --nnodes N "
            "--node-rank K --nproc-per-node G --master-addr HOST -m rftstream.cli trainer "
            "--config ... --nats-url ...`, or one `srun` task per rank), and the explorers "
            "and operators with `rftstream explorer` / `rftstream operator` against the "
            "same NATS (docs/scaling.md, A trainer on several machines)",
            value=cfg.trainer.nnodes,
        )


def _up_holding(run: Any, args: argparse.Namespace, *, stage: bool = False) -> int:
    """``up`` of one prepared run: take its run dir (lock; continue or start over, see
    :mod:`rftstream.run_start`) before any file is written there, then start its logs and
    run it; the lock's record gets how the run ended. ``stage``: one stage of a
    multi-stage config, skipped when it finished earlier. Blocks until the run ends."""
    from rftstream.launch.up import run_up
    from rftstream.run_start import claim_run_dir

    _one_node(run.cfg)
    claim = claim_run_dir(
        run.run_dir, fresh=bool(getattr(args, "fresh", False)), keep_finished=stage
    )
    if claim.finished:
        console.print(f"[yellow]{escape(claim.note or '')}[/]", soft_wrap=True)
        claim.lock.release("done")
        return 0
    status = "failed"
    try:
        stop_logging = _setup_logging(run.run_dir, args.log_level)
        try:
            code = run_up(run, console=console, child_console=child_console, claim=claim)
        finally:
            stop_logging()
        status = "done" if code == 0 else "stopped" if code == 130 else "failed"
        return code
    except KeyboardInterrupt:
        status = "stopped"
        raise
    finally:
        claim.lock.release(status)  # type: ignore[arg-type]


def cmd_up(args: argparse.Namespace) -> int:
    terminal.start()
    if args.config:
        from rftstream.config.stages import load_stages
        from rftstream.plugins.loader import load_plugins

        load_plugins(args.plugin_dir)
        stages = load_stages(args.config, list(args.set))
        if stages:
            return _up_stages(args, stages)
    run = _prepare(args, start_logging=False, prestart_children=True)
    return _up_holding(run, args)


def _up_stages(args: argparse.Namespace, stages: list[Any]) -> int:
    """``rftstream up`` of a config with ``stages``: see :mod:`rftstream.launch.up_stages`."""
    from rftstream.launch.up_stages import run_stages
    from rftstream.runtime import prepare_run

    plugin_dirs = tuple(str(Path(d).resolve()) for d in args.plugin_dir or ())

    def prepare(cfg: Config, stage: Any) -> Any:
        run_dir = str(Path(args.run_dir) / stage.stage_name) if args.run_dir else None
        with console.status(f"preparing stage {stage.stage_name} (model, algorithm, pipeline)…"):
            run = prepare_run(
                cfg,
                steps=args.steps,
                run_dir=run_dir,
                nats_url=args.nats_url,
                progress=lambda msg: console.log(msg),
                source=args.config,
            )
        run.plugin_dirs = plugin_dirs
        return run

    return run_stages(
        stages,
        prepare=prepare,
        run_up=lambda run: _up_holding(run, args, stage=True),
        console=console,
    )


def _operator_pipeline(args: argparse.Namespace) -> Any:
    """``rftstream operator NAME --args JSON``: a pipeline of that one operator (None: the configured one).

    Every way this can fail (unknown name, a module that does not import, a
    class that is not an :class:`~rftstream.experience_pipeline.ExperienceOperator`, a constructor
    that raises) is one :class:`RftError` line naming the operator and its args.
    """
    if not getattr(args, "operator", None):
        return None
    from rftstream.experience_pipeline import (
        EXPERIENCE_OPERATORS,
        ExperienceOperator,
        ExperiencePipeline,
    )

    name = args.operator
    try:
        op_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise RftError(f"--args for operator {name!r}: not valid JSON ({exc})") from exc
    if not isinstance(op_args, dict):
        raise RftError(
            f"--args for operator {name!r}: expected a JSON object, got {type(op_args).__name__}"
        )
    if not args.to_stage:
        raise RftError("--to: a single operator needs the stage it writes to (e.g. --to filtered)")
    cls = EXPERIENCE_OPERATORS.get(name)  # RegistryError names the registered ones
    if not (isinstance(cls, type) and issubclass(cls, ExperienceOperator)):
        what = cls.__name__ if isinstance(cls, type) else type(cls).__name__
        raise RftError(
            f"operator {name!r}: {what} is not an ExperienceOperator; subclass "
            "operators.ExperienceOperator and implement process(exps) -> (exps, metrics)"
        )
    try:
        op = cls(**op_args)
    except Exception as exc:  # noqa: BLE001 - a user's constructor may raise anything
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise RftError(
            f"operator {name!r} ({cls.__name__}) with --args {json.dumps(op_args)}: {detail}"
        ) from exc
    return ExperiencePipeline([op])


def _run_graceful(main: Callable[[anyio.Event], Awaitable[None]]) -> int:
    """Like :func:`rftstream.signals.run_with_signals`, but the first SIGINT/SIGTERM only sets the
    event ``main`` gets (a spliced operator then removes itself); a second one cancels."""
    signals_seen: list[int] = []

    async def wrapper() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        signals_seen.append(signum)
                        if stop.is_set():
                            tg.cancel_scope.cancel()
                            return
                        console.print(
                            "[yellow]stopping: removing the stage (Ctrl-C again to abort and "
                            "leave it spliced)…[/]"
                        )
                        stop.set()

            tg.start_soon(watch)
            await main(stop)
            tg.cancel_scope.cancel()

    anyio.run(wrapper, backend="asyncio")
    return 130 if len(signals_seen) > 1 else 0


def check_standalone_sync(cfg: Config, command: str) -> None:
    """Refuse ``sync_method: memory`` for an actor started alone whose weights must travel.

    Weights move from trainer to explorers only when both run (``mode: both``);
    operators never touch them, a ``mode: train`` trainer is the only actor, and
    explore/bench explorers are never synced.
    """
    weights_travel = cfg.mode == "both" and command in ("explorer", "trainer")
    if cfg.synchronizer.sync_method == "memory" and weights_travel:
        raise RftError(
            "config key `synchronizer.sync_method`: `memory` needs all actors in one process; "
            "use `jetstream` (or `checkpoint`) when running actors separately"
        )


def _launched_ranks(args: argparse.Namespace) -> tuple[int | None, Any]:
    """``rftstream trainer`` under torchrun, DeepSpeed's launcher or Slurm's ``srun`` (one
    task per rank: its variables are translated, see
    :func:`rftstream.training.world.adopt_slurm_env`), on one node or several.

    Returns (exit code, prepared run). Rank 0 goes on as the trainer actor (the one
    process on the bus; it scatters each step's shards to the others), so its exit code
    is None, as for a trainer that runs alone. Any other rank builds the same policy,
    follows rank 0 until it says stop, prints nothing but errors, and returns its exit
    code. ``trainer.nnodes`` x
    ``trainer.n_gpus_per_node`` must equal the launcher's ``WORLD_SIZE`` unless both are 1;
    a trainer started without a launcher while they declare several ranks is refused.
    """
    from rftstream.training.world import (
        adopt_slurm_env,
        check_declared_world,
        env_rank,
        env_world_size,
    )

    slurm = adopt_slurm_env()
    world = env_world_size()
    rank = env_rank()
    if rank > 0:
        console.quiet = True  # the launcher's terminal shows rank 0; errors still print
    run = _prepare(args, roles=("trainer",))
    check_declared_world(run.cfg.trainer.nnodes, run.cfg.trainer.n_gpus_per_node, world)
    if rank == 0:
        if world > 1:
            nodes = f" on {run.cfg.trainer.nnodes} nodes" if run.cfg.trainer.nnodes > 1 else ""
            how = f" (srun tasks, rendezvous {slurm.master})" if slurm is not None else ""
            console.print(
                f"trainer rank 0 of {world}{nodes}{how}: reads the bus and feeds ranks "
                f"1..{world - 1}"
            )
        return None, run
    from rftstream.launch.actor_process import follow_trainer_rank
    from rftstream.training.ranks import end_follower_process

    follow_trainer_rank(run)
    end_follower_process()  # no interpreter teardown racing gloo's threads


def cmd_actor(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rftstream import runtime
    from rftstream.bus.jetstream.connect import server_urls

    terminal.start()
    run = None
    if args.command == "trainer":
        code, run = _launched_ranks(args)
        if code is not None:
            return code
    if run is None:
        run = _prepare(args, roles=(args.command,))
    args.name = args.name or default_actor_name(args)
    url = args.nats_url or ",".join(server_urls(run.cfg.nats))  # else nats.url / nats.servers
    check_standalone_sync(run.cfg, args.command)
    console.print(
        f"[bold]{args.command}[/] [cyan]{args.name}[/] of run [cyan]{escape(run.names.display)}[/] "
        f"on {escape(redact_url(url))}; library output in {escape(str(run.log_dir))}",
        soft_wrap=True,
    )
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,  # CI logs, pipes: the step lines alone
    )
    task = progress.add_task(args.name, total=None, info="starting…")

    def explorer_progress(info: dict[str, Any]) -> None:
        mean = info.get("rollout/reward_mean")
        progress.update(
            task,
            info=f"step {info['step']}  groups {info.get('groups', 0)}  failed {info.get('failed_tasks', 0)}  "
            f"weights v{info.get('model_version', 0)}  reward {format_number(mean if mean == mean else None)}",
        )

    def operator_progress(c: dict[str, Any]) -> None:
        progress.update(
            task,
            info=f"in {int(c.get('messages_in', 0))} msgs / {int(c.get('experiences_in', 0))} exps  "
            f"out {int(c.get('experiences_out', 0))} exps  dead-lettered {int(c.get('dead_lettered_messages', 0))}",
        )

    def trainer_step(r: dict[str, Any]) -> None:
        progress.console.print(step_line(r), soft_wrap=True)
        progress.update(task, info=f"step {r['step']}/{run.cfg.buffer.total_steps or '?'}")

    pipelines: list[Any] = []
    if args.command == "operator":  # every operator error before anything connects
        if args.replicas < 1:
            raise RftError(f"--replicas must be >= 1, got {args.replicas}")
        if (args.splice or args.unsplice) and args.from_stage:
            raise RftError("--from: a spliced operator reads the stage the trainer read; drop it")
        if args.splice and args.unsplice:
            raise RftError("--splice and --unsplice: choose one")
        if args.splice and not args.operator:
            raise RftError("--splice needs an operator NAME (and the stage it writes, --to)")
        if args.unsplice and args.operator:
            if args.to_stage and args.to_stage != args.unsplice:
                raise RftError(f"--to {args.to_stage} and --unsplice {args.unsplice} disagree")
            args.to_stage = args.unsplice
        pipelines = [_operator_pipeline(args) for _ in range(args.replicas)]

    async def name_is_free(*, unless_resuming: str | None = None) -> None:
        """Refuse a name a live actor has; ``unless_resuming``: a stage whose splice record
        exists is being resumed (the splice protocol's claim refuses a second live one)."""
        from rftstream.bus.client import Bus
        from rftstream.control.liveness import refuse_a_live_name
        from rftstream.wire import STAGE

        async with await Bus.connect(url, run.names, run.cfg.nats, f"{args.name}-start") as bus:
            state = RunState(await bus.kv())
            if unless_resuming and await state.get(STAGE.of(stage=unless_resuming)) is not None:
                return
            await refuse_a_live_name(state, args.name, args.command)

    async def main() -> None:
        await runtime.provision(run, url)
        if args.command != "trainer":  # one trainer a run; a launcher restarts it at once
            await name_is_free()
        if args.command == "explorer":
            await runtime.run_explorer(run, url, name=args.name, on_progress=explorer_progress)
        elif args.command == "operator":
            await runtime.run_operator_replicas(
                run,
                url,
                pipelines,
                name=args.name,
                from_stage=args.from_stage,
                to_stage=args.to_stage,
                on_progress=operator_progress,
            )
        else:
            await runtime.run_trainer(run, url, name=args.name, on_step=trainer_step)

    async def spliced(stop: anyio.Event) -> None:
        from rftstream.actors.spliced import run_spliced

        await runtime.provision(run, url)
        if not args.unsplice:  # a resumed unsplice takes over a gone operator's name
            await name_is_free(unless_resuming=args.to_stage)
        progress.update(task, info="asking the trainer to splice this operator in…")
        outcome = await run_spliced(
            run,
            url,
            operator=args.operator,
            args=json.loads(args.args),
            to_stage=args.to_stage,
            pipelines=pipelines,
            name=args.name,
            stop=stop,
            say=lambda line: progress.console.print(
                line, markup=False, highlight=False, soft_wrap=True
            ),
            on_progress=operator_progress,
            unsplice_now=bool(args.unsplice),
        )
        progress.console.print(f"{args.name}: {outcome}", markup=False)

    with progress:
        if args.command == "operator" and (args.splice or args.unsplice):
            return _run_graceful(spliced)
        return run_with_signals(main)


def default_actor_name(args: argparse.Namespace) -> str:
    """An actor command's name when ``--name`` is not given: the role, and for a spliced
    operator ``<operator>-<stage>`` (``reward_filter-filtered``; a ``module:Class`` gives
    its class name in lower case), which cannot collide with ``up``'s operator host."""
    operator = getattr(args, "operator", None)
    stage = getattr(args, "to_stage", None)
    if args.command == "operator" and operator and (args.splice or args.unsplice):
        short = operator.rsplit(":", 1)[-1].rsplit(".", 1)[-1].lower()
        return f"{short}-{stage}" if stage else short
    return str(args.command)


def cmd_unsplice(args: argparse.Namespace) -> int:
    """``rftstream operator --unsplice STAGE`` (no NAME): ask the stage's operator to leave."""
    from rftstream.bus.client import Bus
    from rftstream.control.splice import operator_side

    cfg, names = _names(args)
    stage = args.unsplice

    async def main() -> SpliceDrained | SpliceDone:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "unsplice") as bus:
            state = RunState(await bus.kv())
            splice_id = await operator_side.ask_unsplice(state, stage)
            console.print(f"asked the operator of exp.{stage} to remove itself; waiting…")
            return await operator_side.wait_unsplice(state, splice_id, stage)

    result = anyio.run(main, backend="asyncio")
    console.print(
        f"removed exp.{stage} ({result.operator}): the trainer reads "
        f"exp.{result.from_stage} again from sequence {int(result.cut_seq or 0) + 1}",
        markup=False,
        soft_wrap=True,
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``rftstream status``: a :func:`rftstream.presentation.message_summaries.status_report` of the KV bucket."""
    import time

    from rftstream.bus.client import Bus
    from rftstream.presentation.message_summaries import status_report

    cfg, names = _names(args)

    async def main() -> dict[str, Any]:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "status") as bus:
            return await RunState(await bus.kv(create=False)).all()

    values = anyio.run(main, backend="asyncio")
    p = cfg.data_processor.experience_pipeline
    report = status_report(values, time.time(), p.input_stage, p.output_stage)
    report["run"] = names.run
    report["run_name"] = cfg.name
    if args.all:
        report["kv"] = values
    if args.json:
        print(json.dumps(report, default=str))
        return 0
    _print_status(report)
    return 0


def _print_status(r: dict[str, Any]) -> None:
    from rich.table import Table

    def age(v: Any) -> str:
        return "-" if v is None else f"{v:.0f}s ago"

    t = r["trainer"]
    console.print(
        f"run [cyan]{escape(str(r.get('run_name') or r['run']))}[/] ({r['run']})  status [bold]{r['status'] or '-'}[/]  trainer step "
        f"[bold]{format_number(t['step'], 'd')}[/]  weights v{format_number(r['weights']['version'], 'd')} "
        f"({r['weights']['method'] or '-'}, published {age(r['weights']['age'])})"
    )
    console.print("stages: " + r["chain"], markup=False)
    if r.get("change"):
        c = r["change"]
        console.print(
            f"[yellow]under way:[/] {c.get('kind')} of exp.{c.get('to_stage')} "
            f"({c.get('operator')}): {c.get('state')}"
        )
    if r.get("waiting"):
        console.print(f"[bold red]waiting:[/] {escape(str(r['waiting']))}")
    if r["explorers"]:
        ex = Table(title="explorers")
        for col in (
            "explorer",
            "step",
            "model version",
            "staleness",
            "tasks in flight",
            "heartbeat",
        ):
            ex.add_column(col)
        for e in r["explorers"]:
            ex.add_row(
                e["name"],
                format_number(e["step"], "d"),
                format_number(e["model_version"], "d"),
                format_number(e["staleness"], "d"),
                format_number(e.get("tasks_in_flight"), "d"),
                age(e["heartbeat_age"]),
            )
        console.print(ex)
    hb = Table(title="heartbeats")
    for col in ("actor", "role", "age", "info"):
        hb.add_column(col, overflow="fold")
    for h in r["heartbeats"]:
        info = ", ".join(f"{k}={v}" for k, v in h["info"].items())
        hb.add_row(h["actor"], h["role"], age(h["age"]), info)
    console.print(hb)
    for key, value in (r.get("kv") or {}).items():
        console.print(f"[cyan]{key}[/] = {escape(str(value))}")


def _names(args: argparse.Namespace) -> tuple[Any, Any]:
    cfg = getattr(args, "inspect_cfg", None)
    if cfg is None:
        cfg, _ = load_run_config(args)
    return cfg, RunNames(run_id_from_name(cfg.name), name=cfg.name)


INSPECTING = ("status", "streams", "tail", "account")  # commands that read a run's server


def _inspecting(args: argparse.Namespace, command: Callable[[], int]) -> int:
    """Run an inspecting command against the run's server (:mod:`rftstream.inspect_target`:
    ``--nats-url``, the config's servers, the live embedded server of ``--run-dir``, or a
    private one on its store)."""
    from rftstream.inspect_target import inspect_target

    cfg, _ = load_run_config(args)
    with inspect_target(cfg, args.nats_url, args.run_dir) as (url, target_cfg):
        args.nats_url = url
        args.inspect_cfg = target_cfg
        return command()


def cmd_clean(args: argparse.Namespace) -> int:
    """``rftstream clean``: see :mod:`rftstream.clean`. Exit 1 when a named run was refused."""
    import shutil

    from rich.table import Table

    from rftstream import clean
    from rftstream.weights import checkpoint_dir

    cfg, names = _names(args)
    try:
        older = clean.parse_age(args.older_than) if args.older_than else None
    except ValueError as exc:
        raise RftError(str(exc)) from exc
    wanted = None if args.all else set(args.runs or [names.run])
    if args.files and (args.all or args.runs and set(args.runs) != {names.run}):
        raise RftError(
            "--files deletes the checkpoints of the run of --config only; name no other run"
        )

    async def main() -> tuple[list[Any], list[tuple[Any, str]]]:
        from rftstream.bus.jetstream import connect_transport

        try:
            transport = await connect_transport(
                cfg.nats, args.nats_url, name="rftstream:clean", actor="clean"
            )
        except BusError as exc:
            raise RftError(f"clean: {exc}") from exc
        try:
            runs = await clean.find_runs(transport)
            missing = sorted((wanted or set()) - runs.keys())
            if missing:
                raise RftError(f"clean: no run {', '.join(map(repr, missing))} on {args.nats_url}")
            now = clean.now()
            go, kept = [], []
            for run in sorted(runs if wanted is None else wanted):
                why = clean.refusal(runs[run], now, force=args.force, older_than=older)
                if why:
                    kept.append((runs[run], why))
                else:
                    go.append(runs[run])
            if not args.dry_run:
                for res in go:
                    await clean.remove_run(transport, res)
            return go, kept
        finally:
            await transport.close()

    go, kept = anyio.run(main, backend="asyncio")
    table = Table(title=("would remove" if args.dry_run else "removed") + f" on {args.nats_url}")
    for col in ("run", "status", "streams", "consumers", "bytes"):
        table.add_column(col, overflow="fold")
    for res in go:
        table.add_row(
            res.run,
            res.status or "-",
            ", ".join(sorted(res.streams)),
            str(res.consumers),
            f"{res.bytes:,}",
        )
    console.print(table)
    for res, why in kept:
        console.print(f"[yellow]kept[/] run [cyan]{escape(res.run)}[/]: {escape(why)}")
    if args.files and any(res.run == names.run for res in go):
        path = checkpoint_dir(cfg, args.run_dir)
        if path.exists():
            console.print(
                ("would delete " if args.dry_run else "deleted ") + f"checkpoints {path}",
                markup=False,
            )
            if not args.dry_run:
                shutil.rmtree(path)
    return 1 if kept and wanted is not None else 0


def cmd_streams(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rftstream.bus.client import Bus
    from rftstream.operations.stream_view import streams_report

    cfg, names = _names(args)

    async def main() -> list[Any]:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "inspector") as bus:
            await bus.kv(create=False)  # a run with no state here: a clear error, nothing created
            return await streams_report(bus)

    rows = anyio.run(main, backend="asyncio")
    if args.json:
        print(
            json.dumps(
                {
                    "run": names.run,
                    "run_name": cfg.name,
                    "streams": [dataclasses.asdict(r) for r in rows],
                }
            )
        )
        return 0
    streams = Table(title=f"run {escape(names.display)}: streams")
    for col in ("stream", "messages", "bytes", "subjects (messages)", "description"):
        streams.add_column(col, overflow="fold")
    consumers = Table(title=f"run {escape(names.display)}: consumers")
    for col in ("stream", "consumer", "filter", "lag (pending)", "unacked", "redelivered"):
        consumers.add_column(col, overflow="fold")
    consumers.add_column("reader", overflow="fold")
    for r in rows:
        shown = list(r.subjects.items())
        subjects = ", ".join(f"{k} ({v})" for k, v in shown[:SUBJECTS_SHOWN]) or "-"
        if len(shown) > SUBJECTS_SHOWN:  # the weights stream: two subjects a version
            subjects += f" and {len(shown) - SUBJECTS_SHOWN} more (--json lists them)"
        streams.add_row(r.name, str(r.messages), f"{r.bytes:,}", subjects, r.description)
        for c in r.consumers:
            consumers.add_row(
                r.name,
                c.name if c.durable else f"{c.name} (ephemeral)",
                c.filter,
                str(c.pending),
                str(c.ack_pending),
                str(c.redelivered),
                c.description,
            )
    console.print(streams)
    console.print(consumers)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from rftstream.bus.client import Bus
    from rftstream.operations.stream_view import tail

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
            await bus.kv(create=False)  # a run with no state here: a clear error, nothing created
            await tail(bus, subject, lines=args.lines, follow=not args.no_follow, emit=emit)

    if not args.json:
        console.print(
            f"tailing [cyan]{subject}[/] on {redact_url(args.nats_url or cfg.nats.url or ', '.join(cfg.nats.servers))}"
            + ("" if args.no_follow else " (Ctrl-C to stop)")
        )
    code = run_with_signals(main)
    return 0 if code == 130 else code


def cmd_config_explain(args: argparse.Namespace) -> int:
    """``rftstream config explain FILE``: every key's fate, then the errors. Exit 1 on errors."""
    from rftstream.config.explain import explain_file

    lines, errors = explain_file(args.file, list(args.set))
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for error in errors:
        console.print(f"[bold red]error:[/] {escape(error)}", soft_wrap=True)
    if not errors:
        console.print("[bold green]ok[/]: the config loads and validates")
    return 1 if errors else 0


def cmd_report(args: argparse.Namespace) -> int:
    """``rftstream report RUN_DIR``: write the run's report.html (blocks: rendering)."""
    from rftstream.presentation.report import write_report

    console.print(f"report: {write_report(args.run_dir, args.out)}", soft_wrap=True)
    return 0


def cmd_decode() -> int:
    from rftstream.presentation.message_summaries import summarize_body

    body = sys.stdin.buffer.read()
    try:
        print(json.dumps(summarize_body(body)))
    except SchemaError as exc:
        print(json.dumps({"undecodable": str(exc), "bytes": len(body)}))
        return 1
    return 0


def cmd_debug(args: argparse.Namespace) -> int:
    """``rftstream debug workflow``: see :mod:`rftstream.debug_workflow`. No NATS."""
    from rich.logging import RichHandler

    from rftstream.debug_workflow import debug_workflow
    from rftstream.plugins.loader import load_plugins
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
    _quiet_noisy_loggers()
    if not args.traceback:  # one attempt: the runner's warning would repeat the error line
        logging.getLogger("rftstream.workflow_runner").setLevel(logging.ERROR)
    else:  # the runner logs a raising workflow's traceback at DEBUG
        tb = RichHandler(console=err, show_path=False, rich_tracebacks=True, level=logging.DEBUG)
        tb.addFilter(lambda r: r.exc_info is not None)
        logging.getLogger("rftstream.workflow_runner").addHandler(tb)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = show_warning_via(print_warning_on(console))
    try:
        if args.command == "config":
            return cmd_config_explain(args)
        if args.command == "up":
            return cmd_up(args)
        if args.command == "operator" and args.unsplice and not args.operator:
            return cmd_unsplice(args)
        if args.command in ("explorer", "operator", "trainer"):
            return cmd_actor(args)
        if args.command == "status":
            return _inspecting(args, lambda: cmd_status(args))
        if args.command == "streams":
            return _inspecting(args, lambda: cmd_streams(args))
        if args.command == "clean":
            return cmd_clean(args)
        if args.command == "account":
            from rftstream.account_cli import cmd_account

            return _inspecting(args, lambda: cmd_account(args, console, *_names(args)))
        if args.command == "tail":
            return _inspecting(args, lambda: cmd_tail(args))
        if args.command == "decode":
            return cmd_decode()
        if args.command == "schema":
            from rftstream.wire_schema import published_schema

            sys.stdout.write(published_schema())
            return 0
        if args.command == "report":
            return cmd_report(args)
        if args.command == "debug":
            return cmd_debug(args)
        if args.command == "studio":
            from rftstream.studio.command import cmd_studio

            return cmd_studio(args)
    except RftError as exc:  # one line, never re-wrapped, brackets in it kept (not markup)
        console.quiet = False  # a trainer rank > 0 is quiet but for its errors
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return 2
    except BaseExceptionGroup as group:  # an actor's RftError, raised inside a task group
        errors, rest = group.split(RftError)
        if errors is None or rest is not None:
            terminal.restore()
            raise
        exc = first_leaf(errors)
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the actors started (model build, config)
        console.print("[yellow]interrupted[/]")
        return 130
    except BaseException:  # a bug: its traceback is for the terminal, not the log
        terminal.restore()
        raise
    return 1


def entry() -> None:
    """The ``rftstream`` console command: :func:`main`, then the process's exit (a trainer
    rank's skips the interpreter's teardown: :func:`rftstream.signals.exit_process`)."""
    from rftstream.signals import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
