"""The Trainer actor: waits for ``train_batch_size`` filtered experiences on
``exp.train``, trains one DeepSpeed step, publishes metrics and weights.

Per step it records (``metrics.jsonl`` in the run directory, the metrics
stream, and the ``trainer.step`` KV key): ``step``, ``reward/mean`` (mean
reward of all *raw* experiences explorers published since the previous
trainer step, read from the explorers' metrics, so filters cannot inflate it),
``staleness/mean`` and ``staleness/max`` (trainer version minus the version
that generated each trained experience; ``staleness/counts`` the experiences per
value), ``time/trainer_wait`` (time spent
waiting for experience), ``experience/filtered`` and the algorithm's losses.

Weights are published after the steps the sync policy names (``sync_method:
jetstream``: a snapshot, then a :class:`~rftstream.weights.publisher.WeightPublisher`
sends it on the weights stream in the background; ``sync/*`` in each record says
what it cost); an HF-format checkpoint is saved every ``trainer.save_interval``
steps and at the end.

Resumable checkpoints (:mod:`rftstream.training.checkpoint`: DeepSpeed's model and
optimizer state, lr schedules, step, weights version, RNG states) are written after a
step when one of these says so (its name is the record's ``checkpoint/trigger``):

* ``steps``: the step is a multiple of ``trainer.save_interval`` (0: off);
* ``end``: the step is ``buffer.total_steps`` (or, after the loop, the last step when
  the upstream ran out);
* ``time``: ``trainer.save_interval_seconds`` (default 600; 0: off) have passed since
  the last resumable checkpoint, or since the trainer's start;
* ``held``: the trained messages held for the next checkpoint (below) reached
  :data:`HELD_SHARE` of a limit they count against (:func:`held_limits`): the trainer
  consumer's ``max_ack_pending`` (the server delivers nothing more past it), or
  ``nats.streams.experience`` ``max_msgs`` / ``max_bytes`` (a held message keeps
  the stream's ``exp.train`` from being purged past it, and explorers stop publishing
  at :data:`~rftstream.retention.limits.HIGH_WATER` of those limits). Held messages thus stay
  below a quarter (plus one step's) of each limit whatever the time trigger says: the
  stream keeps more than half of its room for the backlog and the pipeline, and the
  consumer most of its acks pending for the batch being read, so a held message can
  never keep the next step (and with it the checkpoint that releases it) from coming;
* ``splice``: a consumer retired by a splice waits only for held messages to be
  acked before it is deleted (and the splice is done).

Resumable checkpointing is on when either ``save_interval`` or
``save_interval_seconds`` is (by default), with one trainer rank (several: off, with a
warning; the other ranks do not take part in DeepSpeed's save yet). The trainer names each checkpoint in the KV
record ``trainer.checkpoint`` and only then acks the messages it trained since the
previous one (held in progress until then). The step records up to the checkpoint's
are in ``metrics.jsonl`` before that record; the checkpoint's own step record gets
``checkpoint/seconds``: how long the trainer blocked for its checkpoints after that
step (the resumable one, and the HF one of a ``save_interval`` step). With both
triggers off nothing is held, every trained message is acked after its step, and a
crashed trainer starts over. A trainer started again in the
same run (same command, the run's KV bucket still there) with
``continue_from_checkpoint`` (default true, as in Trinity-RFT) loads the checkpoint
that record names: steps, versions and the trained total continue from it, the
messages trained after it are redelivered and trained again, and the records of the
steps it redoes are moved from ``metrics.jsonl`` (and ``trained_uids.jsonl``) to
``metrics.discarded.jsonl`` (``trained_uids.discarded.jsonl``), so both files describe
the steps the final model contains, each once. Every start of a trainer in a run
after the first publishes its weights with a higher ``incarnation``
(:class:`~rftstream.wire.WeightsPointer`), which explorers take whatever its
version. ``trained_uids.jsonl`` lists the experiences (``eid.uid``) of each step.
A trainer started again in a run where the earlier one wrote no checkpoint (or with
``continue_from_checkpoint`` false) trains from step 1, and the earlier records move
to the ``*.discarded.jsonl`` files likewise.

Cancelling :meth:`Trainer.run` (SIGINT / SIGTERM) loses no data. A step whose
training had begun is completed first (published, committed, recorded: the training
thread cannot be interrupted anyway); a batch read but not trained is not included
(its messages are not acked and are redelivered to the next trainer). Then, in a
shielded scope bounded by :data:`CANCEL_SAVE_MIN_S` (or 3x the longest checkpoint
so far), the trainer writes the records not written yet and a resumable checkpoint of
its last completed step if that is newer than its last one, and acks the messages it
held for it, as after any checkpoint. A save that fails or runs out of time is logged
and the trainer exits anyway: the previous checkpoint stays in force and the held
messages are redelivered. The DeepSpeed write itself runs in a thread that is not
interrupted (a SIGKILL meanwhile also leaves the previous checkpoint in force).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from rftstream.actors.common import (
    InProgressTicker,
    append_line,
    consumer_drained,
    frozen_heap,
    nan_to_none,
)
from rftstream.actors.dead_letters import DeadLetterWatcher
from rftstream.actors.feed import ExperienceFeed
from rftstream.actors.raw_monitor import RawMonitor
from rftstream.actors.topology import TrainerTopology
from rftstream.buffer.readers import TrainerInputs, trainer_inputs
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import ConsumerSpec
from rftstream.config.resolve import dataset_epochs, weights_wire_dtype
from rftstream.config.resolved import ResolvedAlgorithmProtocol, ResolvedRun
from rftstream.config.schema import Config, StorageConfig
from rftstream.control.liveness import heartbeat_loop
from rftstream.errors import ConfigError
from rftstream.monitors import MonitorSet
from rftstream.training import checkpoint as ckpt
from rftstream.training.datasets import DatasetSource, load_dataset_experiences
from rftstream.training.ranks import RankLeader
from rftstream.weights import checkpoint_dir, save_weights
from rftstream.weights.codec import SMALL_VERSION_BYTES, WIRE_DTYPES
from rftstream.weights.publisher import WeightPublisher
from rftstream.wire import (
    TRAINER_ACKED_BELOW,
    TRAINER_CHECKPOINT,
    TRAINER_DONE,
    TRAINER_STARTED,
    TRAINER_STARVING,
    TRAINER_STEP,
    TRAINER_UNACKED,
    WEIGHTS_PENDING,
    AckedBelow,
    CheckpointRecord,
    Heartbeat,
    TrainedUnacked,
    TrainerDone,
    TrainerStarted,
    TrainerStarving,
    WeightsPending,
)

log = logging.getLogger(__name__)


_UIDS = "_uids"  # a step record's trained eid.uids, written to trained_uids.jsonl only

#: trained messages held for the next checkpoint stay below this share of each limit
#: they count against (:func:`held_limits`)
HELD_SHARE = 0.25
#: how often (s, between steps) the trainer compares its durable's ack floor with what it
#: holds, and records a lagging floor's true value (:meth:`TrainerActor._record_acked_below`);
#: the chaos tests set ``RFTSTREAM_ACKED_BELOW_EVERY_S`` to look at every step
ACKED_BELOW_EVERY_S = float(os.environ.get("RFTSTREAM_ACKED_BELOW_EVERY_S") or 30.0)
#: the least time a cancelled trainer gives its last checkpoint (3x its longest one if more)
CANCEL_SAVE_MIN_S = 120.0
_MAX_ACK_PENDING = next(
    int(f.default) for f in dataclasses.fields(ConsumerSpec) if f.name == "max_ack_pending"
)


def held_limits(cfg: Config) -> tuple[int, int | None]:
    """``(messages, bytes)``: how many trained messages, and how many bytes of them, the
    trainer may hold unacked before it writes a checkpoint to ack them (``bytes`` None:
    no byte limit). :data:`HELD_SHARE` of the trainer consumer's ``max_ack_pending`` and
    of ``nats.streams.experience.max_msgs``, and of its ``max_bytes`` (those set)."""
    exp = cfg.nats.streams.experience
    msgs = int(HELD_SHARE * _MAX_ACK_PENDING)
    if exp.max_msgs > 0:
        msgs = min(msgs, int(HELD_SHARE * exp.max_msgs))
    nbytes = int(HELD_SHARE * exp.max_bytes) if exp.max_bytes > 0 else None
    return max(1, msgs), nbytes


class Trainer:
    """The trainer actor. ``on_step`` (if given) receives each step's record."""

    role = "trainer"

    def __init__(
        self,
        cfg: Config,
        bus: Bus,
        *,
        model_path: str,
        resolved: ResolvedRun,
        run_dir: Path,
        name: str = "trainer",
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.names = bus.names
        self.model_path = model_path
        self.resolved = resolved
        self.algorithm: ResolvedAlgorithmProtocol = resolved.algorithm
        self.run_dir = Path(run_dir)
        self.name = name
        self.on_step = on_step
        self.policy = resolved.sync
        self.step = 0
        self.version = 0
        self.trained = 0
        self.idle_seconds = 0.0  # waiting for experience, over the run
        self.checkpoint_dir = checkpoint_dir(cfg, self.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.uids_path = self.run_dir / "trained_uids.jsonl"
        self.feed: ExperienceFeed | None = None
        self.incarnation = 0  # which start of a trainer in this run (0: the first)
        self.saved_step: int | None = None  # the step of the committed resumable checkpoint
        self.resumed_from: int | None = None
        self.monitor: RawMonitor | None = None
        self.monitor_resume: dict[str, int] = {}  # a resumed checkpoint's monitor_through
        self._emitted_step = 0  # the last step whose record is written
        self._emit_event: anyio.Event | None = None  # set after each record written
        self._records: deque[dict[str, Any]] = deque()  # step records for the emitter
        self._record_added: anyio.Event | None = None
        # a step's record held back until its checkpoint is written (it gets its time)
        self._checkpoint_record: dict[str, Any] | None = None
        self._saved_at = time.monotonic()  # when the last resumable checkpoint was written
        self._acked_below_at = time.monotonic()  # the last look at the durable's ack floor
        self._acked_below = 0  # the last trainer.acked_below written
        self._longest_save = 0.0  # seconds, over this trainer's checkpoints
        # several trainer ranks: no resumable checkpoints (DeepSpeed's save is a collective
        # the other ranks are not told to join: rank 0 would wait for them forever)
        self._ranks = False
        self.monitors = MonitorSet([])  # monitor.monitor_type's backends, opened in run()
        # sync_method jetstream: publishes versions in the background (made at the first one)
        self.publisher: WeightPublisher | None = None
        self._sync_blocking = 0.0  # seconds this step spent handing its weights over
        self._sync_bytes: float | None = None  # checkpoint / memory: what this step's sync wrote

    @property
    def resumable(self) -> bool:
        """Whether this trainer writes resumable checkpoints (and holds trained messages
        unacked until the next one): ``trainer.save_interval`` or
        ``trainer.save_interval_seconds`` is on."""
        t = self.cfg.trainer
        return not self._ranks and (t.save_interval > 0 or t.save_interval_seconds > 0)

    async def _record_acked_below(self, state: RunState, feed: ExperienceFeed) -> None:
        """Write ``trainer.acked_below`` when the durable's ack floor lags what it acked (see
        :class:`~rftstream.wire.AckedBelow`); explorers purge by it. Call between steps, with
        no fetch in flight. One API round trip (and a KV write when the floor lags); a
        failure is logged and the look is tried again later."""
        self._acked_below_at = time.monotonic()
        try:
            server = await feed.consumer.info()
        except Exception as exc:  # noqa: BLE001 - only a purge hint: never stops training
            log.debug("%s: consumer info for the ack floor: %s", self.name, exc)
            return
        below = feed.acked_below(server)
        if below is None or below <= self._acked_below:
            return
        log.info(
            "%s: durable %s's ack floor is %d but everything on its subject below %d is "
            "acked (a server restart can leave the floor behind): recorded for the "
            "explorers' purges",
            self.name,
            feed.consumer.durable,
            server.ack_floor,
            below,
        )
        try:
            await state.put(
                TRAINER_ACKED_BELOW,
                AckedBelow(durable=feed.consumer.durable, below=below, ts=time.time()),
            )
        except Exception as exc:  # noqa: BLE001 - as above
            log.debug("%s: writing %s: %s", self.name, TRAINER_ACKED_BELOW.name, exc)
            return
        self._acked_below = below

    def _checkpoint_trigger(self, step: int, total: int | None, feed: ExperienceFeed) -> str | None:
        """Why a resumable checkpoint is due after ``step`` (see the module docstring), or
        None."""
        if not self.resumable:
            return None
        t = self.cfg.trainer
        if t.save_interval and step % t.save_interval == 0:
            return "steps"
        if total is not None and step == total:
            return "end"
        if t.save_interval_seconds > 0 and (
            time.monotonic() - self._saved_at >= t.save_interval_seconds
        ):
            return "time"
        max_msgs, max_bytes = held_limits(self.cfg)
        if feed.trained_unacked >= max_msgs or (
            max_bytes is not None and feed.trained_unacked_bytes >= max_bytes
        ):
            return "held"
        if feed.held_for_retired:
            return "splice"
        return None

    async def _exhausted(self) -> bool:
        """Every task done, every stage before the trainer drained, nothing left on exp.train.

        False at once (no round trip) while the feed still drains a stage it stopped
        reading: only the feed's own read loop, which calls this, changes that.
        """
        if self.feed is not None and self.feed.retired:
            return False
        state = RunState(await self.bus.kv())
        if await state.taskset() is None:
            return False
        n = self.names
        if not await consumer_drained(self.bus, n.tasks_stream, n.explorer_consumer):
            return False
        infos = await self.bus.consumers(n.exp_stream)
        mine = self.feed.consumer.durable if self.feed is not None else n.trainer_consumer
        for info in infos:
            pending = info.num_pending
            unacked = info.num_ack_pending
            if info.name == mine:
                if pending:
                    return False
            elif pending or unacked:
                return False
        return True

    async def run(self) -> None:
        """Train until ``buffer.total_steps`` or until the upstream is exhausted. Blocks.

        Cancelled (SIGINT / SIGTERM): the step in training is completed, then the last
        completed step is checkpointed (bounded, shielded; see the module docstring) and
        the run's status is ``stopped``."""
        from rftstream.training.policy_trainer import PolicyTrainer

        state = RunState(await self.bus.kv())
        await state.put(TRAINER_STARTED, TrainerStarted(actor=self.name, ts=time.time()))
        topology = TrainerTopology(self.bus, state, self.name)
        consumer = await topology.open()  # moved by a splice, if any
        ticker = InProgressTicker(self.cfg.nats.ack_wait / 3)

        async def starving(flag: bool, held: int) -> None:
            await state.put(
                TRAINER_STARVING, TrainerStarving(since=time.time() if flag else None, held=held)
            )

        watcher = DeadLetterWatcher(
            self.bus,
            lambda: self.feed.messages_accepted if self.feed is not None else 0,
            window=self.cfg.monitor.dead_letter_window,
            max_share=self.cfg.monitor.max_dead_letter_share,
        )
        await watcher.start()  # before the model loads: the explorers may fail tasks already

        async def trained_counts(trained: int, acked: int) -> None:
            await state.put(
                TRAINER_UNACKED, TrainedUnacked(trained=trained, acked=acked, ts=time.time())
            )

        feed = ExperienceFeed(
            self.bus,
            consumer,
            ticker,
            self._exhausted,
            starving=starving,
            group_size=self.resolved.repeat_times,
            hold_trained=self.resumable,
            trained_counts=trained_counts,
        )
        self.feed = feed
        await topology.attach(feed)  # answers splice/unsplice requests between fetches
        monitor = RawMonitor()
        trainer: Any = await anyio.to_thread.run_sync(
            lambda: PolicyTrainer(self.cfg, self.model_path, self.algorithm)
        )
        if trainer.world_size > 1:  # this is rank 0: it feeds the other ranks each step
            trainer = RankLeader(trainer)
            if self.resumable:
                log.warning(
                    "%s: %d trainer ranks: no resumable checkpoints (trainer.save_interval / "
                    "save_interval_seconds); a crashed trainer starts over",
                    self.name,
                    trainer.world_size,
                )
            self._ranks = True
            feed.hold_trained = False
        feed.validate = trainer.check_experience
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await self._resume(state, trainer, feed)
        self._emitted_step = self.step  # a resumed trainer's records are written up to it
        # from the streams' start (ordered consumers: nothing published meanwhile is
        # missed), or after what the resumed checkpoint's step had read
        await monitor.start(self.bus, after=self.monitor_resume)
        self.monitor = monitor
        strategy = await self._sample_strategy(trainer, feed)
        total = self.cfg.buffer.total_steps
        status = "failed"
        try:
            self.monitors = await anyio.to_thread.run_sync(
                MonitorSet.open, self.cfg, self.run_dir, self.role
            )
            self._emit_event = anyio.Event()

            with frozen_heap():  # the model's objects stay out of GC passes
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._emitter, state)
                    tg.start_soon(ticker.run)
                    tg.start_soon(watcher.watch)  # raises when dead letters pass the threshold
                    if self.cfg.synchronizer.sync_method == "jetstream":
                        tg.start_soon(self._publisher(state, trainer).run)
                    tg.start_soon(heartbeat_loop, state, self._heartbeat)
                    last_end = time.perf_counter()
                    self._saved_at = time.monotonic()  # the time trigger counts from here
                    while total is None or self.step < total:
                        step = self.step + 1
                        t0 = time.perf_counter()
                        try:
                            batch, sample_metrics, _samples = await strategy.sample(step)
                        except (StopAsyncIteration, StopIteration):
                            batch, sample_metrics = [], {}  # a Trinity-style reader ran dry
                        wait = time.perf_counter() - t0
                        if not batch:
                            log.info("%s: upstream exhausted after %d steps", self.name, self.step)
                            await watcher.check_final(self.step)  # raises if it all died
                            break
                        # never negative: experience from weights a killed trainer published
                        # after the checkpoint this one resumed from counts as fresh
                        staleness = [
                            max(0, self.version - int(e.model_version))
                            for e in batch
                            if _from_rollout(e)
                        ]
                        hf_seconds = 0.0
                        # once training began, the step is completed (counted, published,
                        # committed, recorded) even when the trainer is being cancelled: the
                        # checkpoint written on cancel then contains it
                        with anyio.CancelScope(shield=True):
                            async with anyio.create_task_group() as beside:
                                if not self.cfg.trainer_reads_dataset:  # the next batch meanwhile
                                    beside.start_soon(feed.prefetch, self.resolved.train_batch_size)
                                train_metrics = await anyio.to_thread.run_sync(
                                    trainer.train_step, batch
                                )
                                beside.cancel_scope.cancel()
                            self.step = step
                            self.version = step
                            self.trained += len(batch)
                            if self.policy.trainer_publishes_after(step) or (
                                total is not None and step == total
                            ):
                                await self._publish_weights(state, trainer, step)
                            # ack only now: an explorer that sees the backlog shrink also sees
                            # the new weights (held until the next checkpoint instead when
                            # checkpoints are resumable)
                            await feed.commit()
                            if (
                                self.cfg.trainer.save_interval
                                and step % self.cfg.trainer.save_interval == 0
                            ):
                                t_hf = time.perf_counter()
                                await anyio.to_thread.run_sync(
                                    trainer.save_hf_checkpoint,
                                    self.checkpoint_dir / f"global_step_{step}",
                                )
                                hf_seconds = time.perf_counter() - t_hf
                            record = self._record(
                                step,
                                batch,
                                staleness,
                                wait,
                                train_metrics,
                                sample_metrics,
                                monitor,
                                feed,
                            )
                            now = time.perf_counter()
                            self.idle_seconds += wait
                            record["trainer/idle_share"] = min(
                                1.0, wait / max(now - last_end, 1e-9)
                            )
                            record["time/trainer_step_period"] = now - last_end
                            last_end = now
                        trigger = self._checkpoint_trigger(step, total, feed)
                        if trigger is None:
                            self._queue_record(record)  # written while training goes on
                        else:
                            # the records before this step are on disk before the checkpoint
                            # that a restart resumes from (it keeps those, drops later ones);
                            # this step's is written with the checkpoint, which it times
                            self._checkpoint_record = record
                            await self._emitted_through(step - 1)
                            with anyio.CancelScope(shield=True):
                                await self._save_resumable(
                                    state,
                                    trainer,
                                    feed,
                                    trigger=trigger,
                                    records=[record],
                                    extra_seconds=hf_seconds,
                                )
                            self._checkpoint_record = None
                        del batch, _samples  # freed now: not counted as waiting for the next one
                        if time.monotonic() - self._acked_below_at >= ACKED_BELOW_EVERY_S:
                            await self._record_acked_below(state, feed)  # no fetch in flight
                    if self.publisher is not None:  # the last version reaches the explorers
                        await self.publisher.flush()
                    await self._emitted_through(self.step)
                    if self.resumable and 0 < self.step != self.saved_step:
                        with anyio.CancelScope(shield=True):
                            await self._save_resumable(state, trainer, feed, trigger="end")
                    tg.cancel_scope.cancel()
            final = await anyio.to_thread.run_sync(
                trainer.save_hf_checkpoint, self.checkpoint_dir / f"global_step_{self.step}"
            )
            log.info("%s: final checkpoint %s", self.name, final)
            if isinstance(trainer, RankLeader):
                await anyio.to_thread.run_sync(trainer.stop)  # the other ranks exit
            status = "finished"
        except anyio.get_cancelled_exc_class():
            status = "stopped"  # Ctrl-C / SIGTERM: not a failure
            await self._save_on_cancel(state, trainer, feed, ticker)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.monitors.close)
                await monitor.stop()
                await watcher.stop()
                await topology.close()
                await feed.consumer.unsubscribe()
                try:
                    await state.heartbeat(self._heartbeat(status))
                    await state.put(
                        TRAINER_DONE, TrainerDone(step=self.step, status=status, ts=time.time())
                    )
                    await state.set_status(status)
                except Exception as exc:  # noqa: BLE001 - the connection may be gone
                    log.warning("%s: could not record final status: %s", self.name, exc)

    def _heartbeat(self, status: str | None = None) -> Heartbeat:
        """This trainer's heartbeat; ``status``: how it ended (its last one)."""
        return Heartbeat(
            actor=self.name,
            role=self.role,
            ts=time.time(),
            step=self.step,
            version=self.version,
            status=status,
        )

    async def _open_dataset(
        self,
        trainer: Any,
        storage: StorageConfig,
        key_path: str,
        *,
        schema: str,
        epochs: int | None,
    ) -> DatasetSource:
        """Tokenise ``storage`` (a data file or dataset directory) in a worker thread; errors
        name ``key_path``."""
        mp = self.cfg.model

        def load() -> list[Any]:
            return load_dataset_experiences(
                storage,
                trainer.tokenizer,
                schema=schema,
                key_path=key_path,
                max_prompt=mp.max_prompt_tokens,
                max_response=mp.max_response_tokens,
            )

        exps = await anyio.to_thread.run_sync(load)
        for e in exps:
            problem = trainer.check_experience(e)
            if problem:
                raise ConfigError(key_path, f"{storage.path}: {problem}")
        return DatasetSource(
            exps,
            epochs=epochs,
            shuffle=storage.shuffle,
            seed=storage.seed,
            unit=2 if schema == "dpo" else 1,
        )

    async def _sample_strategy(self, trainer: Any, feed: ExperienceFeed) -> Any:
        """The algorithm's sample strategy on the trainer's input.

        ``mode: train`` reads ``buffer.trainer_input.experience_buffer`` (SFT /
        DPO data, ``total_epochs`` passes), the other modes (and ``mode: train``
        with a ``queue`` experience buffer) ``exp.train``. A
        strategy whose constructor takes ``expert_source`` (MIX) gets the
        auxiliary buffer its ``sft_dataset_name`` names, cycled; strategies that
        call :func:`rftstream.buffer.get_buffer_reader` themselves (Trinity-RFT
        style) get the same inputs through it.
        """
        cfg = self.cfg
        tin = cfg.buffer.trainer_input
        schema = str(getattr(self.algorithm.algorithm_type, "schema", "experience"))
        source: Any = feed
        if cfg.trainer_reads_dataset:
            if tin.experience_buffer is None:
                raise ConfigError(
                    "buffer.trainer_input.experience_buffer", "is required in mode: train"
                )
            # the dataset's own total_epochs, else buffer.total_epochs (as Trinity-RFT)
            epochs = dataset_epochs(cfg, tin.experience_buffer)
            source = await self._open_dataset(
                trainer,
                tin.experience_buffer,
                "buffer.trainer_input.experience_buffer",
                schema=schema if schema in ("dpo", "cpt") else "sft",
                epochs=epochs,
            )
        datasets: dict[str, DatasetSource] = {}

        def open_aux(storage: StorageConfig) -> DatasetSource:
            for name, aux in tin.auxiliary_buffers.items():
                if aux == storage and name in datasets:
                    return datasets[name]
            raise ConfigError(
                "buffer.trainer_input.auxiliary_buffers",
                f"a sample strategy asked for storage {storage.name or storage.path!r}, "
                f"which is not one of {sorted(tin.auxiliary_buffers)}",
            )

        for name, aux in tin.auxiliary_buffers.items():
            datasets[name] = await self._open_dataset(
                trainer,
                aux,
                f"buffer.trainer_input.auxiliary_buffers.{name}",
                schema="sft",
                epochs=None,
            )
        buffer_cfg = msgspec.structs.replace(cfg.buffer, pad_token_id=trainer.pad_token_id)
        extra: dict[str, Any] = {}
        cls = self.algorithm.sample_strategy_cls
        params = inspect.signature(cls.__init__).parameters
        if "current_version" in params:  # staleness_control
            extra["current_version"] = lambda: self.version
        if "expert_source" in params:
            name = self.algorithm.sample_strategy_args.get("sft_dataset_name", "sft_dataset")
            if name in datasets:
                extra["expert_source"] = datasets[name]
        inputs = TrainerInputs(tin.experience_buffer, source, open_aux)
        with trainer_inputs(inputs):
            return self.algorithm.create_sample_strategy(buffer_cfg, source, **extra)

    async def _resume(self, state: RunState, trainer: Any, feed: ExperienceFeed) -> None:
        """Pick this start's incarnation; with a committed resumable checkpoint (KV
        ``trainer.checkpoint``) and ``continue_from_checkpoint``, load it (see the module
        docstring) and publish its weights. Blocks for the loading.

        Raises:
            CheckpointError: the checkpoint the record names cannot be loaded.
        """
        record = await state.get(TRAINER_CHECKPOINT)
        previous = await state.latest_weights()
        pending = await state.get(WEIGHTS_PENDING)
        earlier = [r.incarnation for r in (record, previous, pending) if r is not None]
        self.incarnation = max(earlier) + 1 if earlier else 0
        if pending is not None:  # an earlier trainer's version that may never go out
            await state.delete(WEIGHTS_PENDING)
        if record is None or not self.cfg.continue_from_checkpoint:
            if record is not None:
                log.warning(
                    "%s: continue_from_checkpoint is false: ignoring the checkpoint of step %d "
                    "(%s) and training from model.model_path at step 1",
                    self.name,
                    record.step,
                    record.path,
                )
            # an earlier trainer of this run (not a first start) may have written records:
            # this one trains from step 1 again, so they move to the discarded files
            if earlier or (await state.get(TRAINER_STEP) or 0) > 0:
                moved = await self._discard_records_after(0)
                if moved:
                    log.info(
                        "%s: restarted in run %s without a checkpoint to continue from "
                        "(incarnation %d): the %d step record(s) of the earlier trainer "
                        "moved to %s",
                        self.name,
                        self.names.run,
                        self.incarnation,
                        moved,
                        self.metrics_path.with_name("metrics.discarded.jsonl"),
                    )
        else:
            directory = Path(record.path).parent.parent
            engines = [trainer.engine] + ([trainer.critic] if trainer.critic is not None else [])

            def load() -> tuple[ckpt.ResumeState, Any]:
                loaded = ckpt.load_resumable(directory, record.step, engines)
                digests = ckpt.read_trained_digests(directory, record.step)
                schedulers = (trainer.scheduler, trainer.critic_scheduler)
                for scheduler, sd in zip(schedulers, loaded.lr_schedulers, strict=False):
                    if scheduler is not None and sd is not None:
                        scheduler.load_state_dict(sd)
                ckpt.restore_rng(loaded.rng)
                return loaded, digests

            loaded, digests = await anyio.to_thread.run_sync(load)
            self.step = loaded.step
            self.version = loaded.version
            self.trained = loaded.trained
            trainer.global_step = loaded.step
            self.saved_step = self.resumed_from = loaded.step
            feed.mark_trained(loaded.trained_uids, digests)
            self.monitor_resume = dict(loaded.monitor_through)
            moved = await self._discard_records_after(loaded.step)
            log.info(
                "%s: resumed from the checkpoint of step %d (%s), incarnation %d; "
                "%d step(s) after it are trained again",
                self.name,
                loaded.step,
                record.path,
                self.incarnation,
                moved,
            )
            await state.put(TRAINER_STEP, self.step)
        if previous is not None:  # explorers leave the weights of the trainer that is gone
            await self._publish_weights(state, trainer, self.step, inline=True)

    async def _discard_records_after(self, step: int) -> int:
        """Move the records of the steps after ``step`` from ``metrics.jsonl`` and
        ``trained_uids.jsonl`` to their ``*.discarded.jsonl`` files; returns how many
        step records moved."""
        moved = []
        for path in (self.metrics_path, self.uids_path):
            discarded = path.with_name(path.stem + ".discarded.jsonl")
            moved.append(
                await anyio.to_thread.run_sync(ckpt.drop_records_after, path, step, discarded)
            )
        return moved[0]

    async def _emitted_through(self, step: int) -> None:
        """Block until the record of ``step`` is written."""
        while self._emitted_step < step:
            if self._emit_event is None:
                self._emit_event = anyio.Event()
            await self._emit_event.wait()

    def _mark_emitted(self, step: int) -> None:
        self._emitted_step = step
        if self._emit_event is not None:
            self._emit_event.set()
        self._emit_event = anyio.Event()

    def _queue_record(self, record: dict[str, Any]) -> None:
        """Hand a step's record to :meth:`_emitter`."""
        self._records.append(record)
        if self._record_added is not None:
            self._record_added.set()

    async def _emitter(self, state: RunState) -> None:
        """Write the queued step records in order (:meth:`_emit`); blocks until cancelled.
        Each record is written whole (shielded): one cut short by a cancel would be a
        line in ``metrics.jsonl`` without its ``trained_uids.jsonl`` line, or a step in
        KV without its line. A record is taken off the queue once written."""
        while True:
            while self._records:
                record = self._records[0]
                with anyio.CancelScope(shield=True):
                    await self._emit(state, record)
                self._records.popleft()
                self._mark_emitted(record["step"])
            self._record_added = anyio.Event()
            await self._record_added.wait()

    async def _save_resumable(
        self,
        state: RunState,
        trainer: Any,
        feed: ExperienceFeed,
        *,
        trigger: str,
        records: Sequence[dict[str, Any]] = (),
        extra_seconds: float = 0.0,
    ) -> None:
        """Write the resumable checkpoint of ``self.step``, write ``records`` (the step
        records not written yet, up to this step's: call it with the emitter idle), commit
        the checkpoint in KV, then ack the messages it contains and delete older
        checkpoints. Blocks for the writing.

        The last of ``records`` gets ``checkpoint/trigger`` and ``checkpoint/seconds``
        (the time of the write, plus ``extra_seconds``: the HF checkpoint of that step).

        Raises:
            CheckpointError: DeepSpeed or the disk failed (nothing is acked then).
        """
        t0 = time.perf_counter()
        step = self.step
        if len(records) == 1:  # explorers (max_staleness) need not wait for the write
            await state.put(TRAINER_STEP, step)
        engines = [trainer.engine] + ([trainer.critic] if trainer.critic is not None else [])
        resume_state = ckpt.ResumeState(
            step=step,
            version=self.version,
            incarnation=self.incarnation,
            trained=self.trained,
            rng=ckpt.capture_rng(),
            trained_uids=feed.trained_uids(),
            monitor_through=dict(self.monitor.taken_through) if self.monitor else {},
            lr_schedulers=[
                s.state_dict() if s is not None else None
                for s in (trainer.scheduler, trainer.critic_scheduler)
            ],
            ts=time.time(),
        )
        path = await anyio.to_thread.run_sync(
            ckpt.save_resumable,
            self.checkpoint_dir,
            step,
            engines,
            resume_state,
            feed.trained_digests(),
        )
        seconds = time.perf_counter() - t0 + extra_seconds
        if records:
            records[-1]["checkpoint/trigger"] = trigger
            records[-1]["checkpoint/seconds"] = seconds
        for record in records:  # on disk before the checkpoint is committed
            await self._emit(state, record)
            self._mark_emitted(record["step"])
        await state.put(
            TRAINER_CHECKPOINT,
            CheckpointRecord(
                step=step,
                version=self.version,
                incarnation=self.incarnation,
                path=str(path.resolve()),
                ts=time.time(),
            ),
        )
        previous, self.saved_step = self.saved_step, step
        await feed.release_trained()
        keep = {step} | ({previous} if previous is not None else set())
        await anyio.to_thread.run_sync(ckpt.prune, self.checkpoint_dir, keep)
        self._saved_at = time.monotonic()
        self._longest_save = max(self._longest_save, seconds)
        log.info(
            "%s: resumable checkpoint of step %d (%s, %.2f s): %s",
            self.name,
            step,
            trigger,
            seconds,
            path,
        )

    async def _save_on_cancel(
        self, state: RunState, trainer: Any, feed: ExperienceFeed, ticker: InProgressTicker
    ) -> None:
        """On cancel (the task group is gone): write the step records not written yet and,
        if resumable checkpoints are on and the last completed step is newer than the last
        checkpoint, that step's checkpoint, which acks the messages held for it. Shielded,
        for at most :data:`CANCEL_SAVE_MIN_S` (or 3x the longest checkpoint so far);
        held messages stay in progress meanwhile. A failure or the time running out is
        logged only: the previous checkpoint stays in force."""
        pending = list(self._records)
        self._records.clear()
        if self._checkpoint_record is not None:
            pending.append(self._checkpoint_record)
            self._checkpoint_record = None
        due = self.resumable and 0 < self.step != self.saved_step
        if not pending and not due:
            return
        limit = max(CANCEL_SAVE_MIN_S, 3 * self._longest_save)
        with anyio.move_on_after(limit, shield=True) as scope:
            async with anyio.create_task_group() as tick:
                tick.start_soon(ticker.run)
                try:
                    if due:
                        await self._save_resumable(
                            state, trainer, feed, trigger="cancel", records=pending
                        )
                    else:
                        for record in pending:
                            await self._emit(state, record)
                            self._mark_emitted(record["step"])
                except Exception as exc:  # noqa: BLE001 - exiting anyway
                    log.warning(
                        "%s: cancelled: the checkpoint of step %d failed (the one of step %s "
                        "stays in force): %s",
                        self.name,
                        self.step,
                        self.saved_step,
                        exc,
                    )
                finally:
                    tick.cancel_scope.cancel()
        if scope.cancelled_caught:
            log.warning(
                "%s: cancelled: the checkpoint of step %d did not finish within %.0f s (the "
                "one of step %s stays in force)",
                self.name,
                self.step,
                limit,
                self.saved_step,
            )

    def _publisher(self, state: RunState, trainer: Any) -> WeightPublisher:
        """The jetstream publisher of this trainer start (made on first use)."""
        if self.publisher is None:
            sync = self.cfg.synchronizer
            self.publisher = WeightPublisher(
                self.bus,
                state,
                incarnation=self.incarnation,
                delta=sync.weights_delta,
                keyframe_ratio=sync.weights_keyframe_ratio,
                lora=trainer.lora_wire(),
            )
        return self.publisher

    async def _publish_weights(
        self, state: RunState, trainer: Any, step: int, *, inline: bool = False
    ) -> None:
        """Make version ``step`` available by ``synchronizer.sync_method``; what the trainer
        waits for is counted in ``sync/trainer_blocking_seconds``.

        First KV ``weights.pending`` (every method: explorers count ``max_staleness``
        from it). ``jetstream``: meanwhile a snapshot in the wire dtype (blocks for the
        copy; a collective under ZeRO-3), which the publisher sends in the background
        (``inline``, or a version of at most ``SMALL_VERSION_BYTES``: now, before
        returning: a resumed trainer's first version, before the publisher runs; a
        small model's, whose publish takes milliseconds). ``checkpoint`` / ``memory``: the file or the store, then
        the pointer, before returning.
        """
        method = self.cfg.synchronizer.sync_method
        t0 = time.perf_counter()
        pending = WeightsPending(version=step, incarnation=self.incarnation, ts=time.time())
        if method == "jetstream":
            dtype = WIRE_DTYPES[weights_wire_dtype(self.cfg)]
            # the snapshot is copied while the pending record's put waits for its ack:
            # both are done before anything of the version goes out
            async with anyio.create_task_group() as both:
                both.start_soon(state.put, WEIGHTS_PENDING, pending)
                snapshot = await anyio.to_thread.run_sync(trainer.wire_state_dict, dtype)
            publisher = self._publisher(state, trainer)
            blocking = time.perf_counter() - t0
            small = sum(t.numel() * t.element_size() for t in snapshot.values())
            if inline or small <= SMALL_VERSION_BYTES:
                # a small version goes out before the batch is acked, as fast as in the
                # background (the next step would hold the GIL) and sooner for explorers
                await publisher.publish_now(step, step, snapshot, blocking)
            else:
                publisher.submit(step, step, snapshot, blocking)
            self._sync_blocking += time.perf_counter() - t0
            return
        await state.put(WEIGHTS_PENDING, pending)
        weights_dir = self.checkpoint_dir / "weights"

        def _save() -> tuple[Any, int]:
            ptr = save_weights(
                method,
                self.names.run,
                step,
                trainer.state_dict(),
                weights_dir,
                step=step,
                incarnation=self.incarnation,
            )
            return ptr, Path(ptr.uri).stat().st_size if method == "checkpoint" else 0

        ptr, size = await anyio.to_thread.run_sync(_save)
        await state.set_latest_weights(ptr)
        self._sync_blocking += time.perf_counter() - t0
        if size:
            self._sync_bytes = float(size)

    def _sync_metrics(self) -> dict[str, float]:
        """This step's ``sync/*`` figures: the trainer's blocking time, and what the
        versions that went out since the previous step cost."""
        out = {"sync/trainer_blocking_seconds": self._sync_blocking}
        self._sync_blocking = 0.0
        if self._sync_bytes is not None:
            out["sync/bytes"] = self._sync_bytes
            self._sync_bytes = None
        pub = self.publisher
        if pub is None:
            return out
        done = pub.take_published()
        if done:
            last = done[-1]
            out.update(
                {
                    "sync/published_version": float(last.version),
                    "sync/bytes": float(sum(r.payload_bytes for r in done)),
                    "sync/raw_bytes": float(last.raw_bytes),
                    "sync/keyframes": float(sum(r.keyframe for r in done)),
                    "sync/encode_seconds": last.encode_s,
                    "sync/publish_seconds": last.publish_s,
                }
            )
        out["sync/versions_total"] = float(pub.versions_total)
        out["sync/bytes_total"] = float(pub.bytes_total)
        out["sync/skipped_versions_total"] = float(pub.skipped)
        return out

    def _record(
        self,
        step: int,
        batch: list[Any],
        staleness: list[int],
        wait: float,
        train_metrics: dict[str, float],
        sample_metrics: dict[str, Any],
        monitor: RawMonitor,
        feed: ExperienceFeed,
    ) -> dict[str, Any]:
        rewards = [
            float(e.reward)
            for e in batch
            if _from_rollout(e) and e.reward is not None and not math.isnan(float(e.reward))
        ]
        record: dict[str, Any] = {"step": step, "ts": time.time()}
        record[_UIDS] = [e.eid.uid for e in batch]
        record.update(monitor.take())
        for stage, count in feed.taken_stages.items():
            record[f"experience/trained_from/{stage}"] = count
        feed.taken_stages.clear()
        record.update(
            {
                "reward/train_mean": sum(rewards) / len(rewards) if rewards else None,
                "reward/train_min": min(rewards) if rewards else None,
                "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
                "staleness/max": max(staleness) if staleness else 0,
                # experiences per staleness value (metrics.jsonl only: not a scalar)
                "staleness/counts": {str(k): staleness.count(k) for k in sorted(set(staleness))},
                "time/trainer_wait": wait,
                "experience/trained": len(batch),
                "experience/trained_total": self.trained,
                "experience/duplicates_dropped": feed.duplicates,
                "experience/dead_lettered": feed.dead_lettered,
                "weights/version": self.version,
            }
        )
        record.update(self._sync_metrics())
        record.update({k: v for k, v in sample_metrics.items() if isinstance(v, (int, float))})
        record.update(train_metrics)
        return record

    async def _emit(self, state: RunState, record: dict[str, Any]) -> None:
        """Publish one step's record: ``trainer.step`` in KV first (it wakes explorers paused
        by ``max_staleness``), then the metrics stream, ``metrics.jsonl``, the monitors
        (``monitor.monitor_type``) and ``on_step``."""
        uids = record.pop(_UIDS, [])
        await state.put(TRAINER_STEP, record["step"])
        values = {
            k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"
        }
        await self.bus.publish_metrics(self.role, record["step"], values)
        line = (
            json.dumps(record, allow_nan=False, default=float)
            if _finite(record)
            else json.dumps(nan_to_none(record))
        )
        await anyio.to_thread.run_sync(append_line, self.metrics_path, line)
        if self.monitors:
            await anyio.to_thread.run_sync(self.monitors.log, record, record["step"])
        uids_line = json.dumps({"step": record["step"], "uids": uids})
        await anyio.to_thread.run_sync(append_line, self.uids_path, uids_line)
        if self.on_step is not None:
            self.on_step(record)


def _from_rollout(exp: Any) -> bool:
    """False for dataset rows (SFT/DPO data, MIX expert data): no rollout reward or version."""
    return not (exp.info.get("is_expert") or exp.eid.batch == "dataset")


def _finite(record: dict[str, Any]) -> bool:
    return all(not (isinstance(v, float) and not math.isfinite(v)) for v in record.values())
