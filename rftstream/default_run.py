"""The embedded default run: what ``rftstream up`` does with no config.

A tiny Qwen2 model (built locally, briefly trained so that it answers the
built-in arithmetic tasks in the right format but mostly wrongly) learns
single-digit addition with GRPO on CPU, in about a minute. The explorer and the
operator host run in processes of their own (``rftstream up`` does so whenever
weights can leave the process: here they travel on the run's weights stream,
``sync_method: jetstream``, fetched in the background and swapped in between
requests); the explorer
never waits for the trainer (``dynamic_by_explorer``), keeps up to 32 tasks in
flight (``runner_num``: the staleness window's four batches of 8, so that the
window, not the runners, bounds it), and pauses rather than let trained experience
be more than three versions stale (``max_staleness: 3``: with two, a slow verifier
or long replies leave the trainer waiting; see docs/performance.md); the policy loss corrects for that staleness with
the rollout log-probs (``decoupled_ppo``, chosen for GRPO whenever experience
can be stale). No KL term (TRL's ``beta: 0``), so no reference model.
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
        "runner_num": 32,
        "rollout_model": {"engine_type": "transformers", "max_batch_size": 128},
    },
    "synchronizer": {
        "sync_method": "jetstream",
        "sync_style": "dynamic_by_explorer",
        "sync_interval": 1,
        "max_staleness": 3,
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
