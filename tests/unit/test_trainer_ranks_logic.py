"""Pure logic of several trainer ranks: shards, per-rank loss factors, merged metrics."""

from __future__ import annotations

import pytest

from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from rftstream.training.ranks import merge_metrics, rank_scales, shard_batch
from rftstream.training.world import env_world_size, per_rank_batch_size


def exps(*group_sizes: int) -> list[Experience]:
    out = []
    for g, size in enumerate(group_sizes):
        for r in range(size):
            out.append(Experience(tokens=[1, 2, 3], prompt_length=1, eid=EID(0, f"t{g}", r)))
    return out


def test_shards_cover_every_row_once_and_keep_groups_whole() -> None:
    batch = exps(4, 4, 4, 4, 2, 2)  # 20 rows
    for n in (1, 2, 3, 4, 7):
        shards = shard_batch(batch, n)
        assert len(shards) == n
        flat = [i for s in shards for i in s]
        assert flat == list(range(len(batch)))  # contiguous, each row once, in order
        for shard in shards:
            tids = {batch[i].eid.tid for i in shard}
            for other in shards:
                if other is not shard:
                    assert not tids & {batch[i].eid.tid for i in other}


def test_shards_balance_rows_at_group_boundaries() -> None:
    assert [len(s) for s in shard_batch(exps(2, 2, 2, 2), 2)] == [4, 4]
    assert [len(s) for s in shard_batch(exps(4, 1, 1), 2)] == [4, 2]
    # targets 1.5, 3, 4.5: a tie goes to the earlier boundary
    assert [len(s) for s in shard_batch(exps(1, 1, 1, 1, 1, 1), 4)] == [1, 2, 1, 2]
    # fewer groups than ranks: some shard is empty, none is cut
    assert sorted(len(s) for s in shard_batch(exps(4), 2)) == [0, 4]


def test_pair_units_are_never_split() -> None:
    batch = [Experience(tokens=[1, 2], prompt_length=1, eid=EID(0, f"p{i}", 0)) for i in range(6)]
    shards = shard_batch(batch, 2, unit=2)
    assert all(len(s) % 2 == 0 for s in shards)
    assert sum(len(s) for s in shards) == 6


def test_shard_batch_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        shard_batch(exps(2), 0)


def test_rank_scales_make_the_rank_mean_a_row_mean() -> None:
    sizes = [4, 2, 0]
    scales = rank_scales(sizes)
    assert scales == pytest.approx([3 * 4 / 6, 3 * 2 / 6, 0.0])
    # each row's weight in DeepSpeed's mean over ranks (scale / N / B_r) is 1 / B
    for size, scale in zip(sizes, scales, strict=True):
        if size:
            assert scale / len(sizes) / size == pytest.approx(1 / 6)


def test_per_rank_batch_size() -> None:
    assert per_rank_batch_size(8, 2) == 4
    assert per_rank_batch_size(7, 2) == 4
    assert per_rank_batch_size(1, 4) == 1


def test_merge_metrics_weights_rows_and_takes_slowest_time() -> None:
    merged = merge_metrics(
        [
            (3, {"actor/loss": 1.0, "time/train_step": 2.0}),
            (1, {"actor/loss": 5.0, "time/train_step": 3.0}),
            (0, {"actor/loss": 100.0, "time/train_step": 9.0}),  # trained nothing
        ]
    )
    assert merged["actor/loss"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)
    assert merged["time/train_step"] == 3.0


def test_env_world_size_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        env_world_size()
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert env_world_size() == 3


def test_trainer_ranks_config_key_and_errors() -> None:
    from rftstream.config import config_from_dict
    from rftstream.config.validate import validate_config

    assert config_from_dict({}).trainer.n_gpus_per_node == 1
    two = config_from_dict({"trainer": {"n_gpus_per_node": 2}})
    validate_config(two)
    assert two.trainer.n_gpus_per_node == 2
    # Trinity-RFT's cluster key maps onto it
    cfg = config_from_dict({"cluster": {"trainer_gpu_num": 4}})
    assert cfg.trainer.n_gpus_per_node == 4
    with pytest.raises(ConfigError, match="trainer.n_gpus_per_node"):
        validate_config(config_from_dict({"trainer": {"n_gpus_per_node": 0}}))
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node.*sync_method"):
        validate_config(
            config_from_dict(
                {"trainer": {"n_gpus_per_node": 2}, "synchronizer": {"sync_method": "memory"}}
            )
        )
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node.*mode train"):
        validate_config(config_from_dict({"mode": "train", "trainer": {"n_gpus_per_node": 2}}))
