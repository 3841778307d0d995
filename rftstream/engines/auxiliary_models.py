"""``explorer.auxiliary_models``: more models beside the policy, each behind an OpenAI API.

:func:`serve_auxiliary_models` gives a workflow one ``openai.OpenAI`` client per
entry: a local model gets its own rollout engine, :class:`ModelWrapper` and
:class:`~rftstream.engines.openai_server.OpenAIServer`; an entry with a
``base_url`` is just a client of that server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from rftstream.engines.model_wrapper import ModelWrapper
from rftstream.errors import RftError


def _auxiliary_model_path(index: int, model_path: str) -> str:
    """The local directory of ``explorer.auxiliary_models[index]``; builds the tiny model for
    ``builtin:tiny``. Blocks. RftError naming the entry when the directory does not exist."""
    from rftstream.shaped_models import resolve_builtin

    if model_path.startswith("builtin:"):
        built = resolve_builtin(model_path, f"explorer.auxiliary_models[{index}].model_path")
        assert built is not None
        return built
    if not Path(model_path).is_dir():
        raise RftError(
            f"explorer.auxiliary_models[{index}].model_path: no such directory {model_path!r} "
            "(models are loaded from local paths; builtin:tiny is the embedded tiny model)"
        )
    return model_path


@contextlib.asynccontextmanager
async def serve_auxiliary_models(
    configs: Sequence[Any],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 42,
) -> AsyncIterator[list[Any]]:
    """Start ``explorer.auxiliary_models`` and yield one ``openai.OpenAI`` client per entry.

    An entry with ``model_path`` (and no ``base_url``) gets its own rollout
    engine (``engine_type``, default ``transformers``) and its own
    :class:`OpenAIServer` on another loopback port; its ``max_response_tokens``
    and ``temperature`` are the server's defaults for requests that omit
    them. An entry with ``base_url`` just gets a client for that server. Every
    client has ``model_path`` set to the model name to pass as ``model=``
    (``name``, else ``model_path``). ``model_path: builtin:tiny`` is the
    embedded tiny model (built and cached on first use, as for
    ``model.model_path``). Loading blocks a worker thread; on exit the servers
    and engines stop. Raises :class:`RftError` naming the entry for one with
    neither key or with a ``model_path`` that is not a directory.
    """
    import openai

    from rftstream.engines import create_engine

    for i, cfg in enumerate(configs):
        if not cfg.model_path and not cfg.base_url:
            raise RftError(
                f"explorer.auxiliary_models[{i}]: set `model_path` (served here) "
                "or `base_url` (an external OpenAI-compatible server)"
            )
    paths = {  # before anything starts: a wrong path is one plain error
        i: await anyio.to_thread.run_sync(_auxiliary_model_path, i, cfg.model_path)
        for i, cfg in enumerate(configs)
        if not cfg.base_url
    }
    clients: list[Any] = []
    wrappers: list[ModelWrapper] = []
    engines: list[Any] = []
    async with anyio.create_task_group() as tg:
        try:
            for i, cfg in enumerate(configs):
                name = cfg.name or cfg.model_path
                if cfg.base_url:
                    client = openai.OpenAI(base_url=cfg.base_url, api_key=cfg.api_key or "EMPTY")
                    client.model_path = name  # type: ignore[attr-defined]
                    clients.append(client)
                    continue
                path = paths[i]
                engine = await anyio.to_thread.run_sync(
                    lambda c=cfg, p=path: create_engine(
                        c.engine_type,
                        p,
                        dtype=dtype,
                        device=device,
                        seed=seed,
                        default_max_tokens=c.max_response_tokens,
                    )
                )
                engines.append(engine)
                await tg.start(engine.run)
                wrapper = ModelWrapper(
                    engine,
                    model_path=path,
                    max_response_tokens=cfg.max_response_tokens,
                    default_temperature=cfg.temperature,
                    served_model_name=name,
                )
                wrappers.append(wrapper)
                await wrapper.start_openai_server()
                clients.append(wrapper.get_openai_client())
            yield clients
        finally:
            with anyio.CancelScope(shield=True):
                for c in clients:
                    with contextlib.suppress(Exception):
                        c.close()
                for w in wrappers:
                    await w.aclose()
                for e in engines:
                    with contextlib.suppress(Exception):
                        await e.aclose()
            tg.cancel_scope.cancel()
