"""``rftstream up``: a private nats-server plus the actors of the run's mode, with a live display.

Blocks until the run ends: the trainer finishes (``mode: both`` / ``train``),
the explorer's tasks run out or it reached ``buffer.total_steps`` (``mode:
explore``: a bar of explorer steps), or the last evaluation is written
(``mode: bench``: one line per evaluation). SIGINT (Ctrl-C) or SIGTERM cancels the
actors' task group (each actor's ``finally`` closes its NATS connection), then
the embedded server is stopped; the whole shutdown takes a few seconds.
"""

from __future__ import annotations

import contextlib
import functools
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from rftstream.config.secrets import redact_url
from rftstream.launch.actor_process import split_roles
from rftstream.launch.supervise import Supervisor
from rftstream.nats_server.embedded import EmbeddedNatsServer
from rftstream.presentation.console import ChildConsole
from rftstream.presentation.plot import (
    checkpoint_summary,
    idle_shares,
    plot_metrics,
    read_metrics,
    sync_summary,
    window_mean,
)
from rftstream.presentation.report import REPORT_FILE, save_run_config, write_report
from rftstream.presentation.step_lines import StepLines, step_line
from rftstream.run_lock import AUTH_FILE, EMBEDDED_USER, RunLock, new_embedded_auth
from rftstream.run_start import RunClaim
from rftstream.runtime import PreparedRun, run_actors, start_fresh
from rftstream.signals import run_with_signals


class Interrupted(Exception):
    """Raised when a signal stopped the run."""


