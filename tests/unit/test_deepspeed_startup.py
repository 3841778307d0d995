"""A single-rank trainer starts without DeepSpeed's shared-memory all-reduce op: the op only
serves collectives between ranks of one node, and building it compiles C++ (36 s on two
cores the first time, seconds on every later start)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run
from tests.integration._util import small_config


def test_one_rank_never_builds_deepspeeds_shared_memory_op(
    tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # not the torch attribute

    from rftstream.training.policy_trainer import PolicyTrainer

    def refuse() -> None:
        raise AssertionError("a single rank built DeepSpeed's shm op")

    monkeypatch.setattr(ds_torch_comm, "build_shm_op", refuse)
    monkeypatch.setattr(ds_comm, "cdb", None)  # a new backend, as in a fresh process
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path)))
    PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert ds_torch_comm.build_shm_op is refuse  # put back once the engine is made


def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_after() -> None:
    """DeepSpeed's autotuner imports mlflow when it is installed (0.85 s of every trainer's
    start-up here); the trainer imports DeepSpeed without it, and the mlflow monitor can
    import mlflow afterwards. In a fresh interpreter: this one has DeepSpeed imported."""
    import subprocess
    import sys

    pytest.importorskip("mlflow")  # the test extra installs it
    code = (
        "import sys\n"
        "from rftstream.training.policy_trainer import _deepspeed_without_mlflow\n"
        "with _deepspeed_without_mlflow():\n"
        "    import deepspeed\n"
        "import deepspeed.autotuning.autotuner as tuner\n"
        "assert tuner.has_mlflow is False, 'the autotuner imported mlflow'\n"
        "assert 'mlflow' not in sys.modules\n"
        "import mlflow\n"
        "print('ok', mlflow.__name__)\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok mlflow")
