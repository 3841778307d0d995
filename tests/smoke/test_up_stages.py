"""Smoke: Trinity-RFT ``stages`` in one ``rftstream up``: an SFT warm-up, then GRPO from its checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from tests.integration._util import user_env

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]
EXPERT_DATA = Path(__file__).resolve().parents[2] / "examples" / "seed_mix" / "expert_data.jsonl"
SFT_LR = 1e-3
GRPO_LR = 1e-7  # small enough that stage 2 stays next to the weights it started from


def _staged_config(tmp_path: Path) -> Path:
    """Trinity-style: the base holds model, synchronizer and the GRPO sections; stage `sft`
    replaces mode, algorithm and buffer; stage `grpo` replaces algorithm only."""
    config = {
        "name": "warmup_then_rl",
        "model": {"model_path": "builtin:tiny", "max_response_tokens": 6},
        "buffer": {
            "batch_size": 2,
            "total_steps": 50,  # --steps 2 applies to every stage
            "total_epochs": 5,
            "explorer_input": {
                "taskset": {"path": "builtin:arithmetic", "rollout_args": {"max_tokens": 6}}
            },
        },
        "explorer": {"runner_num": 2},
        "synchronizer": {"sync_method": "checkpoint", "sync_style": "dynamic_by_explorer"},
        "trainer": {"ppo_micro_batch_size_per_gpu": 4},
        "stages": [
            {
                "stage_name": "sft",
                "mode": "train",
                "algorithm": {"algorithm_type": "sft", "optimizer": {"lr": SFT_LR}},
                "buffer": {
                    "train_batch_size": 4,
                    "total_epochs": 2,
                    "trainer_input": {
                        "experience_buffer": {
                            "path": str(EXPERT_DATA),
                            "format": {"prompt_type": "messages", "messages_key": "messages"},
                        }
                    },
                },
            },
            {
                "stage_name": "grpo",
                "algorithm": {
                    "algorithm_type": "grpo",
                    "repeat_times": 4,
                    "optimizer": {"lr": GRPO_LR},
                },
            },
        ],
    }
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    return load_file(str(model_dir / "model.safetensors"))


def _max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


def test_up_runs_sft_then_grpo_from_its_checkpoint(tmp_path: Path, tiny_model_path: str) -> None:
    config = _staged_config(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*RFTSTREAM, "up", "-c", str(config), "--steps", "2", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=540,
        env=user_env(tiny_model_path),
    )
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]

    # each stage trained its 2 steps in its own run directory, under its own run name
    for stage in ("sft", "grpo"):
        records = [
            json.loads(x) for x in (run_dir / stage / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == [1, 2], stage
        assert all(r["experience/trained"] > 0 for r in records), stage
    assert "actor/sft_loss" in json.loads(
        (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()[0]
    )
    assert out.index("stage 1/2 sft starting") < out.index("stage 1/2 sft finished")
    assert out.index("stage 1/2 sft finished") < out.index("stage 2/2 grpo starting")
    assert "run warmup_then_rl/sft" in out and "run warmup_then_rl/grpo" in out
    assert "all 2 stages finished" in out

    # stage 2 was started from stage 1's final checkpoint, as the console says ...
    sft_ckpt = run_dir / "sft" / "checkpoints" / "global_step_2"
    grpo_ckpt = run_dir / "grpo" / "checkpoints" / "global_step_2"
    m = re.search(
        r"stage 2/2 grpo starting: .*? model (\S+) \(stage `sft`'s final checkpoint\)", out
    )
    assert m is not None, out[-3000:]
    assert Path(m.group(1)) == sft_ckpt
    child_config = yaml.safe_load((run_dir / "grpo" / "config.yaml").read_text())
    assert Path(child_config["model"]["model_path"]) == sft_ckpt  # what the explorer loaded

    # ... and its weights show it: SFT moved the tiny model by ~lr per parameter, GRPO at
    # lr 1e-7 for 2 steps moves them by at most ~2e-7 from where it started
    base, sft, grpo = _weights(Path(tiny_model_path)), _weights(sft_ckpt), _weights(grpo_ckpt)
    assert _max_abs_diff(sft, base) > 0.5 * SFT_LR  # SFT really trained
    assert _max_abs_diff(grpo, sft) < 1e-5  # stage 2 started at stage 1's weights
    assert _max_abs_diff(grpo, base) > 0.4 * SFT_LR  # not at the base model's
