"""The Explorer actor: tasks in, experience groups out.

Taskset: the training tasksets (``buffer.explorer_input.taskset`` and
``tasksets``) are published into ``RFT_<RUN>_TASKS`` once per run, in the
background while the explorer loads its engine and explores, by the explorer
holding KV claim ``taskset.published.claim`` (its :class:`TasksetPublisher`, see
:mod:`rftstream.actors.taskset_publisher` and the claim protocol in
:mod:`rftstream.control.taskset_claim`); another explorer explores what is there and
takes over a claim that stopped moving. An explorer is out of tasks only when
the queue is drained *and* the plan is published (``taskset.published``).

Steps: the explorer pulls ``buffer.batch_size`` tasks from the shared durable,
runs their workflows concurrently (at most ``explorer.runner_num`` tasks at a
time, across steps: the next step's tasks are fetched as soon as fewer than
``runner_num`` are in flight, so a slow task never holds later steps back and
the runners never wait for a batch) against the rollout
engine, and publishes one message per task group to ``exp.raw``. A restarted explorer continues the step count it left in KV
(``explorer.<name>.step``) and the work queue where it was: every task
carries its taskset, epoch and row index.

Acks: a task is acked only after its group is stored in ``exp.raw`` (or after
it went to ``dlq.tasks`` with the error), so a task of an explorer that dies is
redelivered to another one after the consumer's ack wait; the group's
``Nats-Msg-Id`` (``raw:<taskset>:<epoch>:<index>``) stops a redone task from
being stored twice. A publish that fails for NATS reasons (timed out after its
retries, a 503, a lost connection) is retried with the same group until it is
stored (the task stays held meanwhile; ``rollout/publish_failures``): the
group is split the same way with the same ids, so the parts of a split group
an earlier attempt stored are deduplicated (within ``nats.dedup_window``) and
the group on ``exp.raw`` is whole; only a group that cannot be published as
it is (it does not encode, one experience exceeds ``max_payload``) sends the
task to ``dlq.tasks``. A task that cannot be dead-lettered for NATS reasons
is given back (redelivered later). Cancelling :meth:`Explorer.run` stops after the current
await and naks the tasks it holds, so they are redelivered at once.

Evaluation: with ``buffer.explorer_input.eval_tasksets``, after every
``explorer.eval_interval``-th step and after step ``buffer.total_steps`` (KV
claim ``eval.step.<n>``: one explorer evaluates per step number), and at the
end (claim ``eval.final``, with the newest weights: when the task queue is
drained, or when the explorer sees the run finished), the explorer runs every row of
each eval taskset once (``repeat_times`` of the eval taskset, default 1) with
its current weights, in-process: nothing reaches ``exp.raw``. It publishes
``eval/<name>/reward/mean``, ``eval/<name>/accuracy/mean`` (the reward fn's
``accuracy`` score, or the reward when rewards are 0/1),
``eval/<name>/accuracy/best@<k>`` (k > 1), ``eval/<name>/response_length/mean``,
``eval/<name>/tasks``, ``eval/<name>/failed_tasks``, ``eval/model_version``
and ``eval/final`` on ``metrics.<explorer>`` (role ``explorer``, step = the
explorer step; a metric without a value, e.g. the mean reward when every
task failed, is left out there) and appends the same record to
``<run_dir>/eval.jsonl`` (``null`` for such values; not when
``monitor.monitor_type`` is ``none``). Exploration waits meanwhile
(its :class:`~rftstream.actors.evaluation.Evaluator`).

Sync: before a step the explorer loads newer weights per the sync policy;
with ``max_staleness`` it pauses while too much experience waits for the
trainer. Only in the modes with a trainer (``both``), and never into an
engine that cannot load weights (``engine_type: openai``); a load that fails
keeps the current weights (logged). With ``sync_method: jetstream`` a
:class:`~rftstream.weights.fetcher.WeightFetcher` beside the steps fetches,
checks and stages every new version in the background, and "loading" at a sync
point is swapping the staged one in between two batches; ``max_staleness`` then
counts from the trainer's newest version (``weights.pending``) and waits for a
fetch that is behind rather than generate past the bound.

Modes: ``mode: explore`` has no trainer: no weight sync, no staleness bound;
the explorer stops when the task queue is drained or after
``buffer.total_steps`` of its own steps, runs the final evaluation, and sets
the run status ``finished`` (operators then drain ``exp.raw`` and stop;
experience stays on ``exp.train`` for a trainer elsewhere). ``mode: bench``
publishes no tasks and explores nothing: see :mod:`rftstream.actors.bench`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import anyio.abc

from rftstream.actors.common import (
    InProgressTicker,
    consumer_drained,
    frozen_heap,
)
from rftstream.actors.evaluation import Evaluator
from rftstream.actors.taskset_publisher import TasksetPublisher
from rftstream.bus.client import Bus
from rftstream.bus.state import END_STATUSES, MirroredState, RunState
from rftstream.bus.transport import Delivery
from rftstream.config.resolve import taskset_repeat_times
from rftstream.config.resolved import ResolvedRun
from rftstream.config.schema import TRAINER_MODES, Config, TasksetConfig
from rftstream.config.validate import eval_tasksets, training_tasksets
from rftstream.control import KeyWrites
from rftstream.control.flights import FLIGHT_TTL_S, OwnFlight, PeerWork
from rftstream.control.liveness import heartbeat_loop
from rftstream.control.staleness import (
    IDLE_LOOK_S,
    AwaitWeights,
    Blocked,
    ConsumerListing,
    GateLook,
    LoadNewest,
    StalenessGate,
    Take,
    experience_backlog,
)
from rftstream.errors import (
    BusError,
    PayloadTooLargeError,
    RftError,
    SchemaError,
)
from rftstream.experience import Experience
from rftstream.retention.limits import ExperienceRoom
from rftstream.subjects import (
    KV_STATUS,
    KV_TRAINER_STARVING,
    KV_TRAINER_STEP,
    KV_WEIGHTS,
    RAW_STAGE,
)
from rftstream.weights import load_weights
from rftstream.weights.fetcher import WeightFetcher
from rftstream.wire import (
    EXPLORER_DONE,
    EXPLORER_STEP,
    STATUS,
    TRAINER_STARVING,
    TRAINER_UNACKED,
    WEIGHTS_LATEST,
    WEIGHTS_PENDING,
    ExplorerDone,
    Heartbeat,
    TaskMsg,
    decode_json,
)

log = logging.getLogger(__name__)

TASKS_DLQ_STAGE = "tasks"
#: the keys each step and the staleness gate read, kept in the explorer's process
#: (:class:`~rftstream.bus.state.MirroredState`): several reads per look otherwise
GATE_KEYS = (STATUS, WEIGHTS_LATEST, WEIGHTS_PENDING, TRAINER_UNACKED, TRAINER_STARVING)
RETRY_MAX_S = 30.0  # the longest wait between two attempts to publish a group
# max_staleness with jetstream: how long the trainer's newest version is awaited at most
# before the explorer goes on with older weights (it never came: the trainer failed)
COMING_WAIT_S = 60.0


class Explorer:
    """One explorer: a rollout engine, a workflow runner and a task loop, with a
    :class:`TasksetPublisher` (the run's tasks, once) and an :class:`Evaluator`
    (its eval tasksets)."""

    role = "explorer"

    def __init__(
        self,
        cfg: Config,
        bus: Bus,
        *,
        resolved: ResolvedRun,
        model_path: str,
        name: str = "explorer",
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        on_eval: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.on_progress = on_progress
        self.cfg = cfg
        self.bus = bus
        self.names = bus.names
        self.name = name
        # purges acked experience and holds raw publishes while the stream is near its limits
        self.room = ExperienceRoom(
            bus.transport,
            bus.names.exp_stream,
            cfg.nats.streams.experience,
            name,
            subject_prefix=bus.names.exp_wildcard[:-1],
            message_bytes=bus.max_payload,
        )
        self.model_path = model_path
        self.policy = resolved.sync
        self.repeat_times = resolved.repeat_times
        self.gate = StalenessGate(
            self.policy,
            batch_size=cfg.buffer.batch_size,
            train_batch_size=resolved.train_batch_size,
            group=resolved.repeat_times,
        )
        inp = cfg.buffer.explorer_input
        training_sets: list[tuple[str, TasksetConfig]] = training_tasksets(inp)
        self._taskset_cfg = {ts.name: ts for _, ts in training_sets}
        self.publisher = TasksetPublisher(cfg, bus, name, training_sets)
        self.evaluator = Evaluator(cfg, bus, name, self.role, eval_tasksets(inp), on_eval=on_eval)
        self.step = 0
        self.published_groups = 0
        self.published_experiences = 0
        self.failed_tasks = 0
        self.engine: Any = None
        self.state: RunState | None = None
        self._unacked: dict[int, Delivery] = {}
        self._in_flight = 0  # tasks started and not finished
        self._flight_versions: Counter[int] = Counter()  # tasks in flight by weights version
        self._flight_changed = anyio.Event()
        self._loop_start = self._idle_since = time.monotonic()
        self._idle_total = 0.0
        self._idle_mark = (self._loop_start, 0.0)
        self._step_recorded = 0
        self._weights_changes: KeyWrites | None = None
        # what can make room for a blocked staleness gate: the trainer's step record (it
        # follows the step's acks), its starving record, the run's status, and (poked) a
        # version staged here; not weights.pending / weights.latest, which come before
        # the acks and would wake the gate only to find the queue as it was
        self._gate_wakes: KeyWrites | None = None
        # what the gate and each step read (status, the trainer's versions and totals),
        # kept in this process by write notifications instead of read per look
        self._gate_state: MirroredState | None = None
        # the experience stream's consumers, listed again only when they change
        self._gate_listing: ConsumerListing | None = None
        # the room (experiences) the last look left after its take; None: look at once
        self._gate_spare: int | None = None
        # max_staleness with several explorers: the others' tasks in flight (their KV
        # records), and this explorer's totals and record (rftstream.control.flights)
        self._flights: OwnFlight | None = None
        self._peers_since: float | None = None  # when announced, until the peers answered
        # the trainer start (WeightsPointer.incarnation) whose weights the engine holds
        self._weights_incarnation = 0
        # sync_method jetstream: fetches and stages versions in the background (made with the
        # engine); checkpoint / memory: each load since the last step's metrics, as (seconds
        # generation paused for the copy, seconds from reading the pointer to loaded)
        self.fetcher: WeightFetcher | None = None
        self._load_pauses: list[tuple[float, float]] = []
        # max_staleness with jetstream: since when each trainer version has been awaited
        self._coming_since: dict[tuple[int, int], float] = {}
        self._coming_warned = False

    # ------------------------------------------------------------ run
    @property
    def explore_only(self) -> bool:
        """``mode: explore``: no trainer, so no weight sync and no staleness bound; this
        explorer ends the run when its tasks run out or it reached ``buffer.total_steps``."""
        return self.cfg.mode == "explore"

    def _syncs_weights(self) -> bool:
        """Whether weights published by a trainer are loaded into the engine: with a
        trainer in the run, and in ``mode: explore`` with ``sync_method: jetstream`` or
        ``checkpoint`` (the explorer half of an explorer/trainer pair: it takes the newest
        version a separate ``mode: train`` trainer published, at its sync interval, never
        waiting)."""
        follows = self.explore_only and self.cfg.synchronizer.sync_method in (
            "checkpoint",
            "jetstream",
        )
        return (self.cfg.mode in TRAINER_MODES or follows) and bool(
            getattr(self.engine, "can_load_weights", True)
        )

    async def run(self, *, engine: Any = None) -> None:
        """Explore until the tasks are exhausted or the run ends. Blocks; cancel to stop.

        ``mode: bench`` evaluates instead (:func:`rftstream.actors.bench.run_bench`).
        """

        state = RunState(await self.bus.kv())
        self.state = state
        self.room.state = state  # purges are recorded in the run's KV (the account reads them)
        if self.cfg.mode == "bench":
            from rftstream.actors.bench import run_bench

            await run_bench(
                self.cfg, self.evaluator, state, model_path=self.model_path, engine=engine
            )
            return
        async with anyio.create_task_group() as publishing:
            # the plan is published while the engine loads and the first tasks run
            publishing.start_soon(self.publisher.run, state)
            await self._explore_all(state, engine)
            publishing.cancel_scope.cancel()

    async def _explore_all(self, state: RunState, engine: Any) -> None:
        """Load the engine and explore until the run ends (see :meth:`run`)."""
        from rftstream.engines.rollout import rollout_model
        from rftstream.workflow_runner import WorkflowRunner

        await self.evaluator.load_tasksets()
        step_key = EXPLORER_STEP.of(name=self.name)
        self.step = int(await state.get(step_key) or 0)
        if self.step:
            log.info("%s: resuming after step %d", self.name, self.step)
        consumer = await self.bus.pull(self.names.tasks_stream, self.names.explorer_consumer)
        ticker = InProgressTicker(self.cfg.nats.ack_wait / 3)
        # what an explorer waiting for a weights version reads (see _sync_weights): it wakes
        # at the pointer's (or the status's) write, not on a poll
        self._weights_changes = KeyWrites(await self.bus.kv(), (KV_WEIGHTS, KV_STATUS))
        await self._weights_changes.start()
        self._gate_wakes = KeyWrites(
            await self.bus.kv(), (KV_TRAINER_STEP, KV_TRAINER_STARVING, KV_STATUS)
        )
        await self._gate_wakes.start()
        gate_state = MirroredState(await self.bus.kv(), GATE_KEYS)
        self._gate_state = gate_state
        await gate_state.start()
        listing = ConsumerListing(self.bus, self.names.exp_stream)
        self._gate_listing = listing
        await listing.start()
        if self.gate.enforced and not self.explore_only:
            self._flights, self._peers_since = await OwnFlight.open(
                await self.bus.kv(), self.name, self._oldest_version, on_room=self._peer_gave_room
            )
        try:
            async with rollout_model(self.cfg, self.model_path, engine=engine) as (model, aux, _):
                self.engine = model.engine
                runner = WorkflowRunner(
                    model,
                    max_timeout=self.cfg.explorer.max_timeout,
                    max_retry_times=self.cfg.explorer.max_retry_times,
                    auxiliary_models=aux,
                )
                with frozen_heap():  # the model's objects stay out of GC passes
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(ticker.run)
                        tg.start_soon(heartbeat_loop, state, self._heartbeat)
                        if self._flights is not None:
                            tg.start_soon(self._flights.run)
                        if (
                            self.cfg.synchronizer.sync_method == "jetstream"
                            and self._syncs_weights()
                        ):
                            # versions are fetched and staged beside exploration
                            self.fetcher = WeightFetcher(
                                self.bus,
                                state,
                                self.engine,
                                name=self.name,
                                model_path=self.model_path,
                                on_change=self._gate_wakes.poke,
                            )
                            tg.start_soon(self.fetcher.run)
                        # reads and purges the experience stream off the publish path
                        tg.start_soon(self.room.keep)
                        await self._loop(state, consumer, runner, ticker)
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._nak_unacked()
                await consumer.unsubscribe()
                await self._weights_changes.stop()
                await self._gate_wakes.stop()
                await gate_state.stop()
                await listing.stop()
                if self._flights is not None:  # nothing in flight here any more
                    await self._flights.close()
                    await self._flights.board.stop()
                try:  # the last word on this explorer's step and weights (the loop's may lag)
                    await state.heartbeat(self._heartbeat())
                except Exception as exc:  # noqa: BLE001 - the connection may be gone
                    log.warning("%s: could not write the final heartbeat: %s", self.name, exc)

    async def _nak_unacked(self) -> None:
        """Give the tasks this explorer still holds back to the queue (redelivered at once)."""
        held, self._unacked = list(self._unacked.values()), {}
        if held:
            log.info("%s: returning %d unfinished tasks to the queue", self.name, len(held))
        with anyio.move_on_after(5.0):
            for msg in held:
                try:
                    await msg.nak()
                except Exception:  # noqa: BLE001 - connection gone: ack wait redelivers them
                    pass

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            actor=self.name,
            role=self.role,
            ts=time.time(),
            step=self.step,
            model_version=self._version(),
            groups=self.published_groups,
            failed_tasks=self.failed_tasks,
        )

    def _version(self) -> int:
        return int(getattr(self.engine, "model_version", 0) or 0)

    async def _loop(
        self, state: RunState, consumer: Any, runner: Any, ticker: InProgressTicker
    ) -> None:
        """Start steps until the run ends, the tasks run out or ``total_steps`` (explore).

        A step's tasks run in the background (``_run_step``): the next step is
        fetched as soon as fewer than ``explorer.runner_num`` tasks are in flight
        (and the sync policy and ``max_staleness`` allow it); its tasks wait for a
        runner, so slow tasks of one step never hold the next one back and no runner
        waits for a batch. At the
        run's end the steps in flight are cancelled (their tasks are nak'ed by
        :meth:`run`); when the tasks run out, or at ``total_steps``, they finish first.
        """
        self._loop_start = self._idle_since = time.monotonic()
        self._idle_total = 0.0
        self._idle_mark = (self._loop_start, 0.0)
        async with anyio.create_task_group() as steps:
            why = await self._explore(state, consumer, runner, ticker, steps)
            if why in END_STATUSES:
                steps.cancel_scope.cancel()
            else:
                await self._room_for(0)
        if why in END_STATUSES:
            await self._final_eval(state, runner, why)
        else:
            await self._explorer_done(state, runner, why)

    async def _explore(
        self,
        state: RunState,
        consumer: Any,
        runner: Any,
        ticker: InProgressTicker,
        steps: anyio.abc.TaskGroup,
    ) -> str:
        """The step loop of :meth:`_loop`; returns why it stopped (an end status,
        ``total_steps`` or ``drained``)."""
        batch_size = self.cfg.buffer.batch_size
        # the next step's tasks are fetched as soon as a runner could take one, so runners
        # never wait for a batch while finished tasks wait to publish in order (behind a
        # slow task started with older weights); held at most runner_num - 1 + batch_size
        refill_at = self.cfg.explorer.runner_num - 1
        limiter = anyio.CapacityLimiter(self.cfg.explorer.runner_num)
        total_steps = self.cfg.buffer.total_steps
        gate_state = self._gate_state or state
        while True:
            status = await gate_state.status()
            if status in END_STATUSES:
                return status
            if self.explore_only and total_steps is not None and self.step >= total_steps:
                log.info("%s: reached buffer.total_steps (%d)", self.name, total_steps)
                return "total_steps"
            await self._room_for(refill_at)
            next_step = self.step + 1
            t_wait = time.perf_counter()
            take = batch_size
            if self._syncs_weights():
                if not self.explore_only:  # no trainer of ours to wait for otherwise
                    take = await self._respect_staleness(gate_state, next_step)
                await self._sync_weights(state, next_step)
            wait_sync = time.perf_counter() - t_wait
            msgs: list[Delivery] = []
            while len(msgs) < take:
                got = await consumer.fetch(take - len(msgs), timeout=1.0)
                for m in got:
                    self._unacked[id(m)] = m
                msgs.extend(got)
                if got:
                    continue
                if msgs:
                    break
                status = await state.status()
                if status in END_STATUSES:
                    return status
                if self._in_flight:  # a task in flight may still give its message back
                    await self._room_for(0)
                    continue
                if (
                    await consumer_drained(
                        self.bus, self.names.tasks_stream, self.names.explorer_consumer
                    )
                    and (await state.taskset()) is not None
                ):
                    log.info("%s: no tasks left after %d steps", self.name, self.step)
                    return "drained"
            self.step = next_step
            version = self._version()
            self._started(len(msgs), version)
            if self._flights is not None:  # the reservation's tasks not found in the queue
                self._flights.started(len(msgs))
            steps.start_soon(
                self._run_step, next_step, msgs, runner, limiter, ticker, wait_sync, version
            )
            if self.evaluator.has_tasksets and (
                next_step % self.cfg.explorer.eval_interval == 0
                or next_step == self.cfg.buffer.total_steps
            ):
                await self._room_for(0)  # exploration waits for the evaluation
                await self.evaluator.evaluate(
                    state, runner, step=self.step, version=self._version(), final=False
                )

    # ------------------------------------------------------------ tasks in flight
    def _started(self, n: int, version: int = 0) -> None:
        if self._in_flight == 0 and n:
            self._idle_total += time.monotonic() - self._idle_since
        self._in_flight += n
        self._flight_versions[version] += n

    def _finished(self, n: int = 1, version: int = 0) -> None:
        if self._flights is not None:
            self._flights.finished(n)
        self._in_flight -= n
        self._flight_versions[version] -= n
        if self._flight_versions[version] <= 0:
            del self._flight_versions[version]
        if self._in_flight == 0:
            self._idle_since = time.monotonic()
        self._flight_changed.set()
        self._flight_changed = anyio.Event()

    def _oldest_version(self) -> int:
        """The oldest weights version of this explorer's tasks started and not done (-1:
        none): for its flight record, on which other explorers order their publishes."""
        return min(self._flight_versions, default=-1)

    async def _after_older_tasks(self, version: int) -> None:
        """Wait until no task started with weights older than ``version`` is in flight,
        here or at another explorer (its flight record's ``oldest``).

        Experience reaches the trainer in the order of the weights it was sampled
        with, so ``max_staleness``, counted by position in the trainer's queue
        (:meth:`_respect_staleness`), holds for every task: without this a slow task
        started before a sync (or another explorer's step) could be published behind
        tasks started after it and be trained a version past the bound. Tasks of one
        version are not ordered. Never waits on a newer task (no cycle, across
        explorers too); a task that fails counts as done. Blocks; cancelling loses
        nothing (the task is not acked yet).
        """
        while any(v < version for v in self._flight_versions):
            await self._flight_changed.wait()
        # no older task can start here meanwhile: the engine's version only grows
        if self._flights is not None:
            await self._flights.board.wait_for_older(version)

    async def _room_for(self, limit: int) -> None:
        """Wait until at most ``limit`` tasks are in flight."""
        while self._in_flight > limit:
            await self._flight_changed.wait()

    def _sync_metrics(self) -> dict[str, float]:
        """The weight syncs since the last step's metrics (``sync/*``): swaps, the longest
        pause of generation they caused and the longest fetch (from reading the pointer
        to ready to swap: ``checkpoint`` reads the file, checks it and loads it)."""
        if self.fetcher is not None:
            return self.fetcher.take_metrics()
        loads, self._load_pauses = self._load_pauses, []
        out = {"sync/swaps": float(len(loads))}
        if loads:
            out["sync/explorer_pause_seconds"] = max(pause for pause, _ in loads)
            out["sync/fetch_seconds"] = max(whole for _, whole in loads)
        return out

    def idle_seconds(self) -> float:
        """Seconds since the loop started during which no task of this explorer was running."""
        idle = self._idle_total
        if self._in_flight == 0:
            idle += time.monotonic() - self._idle_since
        return idle

    def _idle_share(self) -> float:
        """The idle share since the previous call (0..1)."""
        now, idle = time.monotonic(), self.idle_seconds()
        last_t, last_idle = self._idle_mark
        self._idle_mark = (now, idle)
        return max(0.0, min(1.0, (idle - last_idle) / max(now - last_t, 1e-9)))

    async def _run_step(
        self,
        step: int,
        msgs: list[Delivery],
        runner: Any,
        limiter: anyio.CapacityLimiter,
        ticker: InProgressTicker,
        wait_sync: float,
        version: int = 0,
    ) -> None:
        """Run one step's tasks concurrently (started with weights ``version``), then publish
        the step's metrics."""
        t0 = time.perf_counter()
        stats: dict[str, float] = {
            "reward_sum": 0.0,
            "reward_count": 0.0,
            "groups": 0.0,
            "experiences": 0.0,
            "failed": 0.0,
            "retries": 0.0,
            "publish_failures": 0.0,
        }

        async def task(msg: Delivery) -> None:
            try:
                await self._run_task(msg, runner, limiter, ticker, stats, version)
            finally:
                self._finished(1, version)

        async with anyio.create_task_group() as tg:
            for msg in msgs:
                tg.start_soon(task, msg)
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
            "rollout/retries": stats["retries"],
            "rollout/publish_failures": stats["publish_failures"],
            "explorer/model_version": float(self._version()),
            "explorer/stream_full_wait_seconds_total": self.room.waited_s,
            "explorer/exp_removed_unacked": float(self.room.lost),
            "explorer/exp_purged_total": float(self.room.purged),
            "explorer/stream_check_seconds_total": self.room.check_s,
            "explorer/idle_share": self._idle_share(),
            "explorer/idle_seconds_total": self.idle_seconds(),
            "explorer/seconds_total": time.monotonic() - self._loop_start,
            "explorer/tasks_in_flight": float(self._in_flight),
            "time/explore_step": dt,
            "time/explorer_wait_sync": wait_sync,
            **self._sync_metrics(),
        }
        await self.bus.publish_metrics(self.role, step, values)
        if step > self._step_recorded:
            self._step_recorded = step
            assert self.state is not None
            await self.state.put(EXPLORER_STEP.of(name=self.name), step)
        if self.on_progress is not None:
            self.on_progress({**self._heartbeat().fields(), "step": step, **values})

    async def _explorer_done(self, state: RunState, runner: Any, why: str) -> None:
        """The final evaluation, the ``explorer.<name>.done`` record and, in ``mode:
        explore``, the run's end (status ``finished``: operators drain and stop)."""
        await self._final_eval(state, runner, why)
        await state.put(
            EXPLORER_DONE.of(name=self.name), ExplorerDone(step=self.step, ts=time.time(), why=why)
        )
        if self.explore_only and await state.status() not in ("failed", "stopped"):
            await state.set_status("finished")

    async def _final_eval(self, state: RunState, runner: Any, why: str) -> None:
        """The end-of-run evaluation with the newest weights, unless the run failed or was
        stopped (or there is nothing to evaluate). Blocks."""
        if not self.evaluator.has_tasksets or why in ("failed", "stopped"):
            return
        await self._load(state, 0, wait=True)
        await self.evaluator.evaluate(
            state, runner, step=self.step, version=self._version(), final=True
        )

    async def _fail_task(self, msg: Delivery, reason: str, stats: dict[str, float]) -> None:
        """Dead-letter a task message (``dlq.tasks``, reason in headers) and count it as failed.

        When the dead letter cannot be published (NATS trouble), the task is
        nak'ed instead: it comes back and is tried again.
        """
        try:
            await self.bus.dead_letter(TASKS_DLQ_STAGE, msg, reason)
        except BusError as exc:
            log.warning(
                "%s: could not dead-letter a task (%s); it comes back: %s", self.name, exc, reason
            )
            self._unacked.pop(id(msg), None)
            try:
                await msg.nak(delay=RETRY_MAX_S)
            except Exception:  # noqa: BLE001 - connection gone: ack wait redelivers it
                pass
            return
        self._unacked.pop(id(msg), None)
        stats["failed"] += 1
        self.failed_tasks += 1

    async def _run_task(
        self,
        msg: Delivery,
        runner: Any,
        limiter: anyio.CapacityLimiter,
        ticker: InProgressTicker,
        stats: dict[str, float],
        version: int = 0,
    ) -> None:
        """Run one task (started with weights ``version``) and publish its group after
        the tasks started with older weights (:meth:`_after_older_tasks`), then ack it; a
        failure is dead-lettered or retried."""
        from rftstream.workflow import make_task

        try:
            tmsg: TaskMsg = decode_json(msg.data, TaskMsg, f"task message on {msg.subject}")
        except SchemaError as exc:
            await self._fail_task(msg, str(exc), stats)
            return
        where = f"task {tmsg.taskset}/{tmsg.epoch}/{tmsg.index}"
        ts_cfg = self._taskset_cfg.get(tmsg.taskset)
        if ts_cfg is None:
            await self._fail_task(
                msg,
                f"{where}: taskset {tmsg.taskset!r} is not among this explorer's training "
                f"tasksets {sorted(self._taskset_cfg)} (buffer.explorer_input)",
                stats,
            )
            return
        repeat = taskset_repeat_times(ts_cfg, self.repeat_times)
        try:
            task = make_task(
                tmsg.raw_task,
                ts_cfg,
                repeat_times=repeat,
                batch_id=tmsg.epoch,
                task_id=tmsg.task_id if tmsg.task_id is not None else tmsg.index,
                index=tmsg.index,
                epoch=tmsg.epoch,
            )
        except RftError as exc:
            await self._fail_task(msg, f"{where}: {exc}", stats)
            return
        ticker.hold(msg)
        try:
            async with limiter:
                result = await runner.run_task(task)
            stats["retries"] += max(0, result.attempts - 1)
            if result.error or not result.experiences:
                reason = result.error or "workflow returned no experiences"
                reason += f" (after {result.attempts} attempt{'s' if result.attempts != 1 else ''})"
                await self._fail_task(msg, f"{where}: {reason}", stats)
                return
            exps = result.experiences
            msg_id = f"raw:{ts_cfg.name}:{tmsg.epoch}:{tmsg.index}"
            await self._after_older_tasks(version)
            if not await self._publish_group(exps, msg_id, where, stats):
                return  # the run ended first: the task stays unacked (nak'ed at the end)
            await msg.ack()
            self._unacked.pop(id(msg), None)
        except RftError as exc:
            await self._fail_task(msg, f"{where}: {exc}", stats)
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

    async def _publish_group(
        self, exps: list[Experience], msg_id: str, where: str, stats: dict[str, float]
    ) -> bool:
        """Publish a task's group to ``exp.raw``, retrying NATS trouble until it is stored.

        Every attempt publishes the same group, split the same way under the
        same ``Nats-Msg-Id`` s, so what an earlier attempt stored is
        deduplicated. Backoff from 1 s, doubling, at most ``RETRY_MAX_S``.
        Waits first while the experience stream is near its limits
        (:class:`~rftstream.retention.limits.ExperienceRoom`; a full stream is retried
        like any NATS trouble). Returns False when the run ended meanwhile. :class:`SchemaError` and
        :class:`PayloadTooLargeError` (the group itself is at fault) propagate.
        Blocks; cancelling leaves the task unacked.
        """
        delay = 1.0
        while True:
            try:
                if not await self.room.wait(self._run_ended):
                    return False
                await self.bus.publish_group(RAW_STAGE, exps, msg_id=msg_id)
                return True
            except PayloadTooLargeError:
                raise
            except BusError as exc:
                stats["publish_failures"] += 1
                log.warning(
                    "%s: %s: publishing its group failed (%s); retrying in %.0fs",
                    self.name,
                    where,
                    exc,
                    delay,
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            if self.state is not None:
                try:
                    if await self.state.status() in END_STATUSES:
                        return False
                except Exception:  # noqa: BLE001 - NATS trouble: keep trying
                    pass

    async def _run_ended(self) -> bool:
        """Whether the run's status is an end status (NATS trouble reads as: not ended)."""
        if self.state is None:
            return False
        try:
            return await self.state.status() in END_STATUSES
        except Exception:  # noqa: BLE001 - NATS trouble: keep trying
            return False

    # ------------------------------------------------------------ sync
    async def _load(self, state: RunState, min_version: int, *, wait: bool = False) -> None:
        """Load the newest published weights if newer than ours (never into an engine that
        cannot load weights, nor without a trainer); a failure keeps the current ones.

        ``jetstream``: swap in the version the fetcher staged, if newer; ``wait``: first
        wait (at most ``synchronizer.sync_timeout``) until the newest published one (and
        at least ``min_version``) is staged."""
        if not self._syncs_weights():
            return
        if self.fetcher is not None:
            await self._swap_fetched(state, min_version, wait=wait)
            return
        ptr = await state.latest_weights()
        current = self._version()
        if ptr is None or not ptr.newer_than(self._weights_incarnation, current):
            return
        if ptr.version < min_version and ptr.incarnation == self._weights_incarnation:
            return
        try:
            t_read = time.perf_counter()
            sd = await anyio.to_thread.run_sync(load_weights, ptr, self.names.run)
            t0 = time.perf_counter()
            await self.engine.load_weights(sd, ptr.version)
            t1 = time.perf_counter()
            self._load_pauses.append((t1 - t0, t1 - t_read))
            self._weights_incarnation = ptr.incarnation
        except (
            RftError,
            OSError,
        ) as exc:  # e.g. replaced by a newer version meanwhile: next sync takes that
            log.warning(
                "%s: could not load weights v%d (%s); keeping v%d",
                self.name,
                ptr.version,
                exc,
                current,
            )
            return
        if ptr.incarnation:
            log.info(
                "%s: loaded weights v%d of the restarted trainer (incarnation %d; had v%d)",
                self.name,
                ptr.version,
                ptr.incarnation,
                current,
            )
        else:
            log.info("%s: loaded weights v%d", self.name, ptr.version)

    async def _swap_fetched(self, state: RunState, min_version: int, *, wait: bool) -> None:
        """``jetstream``: swap the fetcher's staged version in (see :meth:`_load`)."""
        fetcher = self.fetcher
        assert fetcher is not None
        if wait:
            ptr = await state.latest_weights()
            want = max(fetcher.active, (fetcher.active[0], min_version))
            if ptr is not None and ptr.method == "jetstream":
                want = max(want, (ptr.incarnation, ptr.version))
            if want > fetcher.held and not await fetcher.wait_staged(
                want, self.cfg.synchronizer.sync_timeout
            ):
                log.warning(
                    "%s: weights v%d were not fetched within synchronizer.sync_timeout "
                    "(%gs) or were refused; going on with v%d",
                    self.name,
                    want[1],
                    self.cfg.synchronizer.sync_timeout,
                    self._version(),
                )
        before = self._version()
        pause = await fetcher.swap(wait=wait)
        if pause is None:
            return
        self._weights_incarnation = fetcher.active[0]
        log.info(
            "%s: loaded weights v%d (had v%d; fetched in the background, swapped in: "
            "generation paused %.2f ms)",
            self.name,
            fetcher.active[1],
            before,
            pause * 1000,
        )

    async def _sync_weights(self, state: RunState, step: int) -> None:
        if not self._syncs_weights():
            return
        need = None if self.explore_only else self.policy.explorer_waits_for_version(step)
        if need is not None:
            with anyio.fail_after(self.cfg.synchronizer.sync_timeout):
                while True:
                    ptr = await state.latest_weights()
                    if ptr is not None and ptr.version >= need:
                        break
                    if await state.status() in END_STATUSES:
                        return
                    if self._weights_changes is None:
                        await anyio.sleep(0.1)
                    else:  # woken by the trainer's weights (or status) write, not a poll
                        await self._weights_changes.wait(1.0)
            await self._load(state, need, wait=True)
        elif self.policy.explorer_checks_before(step):
            await self._load(state, 0)

    async def _trainer_version(self, state: RunState) -> tuple[tuple[int, int], int]:
        """The trainer's newest weights as (incarnation, version): ``weights.pending``
        (written before it acks the step's batch) or, when newer, ``weights.latest``;
        and the version ``weights.latest`` names (0 before the first of each)."""
        ptr = await state.latest_weights()
        pending = await state.get(WEIGHTS_PENDING)
        published = (ptr.incarnation, ptr.version) if ptr is not None else (0, 0)
        newest = published
        if pending is not None:
            newest = max(newest, (pending.incarnation, pending.version))
        return newest, published[1]

    async def _await_coming(
        self, state: RunState, key: tuple[int, int], before_wait: Callable[[], None] = lambda: None
    ) -> bool:
        """``max_staleness`` with ``jetstream``: the trainer's version ``key`` is newer than
        the bound allows generating with ours; wait up to a second for the fetcher to
        stage it. Returns whether the caller should count again: False once the version
        cannot come (refused), the run ended, or it has been awaited for
        :data:`COMING_WAIT_S` (it never went out: the trainer failed or restarted), so
        the explorer goes on rather than stall the run. ``before_wait`` is called just
        before it waits (not when it returns False)."""
        assert self.fetcher is not None
        if not self.fetcher.coming(key) or await state.status() in END_STATUSES:
            return False
        since = self._coming_since.setdefault(key, time.monotonic())
        if time.monotonic() - since > COMING_WAIT_S:
            if not self._coming_warned:
                self._coming_warned = True
                log.warning(
                    "%s: the trainer's weights v%d have not reached this explorer in %.0fs; "
                    "generating with v%d past max_staleness",
                    self.name,
                    key[1],
                    COMING_WAIT_S,
                    self._version(),
                )
            return False
        before_wait()
        await self.fetcher.wait_staged(key, 1.0)
        return True

    async def _respect_staleness(self, state: RunState, step: int) -> int:
        """How many tasks step ``step`` may take within ``max_staleness``: ``buffer.batch_size``,
        or fewer when only part of a batch fits; blocks while not one task's group fits.

        The loop of the pure :class:`~rftstream.control.staleness.StalenessGate`: look
        (:meth:`_look`), decide, act (wait for a version on its way, load the newest,
        read the trainer's starving record and the run's status), then wait for a
        write of the trainer's step, starving or status key, or a version staged here
        (``_gate_wakes``), at most as long as the gate says. A step whose previous look
        left no group's room waits for one of those before it looks at all
        (:meth:`~rftstream.control.staleness.StalenessGate.blocked_until_woken`). The backlog is
        what waits on (or in) the trainer's side plus this explorer's tasks in flight
        (they are published soon, and before anything started with newer weights:
        :meth:`_after_older_tasks`) and the other explorers' tasks in flight or reserved
        (their KV records, :mod:`rftstream.control.flights`): before each look this
        explorer reserves a whole batch (a KV write it waits for, while another explorer
        is about), gives back what it does not take, and gives it all back before it
        waits (for the trainer, or for a version on its way).
        Messages the trainer trained and holds unacked until its next checkpoint
        (``trainer.save_interval``) are not backlog: the ``trainer.trained_unacked``
        totals read before and after the queues bound them from below
        (:class:`~rftstream.wire.TrainedUnacked`), so the count stays never too low.
        """
        gate = self.gate
        if not gate.enforced:
            return gate.batch_size
        will_sync = (
            self.policy.explorer_checks_before(step)
            or self.policy.explorer_waits_for_version(step) is not None
        )
        wakes = self._gate_wakes
        if wakes is not None and gate.blocked_until_woken(self._gate_spare) and not wakes.written:
            # the last look left no group's room and nothing has made any since: a look
            # now would only be told no (see StalenessGate.blocked_until_woken)
            await wakes.wait(IDLE_LOOK_S)
        self._gate_spare = None
        flights = self._flights
        if flights is not None and self._peers_since is not None:
            # the first look counts what the other explorers have in flight: they write
            # their records when they see this one's (at most PEER_REPLY_S)
            silent = await flights.board.wait_for_peers(self._peers_since)
            self._peers_since = None
            if silent:
                log.warning(
                    "%s: no flight record from %s since this explorer started; counting "
                    "their tasks by their last record until it is %.0f s old",
                    self.name,
                    ", ".join(silent),
                    FLIGHT_TTL_S,
                )
        while True:
            if wakes is not None:
                wakes.forget()  # a write from now on wakes the pause below
            if flights is not None and not flights.reserved:
                await flights.reserve(gate.batch_size)  # stored before the queues are read
            look = await self._look(state, will_sync)
            decision = gate.decide(look)
            if isinstance(decision, AwaitWeights):
                # a gate waiting for weights holds no reservation (the others may go on);
                # the next look reserves again
                release = flights.release if flights is not None else lambda: None
                if await self._await_coming(state, decision.key, release):
                    continue
                decision = gate.decide(replace(look, may_await=False))
            if isinstance(decision, LoadNewest):
                await self._load(state, 0)
                if self._version() > decision.mine:
                    continue
                decision = gate.decide(replace(look, may_await=False, may_load=False))
            if isinstance(decision, Take):
                self._gate_spare = gate.room_after(look, decision.tasks)
                return self._keep_reserved(decision.tasks)
            assert isinstance(decision, Blocked)
            # the record matters only with nothing ahead of the trainer: not read otherwise
            starving = await state.get(TRAINER_STARVING) if decision.ahead == 0 else None
            settled = gate.settle(
                decision,
                starving,
                ended=await state.status() in END_STATUSES,
                in_flight_now=self._in_flight,
            )
            if isinstance(settled, Take):
                return self._keep_reserved(settled.tasks)
            if flights is not None and not settled.keep_reservation:
                flights.release()  # no room: another explorer may take what this would not
            if wakes is not None:
                await wakes.wait(settled.wake_s)
            else:
                await anyio.sleep(settled.wake_s)

    def _peer_gave_room(self, _peer: str) -> None:
        """Another explorer gave back a reservation (or stopped): a waiting gate looks again."""
        if self._gate_wakes is not None:
            self._gate_wakes.poke()

    def _keep_reserved(self, tasks: int) -> int:
        """Keep ``tasks`` of the gate's reservation for the step (the rest is given back
        now, and what the queue does not have once the step is fetched); returns ``tasks``."""
        if self._flights is not None:
            self._flights.keep(tasks)
        return tasks

    async def _look(self, state: RunState, will_sync: bool) -> GateLook:
        """One :class:`GateLook`: our tasks in flight, then the queues, then the trainer's
        versions, in that order (see :class:`GateLook`).

        ``state`` is the explorer's :class:`~rftstream.bus.state.MirroredState`: the KV
        records cost no round trip, and one read after the queues' replies holds every
        write made before the server sent them (``weights.pending`` and the ``acked``
        total, written before the trainer's acks); ``trained``, read before the queues,
        is at most as new as the bucket's, which only lowers what is subtracted."""
        # our tasks in flight are read before the queues: one published while these are
        # read is then counted twice, never missed (read after, it could be in neither)
        in_flight = self._in_flight
        flights = self._flights
        # the others' records before the queues (what they finished) and after (what they
        # claimed): see rftstream.control.flights
        others_before = await flights.board.snapshot() if flights is not None else {}
        before = await state.get(TRAINER_UNACKED)
        queued = await experience_backlog(
            self.bus, self.names.exp_stream, listing=self._gate_listing
        )
        if before is not None and before.trained > before.acked:
            # the trainer holds trained messages unacked until its next checkpoint: they
            # are in its consumer's counts but no longer ahead of anything we start
            after = await state.get(TRAINER_UNACKED)
            if after is not None:
                queued = queued.without_trained(before.trained - after.acked)
        # after the queues: the trainer writes weights.pending before it acks
        newest, published = await self._trainer_version(state)
        others = PeerWork()
        if flights is not None:
            others_after = await flights.board.snapshot()
            others = flights.board.count(others_before, others_after, flights.started_total)
        return GateLook(
            in_flight=in_flight,
            others=others,
            queued=queued,
            newest=newest,
            published=published,
            engine_version=self._version(),
            staged_version=self.fetcher.held[1] if self.fetcher is not None else None,
            will_sync=will_sync,
        )
