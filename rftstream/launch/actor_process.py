"""Actors of one run in a child process: ``rftstream up`` uses both cores (or all of them).

Python runs one thread at a time per process, and the explorer (sampling,
workflows, encoding), the operator host (decoding, operators, encoding) and
the trainer (forward / backward passes) are all mostly Python-bound on small
models. ``rftstream up`` therefore runs the explorer and the operator host each
in a child process and the trainer in its own, whenever the weights can cross
processes (``synchronizer.sync_method`` other than ``memory``, ``mode: both``);
see :func:`split_roles`. Nothing else changes: the actors still meet only on
the bus, and a child is the same code as ``rftstream explorer`` / ``operator``.

The parent side is :class:`ActorProcess`: it writes the prepared run's config
to ``<run_dir>/config.yaml``, starts ``python -m rftstream.launch.actor_process`` with
its output in ``<run_dir>/logs/<name>.log`` (so nothing a library prints in the
child reaches the terminal), watches it, and stops it on exit. Given a
:class:`~rftstream.presentation.console.ChildConsole`, the child also sends its own log records
at the console's level (rftstream's loggers only) to the parent on a pipe, which
shows them on its console: ``--log-level INFO`` shows the explorer's INFO lines. The child side
is :func:`main`: it dies with its parent (``PR_SET_PDEATHSIG`` on Linux), runs
the roles until the run ends, and exits 0, 130 (signal) or 1 (error, the
reason on its last log line).

Threads: each side gets half of the machine's cores for torch
(:func:`torch_threads_per_process`); OpenMP threads spinning against each other
on a small machine cost far more than they bring.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from rftstream.errors import RftError, error_text, mendable_by_restart
from rftstream.presentation.console import (
    LOG_FORMAT,
    ChildConsole,
    RecordForwarder,
    child_console_handler,
    show_warning_via,
)
from rftstream.signals import run_with_signals

log = logging.getLogger(__name__)

ROLLOUT_ROLES = ("explorer", "operator")
# a trainer rank other than 0: no actor, no bus; it trains the shards rank 0 sends it
TRAINER_RANK_ROLE = "trainer-rank"
STOP_GRACE_S = 15.0  # SIGTERM, then this long, then SIGKILL


def split_roles(cfg: Any) -> bool:
    """Whether ``rftstream up`` runs the explorer and the operator host in child processes.

    Only with a trainer and explorers that must load its weights (``mode:
    both``) and only when weights can leave the process (``sync_method``
    ``jetstream`` or ``checkpoint``); ``memory`` keeps every actor in one process.
    """
    return cfg.mode == "both" and cfg.synchronizer.sync_method != "memory"


def torch_threads_per_process(processes: int = 2) -> int:
    """Torch intra-op threads for each of ``processes`` busy processes on this machine."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // max(1, processes))


def _log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


#: the exit code of an actor process that failed in a way a restart cannot mend (a config
#: error, missing credentials: :func:`rftstream.errors.mendable_by_restart`); ``up`` does
#: not restart it
EXIT_NOT_MENDABLE = 3


