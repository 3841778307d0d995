"""Data-parallel trainer ranks: one consumer (rank 0) feeding N training processes.

Design. Rank 0 alone runs the trainer actor: it owns the JetStream consumer, the
feed, acks, KV writes, metrics and weight publishing. Every other rank runs
:func:`follow_leader` instead, a loop with no bus connection at all. Each
trainer step rank 0 cuts its batch into one shard per rank (:func:`shard_batch`)
and sends each rank its shard over a gloo control group
(``scatter_object_list``: the experiences are pickled, tensors included); every
rank then runs :meth:`PolicyTrainer.train_step` on its shard, where DeepSpeed
all-reduces (averages) the gradients. Experience is therefore consumed, acked
and counted once, by rank 0, whatever the number of ranks: a rank never reads
the bus, so nothing is duplicated or dropped.

Why a separate gloo group: the control messages are small Python objects; gloo
carries them on CPU whatever the training backend (nccl on GPU), so no control
traffic needs a CUDA device or stalls behind the gradient all-reduce.

Gradient equivalence (what the tests check). A 1-rank step's gradient is the
rows-weighted mean of its micro-batch losses: ``sum_mb rows_mb / B * grad
L_mb``. DeepSpeed averages the ranks' gradients, so rank ``r`` (``B_r`` rows)
scales its loss by ``rank_scale = N * B_r / B`` (:func:`rank_scales`); then the
N-rank gradient is exactly the 1-rank gradient whose micro-batches are the
union of the ranks' micro-batches, also for shards of unequal size (a short
final batch). With ``ppo_micro_batch_size_per_gpu`` 1, or shards that are whole
multiples of it, those micro-batches are the 1-rank run's own. A rank with
nothing to train (fewer groups than ranks) trains a copy of one experience
at ``rank_scale`` 0: it joins every collective and adds exactly zero.

ZeRO stages. Every rank runs the same number of micro-batch passes; a rank
with fewer rows pads with passes of real losses times 0
(``PolicyTrainer._padding_micro_step``), not with ``sum(params) * 0``: ZeRO-2
reduces each ``backward``'s gradients in one flat bucket in the order their
hooks fire and pairs the ranks' buckets by position, so every rank's pass
must fire them in the model's backward order (a sum over the parameters
fires them in parameter order, which mixed up the gradients of different
parameters: about 2% off the 1-rank loss after one step); ZeRO-3's
parameters are empty partitions outside a forward pass. ZeRO-3 also gathers
the weights in every forward call, so with several ranks the trainer turns
``trainer.share_prompts`` off (a shared prompt's pass makes two calls) and
pads each rank's no-grad passes with discarded forwards up to the rank making
most (``PolicyTrainer._lockstep_extra``). Stages 0-3 are tested
equal to the 1-rank run (tests/integration/test_trainer_ranks.py).

Shards keep each group (consecutive experiences of one task, ``eid.tid``; DPO
pairs) whole, so an advantage fn computed in the trainer on groups (GRPO's,
GAE per row) sees the same groups as on one rank. Statistics over the whole
batch (REINFORCE++'s and PPO's whitening) are all-reduced over the ranks' shards
(``PolicyTrainer._whole_batch_statistics``, :func:`rftstream.training.masked_reductions.whole_batch`).

Failure: a rank that raises in a training step reports it to rank 0, which raises
it naming the rank. A rank that vanishes (its node died, it was killed) breaks the
others' next collective: at once where the connection closes, after
``trainer.nccl_timeout`` where the network went silent. Each surviving rank then
stops with one line (:class:`RanksLost`, an :class:`~rftstream.errors.RftError`)
naming what it was doing, and the launcher (``torchrun``) stops the rest. Rank 0
waiting for experience leaves the others waiting in a collective too: it pings them
(:data:`_PING`) every ``min(60, nccl_timeout / 4)`` seconds while idle, so a long
wait for experience never reaches the timeout.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from rftstream.errors import RftError
from rftstream.experience import Experience, Experiences
from rftstream.signals import end_without_teardown, skip_teardown_at_exit

if TYPE_CHECKING:
    from rftstream.training.policy_trainer import PolicyTrainer

log = logging.getLogger(__name__)

LEADER = 0

# control commands rank 0 sends the others
_TRAIN = "train"
_STATE_DICT = "state_dict"
_CRITIC_STATE_DICT = "critic_state_dict"
_WIRE_STATE_DICT = "wire_state_dict"
_SAVE = "save_hf_checkpoint"
_STOP = "stop"
_PING = "ping"  # nothing to do: rank 0 is idle, and keeps the others' wait short

# what torch.distributed's backends say when a peer is gone (gloo, NCCL, the store)
_LOST_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "connection refused",
    "nccl communicator was aborted",
    "socket",
)


class RanksLost(RftError):
    """A trainer rank stopped answering (its node died, it was killed, the network between
    the nodes failed): the collective this rank was in failed. Its message is the one
    line the run stops with."""


def lost_rank_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank is gone (not a bug or
    a bad batch of this rank's own)."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(sign in text for sign in _LOST_SIGNS)


def ranks_lost(rank: int, world: int, doing: str, exc: BaseException) -> RanksLost:
    """The :class:`RanksLost` of rank ``rank`` (of ``world``) whose collective failed
    while ``doing``, with the backend's first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # gloo's lines start with the source location: the reason is what follows it
    first = first.split("] ", 1)[-1] if first.startswith("[") else first
    first = first.split(". ", 1)[0].strip().rstrip(".")  # not gloo's advice after it
    return RanksLost(
        f"trainer rank {rank} of {world}: another rank stopped answering while {doing} "
        f"({first}): a node died, a rank was killed, or the "
        "network between the nodes failed; the other ranks stop too. Start the trainer "
        "again on every node"
    )


