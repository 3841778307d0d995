"""The Explorer actor: tasks in, experience groups out.

At start the taskset is published into ``RFT_<RUN>_TASKS`` (once per run: the
first explorer claims it in KV; ``Nats-Msg-Id`` per task makes a retry
harmless). Then, step after step, the explorer pulls ``buffer.batch_size``
tasks from the shared durable, runs their workflows concurrently (at most
``explorer.runner_num`` at a time) against the rollout engine, and publishes
one message per task group to ``exp.raw``.

Acks: a task is acked only after its group is stored in ``exp.raw`` (or after
it went to ``dlq.tasks`` with the error), so a task of an explorer that dies is
redelivered to another one; the group's ``Nats-Msg-Id`` (``raw:<epoch>:<index>``)
stops a redone task from being stored twice.

Sync: before a step the explorer loads newer weights per the sync policy;
with ``max_staleness`` it pauses while too much experience waits for the
trainer. Cancelling :meth:`Explorer.run` stops after the current await; tasks
in flight are not acked and will be redelivered.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import anyio
from nats.aio.msg import Msg

from rftstream.actors.common import (
    InProgressTicker,
    consumer_backlog,
    consumer_drained,
    heartbeat_loop,
)
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config.schema import Config
from rftstream.errors import RftError, SchemaError
from rftstream.messages import TaskMsg, TasksetRecord, decode_json, encode_json
from rftstream.subjects import KV_TASKSET, KV_TRAINER_STARVING, RAW_STAGE
from rftstream.sync import SyncPolicy
from rftstream.weights import load_weights

log = logging.getLogger(__name__)

TASKS_DLQ_STAGE = "tasks"


class Explorer:
    """One explorer: a rollout engine, a workflow runner and a task loop."""

    role = "explorer"

    def __init__(
        self,
        cfg: Config,
        bus: Bus,
        *,
        model_path: str,
        name: str = "explorer",
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.on_progress = on_progress
        self.cfg = cfg
        self.bus = bus
        self.names = bus.names
        self.name = name
        self.model_path = model_path
        self.policy = SyncPolicy.from_config(cfg.synchronizer)
        self.repeat_times = int(cfg.algorithm.repeat_times or 1)
        self.step = 0
        self.published_groups = 0
        self.published_experiences = 0
        self.failed_tasks = 0
        self.engine: Any = None
        self.state: RunState | None = None

    # ------------------------------------------------------------ taskset
    async def publish_taskset(self, state: RunState) -> None:
        """Publish every task of every epoch once per run (first explorer wins)."""
        from workflows.tasksets import load_taskset

        if await state.taskset() is not None:
            return
        if not await state.claim(KV_TASKSET + ".claim", {"by": self.name, "ts": time.time()}):
            with anyio.fail_after(self.cfg.synchronizer.sync_timeout):
                while await state.taskset() is None:
                    await anyio.sleep(0.2)
            return
        ts_cfg = self.cfg.buffer.explorer_input.taskset
        rows = await anyio.to_thread.run_sync(load_taskset, ts_cfg)
        epochs = self.cfg.buffer.total_epochs
        count = 0
        for epoch in range(epochs):
            order = list(range(len(rows)))
            if ts_cfg.shuffle:
                random.Random(ts_cfg.seed + epoch).shuffle(order)
            for pos, index in enumerate(order):
                msg = TaskMsg(
                    taskset=ts_cfg.name,
                    index=index,
                    epoch=epoch,
                    seq=epoch * len(rows) + pos,
                    raw_task=rows[index],
                )
                await self.bus.publish(
                    self.names.tasks_subject,
                    encode_json(msg),
                    headers={
                        "Rft-Schema": msg.schema,
                        "Rft-Task": f"{epoch}/{index}",
                        "Rft-Actor": self.name,
                    },
                    msg_id=f"task:{ts_cfg.name}:{epoch}:{index}",
                )
                count += 1
        await state.put_json(
            KV_TASKSET,
            TasksetRecord(count=count, epochs=epochs, rows=len(rows), by=self.name, ts=time.time()),
        )
        log.info(
            "%s: published %d tasks (%d rows x %d epochs)", self.name, count, len(rows), epochs
        )

    # ------------------------------------------------------------ run
    async def run(self, *, engine: Any = None) -> None:
        """Explore until the tasks are exhausted or the run ends. Blocks; cancel to stop."""
        from rftstream.engines import create_engine
        from rftstream.engines.model_wrapper import ModelWrapper
        from workflows.runner import WorkflowRunner

        state = RunState(await self.bus.kv())
        self.state = state
        await self.publish_taskset(state)
        rm = self.cfg.explorer.rollout_model
        if engine is None:
            engine = await anyio.to_thread.run_sync(
                lambda: create_engine(
                    rm.engine_type,
                    self.model_path,
                    max_batch_size=rm.max_batch_size,
                    batch_wait_ms=rm.batch_wait_ms,
                    seed=rm.seed,
                    dtype=self.cfg.model.dtype,
                    default_max_tokens=self.cfg.model.max_response_tokens,
                )
            )
        self.engine = engine
        model = ModelWrapper(
            engine,
            model_path=self.model_path,
            enable_history=rm.enable_history,
            max_response_tokens=self.cfg.model.max_response_tokens,
            max_prompt_tokens=self.cfg.model.max_prompt_tokens,
        )
        runner = WorkflowRunner(
            model,
            max_timeout=self.cfg.explorer.max_timeout,
            max_retry_times=self.cfg.explorer.max_retry_times,
        )
        consumer = await self.bus.pull(self.names.tasks_stream, self.names.explorer_consumer)
        ticker = InProgressTicker(self.cfg.nats.ack_wait / 3)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                tg.start_soon(ticker.run)
                tg.start_soon(heartbeat_loop, state, self.name, self.role, self._info)
                await self._loop(state, consumer, runner, ticker)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.unsubscribe()
                try:
                    await engine.aclose()
                except Exception:  # noqa: BLE001
                    pass

    def _info(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model_version": int(getattr(self.engine, "model_version", 0) or 0),
            "groups": self.published_groups,
            "failed_tasks": self.failed_tasks,
        }

    async def _loop(
        self, state: RunState, consumer: Any, runner: Any, ticker: InProgressTicker
    ) -> None:
        batch_size = self.cfg.buffer.batch_size
        limiter = anyio.CapacityLimiter(self.cfg.explorer.runner_num)
        while True:
            if await state.status() in ("finished", "failed", "stopped"):
                return
            next_step = self.step + 1
            t_wait = time.perf_counter()
            await self._respect_staleness(state, next_step)
            await self._sync_weights(state, next_step)
            wait_sync = time.perf_counter() - t_wait
            msgs: list[Msg] = []
            while len(msgs) < batch_size:
                got = await consumer.fetch(batch_size - len(msgs), timeout=1.0)
                msgs.extend(got)
                if got:
                    continue
                if msgs:
                    break
                if await state.status() in ("finished", "failed", "stopped"):
                    return
                if await consumer_drained(
                    self.bus, self.names.tasks_stream, self.names.explorer_consumer
                ):
                    log.info("%s: no tasks left after %d steps", self.name, self.step)
                    await state.put_json(
                        f"explorer.{self.name}.done", {"step": self.step, "ts": time.time()}
                    )
                    return
            self.step = next_step
            t0 = time.perf_counter()
            stats: dict[str, float] = {
                "reward_sum": 0.0,
                "reward_count": 0.0,
                "groups": 0.0,
                "experiences": 0.0,
                "failed": 0.0,
            }
            async with anyio.create_task_group() as tg:
                for msg in msgs:
                    tg.start_soon(self._run_task, msg, runner, limiter, ticker, stats)
            dt = time.perf_counter() - t0
            values = {
                "rollout/reward_sum": stats["reward_sum"],
                "rollout/reward_count": stats["reward_count"],
                "rollout/reward_mean": stats["reward_sum"] / stats["reward_count"]
                if stats["reward_count"]
                else float("nan"),
                "rollout/groups": stats["groups"],
                "rollout/experiences": stats["experiences"],
                "rollout/failed_tasks": stats["failed"],
                "explorer/model_version": float(getattr(self.engine, "model_version", 0) or 0),
                "time/explore_step": dt,
                "time/explorer_wait_sync": wait_sync,
            }
            await self.bus.publish_metrics(self.role, self.step, values)
            await state.put_json(f"explorer.{self.name}.step", self.step)
            if self.on_progress is not None:
                self.on_progress({"step": self.step, **self._info(), **values})

    async def _fail_task(self, msg: Msg, reason: str, stats: dict[str, float]) -> None:
        """Dead-letter a task message (``dlq.tasks``, reason in headers) and count it as failed."""
        await self.bus.dead_letter(TASKS_DLQ_STAGE, msg, reason)
        stats["failed"] += 1
        self.failed_tasks += 1

    async def _run_task(
        self,
        msg: Msg,
        runner: Any,
        limiter: anyio.CapacityLimiter,
        ticker: InProgressTicker,
        stats: dict[str, float],
    ) -> None:
        from workflows.workflow import make_task

        try:
            tmsg: TaskMsg = decode_json(msg.data, TaskMsg, f"task message on {msg.subject}")
        except SchemaError as exc:
            await self._fail_task(msg, str(exc), stats)
            return
        ts_cfg = self.cfg.buffer.explorer_input.taskset
        repeat = int(ts_cfg.repeat_times or self.repeat_times)
        task = make_task(
            tmsg.raw_task,
            ts_cfg,
            repeat_times=repeat,
            batch_id=tmsg.epoch,
            task_id=tmsg.index,
            index=tmsg.index,
            epoch=tmsg.epoch,
        )
        ticker.hold(msg)
        try:
            async with limiter:
                result = await runner.run_task(task)
            if result.error or not result.experiences:
                reason = result.error or "workflow returned no experiences"
                await self._fail_task(msg, f"task {tmsg.epoch}/{tmsg.index}: {reason}", stats)
                return
            exps = result.experiences
            await self.bus.publish_group(
                RAW_STAGE, exps, msg_id=f"raw:{ts_cfg.name}:{tmsg.epoch}:{tmsg.index}"
            )
            await msg.ack()
        except RftError as exc:
            await self._fail_task(msg, f"task {tmsg.epoch}/{tmsg.index}: {exc}", stats)
            return
        finally:
            ticker.release(msg)
        rewards = [e.reward for e in exps if e.reward is not None]
        stats["reward_sum"] += float(sum(rewards))
        stats["reward_count"] += len(rewards)
        stats["groups"] += 1
        stats["experiences"] += len(exps)
        self.published_groups += 1
        self.published_experiences += len(exps)

    # ------------------------------------------------------------ sync
    async def _load(self, state: RunState, min_version: int) -> None:
        ptr = await state.latest_weights()
        current = int(getattr(self.engine, "model_version", 0) or 0)
        if ptr is None or ptr.version <= current or ptr.version < min_version:
            return
        try:
            sd = await anyio.to_thread.run_sync(load_weights, ptr, self.names.run)
        except (
            RftError,
            OSError,
        ) as exc:  # replaced by a newer version meanwhile: next sync takes that
            log.warning(
                "%s: could not load weights v%d (%s); keeping v%d",
                self.name,
                ptr.version,
                exc,
                current,
            )
            return
        await self.engine.load_weights(sd, ptr.version)
        log.info("%s: loaded weights v%d", self.name, ptr.version)

    async def _sync_weights(self, state: RunState, step: int) -> None:
        need = self.policy.explorer_waits_for_version(step)
        if need is not None:
            with anyio.fail_after(self.cfg.synchronizer.sync_timeout):
                while True:
                    ptr = await state.latest_weights()
                    if ptr is not None and ptr.version >= need:
                        break
                    if await state.status() in ("finished", "failed", "stopped"):
                        return
                    await anyio.sleep(0.1)
            await self._load(state, need)
        elif self.policy.explorer_checks_before(step):
            await self._load(state, 0)

    async def _respect_staleness(self, state: RunState, step: int) -> None:
        """Pause while a batch generated now would exceed ``max_staleness`` when trained."""
        if self.policy.max_staleness is None:
            return
        tbs = self.cfg.buffer.train_batch_size
        will_sync = (
            self.policy.explorer_checks_before(step)
            or self.policy.explorer_waits_for_version(step) is not None
        )
        while True:
            backlog = await consumer_backlog(self.bus, self.names.exp_stream)
            ptr = await state.latest_weights()
            newest = ptr.version if ptr is not None else 0
            mine = newest if will_sync else int(getattr(self.engine, "model_version", 0) or 0)
            if self.policy.explorer_may_run(
                backlog * self.repeat_times, tbs, version_lag=max(0, newest - mine)
            ):
                return
            starving = await state.get_json(KV_TRAINER_STARVING)
            if isinstance(starving, dict) and starving.get("since"):
                return  # filters dropped what was waiting: never stall a starving trainer
            if await state.status() in ("finished", "failed", "stopped"):
                return
            await anyio.sleep(0.05)
