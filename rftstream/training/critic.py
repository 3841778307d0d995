"""The critic (value model) of algorithms with ``use_critic`` (PPO).

:class:`ValueModel` is a causal-LM backbone with a scalar value head; the
value of response token ``j`` is read at the hidden state that predicts it
(column ``P - 1 + j``, as verl's critic), so ``values`` line up with the
actor's ``logprob``. :func:`value_loss` is verl's clipped value loss.
Everything here blocks (forward/backward); the trainer runs it in a worker
thread.
"""

from __future__ import annotations

from typing import Any

import torch

from rftstream.training.masked_reductions import masked_loss, masked_mean


class ValueModel(torch.nn.Module):
    """``backbone`` (an HF causal LM) plus ``value_head: Linear(hidden, 1)``.

    The head starts at zero weight and bias, so initial values are 0 and the
    first GAE advantages are the plain returns.
    """

    def __init__(self, backbone: Any) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_width: int,
    ) -> torch.Tensor:
        """Values of the response tokens, ``(batch, response_width)`` float32."""
        base = getattr(self.backbone, "base_model", self.backbone)  # no vocabulary logits
        out = base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        hidden = out.last_hidden_state
        width = input_ids.shape[1] - prompt_width
        h = hidden[:, prompt_width - 1 : prompt_width - 1 + width, :]
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's clipped value loss.

    ``vpredclipped = clip(vpreds, values - c, values + c)``; loss =
    ``0.5 * agg(max((vpreds - returns)^2, (vpredclipped - returns)^2))``.
    Metrics ``vf_loss``, ``vf_clipfrac`` (share of tokens where the clipped
    term is larger) and ``vpred_mean``. All tensors ``(batch, T)``.
    """
    clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * masked_loss(torch.maximum(l1, l2), response_mask, loss_agg_mode)
    clipfrac = masked_mean((l2 > l1).float(), response_mask)
    return loss, {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(clipfrac),
        "vpred_mean": float(masked_mean(vpreds.detach(), response_mask)),
    }
