"""The ``clipb`` / ``clipv`` advantages (Trinity-RFT ``examples/entropy``) against numpy.

The references below re-derive Trinity-RFT's formulas in float64 numpy: GRPO
group scores, ``S = p (H + log p)``, ``D = N - S`` with ``N = H sum p^2 + sum
p^2 log p``, masked population statistics, Clip_B's one-sided bound on
negative-advantage tokens, Clip_V's bound with its ``max_frac`` cap (top-k of
the largest ``D``). A real trainer step (tiny model, DeepSpeed on CPU) is
checked to train on exactly the mask and advantages the reference computes from
the model's own entropies, and to run no extra forward pass without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from algorithms import ADVANTAGE_FN, POLICY_LOSS_FN
from algorithms.advantage_fn import ClipBAdvantageFn, ClipVAdvantageFn
from algorithms.policy_loss_fn import PPOPolicyLossFn
from operators.advantage import GroupAdvantageOperator
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from rftstream.training.batch import response_token_stats

# ------------------------------------------------------------------ numpy references


def ref_grpo(rewards: list[float], tasks: list[str], eps: float) -> np.ndarray:
    """(r - mean) / (unbiased std + eps) per task; a task with one row gets 0."""
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    for task in set(tasks):
        idx = [i for i, t in enumerate(tasks) if t == task]
        if len(idx) > 1:
            g = r[idx]
            out[idx] = (g - g.mean()) / (g.std(ddof=1) + eps)
    return out


def masked_stats(x: np.ndarray, m: np.ndarray) -> tuple[float, float]:
    n = max(m.sum(), 1)
    mean = (x * m).sum() / n
    return float(mean), float((((x - mean) ** 2) * m).sum() / n)


def ref_clipb(adv, lp, h, m, mu) -> tuple[np.ndarray, float, float]:
    """Kept mask (bool, ANDed with m), ES, varS."""
    s = np.exp(lp) * (h + lp)
    es, var = masked_stats(s, m)
    if np.sqrt(var) < 1e-12:
        return m.copy(), es, var
    keep = np.where(adv < 0, (s - es) >= -mu * np.sqrt(var), True)
    return m & keep, es, var


def ref_clipv(adv, lp, h, n, m, mu, max_frac) -> tuple[np.ndarray, float]:
    """Kept mask (bool, ANDed with m) and stdD, following Trinity-RFT's clipv step by step."""
    d = n - np.exp(lp) * (h + lp)
    _, var = masked_stats(d, m)
    std = np.sqrt(var)
    if std < 1e-12:
        return m.copy(), std
    bound_ok = d <= mu * std
    keep = np.where(adv > 0, True, bound_ok)
    total = max(m.sum(), 1)
    if (m & ~keep).sum() / total <= max_frac:
        return m & keep, std
    budget = max(int(max_frac * total), 1)
    cand = (adv < 0) & m & ~bound_ok
    if cand.sum() <= budget:
        return m & keep, std
    flat = np.where(cand, d, -np.inf).ravel()
    top = np.argsort(-flat, kind="stable")[:budget]
    final = keep.copy()
    final[cand] = True
    final.ravel()[top] = False
    return m & final, std


def ref_fracs(m, kept, adv) -> dict[str, float]:
    def frac(w):
        return 1.0 - (kept * w).sum() / max((m * w).sum(), 1)

    return {
        "frac_clipped": frac(np.ones_like(adv)),
        "frac_clipped_pos": frac(adv > 0),
        "frac_clipped_neg": frac(adv < 0),
    }


def ref_token_stats(logits: np.ndarray, targets: np.ndarray, temperature: float):
    """(logp of target, entropy, nec) per position from raw logits (float64)."""
    z = logits.astype(np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    h = -(p * logp).sum(-1)
    nec = h * (p**2).sum(-1) + (p**2 * logp).sum(-1)
    lp_t = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return lp_t, h, nec


# ------------------------------------------------------------------ a synthetic batch

TASKS = ["a", "a", "a", "a", "b", "b", "b", "c"]  # c: a group of one
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, -1.0, 3.0]
LENGTHS = [5, 3, 6, 4, 6, 2, 5, 3]


