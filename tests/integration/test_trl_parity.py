"""One training step of rftstream's default run equals one step of the TRL that
``benchmarks/vs_trl.py`` runs beside it, on the same batch and the same weights.

The benchmark compares seconds and steps to a reward threshold; a reader must be able
to trust that both sides run the same algorithm, so that the steps differ only by what
was sampled and how stale it was. Here the same 64 rows (8 prompts x 8 replies of 32-48
tokens, continuous rewards) go through

* rftstream: the embedded default config (``rftstream up`` with no config) resolved
  as ``up`` resolves it, its GRPO advantage operator and its :class:`PolicyTrainer`
  (real DeepSpeed, the lean forward); the rows carry no rollout log-probs, i.e. they
  are on-policy, as every TRL row is;
* TRL: ``GRPOTrainer`` with the benchmark's own ``GRPOConfig``
  (``vs_trl.trl_grpo_config``), its loss (``_compute_loss``), then the gradient clip
  and the optimizer its trainer builds (``create_optimizer``).

Checked: the advantages (TRL's formula, ``(r - mean) / (std + 1e-4)`` per group, where
rftstream's GRPO divides by ``std + 1e-6``), the loss, every parameter's gradient, the
optimizer's settings and the weights after the step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import pytest
import torch

from algorithms.advantage_fn.grpo_advantage import GRPOGroupedAdvantage
from rftstream.config import apply_overrides, config_from_dict
from rftstream.default_run import DEFAULT_CONFIG
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run
from rftstream.training.policy_trainer import PolicyTrainer
from tests.unit._util import load_script

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, REPLIES = 8, 8


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(ROOT / "benchmarks" / "vs_trl.py", "vs_trl")


def _rows(tokenizer: object) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, reply ids, reward): the benchmark's prompts in the chat template,
    replies of 32-48 random byte tokens (an end token closes those under 48)."""
    from rftstream.tiny_model import arithmetic_problems

    gen = torch.Generator().manual_seed(0)
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    rows = []
    for i, (question, _answer) in enumerate(arithmetic_problems()[:PROMPTS]):
        prompt = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        for _ in range(REPLIES):
            n = 32 + int(torch.randint(0, 17, (1,), generator=gen))
            reply = torch.randint(4, 260, (n,), generator=gen).tolist()
            if n < 48:
                reply[-1] = eos
            rows.append((prompt, reply, float(torch.rand((), generator=gen)) * (1 + i % 3)))
    return rows


# both sides clip at this instead of their shared default (1.0, checked below): the tiny
# model's gradient norm here depends on the machine that built it (0.56 on one, above 1
# on another), and the clip must act for the comparison to cover it
CLIP = 0.1


def _rftstream_trainer(tmp_path: Path) -> tuple[PolicyTrainer, str]:
    data = apply_overrides(
        copy.deepcopy(DEFAULT_CONFIG),
        ["model.max_response_tokens=48", f"trainer.grad_clip={CLIP}"],
    )
    run = prepare_run(config_from_dict(data), run_dir=str(tmp_path / "run"))
    return PolicyTrainer(run.cfg, run.model_path, run.algorithm), run.model_path


