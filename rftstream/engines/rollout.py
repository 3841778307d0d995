"""The explorer's rollout side in one place: engine, ModelWrapper and auxiliary models.

Used by the explorer actor and by ``rftstream debug workflow``, so both build
the model a workflow sees the same way.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    from rftstream.config.schema import Config
    from rftstream.engines.model_wrapper import ModelWrapper


def rollout_seed(cfg: Config) -> int:
    """The rollout engines' seed: ``explorer.rollout_model.seed``, or the run's ``seed``
    where that is not set."""
    seed = cfg.explorer.rollout_model.seed
    return int(cfg.seed if seed is None else seed)


@asynccontextmanager
async def rollout_model(
    cfg: Config, model_path: str, *, engine: Any = None
) -> AsyncIterator[tuple[ModelWrapper, list[Any], float]]:
    """``(model, auxiliary clients, engine load seconds)`` for the duration of the block.

    Builds the engine of ``explorer.rollout_model`` (``create_engine``; for
    ``openai`` with its ``base_url`` / ``api_key``) unless ``engine`` is given,
    wraps it in a :class:`ModelWrapper` with the ``model`` limits and the
    history / OpenAI-API flags, starts ``explorer.auxiliary_models`` when there
    are any, and runs the engine until the block exits; then the OpenAI server,
    the auxiliary models and the engine are closed (shielded from cancellation).
    Loading blocks a worker thread, not the event loop.
    """
    from rftstream.engines import create_engine
    from rftstream.engines.model_wrapper import ModelWrapper

    rm = cfg.explorer.rollout_model
    seed = rollout_seed(cfg)
    t0 = time.perf_counter()
    if engine is None:
        kwargs: dict[str, Any] = {
            "max_batch_size": rm.max_batch_size,
            "batch_wait_ms": rm.batch_wait_ms,
            "seed": seed,
            "dtype": cfg.model.dtype,
            "default_max_tokens": cfg.model.max_response_tokens,
        }
        kind = (rm.engine_type or "").lower()
        if kind == "transformers":  # a second copy of the model, made at the first staged sync
            kwargs["double_buffer"] = cfg.synchronizer.double_buffer
        if kind == "openai":
            kwargs.update(base_url=rm.base_url, api_key=rm.api_key)
        elif kind == "vllm":
            kwargs.update(
                tensor_parallel_size=rm.tensor_parallel_size,
                max_model_len=cfg.model.max_model_len,
                gpu_memory_utilization=rm.gpu_memory_utilization,
                enforce_eager=rm.enforce_eager,
                enable_prefix_caching=rm.enable_prefix_caching,
                logprobs_mode=rm.logprobs_mode,
                engine_kwargs=dict(rm.engine_kwargs),
            )
        engine = await anyio.to_thread.run_sync(
            lambda: create_engine(rm.engine_type, model_path, **kwargs)
        )
    engine_s = time.perf_counter() - t0
    model = ModelWrapper(
        engine,
        model_path=model_path,
        enable_history=rm.enable_history,
        max_response_tokens=cfg.model.max_response_tokens,
        max_prompt_tokens=cfg.model.max_prompt_tokens,
        enable_openai_api=rm.enable_openai_api,
        api_key=rm.api_key,
    )
    async with AsyncExitStack() as stack:
        stack.push_async_callback(_aclose, engine)
        stack.push_async_callback(_aclose, model)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        await tg.start(engine.run)
        aux: list[Any] = []
        if cfg.explorer.auxiliary_models:
            from rftstream.engines.auxiliary_models import serve_auxiliary_models

            aux = await stack.enter_async_context(
                serve_auxiliary_models(
                    cfg.explorer.auxiliary_models, dtype=cfg.model.dtype, seed=seed
                )
            )
        yield model, aux, engine_s


async def _aclose(obj: Any) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await obj.aclose()
        except Exception:  # noqa: BLE001 - closing must not hide the result
            pass
