"""Pure logic of several trainer ranks: shards, per-rank loss factors, merged metrics, the
launcher's environment (torchrun's, Slurm's) and the config keys that size the ranks."""

from __future__ import annotations

import pytest

from rftstream.errors import ConfigError, RftError
from rftstream.experience import EID, Experience
from rftstream.training.ranks import merge_metrics, rank_scales, shard_batch
from rftstream.training.world import (
    SLURM_PORT_BASE,
    adopt_slurm_env,
    check_declared_world,
    env_world_size,
    first_host,
    per_rank_batch_size,
)


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
    # up starts the ranks in mode train too (a trainer fed by explorers of another
    # deployment, or SFT on a dataset)
    validate_config(config_from_dict({"mode": "train", "trainer": {"n_gpus_per_node": 2}}))
    with pytest.raises(ConfigError, match="trainer.nnodes"):
        validate_config(config_from_dict({"trainer": {"nnodes": 0}}))


def test_trinity_cluster_keys_size_the_trainer() -> None:
    from rftstream.config import config_from_dict

    # Trinity counts the trainer's GPUs on all its nodes
    cfg = config_from_dict({"cluster": {"trainer_node_num": 2, "trainer_gpu_num": 16}})
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)
    # a train-only run trains on every node
    train = config_from_dict({"mode": "train", "cluster": {"node_num": 2, "trainer_gpu_num": 8}})
    assert (train.trainer.nnodes, train.trainer.n_gpus_per_node) == (2, 4)
    # in mode both the nodes are shared with the explorers: node_num says nothing of the
    # trainer's share
    with pytest.warns(UserWarning, match="cluster.node_num"):
        both = config_from_dict({"cluster": {"node_num": 2}})
    assert both.trainer.nnodes == 1
    # the config's own key wins
    own = config_from_dict({"trainer": {"nnodes": 3}, "cluster": {"trainer_node_num": 2}})
    assert own.trainer.nnodes == 3


def test_declared_ranks_must_match_the_launcher() -> None:
    check_declared_world(1, 1, 4)  # the launcher decides
    check_declared_world(2, 2, 4)
    check_declared_world(1, 4, 4)
    with pytest.raises(ConfigError, match=r"trainer.nnodes.*2 x 2 = 4 ranks.*started 6"):
        check_declared_world(2, 2, 6)
    check_declared_world(1, 1, 1)  # a trainer on its own
    with pytest.raises(ConfigError, match=r"2 x 1 trainer ranks.*runs as one process.*torchrun"):
        check_declared_world(2, 1, 1)


def test_up_refuses_several_nodes_with_the_way_to_run_them() -> None:
    from rftstream.cli import _one_node
    from rftstream.config import config_from_dict

    _one_node(config_from_dict({"trainer": {"n_gpus_per_node": 2}}))
    _one_node(config_from_dict({"mode": "explore", "trainer": {"nnodes": 2}}))  # no trainer
    with pytest.raises(ConfigError, match=r"trainer.nnodes.*torchrun --nnodes N.*srun"):
        _one_node(config_from_dict({"trainer": {"nnodes": 2}}))


def test_first_host_of_a_slurm_node_list() -> None:
    assert first_host("gpu[07-08,11],cpu1") == "gpu07"
    assert first_host("node1,node2") == "node1"
    assert first_host("a100-[3,5]") == "a100-3"
    assert first_host("rack[2-3]-n1") == "rack2-n1"
    assert first_host("localhost") == "localhost"
    with pytest.raises(RftError, match="node list"):
        first_host("")


def srun_task(procid: int, nodeid: int, localid: int, **extra: str) -> dict[str, str]:
    """The variables srun sets for one task of a 4-task step on 2 nodes."""
    return {
        "SLURM_JOB_ID": "4711234",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        **extra,
    }


def test_srun_tasks_get_the_torch_distributed_contract() -> None:
    env = srun_task(3, 1, 1)
    got = adopt_slurm_env(env)
    assert got is not None and (got.rank, got.world_size, got.local_rank, got.node) == (3, 4, 1, 1)
    port = str(SLURM_PORT_BASE + 1234)  # the job id's last four digits
    assert got.master == f"gpu07:{port}"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu07", port)
    # what the batch script exports wins
    env = srun_task(0, 0, 0, MASTER_ADDR="10.0.0.7", MASTER_PORT="29500")
    assert adopt_slurm_env(env) is not None
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.7", "29500")


def test_slurm_env_is_left_alone_outside_a_multi_task_srun_step() -> None:
    batch_script = srun_task(0, 0, 0)
    del batch_script["SLURM_STEP_ID"]  # the batch step: one process
    assert adopt_slurm_env(batch_script) is None and "RANK" not in batch_script
    under_torchrun = srun_task(0, 0, 0, RANK="5", WORLD_SIZE="8")
    assert adopt_slurm_env(under_torchrun) is None and under_torchrun["RANK"] == "5"
    one_task = srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="1")
    assert adopt_slurm_env(one_task) is None and "RANK" not in one_task
    broken = srun_task(0, 0, 0, SLURM_PROCID="zero")
    with pytest.raises(RftError, match="SLURM_PROCID"):
        adopt_slurm_env(broken)


def test_a_collective_failing_for_a_gone_rank_is_one_clear_line() -> None:
    from rftstream.training.ranks import keepalive_interval, lost_rank_error, ranks_lost

    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Read error "
        "[10.0.0.2]:54420: Connection reset by peer. This is typically caused by a remote "
        "worker hanging. GLHF!"
    )
    assert lost_rank_error(gloo)
    assert lost_rank_error(RuntimeError("Timed out waiting 600000ms for recv operation"))
    assert not lost_rank_error(RuntimeError("CUDA out of memory"))
    assert not lost_rank_error(ValueError("connection reset by peer"))  # not torch's
    err = ranks_lost(2, 4, "training a step", gloo)
    assert isinstance(err, RftError) and "\n" not in str(err)
    assert str(err).startswith(
        "trainer rank 2 of 4: another rank stopped answering while training a step "
        "(Read error [10.0.0.2]:54420: Connection reset by peer): a node died"
    )
    assert keepalive_interval(600) == 60 and keepalive_interval(10) == 2.5
