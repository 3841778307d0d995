"""The rollout engines' seed follows the run's ``seed`` unless ``explorer.rollout_model.seed``
is set: a run started with another seed samples other rollouts (a benchmark's five seeds
are five samples, not five runs of seed 42 that differ only by timing)."""

from __future__ import annotations

from rftstream.config import config_from_dict
from rftstream.engines.rollout import rollout_seed


def test_the_rollout_seed_is_the_runs_unless_set() -> None:
    assert rollout_seed(config_from_dict({})) == 42
    assert rollout_seed(config_from_dict({"seed": 7})) == 7
    cfg = config_from_dict({"seed": 7, "explorer": {"rollout_model": {"seed": 3}}})
    assert rollout_seed(cfg) == 3
    assert rollout_seed(config_from_dict({"explorer": {"rollout_model": {"seed": 0}}})) == 0