def keepalive_interval(timeout_s: float) -> float:
    """Seconds between rank 0's pings while idle: ``min(60, timeout / 4)``."""
    return max(1.0, min(60.0, timeout_s / 4))


def _blocks(exps: Sequence[Experience], unit: int) -> list[int]:
    """Sizes of the indivisible runs of ``exps``: consecutive experiences of one task
    (``eid.tid``), merged with their successors until each run is a whole number of
    ``unit`` rows (DPO pairs: 2)."""
    sizes: list[int] = []
    prev: str | None = None
    for exp in exps:
        tid = exp.eid.tid
        if sizes and tid == prev:
            sizes[-1] += 1
        else:
            sizes.append(1)
        prev = tid
    out: list[int] = []
    carry = 0
    for size in sizes:
        carry += size
        if carry % unit == 0:
            out.append(carry)
            carry = 0
    if carry:
        out.append(carry)
    return out


def shard_batch(exps: Sequence[Experience], world_size: int, unit: int = 1) -> list[list[int]]:
    """Row indices of each rank's shard of ``exps``: ``world_size`` contiguous runs of whole
    groups (see :func:`_blocks`), cut at the group boundary nearest to each rank's even
    share of the rows. Every row is in exactly one shard; a shard is empty only when there
    are fewer groups than ranks. Pure.

    Raises:
        ValueError: ``world_size`` or ``unit`` is below 1.
    """
    if world_size < 1 or unit < 1:
        raise ValueError(f"world_size and unit must be >= 1, got {world_size} and {unit}")
    blocks = _blocks(exps, unit)
    ends = [0]
    for size in blocks:
        ends.append(ends[-1] + size)
    total = ends[-1]
    cuts = [0]
    for r in range(1, world_size):
        target = total * r / world_size
        # the nearest group boundary not before the previous cut
        best = min((e for e in ends if e >= cuts[-1]), key=lambda e: (abs(e - target), e))
        cuts.append(best)
    cuts.append(total)
    return [list(range(cuts[r], cuts[r + 1])) for r in range(world_size)]


