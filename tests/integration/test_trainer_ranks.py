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
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

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


def launch(model_path: str, out: Path, case: str, zero_stage: int, nproc: int = 2) -> None:
    env = dict(os.environ)
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_cache_with_a_stale_lock(out.parent / "ext"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["DS_ACCELERATOR"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "tests.integration._ranks_worker",
        model_path,
        str(out),
        case,
        str(zero_stage),
    ]
    # its own session, so a timeout kills torchrun's ranks too (they would outlive torchrun)
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
    )
    try:  # a 2-rank case takes 10-30 s here
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            "the ranks did not finish in 240 s: did one build DeepSpeed's shm op and wait on "
            f"the stale lock in {env['TORCH_EXTENSIONS_DIR']}?\n{stderr[-4000:]}"
        ) from None
    assert proc.returncode == 0, stdout[-4000:] + stderr[-8000:]


# every case at stages 0 and 3 (ZeRO-3 gathers partitioned parameters in every forward, a
# collective the ranks must match); the padded cases at 2 (bucketed gradient reduction, where
# a padding pass must fire the hooks as a real pass does) and one at 1 (partitioned optimizer
# state only): the grid of all 16 adds minutes to CI and no failure mode of its own
GRID = [
    (case, stage)
    for stage in (0, 3)
    for case in sorted(worker.CASES)
    if not case.startswith("reinforce")
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
    initial = worker.build(tmp_path / "init", tiny_model_path, case, zero_stage).state_dict()
    assert set(got["state"]) == set(ref["state"])
    moved = max(float((ref["state"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3
    for key, value in got["state"].items():
        torch.testing.assert_close(value, ref["state"][key], rtol=1e-5, atol=1e-6)
