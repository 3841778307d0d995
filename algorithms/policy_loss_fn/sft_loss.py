"""SFT (negative log-likelihood) loss."""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import masked_loss


@POLICY_LOSS_FN.register_module("sft")
class SFTLossFn(PolicyLossFn):
    """Negative log-likelihood of the unmasked response tokens.

    ``use_token_level_loss=True``: mean over all unmasked tokens of the batch
    (``token-mean``); False: mean over sequences of each sequence's token mean
    (``seq-mean-token-mean``; fully masked sequences are left out). The
    configured ``loss_agg_mode`` is stored but, as in Trinity-RFT, not used.
    Metric ``sft_loss``.
    """

    def __init__(self, use_token_level_loss: bool = True, backend: str = "verl", **kwargs) -> None:
        super().__init__(backend=backend, **kwargs)
        self.use_token_level_loss = bool(use_token_level_loss)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        action_mask: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        mode = "token-mean" if self.use_token_level_loss else "seq-mean-token-mean"
        sft_loss = masked_loss(-logprob, action_mask, loss_agg_mode=mode)
        return sft_loss, {"sft_loss": sft_loss.detach().item()}

    @classmethod
    def default_args(cls) -> dict:
        return {"use_token_level_loss": True}
