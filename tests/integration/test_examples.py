"""Every config in examples/ runs (a few steps) through the real actors and NATS;
the benchmark script runs and prints its table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rftstream.config import load_config
from rftstream.errors import ConfigError
from rftstream.runtime import prepare_run
from tests.integration._util import run_actors_to_end, user_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_runs(
    path: Path, tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RFTSTREAM_CACHE", str(Path(tiny_model_path).parent))
    monkeypatch.setenv("RFTSTREAM_CHECKPOINTS", str(tmp_path / "ckpt"))
    cfg = load_config(
        path, ["buffer.batch_size=2", "buffer.train_batch_size=16", "explorer.runner_num=2"]
    )
    run = prepare_run(cfg, steps=2, run_dir=str(tmp_path / "run"))
    steps = run_actors_to_end(run, nats_url, timeout=300)
    assert [r["step"] for r in steps] == [1, 2]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["experience/trained"] == run.cfg.buffer.train_batch_size for r in records)
    eval_sets = run.cfg.buffer.explorer_input.eval_tasksets
    if eval_sets:  # evaluated at least once (the final evaluation, with the newest weights)
        evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
        for ts in eval_sets:
            assert any(r.get(f"eval/{ts.name}/reward/mean") is not None for r in evals), ts.name


def test_every_builtin_workflow_has_an_example() -> None:
    """The README's promise: a runnable tiny-model config per built-in workflow (aliases,
    such as countdown_workflow for countdown, count once)."""
    from workflows import WORKFLOWS

    used = {
        WORKFLOWS.get(load_config(p).buffer.explorer_input.taskset.default_workflow_type)
        for p in EXAMPLES
    }
    registered = {WORKFLOWS.get(name) for name in WORKFLOWS.names()}
    builtin = {c for c in registered if c.__module__.split(".")[0] == "workflows"}
    assert len(builtin) >= 7  # (test modules may have registered their own as well)
    assert builtin <= used, sorted(c.__name__ for c in builtin - used)


GPU_EXAMPLES = sorted((ROOT / "examples" / "gpu").glob("*.yaml"))


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=[p.stem for p in GPU_EXAMPLES])
def test_gpu_example_configs_load_and_validate(
    path: Path, tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU here: the GPU configs are loaded, validated and prepared (algorithm, batch
    sizes, pipeline, model directory), with MODEL_PATH pointing at a copy of the tiny model
    that declares a 1.5B model's context (32768 positions): the tiny model's own 128 hold
    none of those configs' response budgets, which prepare_run refuses."""
    model = tmp_path / "long-context-model"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    monkeypatch.setenv("MODEL_PATH", tiny_model_path)
    monkeypatch.delenv("TASKSET_PATH", raising=False)
    # loaded as on a GPU machine: without CUDA a vllm engine becomes transformers at load
    monkeypatch.setattr("rftstream.config.trinity._torch_cuda_available", lambda: True)
    with pytest.raises(ConfigError, match="model.max_response_tokens"):
        prepare_run(load_config(path), run_dir=str(tmp_path / "run"))
    monkeypatch.setenv("MODEL_PATH", str(model))
    cfg = load_config(path)
    run = prepare_run(cfg, run_dir=str(tmp_path / "run"))
    assert run.cfg.explorer.rollout_model.engine_type == "vllm"
    assert run.model_path == str(model)
    assert run.cfg.buffer.train_batch_size % run.cfg.trainer.ppo_micro_batch_size_per_gpu == 0
    run.build_pipeline()
    # without MODEL_PATH the config says which variable is missing
    monkeypatch.delenv("MODEL_PATH")
    with pytest.raises(ConfigError, match="MODEL_PATH"):
        load_config(path)


def test_benchmarks_run_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("codec: msgspec", "JSON", "bus: one message per task group", "per-experience"):
        assert row in proc.stdout


def test_mix_vs_grpo_benchmark_runs_quick(tmp_path: Path, tiny_model_path: str) -> None:
    out = tmp_path / "curves.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "mix_vs_grpo.py"),
            "--quick",
            "--run-dir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(tiny_model_path),  # not this process's MASTER_PORT (taken)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("GRPO", "MIX", "steps to 0.5", "GRPO steps / MIX steps", str(out)):
        assert text in proc.stdout, text
    assert out.stat().st_size > 0
    assert (tmp_path / "runs" / "grpo" / "metrics.jsonl").exists()
    assert (tmp_path / "runs" / "mix" / "metrics.jsonl").exists()