def rank_scales(sizes: Sequence[int]) -> list[float]:
    """Each rank's loss factor ``N * B_r / B`` for shards of ``sizes`` rows, so that
    DeepSpeed's mean over ranks weights every row as a 1-rank step does; 0 for an empty
    shard. Pure."""
    total = sum(sizes)
    n = len(sizes)
    return [n * s / total if total else 0.0 for s in sizes]


def merge_metrics(per_rank: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One step's metrics from every rank's ``(rows, metrics)``: rows-weighted means
    (ranks that trained nothing are left out), ``time/*`` the slowest rank's. Pure."""
    weighted: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    times: dict[str, float] = {}
    for rows, metrics in per_rank:
        if rows <= 0:
            continue
        for key, value in metrics.items():
            if key.startswith("time/"):
                times[key] = max(times.get(key, value), value)
            else:
                weighted[key] += rows * value
                weights[key] += rows
    out = {k: weighted[k] / weights[k] for k in weighted}
    out.update(times)
    return out


def control_group(timeout_s: float) -> Any:
    """A gloo process group over every rank, for the control messages; its collectives fail
    after ``timeout_s``. A collective: every rank must call it, in the same order
    relative to other group creations."""
    dist = torch.distributed
    if dist.get_backend() == "gloo":
        return None  # the default group already is gloo (timed out as DeepSpeed set it)
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _with_fields(rows: list[Experience], like: Sequence[Experience]) -> list[Experience]:
    """``rows`` as an :class:`Experiences` carrying ``like``'s custom fields, if it has any."""
    fields = getattr(like, "custom_fields", None)
    if not fields:
        return rows
    return Experiences(rows, custom_fields=fields, pad_token_id=getattr(like, "pad_token_id", 0))


class RankLeader:
    """Rank 0's view of the trainer ranks: the :class:`PolicyTrainer` interface the trainer
    actor uses, each call also run on every other rank (which waits in
    :func:`follow_leader`).

    Attributes not defined here (``tokenizer``, ``vocab_size``, ``check_experience``,
    ...) are rank 0's policy's: they need no other rank.
    """

    def __init__(self, policy: PolicyTrainer) -> None:
        dist = torch.distributed
        if not dist.is_initialized():
            raise RuntimeError("RankLeader needs torch.distributed initialised (DeepSpeed does)")
        if dist.get_rank() != LEADER:
            raise RuntimeError(f"RankLeader runs on rank {LEADER}, not {dist.get_rank()}")
        self.policy = policy
        self.world_size = dist.get_world_size()
        timeout = float(policy.cfg.trainer.nccl_timeout)
        self.group = control_group(timeout)
        self.stopped = False
        # one command at a time: the keep-alive's pings never come between a step's parts
        self._lock = threading.Lock()
        self._last_command = time.monotonic()
        self._lost: RanksLost | None = None  # a ping found a rank gone
        self._idle = threading.Event()  # set: stop pinging
        self._pinger = threading.Thread(
            target=self._keepalive,
            args=(keepalive_interval(timeout),),
            name="trainer-ranks-keepalive",
            daemon=True,
        )
        self._pinger.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def _keepalive(self, interval: float) -> None:
        """Ping the other ranks once ``interval`` seconds pass without a command (rank 0
        waits for experience), until :meth:`stop`. A ping that finds a rank gone is kept
        for the next command to raise."""
        while not self._idle.wait(interval / 4):
            if time.monotonic() - self._last_command < interval:
                continue
            with self._lock:
                if self.stopped or self._lost is not None:
                    return
                try:
                    self._scatter([(_PING, None)] * self.world_size, "waiting for experience")
                except RanksLost as exc:
                    self._lost = exc
                    return

    def _scatter(self, commands: list[tuple[str, Any]], doing: str) -> tuple[str, Any]:
        mine: list[Any] = [None]
        try:
            torch.distributed.scatter_object_list(mine, commands, src=LEADER, group=self.group)
        except Exception as exc:
            if lost_rank_error(exc):
                raise ranks_lost(LEADER, self.world_size, doing, exc) from exc
            raise
        self._last_command = time.monotonic()
        return mine[0]

    def _send(self, commands: list[tuple[str, Any]], doing: str) -> tuple[str, Any]:
        """Scatter one ``(command, argument)`` per rank; returns rank 0's own. Blocks; call
        it holding the lock."""
        if self.stopped:
            raise RuntimeError("the trainer ranks were stopped")
        if self._lost is not None:
            raise self._lost
        return self._scatter(commands, doing)

    def _broadcast(self, command: str, argument: Any = None) -> None:
        self._send([(command, argument)] * self.world_size, f"sending {command!r}")

    def _run(self, doing: str, call: Any) -> Any:
        """``call()`` (this rank's part of a command every rank runs), a rank found gone
        reported as :class:`RanksLost`."""
        try:
            return call()
        except RanksLost:
            raise
        except Exception as exc:
            if lost_rank_error(exc):
                raise ranks_lost(LEADER, self.world_size, doing, exc) from exc
            raise
        finally:
            self._last_command = time.monotonic()

    def train_step(self, exps: list[Experience]) -> dict[str, float]:
        """One trainer step of ``exps`` over all ranks (each trains its shard); the metrics
        merged over ranks (:func:`merge_metrics`), plus ``trainer/rank_rows/<r>``: the rows
        rank ``r`` trained (they sum to ``len(exps)``). Blocks until every rank has finished.

        Raises:
            RuntimeError: another rank failed its step (its error named).
        """
        n = self.world_size
        shards = shard_batch(exps, n, self.policy.pair_unit)
        sizes = [len(s) for s in shards]
        scales = rank_scales(sizes)
        commands: list[tuple[str, Any]] = []
        for rows, scale in zip(shards, scales, strict=True):
            # an empty shard trains a copy of one row at scale 0: it joins every collective
            picked = [exps[i] for i in rows] if rows else [exps[0]]
            commands.append((_TRAIN, (_with_fields(picked, exps), scale)))
        gathered: list[Any] = [None] * n
        doing = "training a step"
        with self._lock:
            _, (mine, scale) = self._send(commands, doing)
            metrics = self._run(doing, lambda: self.policy.train_step(mine, rank_scale=scale))
            self._run(
                doing,
                lambda: torch.distributed.gather_object(
                    (sizes[LEADER], metrics, None), gathered, dst=LEADER, group=self.group
                ),
            )
        for rank, (_, _, error) in enumerate(gathered):
            if error is not None:
                raise RuntimeError(f"trainer rank {rank} failed its step: {error}")
        merged = merge_metrics([(rows, m) for rows, m, _ in gathered])
        for rank, (rows, _, _) in enumerate(gathered):
            merged[f"trainer/rank_rows/{rank}"] = float(rows)  # rows each rank trained
        return merged

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights (every rank joins the ZeRO-3 gather). Blocks."""
        with self._lock:
            self._broadcast(_STATE_DICT)
            return self._run("gathering the weights", self.policy.state_dict)

    def wire_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The weights explorers receive (:meth:`PolicyTrainer.wire_state_dict`; every rank
        joins the ZeRO-3 gather). Blocks."""
        with self._lock:
            self._broadcast(_WIRE_STATE_DICT, str(dtype).removeprefix("torch."))
            return self._run("gathering the weights", lambda: self.policy.wire_state_dict(dtype))

    def critic_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The critic's whole weights, or None without a critic. Blocks."""
        with self._lock:
            self._broadcast(_CRITIC_STATE_DICT)
            return self._run("gathering the critic's weights", self.policy.critic_state_dict)

    def save_hf_checkpoint(self, path: str | Path) -> Path:
        """Every rank gathers the weights, rank 0 writes ``path``. Blocks. Returns ``path``."""
        with self._lock:
            self._broadcast(_SAVE, str(path))
            return self._run("writing a checkpoint", lambda: self.policy.save_hf_checkpoint(path))

    def stop(self) -> None:
        """Tell every other rank to leave :func:`follow_leader`, then leave the process
        groups (:func:`leave_ranks`). Idempotent. Blocks."""
        self._idle.set()
        with self._lock:
            if not self.stopped:
                self._broadcast(_STOP)
                self.stopped = True
                self._run("stopping", lambda: leave_ranks(self.group))


def end_follower_process() -> NoReturn:
    """End a rank's process after :func:`follow_leader` returned (a clean stop):
    :func:`rftstream.signals.end_without_teardown` (gloo's threads would race the
    interpreter's teardown)."""
    end_without_teardown(0)


def leave_ranks(group: Any = None) -> None:
    """Destroy this process's torch.distributed groups (the control group and the
    default one), once no collective is left to run. Every rank calls it with the
    control ``group``: a barrier over it comes first. Blocks until every rank is there.

    A process that exits with its gloo groups alive can abort in C++ at exit
    ("terminate called without an active exception": their threads are still
    joinable); destroying them first joins those threads. The barrier keeps a rank
    from closing its connections while another may still be reading the stop
    command from them (the suspected cause of a rare abort of rank 0 under load;
    not reproduced in isolation). No-op without groups.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)
        dist.destroy_process_group()  # every group, the control group included
        skip_teardown_at_exit()


def follow_leader(policy: PolicyTrainer) -> int:
    """Run rank ``!= 0``'s side of the trainer: receive a command from rank 0, run it on
    ``policy`` (joining the collectives), until rank 0 says stop. Returns the number of
    trainer steps run. Blocks.

    A training step that raises is reported to rank 0 (which raises it, naming this
    rank) and re-raised here.
    """
    dist = torch.distributed
    group = control_group(float(policy.cfg.trainer.nccl_timeout))
    rank = dist.get_rank()
    world = dist.get_world_size()
    steps = 0

    def collective(doing: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            if lost_rank_error(exc):
                raise ranks_lost(rank, world, doing, exc) from exc
            raise

    while True:
        mine: list[Any] = [None]
        collective(
            "waiting for rank 0's next command",
            dist.scatter_object_list,
            mine,
            None,
            src=LEADER,
            group=group,
        )
        command, argument = mine[0]
        if command == _PING:
            continue
        if command == _STOP:
            log.info("trainer rank %d: stopped by rank %d after %d steps", rank, LEADER, steps)
            leave_ranks(group)
            return steps
        if command == _TRAIN:
            shard, scale = argument
            error: str | None = None
            metrics: dict[str, float] = {}
            doing = "training a step"
            try:
                metrics = policy.train_step(shard, rank_scale=scale)
            except Exception as exc:  # reported to rank 0, then raised here
                if lost_rank_error(exc):
                    raise ranks_lost(rank, world, doing, exc) from exc
                error = f"{type(exc).__name__}: {exc}"
                collective(doing, dist.gather_object, (0, {}, error), None, LEADER, group)
                raise
            done = (len(shard) if scale > 0 else 0, metrics, error)
            collective(doing, dist.gather_object, done, None, LEADER, group)
            steps += 1
        elif command == _STATE_DICT:
            collective("gathering the weights", policy.state_dict)
        elif command == _WIRE_STATE_DICT:
            collective("gathering the weights", policy.wire_state_dict, getattr(torch, argument))
        elif command == _CRITIC_STATE_DICT:
            collective("gathering the critic's weights", policy.critic_state_dict)
        elif command == _SAVE:
            collective("writing a checkpoint", policy.save_hf_checkpoint, argument)
        else:
            raise RuntimeError(f"trainer rank {rank}: unknown command {command!r} from rank 0")