def live_progress(console: Console, label: str, total: int | None, **kwargs: Any) -> Progress:
    """The one live display of a run: ``label``, a bar of ``total`` (None: open-ended), a
    free ``info`` field and the time elapsed. Lines printed through ``progress.console``
    scroll above it. When the console is not a terminal (CI logs, a pipe) it is disabled:
    those lines are then the only output, plain, one per line."""
    return Progress(
        TextColumn(f"[bold]{escape(label)}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        **kwargs,
    )


def print_summary(console: Console, rows: list[tuple[str, str]]) -> None:
    """Print the end-of-run summary: each row's label, then its value wrapped at word
    boundaries in a column of its own, so that no line reaches the console's last column
    and none ends in padding. A value that is one word too long for that column (a path)
    goes whole on a line of its own under its label, where it can be copied. Labels and
    values are plain text; a label ``done…`` is shown in green."""
    label_width = max((len(label) for label, _ in rows), default=0) + 1
    room = max(20, console.width - 1 - label_width)
    for label, value in rows:
        style = "bold green" if label.startswith("done") else "bold"
        if " " not in value and len(value) > room:
            console.print(Text(label, style=style))
            console.print(Text(value), soft_wrap=True)
            continue
        chunks = textwrap.wrap(value, room, break_long_words=False, break_on_hyphens=False)
        for i, chunk in enumerate(chunks or [""]):
            head = (label if i == 0 else "").ljust(label_width)
            line = Text.assemble((head, style), chunk)
            line.rstrip()  # in place: a label alone has no padding after it
            console.print(line, soft_wrap=True)


def nats_cli_hint(url: str, run: PreparedRun, auth_file: Path | None = None) -> list[str]:
    """NATS CLI commands that show the run. ``auth_file``: the embedded server's
    credential file (the commands then read the password from it, never show it)."""
    n = run.names
    url = redact_url(url)
    lines = []
    if auth_file is not None:
        lines.append(
            f"export NATS_URL={url} NATS_USER={EMBEDDED_USER} NATS_PASSWORD=$(cat {auth_file})"
        )
        server = ""
    else:
        server = f"--server {url} "
    return lines + [
        f"nats {server}stream ls",
        f"nats {server}stream view {n.exp_stream}",
        f"nats {server}consumer info {n.exp_stream} {n.trainer_consumer}",
        f"nats {server}sub '{n.metrics_wildcard}'",
        f"nats {server}kv ls {n.kv_bucket}",
    ]


def _drive(
    run: PreparedRun,
    url: str,
    server: EmbeddedNatsServer | None,
    progress: Progress,
    console: Console,
    child_console: ChildConsole | None = None,
    *,
    supervisor: Supervisor,
    continuing: bool = False,
    lock: RunLock | None = None,
    **callbacks: Any,
) -> tuple[int, float]:
    """Start (or continue) the run and its actors under ``progress`` until they end or a
    signal stops them, with ``supervisor`` restarting the embedded server and the child
    processes when they die; then stop the embedded server. Returns ``(exit code,
    seconds)``; blocks throughout.

    ``callbacks`` go to :func:`rftstream.runtime.run_actors` (``on_step``, ``on_progress``,
    ``on_eval``); ``child_console`` gets the child processes' own log records (if any).
    """
    t_start = time.time()
    try:
        with progress:

            async def main() -> None:
                async with anyio.create_task_group() as tg:
                    if server is not None:
                        tg.start_soon(supervisor.server, server)
                    # heartbeats of a killed run are young: the run dir's lock says it is
                    # dead (a continued run), or the store is ours alone (embedded server)
                    note = await start_fresh(
                        run, url, continuing=continuing, own_store=server is not None or continuing
                    )
                    if note:
                        progress.console.print(f"[yellow]{escape(note)}[/]", soft_wrap=True)
                    if split_roles(run.cfg) or run.cfg.trainer.n_gpus_per_node > 1:
                        await _run_split(
                            run,
                            url,
                            progress.console,
                            child_console,
                            supervisor=supervisor,
                            lock=lock,
                            **callbacks,
                        )
                    else:
                        await run_actors(run, url, **callbacks)
                    tg.cancel_scope.cancel()

            code = run_with_signals(main)
    finally:
        if server is not None:
            server.stop()
    elapsed = time.time() - t_start
    if code:
        console.print(f"[yellow]stopped by signal after {elapsed:.1f}s[/]; everything shut down")
    return code, elapsed


async def _run_split(
    run: PreparedRun,
    url: str,
    console: Console,
    child_console: ChildConsole | None,
    *,
    supervisor: Supervisor,
    lock: RunLock | None = None,
    **callbacks: Any,
) -> None:
    """The trainer here; each explorer (one per rollout engine: ``explorer``, ``explorer-2``,
    ...) and the operator host each in a child process (see :mod:`rftstream.launch.actor_process`),
    in ``mode: both``; trainer ranks 1.. (``trainer.n_gpus_per_node``) in any mode.
    Returns when the trainer is done and the children have ended (the explorers after the
    final evaluation). A child that dies is started again by ``supervisor`` (explorers and
    the operator host); a trainer rank's death, or a child past its restarts, raises and
    stops the run. ``lock``: the run dir's lock, told the children's pids."""
    import torch

    from rftstream.launch.actor_process import (
        TRAINER_RANK_ROLE,
        ActorProcess,
        torch_threads_per_process,
        trainer_rank_processes,
    )
    from rftstream.runtime import FINAL_EVAL_GRACE_S, explorer_names, provision

    await provision(run, url)  # the durables exist before either side publishes
    grace = FINAL_EVAL_GRACE_S if run.cfg.buffer.explorer_input.eval_tasksets else 30.0
    rollout = run.cfg.mode == "both"  # mode train: the trainer's ranks only
    explorers = explorer_names(run.cfg) if rollout else []  # one per rollout engine
    # the trainer's and each explorer's forward passes share the cores
    ranks = max(1, run.cfg.trainer.n_gpus_per_node)
    threads = torch_threads_per_process(ranks + len(explorers))
    common: dict[str, Any] = {
        "plugin_dirs": run.plugin_dirs,
        "exit_grace": grace,
        "child_console": child_console,
    }
    children = [
        ActorProcess(
            run,
            url,
            roles=("explorer",),
            name=name,
            threads=threads,
            explorers=[name],
            **common,
        )
        for name in explorers
    ]
    if rollout:
        children.append(
            ActorProcess(run, url, roles=("operator",), name="operator", threads=1, **common)
        )
    # trainer ranks 1.. (trainer.n_gpus_per_node); the trainer here is rank 0
    children += trainer_rank_processes(run, url, threads=threads, **common)
    async with contextlib.AsyncExitStack() as stack:
        for child in children:
            await stack.enter_async_context(child)
        what = "explorer" if len(explorers) == 1 else f"{len(explorers)} explorers"
        console.print(
            (f"{what} and operator host" if rollout else f"trainer ranks 1..{ranks - 1}")
            + " run in processes "
            + ", ".join(
                f"{c.process.pid if c.process else '?'} ({c.log_path.name})" for c in children
            )
            + f" (logs in {children[0].log_path.parent}); the trainer runs here",
            soft_wrap=True,
        )
        torch.set_num_threads(threads)

        def record_pids() -> None:
            if lock is not None:
                lock.update(children=[c.process.pid for c in children if c.process])

        record_pids()
        supervisor.on_change = record_pids
        async with anyio.create_task_group() as tg:
            for child in children:
                # a failed child is restarted; one past its restarts (or a trainer rank)
                # raises here and stops the trainer
                tg.start_soon(
                    functools.partial(
                        supervisor.child, child, restart=TRAINER_RANK_ROLE not in child.roles
                    )
                )
            await run_actors(run, url, roles=("trainer",), **callbacks)
            tg.cancel_scope.cancel()


def run_up(
    run: PreparedRun,
    *,
    console: Console,
    child_console: ChildConsole | None = None,
    claim: RunClaim | None = None,
) -> int:
    """Start the embedded server (unless ``nats.url`` is set) and all actors; show progress.

    ``claim``: the run dir's lock and whether the earlier run continues
    (:func:`rftstream.run_start.claim_run_dir`, taken before anything was written in the
    directory); None: a new run, nothing locked (tests). The embedded server gets a
    random user/password of its own, which the actors get in memory and the child
    processes in their environment (never on a command line or in a file others can
    read). Blocks until the run ends; returns the exit code (130 after a signal).
    ``child_console`` shows the own log records of the actors running in child processes.
    """
    cfg = run.cfg
    continuing = claim is not None and claim.continuing
    lock = claim.lock if claim is not None else None
    if claim is not None and claim.note:
        console.print(f"[yellow]{escape(claim.note)}[/]", soft_wrap=True)
    if not continuing:  # a new run: its own curves only
        for old in ("metrics.jsonl", "metrics.png", REPORT_FILE):
            (run.run_dir / old).unlink(missing_ok=True)
    else:
        (run.run_dir / REPORT_FILE).unlink(missing_ok=True)  # written again at the end
    save_run_config(cfg, run.run_dir)  # the report shows it; secrets masked
    server: EmbeddedNatsServer | None = None
    url = cfg.nats.url or ",".join(cfg.nats.servers)  # Bus.connect splits a comma list
    if not url:
        auth = new_embedded_auth(run.run_dir)
        server = EmbeddedNatsServer(
            run.run_dir / "nats",
            max_payload=cfg.nats.max_payload,
            # weights kept in memory need room for about two keyframes: the server's default
            max_memory_store=None if cfg.nats.streams.weights.storage == "memory" else 256 << 20,
            user=auth.user,
            password=auth.password,
        )
        with console.status("starting the embedded nats-server…"):
            url = server.start()
        cfg = run.cfg = auth.on(cfg)
        console.print(
            f"[bold green]NATS[/] listening on [cyan]{url}[/] (JetStream store {server.store_dir}; "
            f"user {auth.user}, its password in {run.run_dir / 'nats' / AUTH_FILE})",
            soft_wrap=True,
        )
    else:
        console.print(f"[bold green]NATS[/] using [cyan]{redact_url(url)}[/]", soft_wrap=True)
    console.print(
        f"run [cyan]{escape(run.names.display)}[/]  algorithm [cyan]{run.algorithm.name}[/]  "
        f"model {escape(str(run.model_path))}",
        soft_wrap=True,
    )
    console.print(
        f"run dir {escape(str(run.run_dir))}  (metrics.jsonl, checkpoints/, "
        "logs/: library warnings and child processes' output)",
        soft_wrap=True,
    )
    if lock is not None:
        lock.update(url=redact_url(url), server_pid=server.pid if server is not None else None)
    console.print("inspect the run with the NATS CLI:")
    auth_file = run.run_dir / "nats" / AUTH_FILE if server is not None else None
    for line in nats_cli_hint(url, run, auth_file=auth_file):
        console.print(f"  [dim]$[/] {escape(line)}", soft_wrap=True)
    supervisor = Supervisor(
        lambda line: console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True)
    )
    if cfg.mode in ("explore", "bench"):
        return _run_without_trainer(
            run, url, server, console, supervisor=supervisor, continuing=continuing, lock=lock
        )
    total = cfg.buffer.total_steps

    progress = live_progress(console, "trainer", total, refresh_per_second=4)
    task = progress.add_task("train", total=total, info="waiting for experience…")
    last_reward = [0.0]
    lines = StepLines(total)

    def on_step(record: dict[str, Any]) -> None:
        if lines.due(record["step"]):
            progress.console.print(step_line(record), soft_wrap=True)
        if record.get("reward/mean") is not None:
            last_reward[0] = record["reward/mean"]
        progress.update(task, completed=record["step"], info=f"raw reward {last_reward[0]:.3f}")

    supervisor.say = lambda line: progress.console.print(
        f"[yellow]{escape(line)}[/]", soft_wrap=True
    )
    code, elapsed = _drive(
        run,
        url,
        server,
        progress,
        console,
        child_console=child_console,
        supervisor=supervisor,
        continuing=continuing,
        lock=lock,
        on_step=on_step,
    )
    if code:
        return code
    metrics_path = run.run_dir / "metrics.jsonl"
    if metrics_path.exists():
        records = read_metrics(metrics_path)
        first, last = (
            window_mean(records, "reward/mean", True),
            window_mean(records, "reward/mean", False),
        )
        rows = [(f"done in {elapsed:.0f}s:", f"{len(records)} trainer steps")]
        if first is not None and last is not None:  # sft, dpo: no rollouts, no rewards
            rows.append(
                ("reward/mean:", f"first 20 steps {round(first, 3)} -> last 20 {round(last, 3)}")
            )
        trainer_idle, explorer_idle = idle_shares(records)
        if trainer_idle is not None:
            idle = f"trainer {trainer_idle:.0%} (waiting for experience)"
            if explorer_idle is not None:
                idle += f", explorers {explorer_idle:.0%} (no task running)"
            rows.append(("idle after step 1:", idle))
        sync = sync_summary(records, cfg.synchronizer.sync_method)
        if sync is not None:
            rows.append(("weights sync:", sync))
        checkpoints = checkpoint_summary(records)
        if checkpoints is not None:
            rows.append(("checkpoints:", checkpoints))
        restarts = supervisor.summary()
        if restarts is not None:
            rows.append(("restarted:", restarts + " (each logged above; no work lost)"))
        if cfg.monitor.plot and records:
            rows.append(("curves:", str(plot_metrics(metrics_path))))
        if records:
            rows.append(("report:", str(write_report(run.run_dir))))
        rows.append(("logs:", str(run.run_dir / "logs")))
        print_summary(console, rows)
    return 0


