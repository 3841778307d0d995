"""How often a model answers tasks right, sampled with the transformers engine's sampler.

:func:`evaluate_accuracy` is how the tiny model's tests (and anyone checking a model
against a taskset of question/answer rows) measure it. Blocks; no NATS.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rftstream.engines.transformers_engine import SequenceSpec, sample_sequences
from rftstream.model_loading import quiet_progress_bars

__all__ = ["evaluate_accuracy"]


def evaluate_accuracy(
    model_dir: str | Path,
    tasks: Sequence[dict[str, Any]],
    n_samples: int,
    temperature: float = 1.0,
    *,
    seed: int = 0,
    max_tokens: int = 8,
    prompt_key: str = "question",
    response_key: str = "answer",
) -> float:
    """Fraction of sampled answers equal to the truth (``n_samples`` per task). Blocks.

    Prompts are rendered like ``math_workflow`` does by default (one user
    message, chat template, generation prompt); a sample is correct when its
    text without special tokens, stripped, equals ``task[response_key]``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if n_samples < 1 or not tasks:
        raise ValueError("evaluate_accuracy needs tasks and n_samples >= 1")
    with quiet_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    eos = {int(tokenizer.eos_token_id)}
    gen = torch.Generator().manual_seed(seed)
    seqs, truths = [], []
    for task in tasks:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": str(task[prompt_key])}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(n_samples):
            seqs.append(
                SequenceSpec(prompt=ids, max_new_tokens=max_tokens, temperature=temperature)
            )
            truths.append(str(task[response_key]).strip())
    correct = 0
    chunk = 512
    for start in range(0, len(seqs), chunk):
        comps = sample_sequences(
            model,
            seqs[start : start + chunk],
            eos_token_ids=eos,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
        )
        for comp, truth in zip(comps, truths[start : start + chunk], strict=True):
            correct += tokenizer.decode(comp.token_ids, skip_special_tokens=True).strip() == truth
    return correct / len(seqs)
