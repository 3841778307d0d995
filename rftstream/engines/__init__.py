"""Rollout engines behind one interface (:class:`RolloutEngine`) and the workflow-facing
:class:`ModelWrapper`.

``create_engine("transformers", path, ...)`` builds the embedded engine; ``vllm``
and ``openai`` arrive in a later version. Importing this package does not import
``transformers`` (engine modules are imported on use).
"""

from __future__ import annotations

from typing import Any

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams
from rftstream.errors import RftError

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "create_engine"]

_LATER = {
    "vllm": "the vLLM engine (GPU) arrives in a later version of rftstream",
    "openai": "the OpenAI-compatible client engine arrives in a later version of rftstream",
}


def create_engine(engine_type: str, model_path: str, **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine named by ``explorer.rollout_model.engine_type``. Blocks (loads the model).

    ``kwargs`` go to the engine (for ``transformers``: ``max_batch_size``,
    ``batch_wait_ms``, ``dtype``, ``seed``, ``device``, ``torch_threads``,
    ``default_max_tokens``). Raises :class:`RftError` for unknown or not yet
    available engine types.
    """
    kind = (engine_type or "transformers").lower()
    if kind == "transformers":
        from rftstream.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model_path, **kwargs)
    if kind in _LATER:
        raise RftError(
            f"explorer.rollout_model.engine_type: {kind!r}: {_LATER[kind]}; use 'transformers'"
        )
    raise RftError(
        f"explorer.rollout_model.engine_type: unknown engine {engine_type!r}; available: 'transformers' "
        f"('vllm' and 'openai' arrive in a later version)"
    )