def test_a_step_of_the_default_run_is_a_step_of_the_benchmarks_trl(
    tmp_path: Path, bench: ModuleType
) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer  # the test extra installs it (rftstream[bench])

    ours, model_path = _rftstream_trainer(tmp_path)
    assert ours.reuse_old_logprob  # one optimizer step a batch: on-policy ratios are 1
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = _rows(tokenizer)

    # advantages: rftstream's GRPO operator against TRL's formula
    exps = [
        Experience(
            tokens=prompt + reply,
            prompt_length=len(prompt),
            reward=reward,
            logprobs=None,
            eid=EID(0, f"task{i // REPLIES}", i % REPLIES),
        )
        for i, (prompt, reply, reward) in enumerate(rows)
    ]
    exps, _ = GRPOGroupedAdvantage().process(exps)
    exps.sort(key=lambda e: (int(e.eid.task[4:]), e.eid.run))
    rewards = torch.tensor([r for _, _, r in rows]).view(PROMPTS, REPLIES)
    trl_adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    ours_adv = torch.tensor([float(e.advantages[0]) for e in exps])
    torch.testing.assert_close(ours_adv, trl_adv.view(-1), rtol=1e-3, atol=1e-4)
    assert all(bool((e.advantages == e.advantages[0]).all()) for e in exps)

    start = {k: v.detach().clone() for k, v in ours.engine.module.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    step = ours._optimizer_step

    def capture(engine: object) -> None:
        module = engine.module  # type: ignore[attr-defined]
        grads.update({k: p.grad.detach().clone() for k, p in module.named_parameters()})
        step(engine)

    ours._optimizer_step = capture  # type: ignore[method-assign]
    metrics = ours.train_step(exps)

    # TRL: the benchmark's config, the same weights and rows
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing = model.load_state_dict(start, strict=False).missing_keys
    assert missing == ["lm_head.weight"] and model.config.tie_word_embeddings
    config = bench.trl_grpo_config(bench.WORKLOADS["genheavy"], str(tmp_path / "trl"), 1, 0)
    default_clip = config_from_dict(copy.deepcopy(DEFAULT_CONFIG)).trainer.grad_clip
    assert config.max_grad_norm == default_clip  # the benchmark clips as the default run
    config.max_grad_norm = CLIP
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "unused"}] * 8),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop
    pad = tokenizer.pad_token_id
    width_p = max(len(p) for p, _, _ in rows)
    width_c = max(len(c) for _, c, _ in rows)
    prompt_ids = torch.full((len(rows), width_p), pad)
    prompt_mask = torch.zeros((len(rows), width_p), dtype=torch.long)
    completion_ids = torch.full((len(rows), width_c), pad)
    completion_mask = torch.zeros((len(rows), width_c), dtype=torch.long)
    for i, (prompt, reply, _) in enumerate(rows):  # prompts left-padded, replies right
        prompt_ids[i, width_p - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, width_p - len(prompt) :] = 1
        completion_ids[i, : len(reply)] = torch.tensor(reply)
        completion_mask[i, : len(reply)] = 1
    model.train()
    loss = trainer._compute_loss(
        model,
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": ours_adv,  # the same as TRL's to 1e-4 (above): the loss is compared
            "num_items_in_batch": completion_mask.sum(),
            "old_per_token_logps": None,
        },
    )
    loss.backward()
    loss = loss.detach()
    trl_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    trainer.create_optimizer()
    trainer.optimizer.step()

    assert abs(metrics["actor/pg_loss"] - float(loss)) < 1e-4 * max(1.0, abs(float(loss)))
    assert abs(metrics["actor/grad_norm"] - float(norm)) < 1e-4 * float(norm)
    assert float(norm) > config.max_grad_norm  # the clip acts on both sides
    assert sorted(trl_grads) == sorted(grads)
    for name, g in trl_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)

    # the optimizers: AdamW with the same settings, the same clip
    ours_group = ours.optimizer.param_groups[0]
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    for group in trainer.optimizer.param_groups:
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert group[key] == pytest.approx(ours_group[key]), key
    assert config.max_grad_norm == ours.cfg.trainer.grad_clip

    # the weights after the step; Adam's first step is lr * g / (|g| + eps) per element,
    # so where |g| is near eps (1e-8) rounding alone moves it (k_proj's bias, for one,
    # has a gradient of zero up to rounding: softmax ignores a shift of every score):
    # compare the others, nearly all of them
    after_ours = dict(ours.engine.module.named_parameters())
    moved, compared, total = 0.0, 0, 0
    for name, p in model.named_parameters():
        if name not in after_ours:
            continue
        well_conditioned = trl_grads[name].abs() > 1e-6
        compared += int(well_conditioned.sum())
        total += well_conditioned.numel()
        torch.testing.assert_close(
            after_ours[name].detach()[well_conditioned],
            p.detach()[well_conditioned],
            rtol=0,
            atol=1e-7,
            msg=name,
        )
        moved = max(moved, float((p.detach() - start[name]).abs().max()))
    assert compared > 0.97 * total
    assert moved == pytest.approx(2e-4, rel=0.01)  # lr: the step did move the weights
