"""Helpers shared by the unit tests that train the tiny model with the real DeepSpeed
trainer (:class:`rftstream.training.engine.PolicyTrainer`): a small experience, and the
gradients of an optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rftstream.experience import EID, Experience

if TYPE_CHECKING:
    import torch

    from rftstream.training.engine import PolicyTrainer


def short_exp(i: int) -> Experience:
    """Experience ``i``: 2 prompt and 3 response tokens varying with ``i``, reward ``i % 2``,
    advantage 1 (reward 0) or 0.5 (reward 1), logprobs 0, task ``t<i>``."""
    tokens = [5 + i % 7, 6] + [7 + (i + j) % 9 for j in range(3)]
    return Experience(
        tokens=tokens,
        prompt_length=2,
        reward=float(i % 2),
        logprobs=[0.0] * 3,
        advantages=[1.0 - 0.5 * (i % 2)] * 3,
        eid=EID(0, f"t{i}", 0),
    )


def capture_gradients(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Wrap ``trainer``'s engine step; the returned dict then holds, by parameter name, a CPU
    copy of the accumulated gradients at each optimizer boundary (with ``use_dynamic_bsz``
    every ``step()`` is one: accumulation is unmanaged), the last boundary's winning."""
    grads: dict[str, torch.Tensor] = {}
    engine = trainer.engine
    original = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if trainer.dynamic_bsz or engine.is_gradient_accumulation_boundary():
            for name, p in engine.module.named_parameters():
                if p.grad is not None:
                    grads[name] = p.grad.detach().clone().cpu()
        return original(*args, **kwargs)

    engine.step = step  # type: ignore[method-assign]
    return grads