def synthetic(seed: int = 0) -> tuple[list[Experience], dict[str, list[np.ndarray]], np.ndarray]:
    """Experiences (one masked-out token in row 2), per-row lp / entropy / nec, and the
    padded original mask."""
    rng = np.random.default_rng(seed)
    exps, lp, h, n = [], [], [], []
    width = max(LENGTHS)
    mask = np.zeros((len(TASKS), width), dtype=bool)
    for i, (task, r, k) in enumerate(zip(TASKS, REWARDS, LENGTHS, strict=True)):
        am = np.ones(k, dtype=bool)
        if i == 2:
            am[1] = False
        mask[i, :k] = am
        lp.append(-rng.exponential(1.0, k))
        h.append(rng.uniform(0.1, 3.0, k))
        n.append(rng.normal(0.0, 0.5, k))
        exps.append(
            Experience(
                tokens=list(range(3 + k)),
                prompt_length=3,
                reward=r,
                logprobs=lp[-1].astype(np.float32),
                action_mask=am,
                eid=EID(0, task, i),
            )
        )
    return exps, {"lp": lp, "h": h, "n": n}, mask


def pad(rows: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def as_t(rows: list[np.ndarray]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def kept_masks(exps: list[Experience], width: int) -> np.ndarray:
    return pad([e.action_mask.numpy().astype(float) for e in exps], width).astype(bool)


# ------------------------------------------------------------------ Clip_B


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_clipb_matches_the_reference(mu: float) -> None:
    exps, v, mask = synthetic()
    width = mask.shape[1]
    scores = ref_grpo(REWARDS, TASKS, 1e-6)
    adv = scores[:, None] * mask
    lp, h = pad(v["lp"], width), pad(v["h"], width)
    want, es, var = ref_clipb(adv, lp, h, mask, mu)

    out, metrics = ClipBAdvantageFn(mu=mu)(exps, entropy=as_t(v["h"]))  # lp: exp.logprobs

    assert out is exps
    np.testing.assert_array_equal(kept_masks(out, width), want)
    for i, e in enumerate(out):  # advantages over the original mask, as Trinity
        np.testing.assert_allclose(e.advantages.numpy(), adv[i, : LENGTHS[i]], rtol=1e-5)
        np.testing.assert_allclose(e.returns.numpy(), adv[i, : LENGTHS[i]], rtol=1e-5)
    assert metrics["ES"] == pytest.approx(es, rel=1e-5)
    assert metrics["varS"] == pytest.approx(var, rel=1e-5)
    for key, value in ref_fracs(mask, want, adv).items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
    assert metrics["frac_clipped_pos"] == 0.0  # positive-advantage tokens are never clipped
    if mu == 0.3:  # not vacuous: some negative tokens go, some stay
        assert 0 < metrics["frac_clipped_neg"] < 1


def test_clipb_explicit_rollout_logprob_wins_over_exp_logprobs() -> None:
    exps, v, mask = synthetic(1)
    width = mask.shape[1]
    other = [x - 0.7 * np.arange(len(x)) for x in v["lp"]]
    adv = ref_grpo(REWARDS, TASKS, 1e-6)[:, None] * mask
    want, _, _ = ref_clipb(adv, pad(other, width), pad(v["h"], width), mask, 0.4)
    ClipBAdvantageFn(mu=0.4)(exps, entropy=as_t(v["h"]), rollout_logprob=as_t(other))
    np.testing.assert_array_equal(kept_masks(exps, width), want)


def test_clipb_keeps_everything_when_the_signal_is_flat() -> None:
    exps, _, mask = synthetic()
    const = [np.full(k, -0.5) for k in LENGTHS]
    _, metrics = ClipBAdvantageFn(mu=0.0)(
        exps, entropy=as_t([np.full(k, 0.5) for k in LENGTHS]), rollout_logprob=as_t(const)
    )
    np.testing.assert_array_equal(kept_masks(exps, mask.shape[1]), mask)
    assert metrics["frac_clipped"] == 0.0 and metrics["varS"] == pytest.approx(0.0, abs=1e-12)


def test_inputs_may_cover_a_prefix_of_the_response() -> None:
    """A response cut by max_response_tokens: statistics over the kept tokens only."""
    exps, v, mask = synthetic(2)
    cut = [min(k, 3) for k in LENGTHS]
    width = 3
    h = [x[:c] for x, c in zip(v["h"], cut, strict=True)]
    lp = [x[:c] for x, c in zip(v["lp"], cut, strict=True)]
    m = mask[:, :width]
    adv = ref_grpo(REWARDS, TASKS, 1e-6)[:, None] * m
    want, _, _ = ref_clipb(adv, pad(lp, width), pad(h, width), m, 0.3)
    ClipBAdvantageFn(mu=0.3)(exps, entropy=as_t(h), rollout_logprob=as_t(lp))
    got = kept_masks(exps, mask.shape[1])
    np.testing.assert_array_equal(got[:, :width], want)
    np.testing.assert_array_equal(got[:, width:], mask[:, width:])  # beyond: untouched


# ------------------------------------------------------------------ Clip_V


@pytest.mark.parametrize("mu,max_frac", [(0.2, 1.0), (0.5, 1.0), (0.2, 0.05), (0.2, 0.0)])
def test_clipv_matches_the_reference(mu: float, max_frac: float) -> None:
    exps, v, mask = synthetic(3)
    width = mask.shape[1]
    adv = ref_grpo(REWARDS, TASKS, 1e-6)[:, None] * mask
    lp, h, n = (pad(v[k], width) for k in ("lp", "h", "n"))
    want, std = ref_clipv(adv, lp, h, n, mask, mu, max_frac)

    _, metrics = ClipVAdvantageFn(mu=mu, max_frac=max_frac)(
        exps, entropy=as_t(v["h"]), nec=as_t(v["n"]), old_logprob=as_t(v["lp"])
    )

    np.testing.assert_array_equal(kept_masks(exps, width), want)
    assert metrics["stdD"] == pytest.approx(std, rel=1e-5)
    for key, value in ref_fracs(mask, want, adv).items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
    assert metrics["frac_clipped_pos"] == 0.0
    clipped = int((mask & ~want).sum())
    if max_frac == 1.0 and mu == 0.2:
        assert clipped > 2  # the uncapped bound clips several tokens
    if max_frac < 1.0:  # the cap: one token (budget max(int(frac * 33), 1) = 1) plus zeros
        zero_adv_clipped = int((mask & ~want & (adv == 0)).sum())
        assert int((mask & ~want & (adv < 0)).sum()) == 1
        assert clipped == 1 + zero_adv_clipped


def test_clipv_clips_zero_advantage_tokens_as_trinity_does() -> None:
    """A group of one has advantage 0 here; Trinity's bound applies to A <= 0."""
    exps, v, mask = synthetic(4)
    n = [x.copy() for x in v["n"]]
    n[7][:] = 50.0  # row 7 (group of one, advantage 0): far above the bound
    ClipVAdvantageFn(mu=1.0, max_frac=1.0)(
        exps, entropy=as_t(v["h"]), nec=as_t(n), old_logprob=as_t(v["lp"])
    )
    assert not exps[7].action_mask.any()


def test_clipv_defaults_follow_trinity() -> None:
    assert ClipVAdvantageFn.default_args() == {"epsilon": 1e-6, "mu": 8.5, "max_frac": 1e-4}
    assert ClipVAdvantageFn().mu == 2.0  # Trinity's constructor default differs from its config's
    assert ClipBAdvantageFn.default_args() == {"epsilon": 1e-6, "mu": 2.5}


# ------------------------------------------------------------------ registration and errors


@pytest.mark.parametrize("name,cls", [("clipb", ClipBAdvantageFn), ("clipv", ClipVAdvantageFn)])
def test_registered_and_computed_in_the_trainer(name: str, cls: type) -> None:
    assert ADVANTAGE_FN.get(name) is cls
    assert cls.compute_in_trainer() is True
    assert cls.rewrites_action_mask is True
    assert cls()([]) == ([], {})
    with pytest.raises(ValueError, match="trainer"):
        GroupAdvantageOperator(advantage_fn=name)
    with pytest.raises(TypeError):
        cls(bogus=1)


def test_missing_or_mismatched_inputs_name_what_is_wrong() -> None:
    exps, v, _ = synthetic()
    with pytest.raises(ValueError, match="'entropy'"):
        ClipBAdvantageFn()(exps)
    with pytest.raises(ValueError, match="'nec'"):
        ClipVAdvantageFn()(exps, entropy=as_t(v["h"]), old_logprob=as_t(v["lp"]))
    with pytest.raises(ValueError, match="7 'entropy' tensors for 8"):
        ClipBAdvantageFn()(exps, entropy=as_t(v["h"])[:7])
    bad = as_t(v["h"])
    bad[0] = torch.zeros(LENGTHS[0] + 1)
    with pytest.raises(ValueError, match=exps[0].eid.uid):
        ClipBAdvantageFn()(exps, entropy=bad)
    with pytest.raises(ValueError, match="mu"):
        ClipBAdvantageFn(mu=-1.0)
    with pytest.raises(ValueError, match="max_frac"):
        ClipVAdvantageFn(max_frac=2.0)


def test_response_token_stats_against_numpy() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2.0, (2, 7, 11))
    ids = rng.integers(0, 11, (2, 7))
    P = 3
    stats = response_token_stats(
        torch.tensor(logits, dtype=torch.float32),
        torch.tensor(ids),
        P,
        0.7,
        with_nec=True,
    )
    lp, h, nec = ref_token_stats(logits[:, P - 1 : -1], ids[:, P:], 0.7)
    np.testing.assert_allclose(stats.logprob.numpy(), lp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.entropy.numpy(), h, rtol=1e-5, atol=1e-6)
    assert stats.nec is not None
    np.testing.assert_allclose(stats.nec.numpy(), nec, rtol=1e-5, atol=1e-6)
    assert response_token_stats(torch.tensor(logits), torch.tensor(ids), P, 1.0).nec is None


# ------------------------------------------------------------------ a real trainer step

SEEN: list[dict[str, torch.Tensor]] = []


class RecordingPPO(PPOPolicyLossFn):
    """PPO loss that records the tensors the trainer gives it."""

    def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):  # type: ignore[override]
        SEEN.append(
            {
                "action_mask": action_mask.detach().clone(),
                "advantages": advantages.detach().clone(),
                "logprob": logprob.detach().clone(),
                "old_logprob": old_logprob.detach().clone(),
            }
        )
        return super().__call__(logprob, old_logprob, action_mask, advantages, **kwargs)


