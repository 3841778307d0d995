"""``algorithms.utils.whole_batch``: two shards, each in its own thread with an all-reduce
made of a barrier, whiten to exactly the slices of the whole batch whitened on one rank."""

from __future__ import annotations

import threading

import numpy as np
import torch

from algorithms.advantage_fn.reinforce_plus_plus_advantage import REINFORCEPLUSPLUSAdvantageFn
from algorithms.utils import masked_count, masked_mean, masked_var, masked_whiten, whole_batch
from rftstream.experience import EID, Experience


class AllReduce:
    """An all-reduce of ``n`` threads: each adds its tensor and gets the sum of all."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls = 0

    def for_rank(self, rank: int, weight: float = 1.0):
        def sum_over_shards(local: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = local * weight
            self.barrier.wait()
            total = sum(self.parts.values())
            self.barrier.wait()  # every rank has read before the next call overwrites
            self.calls += 1
            return total

        return sum_over_shards


def run_ranks(fns) -> list:
    out: list = [None] * len(fns)

    def target(i: int) -> None:
        out[i] = fns[i]()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_statistics_inside_whole_batch_are_the_whole_batch_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(7, 5, generator=gen) > 0.3
    shards = [(values[:2], mask[:2]), (values[2:], mask[2:])]
    reduce = AllReduce(2)

    def rank(i: int):
        def go():
            v, m = shards[i]
            with whole_batch(reduce.for_rank(i)):
                return (
                    masked_count(m),
                    float(masked_mean(v, m)),
                    float(masked_var(v, m)),
                    masked_whiten(v, m),
                )

        return go

    got = run_ranks([rank(0), rank(1)])
    sel = values.numpy()[mask.numpy()]
    mean, var = sel.mean(), sel.var(ddof=1)  # numpy: the independent reference
    whitened = (values.numpy() - mean) / np.sqrt(var + 1e-8)
    for i, (count, m, v, w) in enumerate(got):
        assert count == int(mask.sum())
        assert abs(m - mean) < 1e-12
        assert abs(v - var) < 1e-12
        rows = slice(0, 2) if i == 0 else slice(2, 7)
        np.testing.assert_allclose(w.numpy(), whitened[rows], rtol=1e-10, atol=1e-12)
    # outside the block the statistics are local again
    v0, m0 = shards[0]
    assert masked_count(m0) == int(m0.sum())


def _exps(rewards: list[float], lengths: list[int]) -> list[Experience]:
    return [
        Experience(
            tokens=[1, 2] + [3] * n,
            prompt_length=2,
            reward=r,
            logprobs=[-0.5] * n,
            eid=EID(0, f"t{i}", 0),
        )
        for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    ]


def test_reinforce_plus_plus_on_two_shards_equals_one_rank() -> None:
    rewards, lengths = [1.0, 0.0, 0.5, -1.0, 2.0], [3, 4, 2, 5, 1]
    fn = REINFORCEPLUSPLUSAdvantageFn(gamma=0.9)
    one, _ = fn(_exps(rewards, lengths))
    reduce = AllReduce(3)
    cut = [(0, 2), (2, 5)]

    def rank(i: int):
        def go():
            if i == 2:  # a rank training a padding copy of one row: weight 0, adds nothing
                with whole_batch(reduce.for_rank(i, weight=0.0)):
                    return fn(_exps(rewards[:1], lengths[:1]))[0]
            a, b = cut[i]
            with whole_batch(reduce.for_rank(i)):
                return fn(_exps(rewards[a:b], lengths[a:b]))[0]

        return go

    shard0, shard1, _ = run_ranks([rank(0), rank(1), rank(2)])
    for got, ref in zip(shard0 + shard1, one, strict=True):
        torch.testing.assert_close(got.advantages, ref.advantages, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.returns, ref.returns)
    # and a shard alone (no block) whitens over itself: different advantages
    alone, _ = fn(_exps(rewards[:2], lengths[:2]))
    assert not torch.allclose(alone[0].advantages, one[0].advantages)
