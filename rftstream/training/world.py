"""The trainer's rank world as the launcher describes it in the environment.

``torchrun`` / ``deepspeed`` set ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` for every trainer process; Slurm's ``srun``
sets its own variables instead, which :func:`adopt_slurm_env` translates (the
same contract, so one ``srun`` task per GPU needs no torchrun). These helpers
read the environment (no other I/O) and size one rank's share of the train
batch. :mod:`rftstream.training.ranks` runs the ranks;
:mod:`rftstream.training.policy_trainer` sizes its gradient accumulation from here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass

from rftstream.errors import ConfigError, RftError

#: the port of the rank rendezvous under ``srun`` when ``MASTER_PORT`` is not set: this
#: plus the last four digits of the job id (PyTorch Lightning's rule), so two jobs
#: sharing a node seldom collide and every task of one job agrees without talking
SLURM_PORT_BASE = 15000


def env_world_size() -> int:
    """The number of trainer ranks of this process's launch (``WORLD_SIZE``, default 1).

    Raises:
        ConfigError: ``WORLD_SIZE`` is not a positive integer.
    """
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError("WORLD_SIZE", f"must be a positive integer, got {raw!r}")
    return n


def env_rank() -> int:
    """This process's trainer rank (``RANK``, default 0)."""
    return int(os.environ.get("RANK", "0"))


def per_rank_batch_size(train_batch_size: int, world_size: int) -> int:
    """Rows one rank trains per step: ``ceil(train_batch_size / world_size)`` (at least 1).

    Every rank sizes its gradient accumulation from it, so all ranks run the same
    number of micro-batches (DeepSpeed's accumulation boundary) whatever their shard.
    """
    return max(1, math.ceil(max(1, train_batch_size) / max(1, world_size)))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``SLURM_STEP_NODELIST``): ``gpu[07-08,11],cpu1``
    gives ``gpu07``; a plain ``node1,node2`` gives ``node1``. Zero padding is kept.

    Raises:
        RftError: the list is empty or its first entry cannot be read.
    """
    text = nodelist.strip()
    match = re.match(r"([^,\[\]]+)(?:\[([^\]]*)\])?([^,\[\]]*)", text)
    if not text or match is None:
        raise RftError(f"Slurm node list: cannot read a host from {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",", 1)[0].split("-", 1)[0].strip()
    if not first:
        raise RftError(f"Slurm node list: cannot read a host from {nodelist!r}")
    return prefix + first + suffix


@dataclass(frozen=True)
class AdoptedSlurm:
    """What :func:`adopt_slurm_env` set: the task's place in the job step."""

    rank: int
    world_size: int
    local_rank: int
    node: int
    master: str  # HOST:PORT of the rank rendezvous


def adopt_slurm_env(environ: MutableMapping[str, str] | None = None) -> AdoptedSlurm | None:
    """Under ``srun`` (a job step of several tasks) and no launcher of torch's: set
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` from Slurm's ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or
    ``SLURM_NTASKS``), ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``, the first host of
    ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``) and :data:`SLURM_PORT_BASE` plus
    the job id's last four digits. Variables already set (``MASTER_ADDR`` exported in the
    batch script, torchrun's own) win. Returns what it read; None when this is not an
    ``srun`` task (no ``SLURM_STEP_ID``: a batch script or an interactive allocation runs
    one process), or ``RANK`` is set already (torchrun under srun), or the step has one
    task.

    Raises:
        RftError: a Slurm variable it needs is missing or not a number (named).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None

    def number(*keys: str) -> int:
        for key in keys:
            raw = env.get(key)
            if raw is None:
                continue
            try:
                return int(raw.split("(", 1)[0].split(",", 1)[0])  # "4(x2)" per node
            except ValueError:
                raise RftError(
                    f"environment variable {key} must be a number, got {raw!r}"
                ) from None
        raise RftError(f"environment variable {keys[0]} is not set in this srun task")

    world = number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if world <= 1:
        return None
    rank = number("SLURM_PROCID")
    local = number("SLURM_LOCALID")
    node = number("SLURM_NODEID")
    per_node = number("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    host = env.get("MASTER_ADDR") or first_host(
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    )
    port = env.get("MASTER_PORT") or str(
        SLURM_PORT_BASE + int(re.sub(r"\D", "", env.get("SLURM_JOB_ID", "0"))[-4:] or 0)
    )
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(per_node),
        MASTER_ADDR=host,
        MASTER_PORT=port,
    )
    return AdoptedSlurm(rank, world, local, node, f"{host}:{port}")


def check_declared_world(nnodes: int, n_gpus_per_node: int, world: int) -> None:
    """A trainer's ranks (``WORLD_SIZE`` ``world``; 1 without a launcher) against the
    config: ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` must equal ``world`` unless
    both are 1 (then the launcher alone decides).

    Raises:
        ConfigError: they disagree (the keys and the launcher's count named), or they ask
            for several ranks of a trainer started as one process (how to launch it named).
    """
    declared = max(1, nnodes) * max(1, n_gpus_per_node)
    if declared > 1 and world == 1:
        raise ConfigError(
            "trainer.nnodes",
            f"trainer.nnodes x trainer.n_gpus_per_node ask for {nnodes} x {n_gpus_per_node} "
            "trainer ranks, but this trainer runs as one process: start it under a launcher "
            "on every node (`torchrun --nnodes N --nproc-per-node G ... -m rftstream.cli "
            "trainer ...`, or one `srun` task per rank), or set both keys to 1",
            value=nnodes,
        )
    if declared not in (1, world):
        raise ConfigError(
            "trainer.nnodes",
            f"trainer.nnodes x trainer.n_gpus_per_node is {nnodes} x {n_gpus_per_node} = "
            f"{declared} ranks, but the launcher started {world} (WORLD_SIZE): make them "
            "agree, or leave both at 1 and let the launcher decide",
            value=nnodes,
        )
