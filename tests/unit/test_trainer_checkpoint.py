"""Resumable trainer checkpoints (:mod:`rftstream.training.checkpoint`): the real DeepSpeed
trainer saved after two steps and loaded into a new one trains step 3 exactly as the
original does; RNG states, record trimming, pruning; pointers of a restarted trainer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run
from rftstream.training import checkpoint as ckpt
from rftstream.weights import load_weights, save_weights
from rftstream.wire import WeightsPointer
from tests.integration._util import small_config
from tests.unit._trainer import short_exp


def _params(trainer: object) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}  # type: ignore[attr-defined]


def _state(trainer: object, step: int) -> ckpt.ResumeState:
    return ckpt.ResumeState(
        step=step,
        version=step,
        incarnation=0,
        trained=4 * step,
        rng=ckpt.capture_rng(),
        trained_uids=["a", "b"],
        lr_schedulers=[trainer.scheduler.state_dict(), None],  # type: ignore[attr-defined]
    )


def test_a_loaded_checkpoint_trains_the_next_step_as_the_original(
    tmp_path: Path, tiny_model_path: str
) -> None:
    from rftstream.training.policy_trainer import PolicyTrainer

    data = small_config(tmp_path, tiny_model_path)
    data["buffer"].update(total_steps=6, train_batch_size=4)
    data["algorithm"].update(kl_loss_fn="none")
    data["algorithm"]["optimizer"].update(lr=1e-2, warmup_style="cosine", lr_warmup_steps=1)
    data["trainer"].update(ppo_micro_batch_size_per_gpu=4)
    run = prepare_run(config_from_dict(data))
    original = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    for step in range(2):
        original.train_step([short_exp(4 * step + i) for i in range(4)])
    directory = tmp_path / "ckpt"
    saved = ckpt.save_resumable(directory, 2, [original.engine], _state(original, 2))
    assert saved == directory / "resume" / "global_step_2"
    assert (directory / "resume" / "latest").read_text() == "global_step_2"
    batch3 = [short_exp(100 + i) for i in range(4)]
    out_original = original.train_step(batch3)
    after_original = _params(original)

    resumed = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    fresh_params = _params(resumed)
    state = ckpt.load_resumable(directory, 2, [resumed.engine])
    assert (state.step, state.trained, state.trained_uids) == (2, 8, ["a", "b"])
    resumed.scheduler.load_state_dict(state.lr_schedulers[0])
    out_resumed = resumed.train_step(batch3)
    assert out_resumed["actor/lr"] == pytest.approx(out_original["actor/lr"], rel=1e-9)
    after_resumed = _params(resumed)
    for name, value in after_original.items():
        torch.testing.assert_close(after_resumed[name], value, rtol=1e-5, atol=1e-6)
    # a trainer that had not loaded it (fresh model, fresh Adam moments) ends elsewhere
    fresh = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    fresh.train_step(batch3)
    moved = max(float((_params(fresh)[k] - after_original[k]).abs().max()) for k in after_original)
    assert moved > 1e-4
    assert any(not torch.equal(fresh_params[k], after_original[k]) for k in fresh_params)


def test_rng_states_round_trip() -> None:
    saved = ckpt.capture_rng()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)  # move on
    # through JSON, as rftstream_state.json stores it
    restored = msgspec.json.decode(msgspec.json.encode(saved), type=ckpt.RngStates)
    ckpt.restore_rng(restored)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_an_incomplete_checkpoint_is_refused_with_its_file(tmp_path: Path) -> None:
    (tmp_path / "resume" / "global_step_4").mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="rftstream_state.json: missing"):
        ckpt.read_state(tmp_path, 4)


def test_prune_keeps_the_named_steps(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        (tmp_path / "resume" / f"global_step_{step}").mkdir(parents=True)
    (tmp_path / "resume" / "latest").write_text("global_step_4")
    assert ckpt.prune(tmp_path, {2, 4}) == [6]
    left = sorted(p.name for p in (tmp_path / "resume").iterdir())
    assert left == ["global_step_2", "global_step_4", "latest"]


def test_records_after_the_resume_point_move_to_the_discarded_file(tmp_path: Path) -> None:
    path, discarded = tmp_path / "metrics.jsonl", tmp_path / "metrics.discarded.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s * 10}) + "\n" for s in range(1, 6)))
    assert ckpt.drop_records_after(path, 3, discarded) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(x)["x"] for x in discarded.read_text().splitlines()] == [40, 50]
    assert ckpt.drop_records_after(tmp_path / "absent.jsonl", 3, discarded) == 0


def test_a_restarted_trainers_pointer_is_newer_whatever_its_version() -> None:
    ptr = WeightsPointer(version=4, method="memory", uri="u", incarnation=1)
    assert ptr.newer_than(0, 6)  # the killed trainer published v6, this one resumed at v4
    assert not ptr.newer_than(1, 4) and not ptr.newer_than(1, 5)
    assert WeightsPointer(version=5, method="memory", uri="u", incarnation=1).newer_than(1, 4)


def test_weights_of_two_incarnations_do_not_collide(tmp_path: Path) -> None:
    first = {"w": torch.zeros(2)}
    second = {"w": torch.ones(2)}
    p0 = save_weights("checkpoint", "r", 3, first, tmp_path, step=3)
    p1 = save_weights("checkpoint", "r", 3, second, tmp_path, step=3, incarnation=1)
    assert Path(p0.uri).name == "v3.safetensors" and Path(p1.uri).name == "v3.r1.safetensors"
    assert not Path(p0.uri).exists()  # an earlier incarnation's file is deleted
    assert torch.equal(load_weights(p1, "r")["w"], second["w"])
    m0 = save_weights("memory", "rm", 3, first, tmp_path, step=3)
    m1 = save_weights("memory", "rm", 3, second, tmp_path, step=3, incarnation=1)
    assert torch.equal(load_weights(m0, "rm")["w"], first["w"])
    assert torch.equal(load_weights(m1, "rm")["w"], second["w"])


def test_trained_digests_round_trip_and_a_short_file_is_named(tmp_path: Path) -> None:
    from rftstream.experience import uid_digests

    digests = np.unique(uid_digests([f"0/{i}/0/0/abc" for i in range(50)]))
    tag_dir = tmp_path / ckpt.RESUME_DIR / ckpt.tag_for(3)
    tag_dir.mkdir(parents=True)
    assert len(ckpt.read_trained_digests(tmp_path, 3)) == 0  # a checkpoint without the file
    (tag_dir / ckpt.TRAINED_FILE).write_bytes(digests.astype("<u8").tobytes())
    np.testing.assert_array_equal(ckpt.read_trained_digests(tmp_path, 3), digests)
    (tag_dir / ckpt.TRAINED_FILE).write_bytes(b"\0" * 12)
    with pytest.raises(ckpt.CheckpointError, match=ckpt.TRAINED_FILE):
        ckpt.read_trained_digests(tmp_path, 3)
