"""The explorer's taskset publisher: the training tasksets into the task stream, once per run.

The training tasksets (``buffer.explorer_input.taskset`` and ``tasksets``, see
:func:`rftstream.tasksets.plan_tasks`) are published into ``RFT_<RUN>_TASKS``
once per run, by one explorer, at most ``publish_lead`` tasks ahead of what
explorers have taken. Which explorer publishes, its progress and the take-over
of a dead publisher are the claim protocol of :mod:`rftstream.control.taskset_claim`;
:class:`TasksetPublisher` performs its actions on the run's KV. ``Nats-Msg-Id``
``task:<taskset>:<epoch>:<index>`` makes a re-published task a duplicate the
stream drops (within ``nats.dedup_window``). ``taskset.published``
(:class:`~rftstream.wire.TasksetRecord`) marks the end.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import anyio.to_thread

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config.resolve import dataset_epochs
from rftstream.config.schema import Config, TasksetConfig
from rftstream.control import Clock, KeyWrites
from rftstream.control.taskset_claim import (
    Action,
    ClaimLost,
    ClaimProtocol,
    ClaimState,
    Done,
    Event,
    Look,
    Observed,
    Progressed,
    Seeking,
    StartPublishing,
    Tick,
    Wait,
    WriteClaim,
    WriteFailed,
    Wrote,
)
from rftstream.errors import BusError, SchemaError
from rftstream.wire import (
    TASKSET_CLAIM,
    TASKSET_PUBLISHED,
    TaskMsg,
    TasksetClaim,
    TasksetRecord,
    encode_json,
)

log = logging.getLogger(__name__)

__all__ = ["PUBLISH_CHUNK", "TasksetPublisher"]

PUBLISH_CHUNK = 64  # tasks published concurrently between two progress records


class _ClaimTakenOver(Exception):
    """Another explorer took the taskset claim over."""


class TasksetPublisher:
    """Publishes the run's training tasksets once, or waits while another explorer does.

    ``claim_stale_s``, ``claim_keepalive_s``, ``claim_poll_s`` and ``publish_lead`` may be changed
    before :meth:`run` (tests shorten them).
    """

    claim_stale_s = 30.0  # a taskset claim unchanged this long belongs to a dead publisher
    claim_keepalive_s = 5.0
    claim_poll_s = 2.0  # the longest look-to-look pause without a write (ClaimProtocol.poll_s)
    publish_lead = 1024  # tasks published ahead of the explorers (the rest as they are taken)

    def __init__(
        self,
        cfg: Config,
        bus: Bus,
        name: str,
        training_sets: list[tuple[str, TasksetConfig]],
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.names = bus.names
        self.name = name
        self.training_sets = training_sets
        # both set again by each _seek, with the timing attributes as they are then
        self._protocol = ClaimProtocol(name)
        self._claim: ClaimState = Seeking()
        self._claim_lock = anyio.Lock()  # one claim write at a time (chunks vs keep-alive)
        # what the claim's staleness is judged by (its revision not moving for claim_stale_s)
        self.clock: Clock = time.monotonic

    async def run(self, state: RunState) -> None:
        """Publish every task of every epoch of the training tasksets, once per run.

        Blocks until the taskset is in the task stream (published here or by
        another explorer; the wait for a claim is bounded by
        ``synchronizer.sync_timeout``: :class:`TimeoutError`). A KV failure
        while recording progress raises :class:`BusError`. Cancelling stops
        after the current await; the claim then goes stale and another
        explorer (or this one, restarted) publishes the rest.
        """
        while True:
            with anyio.fail_after(self.cfg.synchronizer.sync_timeout):
                start = await self._seek(state)
            if start is None:
                return
            try:
                await self._publish_plan(state, start)
                return
            except _ClaimTakenOver:
                log.warning("%s: another explorer took the taskset over", self.name)

    # ------------------------------------------------------------ the claim
    async def _seek(self, state: RunState) -> int | None:
        """Run the protocol until the claim is ours (the first plan position to publish)
        or the taskset is published (None). Blocks."""
        self._protocol = ClaimProtocol(
            self.name,
            stale_s=self.claim_stale_s,
            keepalive_s=self.claim_keepalive_s,
            poll_s=self.claim_poll_s,
        )
        self._claim, actions = self._protocol.start()
        # the protocol's waits end early at a write of the claim or of taskset.published
        async with KeyWrites(state.kv, (TASKSET_CLAIM, TASKSET_PUBLISHED)) as writes:
            while True:
                event: Event | None = None
                for action in actions:  # only the last one answers with an event
                    if isinstance(action, StartPublishing):
                        if action.taken_over_from:
                            log.warning(
                                "%s: taking the taskset over from %s at task %d (%s)",
                                self.name,
                                action.taken_over_from,
                                action.start,
                                "claim went stale" if action.stale else "its own earlier claim",
                            )
                        return action.start
                    if isinstance(action, Done):
                        return None
                    event = await self._perform(state, action, writes)
                if event is None:
                    raise RuntimeError(f"taskset claim: no event after {actions!r}")
                actions = self._step(event)

    def _step(self, event: Event) -> list[Action]:
        self._claim, actions = self._protocol.step(self._claim, event, self.clock())
        return actions

    async def _perform(self, state: RunState, action: Action, writes: KeyWrites) -> Event | None:
        """Do one I/O action of the protocol; its answer as an event (None for a wait).
        A :class:`Wait` ends at its time or at the first write ``writes`` sees."""
        if isinstance(action, Wait):
            await writes.wait(action.seconds)
            return None
        if isinstance(action, Look):
            return await self._look(state)
        if isinstance(action, WriteClaim):
            try:
                return Wrote(revision=await self._write_claim(state, action))
            except BusError as exc:  # not a lost race: a KV hiccup
                log.warning("%s: taskset claim: %s; retrying", self.name, exc)
                return WriteFailed(reason=str(exc))
        raise TypeError(f"not an I/O action: {action!r}")

    async def _look(self, state: RunState) -> Observed:
        if await state.get(TASKSET_PUBLISHED) is not None:
            return Observed(published=True)
        try:
            claim, revision = await state.entry(TASKSET_CLAIM)
        except SchemaError:  # a claim that does not decode, at a revision: wait for it to change
            return Observed(published=False, revision=await state.revision(TASKSET_CLAIM))
        return Observed(published=False, claim=claim, revision=revision)

    async def _write_claim(self, state: RunState, action: WriteClaim) -> int | None:
        """Create or compare-and-set the claim; its revision, None when another was first."""
        claim = TasksetClaim(
            by=self.name, ts=time.time(), seq=action.seq, taken_over_from=action.taken_over_from
        )
        rev = await state.cas(TASKSET_CLAIM, claim, action.revision)
        return None if rev is None else int(rev)

    async def _record(self, state: RunState, event: Progressed | Tick) -> None:
        """Record progress (or keep the claim alive when due). Raises :class:`_ClaimTakenOver`
        when another explorer took the claim over, :class:`BusError` on KV trouble.
        Cancelled during its write, the write's outcome is left open (see
        :mod:`rftstream.control.taskset_claim`)."""
        async with self._claim_lock:
            for action in self._step(event):  # nothing, or one WriteClaim
                if not isinstance(action, WriteClaim):
                    raise TypeError(f"taskset claim: unexpected {action!r} while publishing")
                try:
                    revision = await self._write_claim(state, action)
                except BaseException as exc:
                    self._step(WriteFailed(reason=repr(exc)))
                    raise
                if any(isinstance(a, ClaimLost) for a in self._step(Wrote(revision=revision))):
                    raise _ClaimTakenOver

    # ------------------------------------------------------------ the plan
    async def _publish_plan(self, state: RunState, start: int) -> None:
        """Load the training tasksets and publish the plan from ``start`` on; then the record."""
        from rftstream.tasksets import TasksetPlan, load_taskset, plan_tasks

        lost = False

        async def keepalive(scope: anyio.CancelScope) -> None:
            nonlocal lost
            while True:
                await anyio.sleep(self.claim_keepalive_s)
                try:
                    await self._record(state, Tick())
                except _ClaimTakenOver:
                    lost = True
                    scope.cancel()
                    return

        sets: list[tuple[TasksetConfig, list[dict[str, Any]]]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(keepalive, tg.cancel_scope)
            for key, ts in self.training_sets:
                rows = await anyio.to_thread.run_sync(load_taskset, ts, key)
                sets.append((ts, rows))
            tg.cancel_scope.cancel()
        if lost:
            raise _ClaimTakenOver
        plans = [
            TasksetPlan(
                name=ts.name,
                rows=len(rows),
                epochs=dataset_epochs(self.cfg, ts),
                shuffle=ts.shuffle,
                seed=ts.seed,
            )
            for ts, rows in sets
        ]
        plan = plan_tasks(plans)
        rows_of = {ts.name: rows for ts, rows in sets}
        mixed = len(sets) > 1
        errors: list[Exception] = []

        async def publish(msg: TaskMsg) -> None:
            try:
                await self.publish_task(msg)
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                errors.append(exc)

        for lo in range(start, len(plan), PUBLISH_CHUNK):
            async with anyio.create_task_group() as tg:
                for p in plan[lo : lo + PUBLISH_CHUNK]:
                    msg = TaskMsg(
                        taskset=p.taskset,
                        index=p.index,
                        epoch=p.epoch,
                        seq=p.seq,
                        raw_task=rows_of[p.taskset][p.index],
                        task_id=f"{p.taskset}:{p.index}" if mixed else p.index,
                    )
                    tg.start_soon(publish, msg)
            if errors:
                raise errors[0]
            done = min(lo + PUBLISH_CHUNK, len(plan))
            await self._record(state, Progressed(seq=done))
            if done < len(plan):
                await self._stay_ahead(state)
        per_set = {p.name: p.rows * p.epochs for p in plans}
        await state.put(
            TASKSET_PUBLISHED,
            TasksetRecord(
                count=len(plan),
                epochs=max(p.epochs for p in plans),
                rows=sum(p.rows for p in plans),
                by=self.name,
                ts=time.time(),
                tasksets=per_set,
            ),
        )
        log.info(
            "%s: published %d tasks (%s)",
            self.name,
            len(plan) - start,
            ", ".join(f"{p.name}: {p.rows} rows x {p.epochs} epochs" for p in plans),
        )

    async def _stay_ahead(self, state: RunState) -> None:
        """Wait while ``publish_lead`` tasks or more wait in the queue, keeping the claim alive.

        The plan is published as it is consumed, not all at once: a long run's
        tens of thousands of tasks would otherwise take the explorer's first
        seconds (and their CPU) before any rollout.
        """
        n = self.names
        while True:
            try:
                info = await self.bus.consumer_state(n.tasks_stream, n.explorer_consumer)
                waiting = info.num_pending
            except BusError as exc:
                log.warning("%s: task queue info: %s; publishing on", self.name, exc)
                return
            if waiting < self.publish_lead:
                return
            await self._record(
                state, Tick()
            )  # raises _ClaimTakenOver when another explorer took over
            await anyio.sleep(0.25)

    async def publish_task(self, msg: TaskMsg) -> None:
        """Publish one task to the task stream (deduplicated by its position). Blocks."""
        await self.bus.publish(
            self.names.tasks_subject,
            encode_json(msg),
            headers={
                "Rft-Schema": msg.schema,
                "Rft-Task": f"{msg.taskset}/{msg.epoch}/{msg.index}",
                "Rft-Actor": self.name,
            },
            msg_id=f"task:{msg.taskset}:{msg.epoch}:{msg.index}",
        )
