"""Every algorithm preset trains 2 steps on the tiny model through the real actors and NATS.

RL presets run explorer → operator → trainer over a real nats-server; ``sft``
and ``dpo`` run the trainer alone in ``mode: train`` on a jsonl dataset. Each
must produce finite losses and the metrics its components name, and none that
another preset's components name (so the test tells which algorithm ran).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import anyio
import pytest

from algorithms import ALGORITHM_TYPE
from rftstream.config import config_from_dict
from rftstream.experience import Experience, decode_group
from rftstream.runtime import prepare_run
from tests.integration._util import read_stream, run_actors_to_end, small_config

pytestmark = pytest.mark.integration

# Metrics that tell the presets apart: key -> the presets whose components emit it. Every
# preset must emit exactly the keys naming it, none of the others. Trainer keys are
# checked in every step record (metrics.jsonl); pipeline keys (a group advantage run by
# the operator host) in the operator's messages on the metrics stream, where each batch's
# figures are stored whatever the timing between the actors.
KL_LOSS = {
    "grpo",
    "ppo",
    "opmd",
    "rloo",
    "reinforceplusplus",
    "gspo",
    "cispo",
    "topr",
    "rec",
    "mix",
    "mix_chord",
    "dpo",
    "multi_step_grpo",
    "sapo",
    "gigpo",
    "grpo_verl",
}
PPO_LOSS = {
    "grpo",
    "grpo_verl",
    "ppo",
    "dapo",
    "rloo",
    "reinforceplusplus",
    "multi_step_grpo",
    "gigpo",
    "on_policy_distill",
    "jsd",
}
TRAINER_KEYS: dict[str, set[str]] = {
    "actor/pg_clipfrac_lower": PPO_LOSS,  # PPO's dual clip
    "actor/ppo_kl_seq": {"gspo"},  # the sequence-level ratio
    "actor/sppo_loss": {"sppo"},
    "actor/sapo_loss": {"sapo"},
    "actor/avg_soft_gate": {"sapo"},  # SAPO's soft gate instead of the hard clip
    "actor/cispo_loss": {"cispo"},
    "actor/topr_loss": {"topr"},
    "actor/opmd_loss": {"opmd", "asymre"},
    "actor/sft_loss": {"raft", "sft", "cpt"},
    "actor/dpo_loss": {"dpo"},
    "actor/usual/pg_loss": {"mix", "mix_chord"},
    "actor/expert/sft_loss": {"mix"},
    "actor/expert/sft_phi_loss": {"mix_chord"},  # CHORD's phi-weighted SFT part
    "actor/mu": {"mix_chord"},  # CHORD's scheduled SFT weight
    "sample/expert_count": {"mix", "mix_chord"},
    "actor/kl_loss": KL_LOSS,  # only with a reference model and a KL loss
    "critic/vf_loss": {"ppo"},
    "advantage/advantages/mean": {"ppo", "on_policy_distill", "jsd"},  # in the trainer
    "advantage/kl/mean": {"on_policy_distill"},  # teacher vs student log-probs
    "advantage/jsd/mean": {"jsd"},
    "advantage/return_mean": {"reinforceplusplus"},  # REINFORCE++ in the trainer
}
PIPELINE_KEYS: dict[str, set[str]] = {
    "rloo_baseline": {"rloo"},
    "drop_balance": {"rec"},
    "experience_count": {"multi_step_grpo", "gigpo"},
    "gigpo/mean_abs_A_S": {"gigpo"},
    "group_baseline": {"opmd", "asymre", "sppo"},
    "reward_std": {
        "grpo",
        "dapo",
        "gspo",
        "cispo",
        "rec",
        "mix",
        "mix_chord",
        "multi_step_grpo",
        "sapo",
    },
}
PRESETS = (
    "grpo ppo dapo opmd asymre rloo reinforceplusplus gspo cispo topr sppo rec "
    "multi_step_grpo mix raft sft dpo sapo gigpo grpo_verl mix_chord on_policy_distill jsd cpt"
).split()
PIPELINE = {p for presets in PIPELINE_KEYS.values() for p in presets} | {"topr"}
DISTILL = {"on_policy_distill", "jsd"}  # need the teacher's log-probs from the workflow


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
    cfg["name"] = f"preset{sorted(PRESETS).index(preset)}"  # run ids are at most 16 chars
    algo = {"algorithm_type": preset, "repeat_times": 4, "optimizer": {"lr": 1e-3}}
    if preset in ("mix", "mix_chord"):
        algo["sample_strategy_args"] = {"expert_data_ratio": 0.25}
        cfg["buffer"]["trainer_input"] = {
            "auxiliary_buffers": {
                "sft_dataset": {
                    "path": _write_jsonl(tmp_path / "expert.jsonl", _expert_rows()),
                    "format": {"prompt_type": "messages", "messages_key": "messages"},
                }
            }
        }
    if preset == "cpt":  # continued pre-training on plain text
        cfg["mode"] = "train"
        algo.pop("repeat_times")
        rows = [{"text": f"{a}+{b}={a + b}"} for a in range(3) for b in range(3)]
        cfg["buffer"]["trainer_input"] = {
            "experience_buffer": {"path": _write_jsonl(tmp_path / "corpus.jsonl", rows)}
        }
        cfg["buffer"]["train_batch_size"] = 4
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
    if preset in DISTILL:  # the student rolls out, a teacher (the same tiny model) scores
        cfg["buffer"]["explorer_input"]["taskset"]["default_workflow_type"] = (
            "on_policy_distill_workflow"
        )
        cfg["explorer"]["auxiliary_models"] = [
            {"model_path": tiny_model_path, "max_response_tokens": 6}
        ]
    cfg["algorithm"] = algo
    return cfg


async def _operator_metrics(url: str, run: str) -> list[dict[str, float]]:
    """The group advantage figures of every batch the operator host published."""
    out = []
    for msg in await read_stream(url, f"rft.{run}.metrics.>"):
        body = json.loads(msg.data)
        if body["role"] == "operator":
            out.append(
                {
                    k.removeprefix("group_advantage/"): v
                    for k, v in body["values"].items()
                    if k.startswith("group_advantage/")
                }
            )
    return out


async def _trained_experiences(url: str, run: str) -> list[Experience]:
    """Every experience the pipeline handed the trainer (``exp.train``), decoded."""
    return [
        e for msg in await read_stream(url, f"rft.{run}.exp.train") for e in decode_group(msg.data)
    ]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_two_steps(
    preset: str, tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = prepare_run(config_from_dict(_config(preset, tmp_path, tiny_model_path)))
    steps = run_actors_to_end(run, nats_url, timeout=240)
    assert [r["step"] for r in steps] == [1, 2], preset
    lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and [r["step"] for r in lines] == [1, 2]
    for record in lines:
        assert record["experience/trained"] > 0
        for key, emitters in TRAINER_KEYS.items():
            if preset in emitters:
                value = record.get(key)
                assert value is not None and math.isfinite(value), f"{preset}: {key}={value}"
            else:
                assert key not in record, f"{preset} emits {key}, which is not its component's"
        assert math.isfinite(record["actor/loss"]), preset

    ops = anyio.run(_operator_metrics, nats_url, run.names.run, backend="asyncio")
    emitted = {k for m in ops for k in m}
    if preset in PIPELINE:
        assert ops and "group_count" in emitted, f"{preset}: no group advantage ran"
    else:
        assert not emitted, f"{preset}: a group advantage ran in the pipeline: {emitted}"
    for key, emitters in PIPELINE_KEYS.items():
        assert (key in emitted) == (preset in emitters), f"{preset}: {key} in {sorted(emitted)}"
    # the baselines tell OPMD (the group mean) and AsymRE (the mean shifted by -0.1) apart
    shift = {"opmd": 0.0, "sppo": 0.0, "asymre": -0.1}.get(preset)
    if shift is not None:
        for m in ops:
            assert m["group_baseline"] == pytest.approx(m["reward_mean"] + shift, abs=1e-6)
    if preset == "dapo":  # DAPO's decoupled clip reached the loss the trainer used
        fn = run.algorithm.policy_loss_fn
        assert (fn.clip_range_low, fn.clip_range_high) == (0.2, 0.28)
    if preset == "rloo":  # over groups of 4 the leave-one-out baselines average to the mean
        for m in ops:
            assert m["rloo_baseline"] == pytest.approx(m["reward_mean"], abs=1e-6)
    if preset == "mix_chord":  # mu's schedule at its defaults: the constant 0.1
        assert all(r["actor/mu"] == pytest.approx(0.1) for r in lines)
    if preset in DISTILL:
        exps = anyio.run(_trained_experiences, nats_url, run.names.run, backend="asyncio")
        assert exps, preset
        for exp in exps:  # one finite teacher log-prob per response token
            teacher = exp.info["teacher_logprobs"]
            assert len(teacher) == exp.response_length > 0, preset
            assert all(math.isfinite(v) and v <= 0 for v in teacher), teacher
        # the first step trains on rollouts of the initial weights, which the teacher (the
        # same model) scores alike: a misaligned teacher would be far from 0
        divergence = "advantage/kl/mean" if preset == "on_policy_distill" else "advantage/jsd/mean"
        assert lines[0][divergence] == pytest.approx(0.0, abs=1e-3), lines[0]


def test_every_builtin_preset_is_covered() -> None:
    builtin = {
        n
        for n in ALGORITHM_TYPE.names()
        if ALGORITHM_TYPE.get(n).__module__.startswith("algorithms.")
    }
    assert len(builtin) >= 17
    assert builtin == set(PRESETS), sorted(builtin ^ set(PRESETS))
