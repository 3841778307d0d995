"""SFT (negative log-likelihood) loss."""

from __future__ import annotations

import torch

from algorithms.policy_loss_fn.policy_loss_fn import POLICY_LOSS_FN, PolicyLossFn
from algorithms.utils import check_loss_agg_mode, masked_loss


def token_level_mode(use_token_level_loss: bool) -> str:
    """The ``loss_agg_mode`` an older Trinity-RFT ``use_token_level_loss`` flag stood for.

    True: ``token-mean``; False: ``seq-mean-token-mean``.
    """
    return "token-mean" if use_token_level_loss else "seq-mean-token-mean"


@POLICY_LOSS_FN.register_module("sft")
class SFTLossFn(PolicyLossFn):
    """Negative log-likelihood of the unmasked response tokens, aggregated with ``loss_agg_mode``.

    As in Trinity-RFT 0.6: ``loss = masked_loss(-logprob, action_mask,
    loss_agg_mode)`` (``algorithm.loss_agg_mode`` reaches it unless
    ``policy_loss_fn_args`` set their own). ``use_token_level_loss`` (the
    pre-0.6 flag) is still accepted: when given it overrides the mode (True:
    ``token-mean``, False: ``seq-mean-token-mean``). Metric ``sft_loss``.
    Raises ValueError for an unknown ``loss_agg_mode``.
    """

    def __init__(
        self,
        backend: str = "verl",
        loss_agg_mode: str = "token-mean",
        use_token_level_loss: bool | None = None,
        **kwargs,
    ) -> None:
        if use_token_level_loss is not None:
            loss_agg_mode = token_level_mode(bool(use_token_level_loss))
        super().__init__(
            backend=backend, loss_agg_mode=check_loss_agg_mode(loss_agg_mode), **kwargs
        )
        self.use_token_level_loss = use_token_level_loss

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        action_mask: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, dict]:
        sft_loss = masked_loss(-logprob, action_mask, loss_agg_mode=self.loss_agg_mode)
        return sft_loss, {"sft_loss": sft_loss.detach().item()}

    @classmethod
    def default_args(cls) -> dict:
        return {"loss_agg_mode": "token-mean"}
