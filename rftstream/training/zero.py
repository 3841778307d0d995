"""Whole weights out of a DeepSpeed engine, whatever its ZeRO stage.

Under ZeRO stage 3 every parameter of the engine's module is partitioned
across the ranks: outside a forward pass ``param.data`` is an empty tensor of
shape ``(0,)`` and the real shape is ``param.ds_shape``. ``module.state_dict()``
then holds those empty tensors, and so would a checkpoint or a weight sync
built from it. :func:`full_state_dict` gathers each partitioned parameter (one
at a time, so at most one whole parameter is materialised besides the copy
being built) and copies it to the CPU; :func:`embedding_rows` reads the
vocabulary size from the module's structure instead of its (possibly empty)
weight.

Stages 0 to 2 keep whole parameters on every rank: nothing is gathered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def is_partitioned(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (its data may be a partition, or empty)."""
    return hasattr(param, "ds_id")


def full_state_dict(
    module: torch.nn.Module,
    dtype: torch.dtype | None = None,
    include: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor whole, detached, contiguous and on the CPU
    (and of ``dtype``, when given: floating-point tensors are converted in the same copy;
    only the keys ``include`` accepts, when given).

    ZeRO-3 parameters are gathered with ``deepspeed.zero.GatheredParameters``
    (every rank receives the whole tensor). Keys that name the same parameter
    (tied embeddings) get separate copies, as safetensors requires.

    Blocks. Under ZeRO-3 this is a collective operation: every rank of the
    engine's process group must call it, in the same order as the others.

    Raises:
        RuntimeError: a gathered parameter does not have the shape DeepSpeed
            recorded for it (``ds_shape``).
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    state = module.state_dict()
    if include is not None:
        state = {k: v for k, v in state.items() if include(k)}

    def cpu(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.detach().to("cpu", dtype=dtype, copy=True).contiguous()
        return t.detach().to("cpu", copy=True).contiguous()

    if not any(is_partitioned(p) for p in params.values()):
        return {k: cpu(v) for k, v in state.items()}
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # id(param) -> its whole CPU copy
    for key, value in state.items():
        param = params.get(key)  # None: a buffer
        if param is None or not is_partitioned(param):
            out[key] = cpu(value)
            continue
        whole = gathered.get(id(param))
        if whole is None:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                whole = cpu(param.data)
            expected = tuple(param.ds_shape)
            if tuple(whole.shape) != expected:
                raise RuntimeError(
                    f"gathering ZeRO-3 parameter {key}: got shape {tuple(whole.shape)}, "
                    f"DeepSpeed recorded {expected}"
                )
            gathered[id(param)] = whole
            out[key] = whole
        else:
            out[key] = whole.clone()  # a tied key: its own storage
    return out


def tied_aliases(module: torch.nn.Module) -> set[str]:
    """Names of ``module``'s parameters that are another, earlier-named parameter (tied
    weights: ``lm_head.weight`` of a model whose output layer is its input embedding).

    A checkpoint leaves them out, as ``save_pretrained`` does on its own: loading
    ties them again. (A state dict of copies, as :func:`full_state_dict` returns,
    no longer shows the tie, so the caller drops these keys.)
    """
    seen: set[int] = set()
    aliases: set[str] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def embedding_rows(model: torch.nn.Module) -> int:
    """How many token ids ``model``'s input embedding has rows for (valid ids are
    ``0 .. n - 1``).

    Read from the embedding module (``num_embeddings``), which partitioning leaves
    alone, else from the config's ``vocab_size``; never from the weight's shape,
    which is ``(0,)`` for a ZeRO-3 partitioned parameter.

    Raises:
        ValueError: the model has neither, or they give no positive size.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if rows is None:
        rows = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(rows, int) or rows <= 0:
        raise ValueError(
            f"cannot tell the vocabulary size of {type(model).__name__}: its input embedding "
            f"has no num_embeddings and its config no positive vocab_size (got {rows!r})"
        )
    return rows
