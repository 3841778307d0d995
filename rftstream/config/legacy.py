"""Layouts of Trinity-RFT releases before 0.3, met in a config file before anything else
reads it. Pure (no I/O); warnings are :class:`~rftstream.config.trinity.TrinityConfigWarning`.

Two whole-file layouts cannot be mapped key by key (:mod:`rftstream.config.trinity` maps
single keys of every release):

* the pre-0.1 layout, a top-level ``data:`` section (``data.dataset_path``,
  ``data.format_config``, ...; Trinity-RFT's repository in April-May 2025, before its
  0.1.0 release): refused with one message that shows where each key went
  (:func:`check_pre_release_layout`);
* the SFT warm-up of 0.1-0.3.0 (``buffer.trainer_input.sft_warmup_dataset`` with
  ``sft_warmup_steps``): Trinity-RFT 0.3.1 moved it to ``stages:``, and so does
  :func:`sft_warmup_as_stages` (a ``sft_warmup`` stage in mode ``train`` with
  ``algorithm_type: sft``, then the file's own run). For MIX and CHORD the same dataset
  was the expert data, which :mod:`rftstream.config.trinity` maps to
  ``auxiliary_buffers.sft_dataset``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from rftstream.config.paths import ROOT
from rftstream.config.trinity import MIX_FAMILY, TrinityConfigWarning
from rftstream.errors import ConfigError

__all__ = [
    "check_pre_release_layout",
    "moving_overrides",
    "sft_warmup_as_stages",
    "sft_warmup_as_stages_needed",
    "upgrade_layout",
]

# the keys the SFT warm-up moves into a stage (their command-line overrides go first)
_WARMUP_KEYS = (
    "buffer.trainer_input.sft_warmup_dataset",
    "buffer.trainer_input.sft_warmup_steps",
)

# the pre-0.1 ``data:`` keys users meet most, and where Trinity-RFT 0.1.0 put them
_PRE_RELEASE_KEYS = {
    "data.dataset_path": "buffer.explorer_input.taskset.path",
    "data.subset_name": "buffer.explorer_input.taskset.subset_name",
    "data.train_split": "buffer.explorer_input.taskset.split",
    "data.eval_split": "buffer.explorer_input.eval_tasksets[0].split (same path)",
    "data.format_config.*": "buffer.explorer_input.taskset.format.*",
    "data.total_epochs": "buffer.total_epochs",
    "data.batch_size": "buffer.batch_size",
    "data.default_workflow_type": "buffer.explorer_input.default_workflow_type",
    "data.default_reward_fn_type": "buffer.explorer_input.default_reward_fn_type",
    "buffer.train_dataset": "buffer.trainer_input.experience_buffer",
    "trainer.algorithm_type": "algorithm.algorithm_type",
    "explorer.repeat_times": "algorithm.repeat_times",
    "monitor.project / monitor.name": "project / name",
}
_PRE_RELEASE_MARKERS = ("dataset_path", "format_config", "train_split", "dj_config_path")


def check_pre_release_layout(data: Any, source: str | None = None) -> None:
    """Refuse a file in Trinity-RFT's pre-0.1 layout (a top-level ``data:`` section) with
    one :class:`ConfigError` that lists where its keys went in the ``buffer:`` layout."""
    section = data.get("data") if isinstance(data, dict) else None
    if not isinstance(section, dict) or not any(k in section for k in _PRE_RELEASE_MARKERS):
        return
    moves = "; ".join(f"{old} -> {new}" for old, new in _PRE_RELEASE_KEYS.items())
    raise ConfigError(
        ROOT,
        "this file is in Trinity-RFT's layout from before its 0.1.0 release (a top-level "
        "`data:` section, April-May 2025); every release since reads the `buffer:` layout, "
        f"as rftstream does. Rewrite it so: {moves}; see docs/trinity.md",
        source=source,
    )


def sft_warmup_as_stages(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with Trinity-RFT 0.1-0.3.0's SFT warm-up as 0.3.1's ``stages:`` (a copy;
    ``data`` itself when there is nothing to move). Warns once saying so. Left alone: a file
    that has ``stages`` already, an algorithm of the MIX family (its dataset is the expert
    data), and a warm-up of 0 steps (then the key is only reported as ignored)."""
    if not sft_warmup_as_stages_needed(data):
        return data
    steps = data["buffer"]["trainer_input"]["sft_warmup_steps"]
    out = copy.deepcopy(data)
    out_tin = out["buffer"]["trainer_input"]
    warmup_data = out_tin.pop("sft_warmup_dataset")
    out_tin.pop("sft_warmup_steps", None)
    warmup_data.pop("algorithm_type", None)
    warmup_data.setdefault("storage_type", "file")
    warmup_buffer: dict[str, Any] = {
        "total_steps": int(steps),
        "trainer_input": {"experience_buffer": warmup_data},
    }
    for key in ("batch_size", "train_batch_size"):  # the stage's buffer replaces the base's
        if isinstance(data["buffer"].get(key), int):
            warmup_buffer[key] = data["buffer"][key]
    out["stages"] = [
        {
            "stage_name": "sft_warmup",
            "mode": "train",
            "algorithm": {"algorithm_type": "sft"},
            "buffer": warmup_buffer,
        },
        {"stage_name": "rft"},
    ]
    warnings.warn(
        f"config keys `buffer.trainer_input.sft_warmup_dataset` and `sft_warmup_steps` "
        f"(Trinity-RFT 0.1-0.3.0; 0.3.1 moved the SFT warm-up to `stages:`) -> stages "
        f"`sft_warmup` ({steps} steps of SFT in mode train on that dataset) then `rft` "
        f"(the rest of the file)",
        TrinityConfigWarning,
        stacklevel=1,
    )
    return out


def moving_overrides(data: Any, overrides: list[str]) -> list[str]:
    """The ``overrides`` that name keys :func:`upgrade_layout` moves (the command line names
    the file's own keys, ``buffer.trainer_input.sft_warmup_dataset.path=...``): to be
    applied before it."""
    if not isinstance(data, dict) or not sft_warmup_as_stages_needed(data):
        return []
    return [o for o in overrides if o.startswith(_WARMUP_KEYS)]


def sft_warmup_as_stages_needed(data: dict[str, Any]) -> bool:
    """Whether :func:`sft_warmup_as_stages` would rewrite ``data`` (no warning issued)."""
    tin = (data.get("buffer") or {}).get("trainer_input")
    if not isinstance(tin, dict) or data.get("stages"):
        return False
    algorithm = (data.get("algorithm") or {}).get("algorithm_type")
    return (
        isinstance(tin.get("sft_warmup_dataset"), dict)
        and algorithm not in MIX_FAMILY
        and bool(tin.get("sft_warmup_steps"))
    )


def upgrade_layout(data: Any, source: str | None = None) -> Any:
    """A config file's raw mapping in today's layout: :func:`check_pre_release_layout`,
    then :func:`sft_warmup_as_stages`. Anything not a mapping is returned as it is. Apply
    :func:`moving_overrides` first."""
    check_pre_release_layout(data, source)
    return sft_warmup_as_stages(data) if isinstance(data, dict) else data
