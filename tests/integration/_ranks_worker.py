"""One trainer rank of the several-ranks tests (tests/integration/test_trainer_ranks.py).

Run by ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N
-m tests.integration._ranks_worker MODEL OUT CASE ZERO_STAGE``): rank 0 trains ``STEPS`` steps on
the case's fixed batch through :class:`~rftstream.training.ranks.RankLeader` and saves
the losses, KL losses and final weights to ``OUT``; the other ranks follow it.
:func:`train_reference` runs the same steps on one rank, in the calling process. Both
train at ``trainer.zero_stage`` ``ZERO_STAGE``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.policy_trainer import PolicyTrainer
from tests.integration._util import kl_entropy_config

STEPS = 2

# case name: (rows of each group, ppo_micro_batch_size_per_gpu)
CASES: dict[str, tuple[tuple[int, ...], int]] = {
    # 4 groups of 2 on 2 ranks: equal shards of whole micro-batches of 2
    "equal": ((2, 2, 2, 2), 2),
    # groups of 4, 1 and 1 rows: shards of 4 and 2 rows (a group is never cut), each rank
    # weighted by its share; micro-batches of 1 row
    "uneven": ((4, 1, 1), 1),
    # 1 group on 2 ranks: one rank trains nothing (scale 0)
    "one_group": ((4,), 1),
    # trainer.use_dynamic_bsz, token budget 20 (rows of 6 to 9 tokens): the 4-row shard
    # forms 2 micro-batches, the 2-row shard 1, padded with a zero pass to rank 0's 2
    "dynamic_uneven": ((4, 1, 1), 1),
    # REINFORCE++: the trainer whitens the returns over the whole batch
    # (algorithms.utils.whole_batch): unequal shards, and a rank with a padding copy only
    "reinforce_uneven": ((4, 1, 1), 1),
    "reinforce_one_group": ((4,), 1),
    # equal shards; rank 0 idles IDLE_S between the steps, past the ranks' collective
    # timeout (trainer.nccl_timeout IDLE_TIMEOUT_S): its pings keep the others waiting
    "idle": ((2, 2, 2, 2), 2),
}
IDLE_S = 14.0
IDLE_TIMEOUT_S = 10.0


def batch(case: str) -> list[Experience]:
    """The case's groups; the rows of a group share their 3-token prompt."""
    sizes, _ = CASES[case]
    out = []
    for g, size in enumerate(sizes):
        prompt = [10 + g, 20 + g, 30]
        for r in range(size):
            resp = [40 + (g * 7 + r * 3 + j) % 50 for j in range(3 + g + r)]
            adv = 1.0 - r * 0.7
            out.append(
                Experience(
                    tokens=prompt + resp,
                    prompt_length=len(prompt),
                    reward=adv,
                    logprobs=[-0.5] * len(resp),
                    advantages=[adv] * len(resp),
                    eid=EID(0, f"t{g}", r),
                )
            )
    return out


def build(tmp_path: Path, model_path: str, case: str, zero_stage: int = 0) -> PolicyTrainer:
    """A GRPO trainer with a KL loss and an entropy bonus; AdamW with ``eps`` 1, so the
    first steps move each weight by about ``lr * g / (|g| + 1)``: the weights depend on the
    gradients' scale, not only their sign, and no clipping hides a wrong scale."""
    _, micro = CASES[case]
    data = kl_entropy_config(tmp_path, model_path, optimizer={"lr": 0.1, "eps": 1.0})
    data["trainer"] = {
        "ppo_micro_batch_size_per_gpu": micro,
        "balance_batch": False,
        "share_prompts": True,
        "grad_clip": 1e9,
        "zero_stage": zero_stage,
    }
    if case.startswith("dynamic"):
        data["model"]["max_prompt_tokens"] = 4
        data["trainer"].update(use_dynamic_bsz=True, max_token_len_per_gpu=20)
        # per-row means: the step is the same however the rows fall into micro-batches
        data["algorithm"]["loss_agg_mode"] = "seq-mean-token-mean"
    if case.startswith("reinforce"):
        data["algorithm"]["algorithm_type"] = "reinforceplusplus"
    if case == "idle":
        data["trainer"]["nccl_timeout"] = IDLE_TIMEOUT_S
    run = prepare_run(config_from_dict(data))
    return PolicyTrainer(run.cfg, run.model_path, run.algorithm)


def _train(trainer: Any, case: str) -> dict[str, Any]:
    metrics = []
    for step in range(STEPS):
        if case == "idle" and step and trainer.world_size > 1:
            time.sleep(IDLE_S)  # as a trainer waiting for experience
        metrics.append(trainer.train_step(batch(case)))
    return {
        "losses": [m["actor/loss"] for m in metrics],
        "kl": [m["actor/kl_loss"] for m in metrics],
        "micro_batches": [m["actor/micro_batches"] for m in metrics],
        "state": trainer.state_dict(),
    }


def train_reference(
    tmp_path: Path, model_path: str, case: str, zero_stage: int = 0
) -> dict[str, Any]:
    """The case's steps on one rank, in this process."""
    trainer = build(tmp_path, model_path, case, zero_stage)
    try:
        return _train(trainer, case)
    finally:
        release(trainer)


def initial_state(tmp_path: Path, model_path: str, case: str, zero_stage: int = 0) -> dict:
    """The case's weights before any step (built in this process)."""
    trainer = build(tmp_path, model_path, case, zero_stage)
    try:
        return trainer.state_dict()
    finally:
        release(trainer)


def release(trainer: PolicyTrainer) -> None:
    """Free what a trainer built in the test process holds: a ZeRO-3 engine keeps gigabytes
    of address space (its buckets) past its last use, and forks of a process that has
    gathered several fail with ENOMEM (the kernel's overcommit check)."""
    import gc

    for engine in (trainer.engine, getattr(trainer, "critic", None)):
        if engine is not None:
            engine.destroy()
    gc.collect()


def main(model_path: str, out: str, case: str, zero_stage: str = "0") -> None:
    from rftstream.signals import exit_process
    from rftstream.training.ranks import (
        RankLeader,
        end_follower_process,
        follow_leader,
    )
    from rftstream.training.world import env_rank

    rank = env_rank()
    trainer = build(Path(out).parent / f"rank{rank}", model_path, case, int(zero_stage))
    # where each rank runs: LOCAL_RANK restarts at 0 on every node
    local_ranks: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(local_ranks, int(os.environ["LOCAL_RANK"]))
    if rank != 0:
        steps = follow_leader(trainer)
        assert steps == STEPS, steps
        end_follower_process()
    leader = RankLeader(trainer)
    try:
        result = _train(leader, case)
    finally:
        leader.stop()
    result["world"] = {"world_size": len(local_ranks), "local_ranks": local_ranks}
    torch.save(result, out)
    exit_process(0)  # rank 0 too: no interpreter teardown racing gloo's threads


if __name__ == "__main__":
    main(*sys.argv[1:5])
