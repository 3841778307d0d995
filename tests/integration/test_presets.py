"""Every algorithm preset trains 2 steps on the tiny model through the real actors and NATS.

RL presets run explorer → operator → trainer over a real nats-server; ``sft``
and ``dpo`` run the trainer alone in ``mode: train`` on a jsonl dataset. Each
must produce finite losses and the metrics its components name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from algorithms import ALGORITHM_TYPE
from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run
from tests.integration._util import run_actors_to_end, small_config

pytestmark = pytest.mark.integration

# preset -> metrics its trainer records must carry (besides actor/loss)
EXPECTED: dict[str, tuple[str, ...]] = {
    "grpo": ("actor/pg_loss", "actor/kl_loss", "advantage/reward_mean"),
    "ppo": ("actor/pg_loss", "critic/vf_loss", "critic/vpred_mean", "advantage/advantages/mean"),
    "dapo": ("actor/pg_loss", "actor/pg_clipfrac"),
    "opmd": ("actor/opmd_loss", "advantage/group_baseline"),
    "asymre": ("actor/opmd_loss", "advantage/group_baseline"),
    "rloo": ("actor/pg_loss",),
    "reinforceplusplus": ("actor/pg_loss", "actor/kl_loss"),
    "gspo": ("actor/pg_loss",),
    "cispo": ("actor/cispo_loss",),
    "topr": ("actor/topr_loss",),
    "sppo": ("actor/pg_loss",),
    "rec": ("actor/pg_loss",),
    "multi_step_grpo": ("actor/pg_loss",),
    "mix": ("actor/usual/pg_loss", "actor/expert/sft_loss", "sample/expert_count"),
    "raft": ("actor/sft_loss",),
    "sft": ("actor/sft_loss",),
    "dpo": ("actor/dpo_loss",),
}


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _expert_rows() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"{a}+{b}="},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
        for a in range(3)
        for b in range(3)
    ]


def _config(preset: str, tmp_path: Path, tiny_model_path: str) -> dict:
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["name"] = f"preset{sorted(EXPECTED).index(preset)}"  # run ids are at most 16 chars
    algo = {"algorithm_type": preset, "repeat_times": 4, "optimizer": {"lr": 1e-3}}
    if preset == "mix":
        algo["sample_strategy_args"] = {"expert_data_ratio": 0.25}
        cfg["buffer"]["trainer_input"] = {
            "auxiliary_buffers": {
                "sft_dataset": {
                    "path": _write_jsonl(tmp_path / "expert.jsonl", _expert_rows()),
                    "format": {"prompt_type": "messages", "messages_key": "messages"},
                }
            }
        }
    if preset == "sft":
        cfg["mode"] = "train"
        algo.pop("repeat_times")
        cfg["buffer"]["trainer_input"] = {
            "experience_buffer": {"path": _write_jsonl(tmp_path / "sft.jsonl", _expert_rows())}
        }
        cfg["buffer"]["train_batch_size"] = 4
    if preset == "dpo":
        cfg["mode"] = "train"
        algo.pop("repeat_times")
        rows = [
            {"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(6)
        ]
        cfg["buffer"]["trainer_input"] = {
            "experience_buffer": {
                "path": _write_jsonl(tmp_path / "dpo.jsonl", rows),
                "format": {"prompt_key": "prompt"},
            }
        }
        cfg["buffer"]["train_batch_size"] = 4
    cfg["algorithm"] = algo
    return cfg


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_trains_two_steps(
    preset: str, tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = prepare_run(config_from_dict(_config(preset, tmp_path, tiny_model_path)))
    steps = run_actors_to_end(run, nats_url, timeout=240)
    assert [r["step"] for r in steps] == [1, 2], preset
    lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        for key in ("actor/loss", *EXPECTED[preset]):
            assert key in record, f"{preset}: {key} missing from {sorted(record)}"
            value = record[key]
            assert value is not None and math.isfinite(value), f"{preset}: {key}={value}"
        assert record["experience/trained"] > 0


def test_every_builtin_preset_is_covered() -> None:
    builtin = {
        n
        for n in ALGORITHM_TYPE.names()
        if ALGORITHM_TYPE.get(n).__module__.startswith("algorithms.")
    }
    assert len(builtin) >= 17
    assert builtin <= set(EXPECTED), sorted(builtin - set(EXPECTED))
