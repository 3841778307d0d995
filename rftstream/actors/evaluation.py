"""The explorer's evaluation of its ``eval_tasksets`` (see :mod:`rftstream.actors.explorer`).

:class:`EvaluationMixin` is a part of :class:`~rftstream.actors.explorer.Explorer`:
it loads the eval tasksets, runs every row once (``repeat_times`` of the eval
taskset, default 1) with the current weights through the explorer's workflow
runner (nothing reaches ``exp.raw``), publishes ``eval/<name>/...`` metrics on
``metrics.<explorer>`` and appends the record to ``<run_dir>/eval.jsonl``. One
explorer evaluates each step (KV claims). Every method blocks the explorer's
loop while it runs; cancelling stops after the current await.
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
from rftstream.config.schema import Config, TasksetConfig
from rftstream.errors import RftError
from rftstream.subjects import KV_EVAL_FINAL, KV_EVAL_STEP

log = logging.getLogger(__name__)

__all__ = ["EvaluationMixin"]


class EvaluationMixin:
    """Evaluation methods of the explorer (they use its config, bus, step and weights)."""

    cfg: Config
    bus: Bus
    name: str
    role: str
    step: int
    evaluations: int
    eval_sets: list[tuple[str, TasksetConfig]]
    on_eval: Callable[[dict[str, Any]], None] | None
    _eval_rows: list[tuple[TasksetConfig, list[dict[str, Any]]]]
    _last_eval: tuple[int, int] | None

    def _version(self) -> int:
        raise NotImplementedError

    async def _load(self, state: RunState, min_version: int) -> None:
        raise NotImplementedError

    async def _load_eval_tasksets(self) -> None:
        from rftstream.tasksets import load_taskset

        self._eval_rows = []
        for key, ts in self.eval_sets:
            rows = await anyio.to_thread.run_sync(load_taskset, ts, key)
            self._eval_rows.append((ts, rows))

    async def _final_eval(self, state: RunState, runner: Any, why: str) -> None:
        """The end-of-run evaluation (newest weights), unless the run failed or was stopped."""
        if not self._eval_rows or why in ("failed", "stopped"):
            return
        await self._load(state, 0)
        await self._evaluate(state, runner, final=True)

    async def _evaluate(
        self,
        state: RunState,
        runner: Any,
        *,
        final: bool,
        claim_key: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Run every eval taskset once with the current weights; publish and record the metrics.

        Blocks exploration meanwhile. One explorer per step number (KV claim
        ``claim_key``, default ``eval.step.<n>`` / ``eval.final``); a final
        evaluation of what was just evaluated is skipped. ``extra`` goes into the
        ``eval.jsonl`` record (bench: the checkpoint). Cancelled or failed
        before its metrics and record are out, it releases the claim (deletes
        the key), so a later explorer evaluates that step instead of skipping it.
        """
        version = self._version()
        if final and self._last_eval == (self.step, version):
            return
        key = claim_key or (KV_EVAL_FINAL if final else KV_EVAL_STEP.format(step=self.step))
        claim = {"by": self.name, "step": self.step, "model_version": version, "ts": time.time()}
        if not await state.claim(key, claim):
            return
        try:
            values, record = await self._evaluate_claimed(final, version, extra, runner)
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                try:
                    await state.delete(key)
                except Exception as exc:  # noqa: BLE001 - the connection may be gone
                    log.warning("%s: could not release the claim %s: %s", self.name, key, exc)
            raise
        self._last_eval = (self.step, version)
        log.info(
            "%s: evaluation after step %d (weights v%d): %s",
            self.name,
            self.step,
            version,
            ", ".join(f"{k}={v:.4g}" for k, v in values.items() if k.endswith("/mean")),
        )
        if self.on_eval is not None:
            self.on_eval(record)

    async def _evaluate_claimed(
        self, final: bool, version: int, extra: dict[str, Any] | None, runner: Any
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """The evaluation :meth:`_evaluate` claimed: run it, publish the metrics, write the
        ``eval.jsonl`` record. Returns ``(values, record)``."""
        t0 = time.perf_counter()
        values: dict[str, float] = {}
        for ts_cfg, rows in self._eval_rows:
            values.update(await self._eval_taskset(ts_cfg, rows, runner))
        values["eval/model_version"] = float(version)
        values["eval/final"] = 1.0 if final else 0.0
        values["time/eval"] = time.perf_counter() - t0
        await self.bus.publish_metrics(self.role, self.step, values)
        record: dict[str, Any] = {
            "step": self.step,
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
        repeat = int(ts_cfg.repeat_times or 1)
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
