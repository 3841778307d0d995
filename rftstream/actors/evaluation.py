"""The explorer's evaluation of its ``eval_tasksets`` (see :mod:`rftstream.actors.explorer`).

:class:`Evaluator` loads the eval tasksets, runs every row once
(``repeat_times`` of the eval taskset, default 1) with the engine's current
weights through a workflow runner (nothing reaches ``exp.raw``), publishes
``eval/<name>/...`` metrics on ``metrics.<actor>`` and appends the record to
``<run_dir>/eval.jsonl``. One actor evaluates each step number (KV claims).
The explorer evaluates during its run, ``mode: bench`` its checkpoints
(:mod:`rftstream.actors.bench`). Every method blocks its caller while it runs;
cancelling stops after the current await.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from rftstream.actors.common import append_line, nan_to_none
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config.resolve import eval_repeat_times
from rftstream.config.schema import Config, TasksetConfig
from rftstream.control.eval_claim import claim_eval, eval_claim_key, release_eval
from rftstream.errors import RftError
from rftstream.wire import EvalClaim

log = logging.getLogger(__name__)

__all__ = ["Evaluator"]


class Evaluator:
    """Evaluates the eval tasksets of one actor (``name``, ``role``) and records the results.

    ``evaluations`` counts the evaluations this one ran; ``on_eval`` is called
    with each ``eval.jsonl`` record.
    """

    def __init__(
        self,
        cfg: Config,
        bus: Bus,
        name: str,
        role: str,
        eval_sets: list[tuple[str, TasksetConfig]],
        *,
        on_eval: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.name = name
        self.role = role
        self.eval_sets = eval_sets
        self.on_eval = on_eval
        self.evaluations = 0
        self._rows: list[tuple[TasksetConfig, list[dict[str, Any]]]] = []
        self._last: tuple[int, int] | None = None  # (step, weights version) last evaluated

    @property
    def has_tasksets(self) -> bool:
        """Whether there is anything to evaluate (after :meth:`load_tasksets`)."""
        return bool(self._rows)

    @property
    def taskset_count(self) -> int:
        return len(self._rows)

    async def load_tasksets(self) -> None:
        """Read every eval taskset (in a worker thread). Blocks."""
        from rftstream.tasksets import load_taskset

        self._rows = []
        for key, ts in self.eval_sets:
            rows = await anyio.to_thread.run_sync(load_taskset, ts, key)
            self._rows.append((ts, rows))

    async def evaluate(
        self,
        state: RunState,
        runner: Any,
        *,
        step: int,
        version: int,
        final: bool,
        claim_key: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Run every eval taskset once with weights ``version`` after step ``step``;
        publish and record the metrics.

        Blocks the caller meanwhile. One actor per step number (KV claim
        ``claim_key``, default ``eval.step.<n>`` / ``eval.final``); a final
        evaluation of what was just evaluated is skipped. ``extra`` goes into the
        ``eval.jsonl`` record (bench: the checkpoint). Cancelled or failed
        before its metrics and record are out, it releases the claim (deletes
        the key), so a later explorer evaluates that step instead of skipping it.
        """
        if final and self._last == (step, version):
            return
        key = eval_claim_key(step, final=final, claim_key=claim_key)
        claim = EvalClaim(by=self.name, step=step, model_version=version, ts=time.time())
        if not await claim_eval(state, key, claim):
            return
        try:
            values, record = await self._evaluate_claimed(step, final, version, extra, runner)
        except BaseException:
            await release_eval(state, key, self.name)
            raise
        self._last = (step, version)
        log.info(
            "%s: evaluation after step %d (weights v%d): %s",
            self.name,
            step,
            version,
            ", ".join(f"{k}={v:.4g}" for k, v in values.items() if k.endswith("/mean")),
        )
        if self.on_eval is not None:
            self.on_eval(record)

    async def _evaluate_claimed(
        self, step: int, final: bool, version: int, extra: dict[str, Any] | None, runner: Any
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """The evaluation :meth:`evaluate` claimed: run it, publish the metrics, write the
        ``eval.jsonl`` record. Returns ``(values, record)``."""
        t0 = time.perf_counter()
        values: dict[str, float] = {}
        for ts_cfg, rows in self._rows:
            values.update(await self._eval_taskset(ts_cfg, rows, runner))
        values["eval/model_version"] = float(version)
        values["eval/final"] = 1.0 if final else 0.0
        values["time/eval"] = time.perf_counter() - t0
        await self.bus.publish_metrics(self.role, step, values)
        record: dict[str, Any] = {
            "step": step,
            "ts": time.time(),
            "explorer": self.name,
            **(extra or {}),
            **nan_to_none(values),
        }
        await self._write_eval_record(record)
        self.evaluations += 1
        return values, record

    async def _eval_taskset(
        self, ts_cfg: TasksetConfig, rows: list[dict[str, Any]], runner: Any
    ) -> dict[str, float]:
        from rftstream.workflow import make_task

        name = ts_cfg.name
        repeat = eval_repeat_times(ts_cfg)
        limiter = anyio.CapacityLimiter(self.cfg.explorer.runner_num)
        summaries: list[tuple[list[float], list[float], list[int]] | None] = [None] * len(rows)

        async def one(i: int) -> None:
            try:
                task = make_task(
                    rows[i],
                    ts_cfg,
                    repeat_times=repeat,
                    batch_id=f"eval:{name}",
                    task_id=i,
                    index=i,
                    epoch=0,
                    is_eval=True,
                )
            except RftError as exc:
                log.warning("%s: eval taskset %s, row %d: %s", self.name, name, i, exc)
                return
            async with limiter:
                result = await runner.run_task(task)
            if result.error or not result.experiences:
                log.warning(
                    "%s: eval taskset %s, row %d failed: %s",
                    self.name,
                    name,
                    i,
                    result.error or "no experiences",
                )
                return
            exps = result.experiences
            rewards = [float(e.reward) for e in exps if e.reward is not None]
            if all("accuracy" in (e.metrics or {}) for e in exps):
                acc = [float(e.metrics["accuracy"]) for e in exps]
            elif rewards and all(r in (0.0, 1.0) for r in rewards):
                acc = list(rewards)
            else:
                acc = []
            summaries[i] = (rewards, acc, [e.response_length for e in exps])

        async with anyio.create_task_group() as tg:
            for i in range(len(rows)):
                tg.start_soon(one, i)
        done = [s for s in summaries if s is not None]
        rewards = [r for s in done for r in s[0]]
        p = f"eval/{name}"
        out = {
            f"{p}/tasks": float(len(rows)),
            f"{p}/failed_tasks": float(len(rows) - len(done)),
            f"{p}/reward/mean": _mean(rewards),
            f"{p}/response_length/mean": _mean([n for s in done for n in s[2]]),
        }
        if done and all(s[1] for s in done):
            out[f"{p}/accuracy/mean"] = _mean([a for s in done for a in s[1]])
            if repeat > 1:
                out[f"{p}/accuracy/best@{repeat}"] = _mean([max(s[1]) for s in done])
        return out

    async def _write_eval_record(self, record: dict[str, Any]) -> None:
        if not self.cfg.run_dir or self.cfg.monitor.monitor_type == "none":
            return
        path = Path(self.cfg.run_dir) / "eval.jsonl"
        try:
            await anyio.to_thread.run_sync(append_line, path, json.dumps(record))
        except OSError as exc:
            log.warning("%s: cannot write %s: %s", self.name, path, exc)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
