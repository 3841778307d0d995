"""Rollout engines behind one interface (:class:`RolloutEngine`) and the workflow-facing
:class:`ModelWrapper`.

``create_engine(engine_type, path, ...)`` builds ``transformers`` (the embedded
engine) or ``openai`` (a client of any OpenAI-compatible server); ``vllm``
arrives in a later version. Importing this package does not import
``transformers``, ``openai`` or ``aiohttp`` (engine modules are imported on use).
The OpenAI-compatible server of a model is
:class:`~rftstream.engines.openai_server.OpenAIServer` (started by
``ModelWrapper.get_openai_client()``); ``explorer.auxiliary_models`` are
started by :func:`~rftstream.engines.openai_server.serve_auxiliary_models`.
"""

from __future__ import annotations

from typing import Any

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams, TokenScores
from rftstream.errors import RftError

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "TokenScores", "create_engine"]

_LATER = {
    "vllm": "the vLLM engine (GPU) arrives in a later version of rftstream",
}


def create_engine(engine_type: str, model_path: str, **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine named by ``explorer.rollout_model.engine_type``. Blocks (loads the model / tokenizer).

    ``kwargs`` go to the engine. ``transformers``: ``max_batch_size``,
    ``batch_wait_ms``, ``dtype``, ``seed``, ``device``, ``torch_threads``,
    ``default_max_tokens``. ``openai``: ``base_url`` and ``api_key``
    (``explorer.rollout_model.base_url`` / ``api_key``), ``served_model_name``,
    ``max_concurrency``, ``timeout``, ``default_max_tokens``; the
    transformers-only keys are accepted and ignored. Raises :class:`RftError`
    for unknown or not yet available engine types.
    """
    kind = (engine_type or "transformers").lower()
    if kind == "transformers":
        from rftstream.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model_path, **kwargs)
    if kind == "openai":
        from rftstream.engines.openai_engine import OpenAIEngine

        return OpenAIEngine(model_path, **kwargs)
    if kind in _LATER:
        raise RftError(
            f"explorer.rollout_model.engine_type: {kind!r}: {_LATER[kind]}; use 'transformers'"
        )
    raise RftError(
        f"explorer.rollout_model.engine_type: unknown engine {engine_type!r}; available: "
        "'transformers', 'openai' ('vllm' arrives in a later version)"
    )
