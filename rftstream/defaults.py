"""The embedded default run: what ``rftstream up`` does with no config.

A tiny Qwen2 model (built locally, briefly trained so that it answers the
built-in arithmetic tasks in the right format but mostly wrongly) learns
single-digit addition with GRPO on CPU, in a few minutes. Weights move in
memory (all actors share one process); the explorer never waits for the
trainer (``dynamic_by_explorer``) but pauses rather than let the trained
experience be more than two versions stale (``max_staleness: 2``).
"""

from __future__ import annotations

from typing import Any

DEFAULT_CONFIG: dict[str, Any] = {
    "mode": "both",
    "project": "rftstream",
    "name": "default",
    "model": {"model_path": "", "max_prompt_tokens": 64, "max_response_tokens": 6},
    "buffer": {
        "batch_size": 8,
        "total_epochs": 200,
        "total_steps": 2000,
        "explorer_input": {
            "taskset": {
                "path": "builtin:arithmetic",
                "default_workflow_type": "math_workflow",
                "rollout_args": {"temperature": 1.0, "max_tokens": 6},
            }
        },
    },
    "explorer": {
        "runner_num": 16,
        "rollout_model": {"engine_type": "transformers", "max_batch_size": 128},
    },
    "synchronizer": {
        "sync_method": "checkpoint",
        "sync_style": "dynamic_by_explorer",
        "sync_interval": 1,
        "max_staleness": 1,
    },
    "algorithm": {
        "algorithm_type": "grpo",
        "repeat_times": 8,
        "kl_loss_fn": "none",
        "optimizer": {"lr": 2e-4, "weight_decay": 0.0},
    },
    "trainer": {"save_interval": 0, "ppo_micro_batch_size_per_gpu": 64},
    "monitor": {"monitor_type": "jsonl", "plot": True},
}
