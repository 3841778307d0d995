"""Several trainer ranks (real DeepSpeed on CPU, gloo, launched by torchrun) train exactly
as one rank does on the same batch.

A 2-rank run (``torchrun --standalone --nproc-per-node 2``, rank 0 scattering shards
through :class:`~rftstream.training.ranks.RankLeader`) and a 1-rank run in this process
train 2 steps on the same fixed batch; the 2-rank run's losses (merged over ranks), KL
losses and final weights equal the 1-rank run's. The optimizer's ``eps`` of 1 makes each
weight's update about ``lr * g / (|g| + 1)``: it depends on the gradient's scale (plain
Adam would hide a rank weighting off by a constant factor), and clipping is off. Cases: equal
shards, unequal shards (a group is never cut), a rank that gets no group at all, and
``trainer.use_dynamic_bsz`` with unequal micro-batch counts on the two ranks; each at every
``trainer.zero_stage`` 0-3. The unequal cases pad the short rank with passes that add nothing
(``PolicyTrainer._padding_micro_step``): under ZeRO-2 a padding pass that fired the
gradient hooks in another order than a training pass mixed up the ranks' gradients, under
ZeRO-3 it could not differentiate the partitioned parameters.

Nothing compiles at run time: the ranks run with a torch-extensions cache whose DeepSpeed
shared-memory op holds a stale build lock, as a rank killed mid-build leaves it. A rank that
tried to build (or load) that op would wait on the lock for ever; the launch's timeout then
fails the case with that reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

from rftstream.nats_server.embedded import free_port
from tests.integration import _ranks_worker as worker

REPO = Path(__file__).resolve().parents[2]


def extensions_cache_with_a_stale_lock(root: Path) -> Path:
    """A ``TORCH_EXTENSIONS_DIR`` in which DeepSpeed's ``deepspeed_shm_comm`` build directory
    holds a lock file that nobody will release."""
    from torch.utils import cpp_extension

    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    try:
        build_dir = Path(cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False))
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR")
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    (build_dir / "lock").touch()
    return root


def launch(
    model_path: str, out: Path, case: str, zero_stage: int, nproc: int = 2, nnodes: int = 1
) -> None:
    """torchrun the case's ranks: ``nproc`` on one node, or ``nproc`` on each of ``nnodes``
    "nodes" (one torchrun each, ``--node-rank`` 0.., one loopback rendezvous), as on as many
    machines. Fails naming the node whose launch failed or hung."""
    env = dict(os.environ)
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_cache_with_a_stale_lock(out.parent / "ext"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["DS_ACCELERATOR"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    worker_args = ["-m", "tests.integration._ranks_worker", model_path, str(out), case]
    worker_args.append(str(zero_stage))
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        launches = [[*run, "--standalone", *worker_args]]
    else:
        rendezvous = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        launches = [
            [*run, f"--nnodes={nnodes}", f"--node-rank={k}", *rendezvous, *worker_args]
            for k in range(nnodes)
        ]
    # each in its own session, so a timeout kills torchrun's ranks too (they would outlive
    # torchrun)
    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
        )
        for cmd in launches
    ]
    deadline = time.monotonic() + 120 + 120 * nnodes  # a 2-rank case takes 10-30 s here
    for node, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise AssertionError(
                f"node {node}'s ranks did not finish in time: did one build DeepSpeed's shm "
                f"op and wait on the stale lock in {env['TORCH_EXTENSIONS_DIR']}?\n"
                f"{stderr[-4000:]}"
            ) from None
        assert proc.returncode == 0, f"node {node}:\n" + stdout[-4000:] + stderr[-8000:]


# every case at stages 0 and 3 (ZeRO-3 gathers partitioned parameters in every forward, a
# collective the ranks must match); the padded cases at 2 (bucketed gradient reduction, where
# a padding pass must fire the hooks as a real pass does) and one at 1 (partitioned optimizer
# state only): the grid of all 16 adds minutes to CI and no failure mode of its own
GRID = [
    (case, stage)
    for stage in (0, 3)
    for case in sorted(worker.CASES)
    if not case.startswith("reinforce") and case != "idle"
] + [
    ("reinforce_uneven", 0),
    ("reinforce_one_group", 0),
    ("uneven", 2),
    ("dynamic_uneven", 2),
    ("uneven", 1),
]


@pytest.mark.parametrize(("case", "zero_stage"), GRID)
def test_two_ranks_train_as_one(
    case: str, zero_stage: int, tiny_model_path: str, tmp_path: Path
) -> None:
    out = tmp_path / "ranks.pt"
    launch(tiny_model_path, out, case, zero_stage)
    check_trained_as_one(out, tmp_path, tiny_model_path, case, zero_stage)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_two_nodes_of_two_ranks_train_as_one(
    zero_stage: int, tiny_model_path: str, tmp_path: Path
) -> None:
    """Two torchrun launches, ``--nnodes 2`` and ``--node-rank`` 0 and 1 against one
    loopback rendezvous, 2 ranks each, as two machines would run them: ranks 2 and 3 have
    ``LOCAL_RANK`` 0 and 1 on the second node. Uneven groups over 4 ranks (one rank gets
    none) train as one rank does."""
    out = tmp_path / "ranks.pt"
    launch(tiny_model_path, out, "uneven", zero_stage, nproc=2, nnodes=2)
    got = check_trained_as_one(out, tmp_path, tiny_model_path, "uneven", zero_stage)
    assert got["world"] == {"world_size": 4, "local_ranks": [0, 1, 0, 1]}


def test_ranks_outwait_their_collective_timeout_while_rank_0_is_idle(
    tiny_model_path: str, tmp_path: Path
) -> None:
    """Rank 0 idles 14 s between two steps (a trainer waiting for experience) while the
    other rank waits for its next command in a collective that fails after 10 s
    (``trainer.nccl_timeout``): rank 0's pings keep that wait short, and the step after
    the idle trains as one rank's does."""
    assert worker.IDLE_S > worker.IDLE_TIMEOUT_S
    out = tmp_path / "ranks.pt"
    launch(tiny_model_path, out, "idle", 0)
    check_trained_as_one(out, tmp_path, tiny_model_path, "idle", 0)


def check_trained_as_one(
    out: Path, tmp_path: Path, tiny_model_path: str, case: str, zero_stage: int
) -> dict:
    """The ranks' saved losses, KL losses and weights equal one rank's on the same steps."""
    got = torch.load(out, weights_only=False)
    ref = worker.train_reference(tmp_path / "one", tiny_model_path, case, zero_stage)

    assert len(set(ref["losses"])) == worker.STEPS  # the second step saw the first's update
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    if case.startswith("dynamic"):
        # token-budget micro-batches: the shards form other micro-batches than the whole
        # batch does, so the KL metric (a mean over micro-batches) differs; the weights,
        # which the KL loss moves too, are compared below
        # rank 0: 2 micro-batches of its 4 rows, rank 1: 1 of its 2 (then a zero pass),
        # merged rows-weighted; one rank: 3 of the 6 rows
        assert got["micro_batches"] == pytest.approx([(4 * 2 + 2 * 1) / 6] * 2)
        assert ref["micro_batches"] == [3, 3]
    else:
        assert got["kl"] == pytest.approx(ref["kl"], rel=1e-5, abs=1e-7)
    initial = worker.initial_state(tmp_path / "init", tiny_model_path, case, zero_stage)
    assert set(got["state"]) == set(ref["state"])
    moved = max(float((ref["state"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3
    for key, value in got["state"].items():
        torch.testing.assert_close(value, ref["state"][key], rtol=1e-5, atol=1e-6)
    return got
