"""Helpers shared by the unit tests that train the tiny model with the real DeepSpeed
trainer (:class:`rftstream.training.policy_trainer.PolicyTrainer`): a small experience, the
gradients of an optimizer step, and the reference they are checked against (one unpadded
forward of a plain ``transformers`` model per row)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rftstream.experience import EID, Experience

if TYPE_CHECKING:
    from rftstream.training.policy_trainer import PolicyTrainer


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


def row_logprobs(model: torch.nn.Module, e: Experience) -> torch.Tensor:
    """log p(response token j) of experience ``e`` under ``model``: one unpadded forward,
    with the graph (``backward()`` of an objective built on it fills ``model``'s grads)."""
    ids = e.tokens.to(torch.long).unsqueeze(0)
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    p = e.prompt_length
    return logp[p - 1 : ids.shape[1] - 1].gather(-1, ids[0, p:].unsqueeze(-1)).squeeze(-1)


def assert_gradients_match(grads: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """``grads`` (from :func:`capture_gradients`) hold every parameter gradient that
    ``model``'s own ``backward()`` filled, and those gradients, flattened, agree with
    them (relative 1e-3); a zero reference gradient fails (it would prove nothing)."""
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(want) <= set(grads)
    flat_want = torch.cat([want[n].reshape(-1) for n in sorted(want)])
    flat_got = torch.cat([grads[n].reshape(-1) for n in sorted(want)])
    assert float(flat_want.norm()) > 0
    torch.testing.assert_close(
        flat_got, flat_want, rtol=1e-3, atol=1e-5 * float(flat_want.abs().max())
    )
