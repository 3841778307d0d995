"""Trinity-RFT-format configs, written from Trinity's documentation and examples, start and
train 2 steps through ``rftstream up`` as a user runs it: only the model path, the data
path(s) and the step count come from the command line (and, for gsm8k, a response budget
the tiny model's 128-position context can hold: :data:`FITS_THE_TINY_MODEL`).

Each config keeps Trinity's own keys (``cluster``, ``storage_type``, ``runner_per_model``,
``rollout_model.dtype``, ``sync_method: nccl``, ``use_dynamic_bsz``, verl's
``trainer_config``, ``monitor_type: wandb``, ...): the loader maps them or names the ones
without a meaning here, once each. The asynchronous pair runs the explorer half
(``mode: explore``) and the trainer half (``mode: train`` on the experience queue) as two
``up`` processes against one nats-server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._util import user_env

pytestmark = pytest.mark.smoke

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
DATA = HERE / "data"
TASKSET = "buffer.explorer_input.taskset.path"
DATASET = "buffer.trainer_input.experience_buffer.path"

# config -> its data path overrides (key, file under tests/compat/data)
CORPUS: dict[str, list[tuple[str, str]]] = {
    # Trinity's example at its own sizes; the data a local copy laid out as openai/gsm8k
    "grpo_gsm8k": [(TASKSET, "gsm8k"), ("buffer.explorer_input.eval_tasksets[0].path", "gsm8k")],
    "grpo_small": [(TASKSET, "arithmetic.jsonl")],
    "mix": [
        (TASKSET, "arithmetic.jsonl"),
        ("buffer.trainer_input.auxiliary_buffers.sft_dataset.path", "sft_messages.jsonl"),
    ],
    "dpo": [(DATASET, "dpo_pairs.jsonl")],
    "sft": [(DATASET, "sft_messages.jsonl")],
    "multi_step": [(TASKSET, "guess_number.jsonl")],
    "dapo": [(TASKSET, "dapo_math.jsonl")],
    "grpo_task_pipeline": [("data_processor.task_pipeline.inputs[0]", "arithmetic.jsonl")],
    # older releases' keys and layouts (Trinity-RFT 0.2.0 MIX, 0.3.0 CHORD)
    "mix_0_2": [
        (TASKSET, "arithmetic.jsonl"),
        ("buffer.trainer_input.sft_warmup_dataset.path", "sft_messages.jsonl"),
    ],
    "chord_0_3": [
        (TASKSET, "arithmetic.jsonl"),
        ("buffer.trainer_input.auxiliary_buffers.sft_dataset.path", "sft_shards"),
    ],
}

# config -> what the tiny model cannot take as Trinity wrote it: its context is 128
# positions, and a response budget of 1024 tokens is refused at load (as it would be for
# any model whose context it exceeds)
FITS_THE_TINY_MODEL: dict[str, list[str]] = {"grpo_gsm8k": ["model.max_response_tokens=64"]}


def _up(
    config: str, tiny: str, run_dir: Path, sets: list[tuple[str, str]], *extra: str
) -> list[str]:
    cmd = [sys.executable, "-m", "rftstream.cli", "up", "-c", str(CONFIGS / f"{config}.yaml")]
    cmd += ["--run-dir", str(run_dir), "--steps", "2", "--set", f"model.model_path={tiny}"]
    for key, name in sets:
        cmd += ["--set", f"{key}={DATA / name}"]
    for setting in FITS_THE_TINY_MODEL.get(config, []):
        cmd += ["--set", setting]
    return cmd + list(extra)


def _trained_steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("config", list(CORPUS))
def test_trinity_config_runs_two_steps(config: str, tmp_path: Path, tiny_model_path: str) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        _up(config, tiny_model_path, run_dir, CORPUS[config]),
        capture_output=True,
        text=True,
        timeout=420,
        env=user_env(tiny_model_path),
        cwd=tmp_path,  # checkpoint_root_dir: ./checkpoints, as Trinity's examples have it
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    records = _trained_steps(run_dir)
    assert [r["step"] for r in records] == [1, 2], text[-2000:]
    assert all(r["experience/trained"] > 0 for r in records)
    assert "done in" in out.stdout
    # Trinity's Ray placement keys are named once each, not silently dropped; in mode train
    # every node trains, so cluster.node_num is trainer.nnodes (1 here) and nothing is said
    train_only = "\nmode: train\n" in (CONFIGS / f"{config}.yaml").read_text()
    assert text.count("`cluster.node_num`") == (0 if train_only else 1), text[:3000]
    assert (tmp_path / "checkpoints").is_dir() or (run_dir / "checkpoints").is_dir()


@pytest.mark.parametrize("first", ["trainer", "explorer"])
def test_trinity_async_pair_trains_on_the_explorers_queue(
    tmp_path: Path, tiny_model_path: str, nats_url: str, first: str
) -> None:
    """Trinity's asynchronous setup: ``mode: explore`` and ``mode: train`` with a queue
    experience buffer, started one after the other against one server, are one run: the
    second joins the first (nothing replaced), the trainer trains on what the explorer
    published and the explorer finishes its steps. Either order: Trinity's ``run.sh``
    starts the explorer first, and here it has finished before the trainer starts."""
    env = user_env(tiny_model_path)
    trainer_cmd = _up(
        "async_trainer", tiny_model_path, tmp_path / "trainer", [], "--nats-url", nats_url
    )
    explorer_cmd = _up(
        "async_explorer",
        tiny_model_path,
        tmp_path / "explorer",
        [(TASKSET, "arithmetic.jsonl")],
        "--nats-url",
        nats_url,
    )

    def run_explorer() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            explorer_cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
        )

    explorer = run_explorer() if first == "explorer" else None
    trainer = subprocess.Popen(
        trainer_cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        if explorer is None:
            explorer = run_explorer()
        trainer_out, _ = trainer.communicate(timeout=300)
    finally:
        trainer.kill()
    assert explorer.returncode == 0, explorer.stdout[-3000:] + explorer.stderr[-3000:]
    assert trainer.returncode == 0, trainer_out[-3000:]
    assert "replaced the earlier run" not in explorer.stdout + trainer_out
    assert "2 explorer steps" in explorer.stdout
    if first == "explorer":
        assert "its explorer finished before this trainer started" in trainer_out
    records = _trained_steps(tmp_path / "trainer")
    assert [r["step"] for r in records] == [1, 2]
    # train_batch_size = batch_size x repeat_times = 16 rollouts a step, all from the explorer
    assert [r["experience/trained"] for r in records] == [16, 16]
    assert all(r["experience/trained_from/train"] == 16 for r in records)


def test_a_sft_warmup_of_trinity_0_2_runs_as_two_stages(
    tmp_path: Path, tiny_model_path: str
) -> None:
    """``sft_warmup_dataset`` with ``sft_warmup_steps`` (Trinity-RFT 0.1-0.3.0) runs an SFT
    stage, then the file's GRPO run from its final checkpoint; the dataset path given on
    the command line by its old key reaches the SFT stage."""
    run_dir = tmp_path / "run"
    cmd = _up(
        "grpo_warmup_0_2",
        tiny_model_path,
        run_dir,
        [
            (TASKSET, "arithmetic.jsonl"),
            ("buffer.trainer_input.sft_warmup_dataset.path", "sft_messages.jsonl"),
        ],
    )
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=420,
        env=user_env(tiny_model_path),
        cwd=tmp_path,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "0.3.1 moved the SFT warm-up to `stages:`" in text
    assert "all 2 stages finished" in out.stdout
    warm, rft = _trained_steps(run_dir / "sft_warmup"), _trained_steps(run_dir / "rft")
    assert [r["step"] for r in warm] == [1, 2] and [r["step"] for r in rft] == [1, 2]
    assert all(r["experience/trained"] > 0 for r in warm + rft)