def _eval_line(record: dict[str, Any]) -> str:
    """One evaluation record (``eval.jsonl``) as a line: step, checkpoint, each taskset's means."""
    where = record.get("checkpoint") or ("the given model" if record.get("bench") else "")
    parts = [f"eval step {record.get('step')}" + (f" ({where})" if where else "")]
    for key, value in record.items():
        if key.startswith("eval/") and key.endswith("/mean") and value is not None:
            parts.append(f"{key[len('eval/') :]} {value:.3f}")
    return "  ".join(parts)


def _run_without_trainer(
    run: PreparedRun,
    url: str,
    server: EmbeddedNatsServer | None,
    console: Console,
    *,
    supervisor: Supervisor,
    continuing: bool,
    lock: RunLock | None,
) -> int:
    """``mode: explore`` (explorer + operators) or ``bench`` (one evaluating explorer)."""
    cfg = run.cfg
    explore = cfg.mode == "explore"
    counts = {"steps": 0, "groups": 0, "evals": 0}
    total = cfg.buffer.total_steps if explore else None
    progress = live_progress(console, "explorer" if explore else "bench", total)
    task = progress.add_task(cfg.mode, total=total, info="starting…")
    supervisor.say = lambda line: progress.console.print(
        f"[yellow]{escape(line)}[/]", soft_wrap=True
    )

    def on_progress(info: dict[str, Any]) -> None:
        counts["steps"] = int(info.get("step", 0))
        counts["groups"] = int(info.get("groups", 0))
        mean = info.get("rollout/reward_mean")
        reward = f"reward {mean:.3f}" if isinstance(mean, float) and mean == mean else ""
        progress.update(
            task,
            completed=counts["steps"],
            info=f"groups {counts['groups']}  failed {info.get('failed_tasks', 0)}  {reward}",
        )

    def on_eval(record: dict[str, Any]) -> None:
        counts["evals"] += 1
        progress.console.print(_eval_line(record), markup=False, soft_wrap=True)
        if not explore:
            progress.update(task, completed=counts["evals"], info="evaluating…")

    code, elapsed = _drive(
        run,
        url,
        server,
        progress,
        console,
        supervisor=supervisor,
        continuing=continuing,
        lock=lock,
        on_progress=on_progress,
        on_eval=on_eval,
    )
    if code:
        return code
    evals = run.run_dir / "eval.jsonl"
    done = f"done in {elapsed:.0f}s:"
    if explore:
        rows = [
            (
                done,
                f"{counts['steps']} explorer steps, {counts['groups']} experience groups on "
                f"{run.names.exp_subject('train')} (stream {run.names.exp_stream}) for a trainer "
                "to read",
            )
        ]
        if server is not None:
            rows.append(
                (
                    "kept in:",
                    f"the JetStream store {server.store_dir}; set nats.url to share "
                    "them with a trainer on another server",
                )
            )
    else:
        rows = [(done, f"{counts['evals']} evaluations")]
    if counts["evals"] and evals.exists():
        rows.append(("eval results:", str(evals)))
    restarts = supervisor.summary()
    if restarts is not None:
        rows.append(("restarted:", restarts + " (each logged above; no work lost)"))
    rows.append(("logs:", str(run.run_dir / "logs")))
    print_summary(console, rows)
    return 0