def how_it_ended(code: int | None) -> str:
    """An exit code in words: ``killed by SIGKILL``, ``exited with code 1``."""
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ActorProcess:
    """A child process running ``roles`` of ``run`` against ``url``.

    ``async with ActorProcess(...) as proc`` starts it (returns at once; the
    child imports and loads its model on its own) and, on exit, waits up to
    ``exit_grace`` seconds for it to end by itself (the run is over: explorers
    and operators return when the run status says so), then sends SIGTERM
    (the child naks the tasks it holds), then SIGKILL after
    :data:`STOP_GRACE_S`. Cancelling the block stops the child the same way,
    without the wait. :meth:`wait` returns the child's exit code, :meth:`failed`
    says whether it is a failure and :meth:`failure` makes its :class:`RftError` (with
    the tail of its log); :meth:`restart` starts it again
    (:class:`rftstream.launch.supervise.Supervisor` runs that loop).
    ``explorers``: the names of the explorers the child runs for role
    ``explorer`` (None: one per rollout engine, as :func:`rftstream.runtime.run_actors`).
    """

    def __init__(
        self,
        run: Any,
        url: str,
        *,
        roles: Sequence[str] = ROLLOUT_ROLES,
        name: str = "rollout",
        plugin_dirs: Sequence[str] = (),
        threads: int | None = None,
        exit_grace: float = 60.0,
        explorers: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        child_console: ChildConsole | None = None,
    ) -> None:
        self.run = run
        self.child_console = child_console
        self._forwarder: RecordForwarder | None = None
        self.env = dict(env or {})
        self.url = url
        self.roles = tuple(roles)
        self.name = name
        self.plugin_dirs = list(plugin_dirs)
        self.threads = threads or torch_threads_per_process()
        self.exit_grace = exit_grace
        self.explorers = list(explorers) if explorers is not None else None
        self.log_path = Path(run.run_dir) / "logs" / f"{name}.log"
        self.config_path = Path(run.run_dir) / "config.yaml"
        self.process: anyio.abc.Process | None = None
        self._log_file: Any = None
        self._first_start = True

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "rftstream.launch.actor_process",
            "--config",
            str(self.config_path),
            "--nats-url",
            self.url,
            "--run-dir",
            str(self.run.run_dir),
            "--roles",
            ",".join(self.roles),
            "--threads",
            str(self.threads),
            "--parent-pid",
            str(os.getpid()),
        ]
        for d in self.plugin_dirs:
            argv += ["--plugin-dir", str(d)]
        for explorer in self.explorers or ():
            argv += ["--explorer", explorer]
        if self._forwarder is not None and self.child_console is not None:
            argv += ["--console-fd", str(self._forwarder.write_fd)]
            argv += ["--console-level", str(self.child_console.level)]
        return argv

    def _write_config(self) -> None:
        """The prepared config, with the resolved model path, for the child to load."""
        import msgspec

        from rftstream.bus.jetstream.connect import secrets_to_env
        from rftstream.config.loader import dump_config_yaml
        from rftstream.run_lock import write_private

        cfg = self.run.cfg
        model = msgspec.structs.replace(cfg.model, model_path=self.run.model_path)
        # the file never holds a NATS secret: the child gets it in its environment
        nats_cfg, secret_env = secrets_to_env(cfg.nats)
        self.env.update(secret_env)
        write_private(  # 0600: nothing secret in it, but nobody else's business either
            self.config_path,
            dump_config_yaml(msgspec.structs.replace(cfg, model=model, nats=nats_cfg)).encode(),
        )

    async def __aenter__(self) -> ActorProcess:
        self._write_config()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")  # closed in __aexit__; a local file
        await self._spawn()
        return self

    async def _spawn(self) -> None:
        """Start the child process (its output appended to its log): on the first start,
        a prestarted child of its role where there is one (:mod:`rftstream.launch.prestart`)."""
        first, self._first_start = self._first_start, False
        if first and len(self.roles) == 1:
            from rftstream.launch.prestart import take

            waiting = take(self.roles[0])
            if waiting is not None:
                if self.child_console is not None:
                    self._forwarder = waiting.forwarder
                emit = self.child_console.emit if self.child_console is not None else None
                self.process = waiting.hand_over(  # type: ignore[assignment]
                    self.argv()[3:], self.env, self.log_path, emit
                )
                log.info(
                    "%s: pid %d (started early) runs %s (log %s)",
                    self.name,
                    self.process.pid,
                    "+".join(self.roles),
                    self.log_path,
                )
                return
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        if self.child_console is not None:
            if self._forwarder is not None:  # a restart: the dead child's pipe is drained
                self._forwarder.join()
            self._forwarder = RecordForwarder(self.child_console.emit)
        # spawned from the event loop's (main) thread: PR_SET_PDEATHSIG follows that thread
        try:
            self.process = await anyio.open_process(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the terminal's Ctrl-C reaches the parent, which stops it
                pass_fds=(self._forwarder.write_fd,) if self._forwarder else (),
            )
        finally:
            if self._forwarder is not None:
                self._forwarder.child_started()  # the pipe ends when the child's copy closes
        log.info(
            "%s: started pid %d for %s (log %s)",
            self.name,
            self.process.pid,
            "+".join(self.roles),
            self.log_path,
        )

    async def restart(self) -> None:
        """Start the child again after it exited (the same roles, names and log). Blocks
        only for the spawn."""
        assert self.process is not None and self.process.returncode is not None
        await self._spawn()

    @staticmethod
    def failed(code: int | None) -> bool:
        """Whether exit ``code`` is a failure (not 0, not a stop by SIGTERM or SIGINT)."""
        return code not in (0, -signal.SIGTERM, 128 + signal.SIGTERM, 130, None)

    def failure(self, code: int | None) -> RftError:
        """The error of a failed exit ``code``: the child, its code and its log's tail."""
        why = " (not restarted: it would fail the same way again)"
        return RftError(
            f"the {self.name} process ({'+'.join(self.roles)}) {how_it_ended(code)}"
            f"{why if code == EXIT_NOT_MENDABLE else ''}; "
            f"its log {self.log_path} ends with:\n{_log_tail(self.log_path)}"
        )

    async def wait(self) -> int:
        """Wait for the child to exit; its exit code (negative: the killing signal)."""
        assert self.process is not None
        return await self.process.wait()

    async def stop(self, grace: float = 0.0) -> int | None:
        """Wait ``grace`` s for the child to end, then SIGTERM it, then SIGKILL. Returns its
        exit code."""
        proc = self.process
        if proc is None:
            return None
        with anyio.CancelScope(shield=True):
            if proc.returncode is None and grace > 0:
                with anyio.move_on_after(grace):
                    await proc.wait()
            if proc.returncode is None:
                proc.terminate()
                with anyio.move_on_after(STOP_GRACE_S):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        return proc.returncode

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.stop(self.exit_grace if exc_type is None else 0.0)
        finally:
            if self._forwarder is not None:
                self._forwarder.join()  # the child's last records, then its pipe's end
            if self._log_file is not None:
                self._log_file.close()