@pytest.fixture(autouse=True)
def recorder() -> None:
    SEEN.clear()
    POLICY_LOSS_FN.register_module("recording_ppo_for_clip_test")(RecordingPPO)


STEP_TASKS = ["a"] * 4 + ["b"] * 4
STEP_REWARDS = [1.0, 0.0, 0.0, 0.5, 2.0, -1.0, 0.0, 1.0]
TEMPERATURE = 0.8


def step_exps() -> list[Experience]:
    """8 rows of two tasks; rows 0-3 carry (stale) rollout log-probs, rows 4-7 none; row 5
    has a masked-out response token."""
    out = []
    for i, (task, r) in enumerate(zip(STEP_TASKS, STEP_REWARDS, strict=True)):
        k = 3 + i % 4
        mask = [True] * k
        if i == 5:
            mask[1] = False
        out.append(
            Experience(
                tokens=[5 + i % 3, 6] + [7 + ((3 * i + j) % 11) for j in range(k)],
                prompt_length=2,
                reward=r,
                logprobs=[-0.3 - 0.2 * j for j in range(k)] if i < 4 else None,
                action_mask=mask,
                eid=EID(0, task, i),
            )
        )
    return out


def make_trainer(tmp_path: Path, tiny_model_path: str, algorithm: dict, **trainer: Any):
    from rftstream.config import config_from_dict
    from rftstream.runtime import prepare_run
    from rftstream.training.policy_trainer import PolicyTrainer
    from tests.integration._util import small_config

    data = small_config(tmp_path, tiny_model_path)
    data["model"]["max_response_tokens"] = 16
    data["buffer"]["train_batch_size"] = 8
    data["buffer"]["explorer_input"]["taskset"]["rollout_args"]["temperature"] = TEMPERATURE
    data["algorithm"] = {
        "policy_loss_fn": "recording_ppo_for_clip_test",
        "kl_loss_fn": "none",
        "entropy_loss_fn": "none",
        **algorithm,
    }
    data["trainer"] = {"ppo_micro_batch_size_per_gpu": 8, "balance_batch": False, **trainer}
    run = prepare_run(config_from_dict(data))
    return PolicyTrainer(run.cfg, run.model_path, run.algorithm)


