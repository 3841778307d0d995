"""Advantages computed in the trainer land on the right batch rows, whatever order the
advantage fn returns its experiences in (group advantages return them by group)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.batch import collate
from rftstream.training.policy_trainer import PolicyTrainer
from tests.integration._util import small_config


def test_group_advantage_in_the_trainer_maps_back_to_rows(
    tmp_path: Path, tiny_model_path: str
) -> None:
    data = small_config(tmp_path, tiny_model_path)
    data["algorithm"] = {"algorithm_type": "ppo", "advantage_fn": "grpo"}
    run = prepare_run(config_from_dict(data))
    trainer = PolicyTrainer(run.cfg, run.model_path, run.algorithm)
    rewards = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    exps = [
        Experience(tokens=[5, 6, 7, 8], prompt_length=2, reward=r, eid=EID(0, f"t{i % 2}", i))
        for i, r in enumerate(rewards)
    ]  # rows alternate between two tasks
    batch = collate(exps, trainer.pad_token_id)
    trainer._compute_advantages(exps, batch, batch.advantages.clone(), None, None)
    expected = []
    for i, r in enumerate(rewards):
        group = np.array([x for j, x in enumerate(rewards) if j % 2 == i % 2])
        expected.append((r - group.mean()) / (group.std(ddof=1) + 1e-6))
    got = batch.advantages[:, 0].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(batch.advantages[:, 1].numpy(), expected, rtol=1e-5)