def trainer_rank_processes(
    run: Any,
    url: str,
    *,
    threads: int,
    plugin_dirs: Sequence[str] = (),
    exit_grace: float = 60.0,
    child_console: ChildConsole | None = None,
) -> list[ActorProcess]:
    """The child processes of trainer ranks 1 .. ``trainer.n_gpus_per_node - 1`` (none for
    one rank), not started yet; sets this process's torch.distributed env as rank 0 of
    them (``MASTER_ADDR``/``MASTER_PORT`` on this host, ``RANK`` 0, ``WORLD_SIZE``), the
    contract ``torchrun`` also follows. Each child builds the same
    :class:`~rftstream.training.policy_trainer.PolicyTrainer` and follows rank 0
    (:func:`rftstream.training.ranks.follow_leader`); it exits 0 when rank 0 stops it."""
    n = int(run.cfg.trainer.n_gpus_per_node)
    if n <= 1:
        return []
    from rftstream.nats_server.embedded import free_port

    dist_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n)}
    os.environ.update(dist_env, RANK="0", LOCAL_RANK="0")
    return [
        ActorProcess(
            run,
            url,
            roles=(TRAINER_RANK_ROLE,),
            name=f"trainer-rank-{rank}",
            plugin_dirs=plugin_dirs,
            threads=threads,
            exit_grace=exit_grace,
            env={**dist_env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            child_console=child_console,
        )
        for rank in range(1, n)
    ]


def follow_trainer_rank(run: Any) -> int:
    """This process as a trainer rank other than 0: build the policy, follow rank 0 until it
    says stop. Blocks; returns 0. The caller then ends the process with
    :func:`~rftstream.training.ranks.end_follower_process` (after its own last words)."""
    from rftstream.training.policy_trainer import PolicyTrainer
    from rftstream.training.ranks import follow_leader
    from rftstream.training.world import env_rank

    policy = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    steps = follow_leader(policy)
    log.info("trainer rank %d: %d steps", env_rank(), steps)
    return 0


# ------------------------------------------------------------------ child side


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the parent goes (Linux); exit at once if it is gone already."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if parent_pid and os.getppid() != parent_pid:
        sys.exit(130)


def _await_hand_over(argv: Sequence[str]) -> list[str] | None:
    """A prestarted child (:mod:`rftstream.launch.prestart`; ``argv``: ``--roles ROLE
    --parent-pid PID``): import what the role needs, then
    wait for the hand-over line on stdin and apply it (log file, environment); its
    command line, or None when stdin closed without one. Blocks."""
    import importlib
    import json

    from rftstream.launch.prestart import PRELOAD

    p = argparse.ArgumentParser(prog="python -m rftstream.launch.actor_process --await-args")
    p.add_argument("--roles", required=True)
    p.add_argument("--parent-pid", type=int, default=0)
    args = p.parse_args(argv)
    _die_with_parent(args.parent_pid)
    for module in PRELOAD.get(args.roles, ()):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001, S112 - main() imports it again and reports it
            continue
    line = sys.stdin.readline()
    if not line.strip():
        return None
    spec = json.loads(line)
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(spec["env"])
    return list(spec["argv"])


def main(argv: Sequence[str] | None = None) -> int:
    """The child: run ``--roles`` of the run in ``--config`` against ``--nats-url``. Blocks.

    ``--await-args --roles ROLE --parent-pid PID``: a prestarted child, which gets its
    command line later (see :mod:`rftstream.launch.prestart`)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--await-args"]:
        handed = _await_hand_over(args_in[1:])
        if handed is None:
            return 0
        args_in = handed
    p = argparse.ArgumentParser(prog="python -m rftstream.launch.actor_process")
    p.add_argument("--config", required=True)
    p.add_argument("--nats-url", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--roles", default=",".join(ROLLOUT_ROLES))
    p.add_argument("--plugin-dir", action="append", default=[])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument(
        "--explorer",
        action="append",
        default=None,
        help="name of an explorer to run (repeatable; default: one per rollout engine)",
    )
    p.add_argument(
        "--console-fd",
        type=int,
        default=-1,
        help="write own log records (JSON lines) here for the parent's console",
    )
    p.add_argument("--console-level", type=int, default=logging.WARNING)
    args = p.parse_args(args_in)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=LOG_FORMAT)
    if args.console_fd >= 0:
        logging.getLogger().addHandler(child_console_handler(args.console_fd, args.console_level))
    # rftstream's own warnings as log records (so the parent's console shows them); the
    # libraries' ones to this child's log only
    warnings.showwarning = show_warning_via(logging.getLogger("rftstream.warnings").warning)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    t0 = time.time()
    try:
        import torch

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        from rftstream.config import load_config
        from rftstream.plugins.loader import load_plugins
        from rftstream.runtime import prepare_run, run_actors

        load_plugins(args.plugin_dir)
        cfg = load_config(args.config, validate=False)
        roles = tuple(r for r in args.roles.split(",") if r)
        run = prepare_run(
            cfg,
            run_dir=args.run_dir,
            nats_url=args.nats_url,
            source=args.config,
            roles=tuple("trainer" if r == TRAINER_RANK_ROLE else r for r in roles),
        )
        log.info(
            "running %s of run %s%s (%.1fs to start)",
            "+".join(roles),
            run.names.run,
            f" (explorers {', '.join(args.explorer)})" if args.explorer else "",
            time.time() - t0,
        )

        if roles == (TRAINER_RANK_ROLE,):
            code = follow_trainer_rank(run)
        else:

            async def actors() -> None:
                await run_actors(run, args.nats_url, roles, explorers=args.explorer)

            code = run_with_signals(actors)
    except Exception as exc:  # noqa: BLE001 - the parent reads the reason off the log
        log.exception("failed: %s", exc, extra={"console": False})  # the parent reports it
        print(f"error: {error_text(exc)}", flush=True)
        return 1 if mendable_by_restart(exc) else EXIT_NOT_MENDABLE
    log.info("done after %.1fs (exit %d)", time.time() - t0, code)
    if roles == (TRAINER_RANK_ROLE,) and code == 0:
        from rftstream.training.ranks import end_follower_process

        end_follower_process()  # no interpreter teardown racing gloo's threads
    return code


if __name__ == "__main__":
    from rftstream.signals import exit_process

    exit_process(main())
