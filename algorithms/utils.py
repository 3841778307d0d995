"""Masked reductions and loss aggregation for algorithm components (Trinity-RFT's
``trinity.algorithm.utils``).

The trainer computes with the same functions, so they live in the core,
:mod:`rftstream.training.masked_reductions`; this module re-exports them under the
name algorithm code (and the seeds' plugins) import.
"""

from rftstream.training.masked_reductions import (
    LOSS_AGG_MODES,
    aggregate_loss,
    check_loss_agg_mode,
    masked_count,
    masked_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    prefix_metrics,
    whole_batch,
)

__all__ = [
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "check_loss_agg_mode",
    "masked_count",
    "masked_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "prefix_metrics",
    "whole_batch",
]