def model_stats(tiny_model_path: str, exps: list[Experience]) -> list[tuple[np.ndarray, ...]]:
    """(logp, entropy, nec) of each response token, one unpadded forward per row (float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for e in exps:
            ids = e.tokens.long()
            logits = model(input_ids=ids[None]).logits[0].numpy()
            p = e.prompt_length
            out.append(ref_token_stats(logits[p - 1 : -1], ids[p:].numpy(), TEMPERATURE))
    return out


def count_calls(obj: Any, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(obj, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return original(*a, **k)

    setattr(obj, name, wrapped)
    return calls


@pytest.mark.parametrize("name", ["clipb", "clipv"])
def test_trainer_step_trains_on_the_clipped_mask(
    tmp_path: Path, tiny_model_path: str, name: str
) -> None:
    # bounds that clip some, not all, negative-advantage tokens of this batch and model
    mu = 0.3 if name == "clipb" else 4.5
    args = {"mu": mu} if name == "clipb" else {"mu": mu, "max_frac": 1.0}
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        {"algorithm_type": "grpo_verl", "advantage_fn": name, "advantage_fn_args": args},
    )
    assert trainer.reuse_old_logprob  # the old-log-prob pass is skipped: stats run instead
    stats_calls = count_calls(trainer, "_token_stats_no_grad")
    lp_calls = count_calls(trainer, "_logprobs_no_grad")
    exps = step_exps()
    ref = model_stats(tiny_model_path, exps)

    out = trainer.train_step(exps)

    assert stats_calls == [1] and lp_calls == []
    width = max(len(r[0]) for r in ref)
    mask = pad([e.action_mask.numpy().astype(float) for e in step_exps()], width).astype(bool)
    adv = ref_grpo(STEP_REWARDS, STEP_TASKS, 1e-6)[:, None] * mask
    lp = pad([r[0] for r in ref], width)
    h = pad([r[1] for r in ref], width)
    if name == "clipb":  # rollout log-probs where the row has them, else the model's
        rollout = [np.asarray(e.logprobs) for e in step_exps()[:4]]
        lp_b = pad(rollout + [r[0] for r in ref[4:]], width)
        want, *_ = ref_clipb(adv, lp_b, h, mask, mu)
    else:
        want, _ = ref_clipv(adv, lp, h, pad([r[2] for r in ref], width), mask, mu, 1.0)
    assert 0 < (mask & ~want).sum() < (mask & (adv < 0)).sum()  # some, not all, clipped

    (seen,) = SEEN  # one micro-batch, rows in batch order
    np.testing.assert_array_equal(seen["action_mask"].numpy().astype(bool), want)
    np.testing.assert_allclose(seen["advantages"].numpy(), adv, rtol=1e-5, atol=1e-6)
    # the gradient pass's log-probs are the model's own: the reference forward agrees
    np.testing.assert_allclose(seen["logprob"].numpy() * mask, lp * mask, atol=1e-4)
    np.testing.assert_array_equal(seen["old_logprob"].numpy(), seen["logprob"].numpy())
    assert out["advantage/frac_clipped"] == pytest.approx(
        ref_fracs(mask, want, adv)["frac_clipped"], abs=1e-6
    )


def test_the_stats_pass_serves_as_the_old_logprob_pass(
    tmp_path: Path, tiny_model_path: str
) -> None:
    trainer = make_trainer(
        tmp_path,
        tiny_model_path,
        {"algorithm_type": "grpo_verl", "advantage_fn": "clipb"},
        ppo_epochs=2,
    )
    assert not trainer.reuse_old_logprob
    stats_calls = count_calls(trainer, "_token_stats_no_grad")
    lp_calls = count_calls(trainer, "_logprobs_no_grad")
    trainer.train_step(step_exps())
    assert stats_calls == [1] and lp_calls == []
    first = SEEN[0]  # epoch 1: the weights have not moved, old == current
    np.testing.assert_allclose(first["old_logprob"].numpy(), first["logprob"].numpy(), atol=1e-5)


@pytest.mark.parametrize("algorithm_type", ["grpo", "grpo_verl"])
def test_no_extra_pass_without_an_entropy_advantage(
    tmp_path: Path, tiny_model_path: str, algorithm_type: str
) -> None:
    trainer = make_trainer(tmp_path, tiny_model_path, {"algorithm_type": algorithm_type})
    assert trainer.advantage_inputs == ()
    stats_calls = count_calls(trainer, "_token_stats_no_grad")
    lp_calls = count_calls(trainer, "_logprobs_no_grad")
    exps = step_exps()
    for e in exps:
        e.advantages = torch.zeros(e.response_length)
    trainer.train_step(exps)
    assert stats_calls == [] and lp_calls == []
    (seen,) = SEEN
    mask = np.zeros_like(seen["action_mask"].numpy())
    for i, e in enumerate(step_exps()):
        mask[i, : e.response_length] = e.action_mask.numpy()
    np.testing.assert_array_equal(seen["action_mask"].numpy(), mask)  # the mask is untouched


def test_a_pipeline_algorithm_rejects_a_trainer_advantage(
    tmp_path: Path, tiny_model_path: str
) -> None:
    with pytest.raises(ConfigError, match="grpo_verl") as info:
        make_trainer(tmp_path, tiny_model_path, {"algorithm_type": "grpo", "advantage_fn": "clipb"})
    assert "algorithm.advantage_fn" in str(info.value)
