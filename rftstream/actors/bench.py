"""``mode: bench``: the explorer evaluates a model and its saved checkpoints; nothing is trained.

Trinity-RFT's benchmark mode, run by the explorer actor (``rftstream up`` starts
only an explorer in this mode, ``rftstream explorer`` does the same against an
existing NATS). :func:`run_bench`:

1. evaluates every ``buffer.explorer_input.eval_tasksets`` entry with the
   given model (``model.model_path``, or the external server of
   ``explorer.rollout_model.engine_type: openai``): step 0;
2. then, when the engine can load weights, each checkpoint the trainer saved
   under the run's checkpoint directory (``<checkpoint_root_dir>/<project>/<name>``,
   or ``<run_dir>/checkpoints``: directories ``global_step_<N>`` in HF
   safetensors format), in step order, with step ``N`` and weight version ``N``.
   With ``explorer.bench_on_latest_checkpoint`` only the newest checkpoint is
   evaluated (the given model when there is none). The ``openai`` engine
   cannot load weights: checkpoints are skipped with a warning.

Each evaluation is the explorer's own (:meth:`Evaluator.evaluate
<rftstream.actors.evaluation.Evaluator.evaluate>`): the
``eval/<taskset>/...`` metrics on ``metrics.<explorer>`` and one record in
``<run_dir>/eval.jsonl``, here with ``"bench": true`` and ``"checkpoint"``
(the directory, or null for the given model). KV claims ``bench.step.<N>``
make one explorer evaluate each step; an evaluation that is cancelled or
fails releases its claim (deletes the key), so a later explorer evaluates
that step instead of skipping it. At the end the run status becomes
``finished``. Blocks until done; cancelling stops after the current await
(the steps already evaluated keep their claims and records).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

from rftstream.actors.evaluation import Evaluator
from rftstream.bus.state import RunState
from rftstream.config.schema import Config
from rftstream.control.liveness import heartbeat_loop
from rftstream.errors import RftError
from rftstream.weights import checkpoint_dir
from rftstream.wire import Heartbeat

log = logging.getLogger(__name__)

__all__ = ["checkpoint_dir", "find_checkpoints", "load_hf_state_dict", "run_bench"]

KV_BENCH_STEP = "bench.step.{step}"
_STEP_DIR = re.compile(r"global_step_(\d+)")


def find_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete ``global_step_<N>`` checkpoint, by step. Blocks."""
    if not directory.is_dir():
        return []
    out = []
    for child in directory.iterdir():
        m = _STEP_DIR.fullmatch(child.name)
        if m and child.is_dir() and any(child.glob("*.safetensors")):
            out.append((int(m.group(1)), child))
    return sorted(out)


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint directory (all shards). Blocks."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RftError(f"{path}: no *.safetensors files (not an HF checkpoint)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


async def run_bench(
    cfg: Config,
    evaluator: Evaluator,
    state: RunState,
    *,
    model_path: str,
    engine: Any = None,
) -> None:
    """Evaluate the given model (``model_path``, or ``engine`` when given), then the saved
    checkpoints, with ``evaluator``; see the module docstring. Heartbeats as
    ``evaluator.name`` meanwhile."""
    from rftstream.engines.rollout import rollout_model
    from rftstream.workflow_runner import WorkflowRunner

    await evaluator.load_tasksets()
    directory = checkpoint_dir(cfg)
    found = await anyio.to_thread.run_sync(find_checkpoints, directory)
    step = 0
    async with rollout_model(cfg, model_path, engine=engine) as (model, aux, _):
        runner = WorkflowRunner(
            model,
            max_timeout=cfg.explorer.max_timeout,
            max_retry_times=cfg.explorer.max_retry_times,
            auxiliary_models=aux,
        )

        def version() -> int:
            return int(getattr(model.engine, "model_version", 0) or 0)

        def beat() -> Heartbeat:  # an explorer's heartbeat: it explores nothing here
            return Heartbeat(
                actor=evaluator.name,
                role=evaluator.role,
                ts=time.time(),
                step=step,
                model_version=version(),
                groups=0,
                failed_tasks=0,
            )

        can_load = bool(getattr(model.engine, "can_load_weights", True))
        if found and not can_load:
            log.warning(
                "%s: engine %s cannot load weights; the %d checkpoints in %s are not evaluated",
                evaluator.name,
                cfg.explorer.rollout_model.engine_type,
                len(found),
                directory,
            )
            found = []
        plan: list[tuple[int, Path | None]] = [(0, None)] + [(s, p) for s, p in found]
        if cfg.explorer.bench_on_latest_checkpoint:
            plan = plan[-1:]
        log.info(
            "%s: benchmarking %s on %d eval tasksets",
            evaluator.name,
            ", ".join("the given model" if p is None else p.name for _, p in plan),
            evaluator.taskset_count,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat_loop, state, beat)
            for step, path in plan:
                if path is not None:
                    sd = await anyio.to_thread.run_sync(load_hf_state_dict, path)
                    await model.engine.load_weights(sd, step)
                await evaluator.evaluate(
                    state,
                    runner,
                    step=step,
                    version=version(),
                    final=False,
                    claim_key=KV_BENCH_STEP.format(step=step),
                    extra={"bench": True, "checkpoint": str(path) if path else None},
                )
            tg.cancel_scope.cancel()
    if await state.status() not in ("failed", "stopped"):
        await state.set_status("finished")
