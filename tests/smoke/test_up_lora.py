"""Smoke: `rftstream up` trains a LoRA adapter (with gradient checkpointing) through the real
actors: explorers load the merged weights with a plain transformers engine, the checkpoint
holds the merged weights and the adapter."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from rftstream.model_loading import load_causal_lm
from tests.integration._util import run_up

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]

CONFIG = """
name: up_lora
model:
  lora_configs:
    - {lora_rank: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}
buffer:
  batch_size: 2
  total_steps: 3
  explorer_input:
    taskset:
      path: builtin:arithmetic
      rollout_args: {max_tokens: 6}
algorithm: {algorithm_type: grpo, repeat_times: 4, optimizer: {lr: 0.01}}
explorer: {runner_num: 2}
trainer: {gradient_checkpointing: true}
# the explorer waits for the trainer's versions (else, on a busy machine, it can explore
# every task with the base weights before the first step)
synchronizer: {max_staleness: 1}
"""


def test_up_trains_a_lora_adapter(tmp_path: Path, tiny_model_path: str) -> None:
    pytest.importorskip("peft")  # the optional extra rftstream[lora]; CI installs it
    config = tmp_path / "lora.yaml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    _, records = run_up(run_dir, tiny_model_path, "--config", str(config), timeout=420)
    assert [r["step"] for r in records] == [1, 2, 3]
    # the explorer's plain transformers engine loaded the trainer's merged weights
    explorer_log = (run_dir / "logs" / "explorer.log").read_text()
    assert re.search(r"loaded weights v[1-9]", explorer_log), explorer_log[-2000:]
    final = run_dir / "checkpoints" / "global_step_3"
    assert (final / "lora_adapter" / "adapter_config.json").is_file()
    trained = load_causal_lm(str(final)).state_dict()
    base = load_causal_lm(tiny_model_path).state_dict()
    changed = {k.rsplit(".", 2)[-2] for k in base if not torch.equal(base[k], trained[k])}
    assert changed == {"q_proj", "v_proj"}  # only the adapted layers moved
