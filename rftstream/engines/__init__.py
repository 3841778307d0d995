"""Rollout engines behind one interface (:class:`RolloutEngine`) and the workflow-facing
:class:`ModelWrapper`.

``create_engine(engine_type, path, ...)`` builds ``transformers`` (the embedded
engine), ``vllm`` (vLLM's async engine on CUDA GPUs, the ``rftstream[vllm]``
extra) or ``openai`` (a client of any OpenAI-compatible server). Importing this
package does not import ``transformers``, ``vllm``, ``openai`` or ``aiohttp``
(engine modules are imported on use).
The OpenAI-compatible server of a model is
:class:`~rftstream.engines.openai_server.OpenAIServer` (started by
``ModelWrapper.get_openai_client()``); ``explorer.auxiliary_models`` are
started by :func:`~rftstream.engines.auxiliary_models.serve_auxiliary_models`.
"""

from __future__ import annotations

from typing import Any

from rftstream.engines.base import Completion, RolloutEngine, SamplingParams, TokenScores
from rftstream.errors import RftError

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "TokenScores", "create_engine"]


def create_engine(engine_type: str, model_path: str, **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine named by ``explorer.rollout_model.engine_type``. Blocks (loads the model / tokenizer).

    ``kwargs`` go to the engine. ``transformers``: ``max_batch_size``,
    ``batch_wait_ms``, ``dtype``, ``seed``, ``device``, ``torch_threads``,
    ``default_max_tokens``. ``vllm``: ``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ``seed``,
    ``enforce_eager``, ``enable_prefix_caching``, ``max_batch_size`` (vLLM's
    ``max_num_seqs``), ``default_max_tokens``, ``max_logprobs``,
    ``logprobs_mode``, ``engine_kwargs`` (more ``vllm.AsyncEngineArgs``) and
    more (see :class:`~rftstream.engines.vllm_engine.VLLMEngine`); the other
    transformers-only keys are accepted and ignored. ``openai``: ``base_url``
    and ``api_key`` (``explorer.rollout_model.base_url`` / ``api_key``),
    ``served_model_name``, ``max_concurrency``, ``timeout``,
    ``default_max_tokens``; the transformers-only keys are accepted and
    ignored. Raises :class:`RftError` for unknown engine types, and for
    ``vllm`` when the vLLM package cannot be imported (the message names the
    extra to install).
    """
    kind = (engine_type or "transformers").lower()
    if kind == "transformers":
        from rftstream.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model_path, **kwargs)
    if kind == "vllm":
        from rftstream.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **kwargs)
    if kind == "openai":
        from rftstream.engines.openai_engine import OpenAIEngine

        return OpenAIEngine(model_path, **kwargs)
    raise RftError(
        f"explorer.rollout_model.engine_type: unknown engine {engine_type!r}; available: "
        "'transformers', 'vllm', 'openai'"
    )
