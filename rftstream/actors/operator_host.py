"""The operator host: runs an experience pipeline between two stage subjects.

It pulls up to ``batch_messages`` groups from ``exp.<from>`` (a durable shared
by all replicas of this stage), runs the operators on all their experiences at
once, regroups the survivors by task group and publishes each group to
``exp.<to>`` with ``Nats-Msg-Id = "<to>:<input id>"`` (so a redelivered input
is never stored twice downstream), then acks the inputs.

Failures: a body that does not decode is dead-lettered at once. When the
pipeline raises, the batch is retried with backoff up to ``max_retries``
times, then every input of the batch goes to ``dlq.<from>`` with the exception
and the stage in its headers, and the stage keeps running.

Cancelling :meth:`OperatorHost.run` leaves the current batch unacked: it is
redelivered (to this or another replica) after ``ack_wait``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import anyio
from nats.aio.msg import Msg

from rftstream.actors.common import InProgressTicker, heartbeat_loop
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.errors import RftError, SchemaError
from rftstream.experience import H_MSG_ID, Experience, decode_group

log = logging.getLogger(__name__)


class OperatorHost:
    """One replica of one pipeline stage."""

    role = "operator"

    def __init__(
        self,
        bus: Bus,
        pipeline: Any,
        *,
        from_stage: str,
        to_stage: str,
        name: str = "operator",
        batch_messages: int = 16,
        max_retries: int = 3,
        fetch_timeout: float = 0.5,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        start_seq: int | None = None,
    ) -> None:
        self.start_seq = start_seq  # a spliced stage starts where the trainer stopped reading
        self.on_progress = on_progress
        self.bus = bus
        self.names = bus.names
        self.pipeline = pipeline
        self.from_stage = from_stage
        self.to_stage = to_stage
        self.name = name
        self.batch_messages = batch_messages
        self.max_retries = max_retries
        self.fetch_timeout = fetch_timeout
        self.counters: dict[str, float] = defaultdict(float)
        self.batches = 0

    async def run(self) -> None:
        """Process until the run ends. Blocks; cancel to stop."""
        await self.bus.ensure_consumer(
            self.names.exp_stream,
            self.names.stage_consumer(self.from_stage, self.to_stage),
            self.names.exp_subject(self.from_stage),
            description=f"run {self.names.run}: operator pipeline {self.from_stage} -> {self.to_stage}",
            role="operator",
            start_seq=self.start_seq,
        )
        consumer = await self.bus.pull(
            self.names.exp_stream, self.names.stage_consumer(self.from_stage, self.to_stage)
        )
        state = RunState(await self.bus.kv())
        ticker = InProgressTicker(self.bus.cfg.ack_wait / 3)
        await self.pipeline.prepare()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker.run)
                tg.start_soon(
                    heartbeat_loop, state, self.name, self.role, lambda: dict(self.counters)
                )
                idle_checks = 0
                while True:
                    msgs = await consumer.fetch(self.batch_messages, timeout=self.fetch_timeout)
                    if not msgs:
                        idle_checks += 1
                        if idle_checks % 4 == 0 and await state.status() in (
                            "finished",
                            "failed",
                            "stopped",
                        ):
                            break
                        continue
                    for m in msgs:
                        ticker.hold(m)
                    try:
                        await self.process_batch(msgs)
                    finally:
                        for m in msgs:
                            ticker.release(m)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.unsubscribe()
                await self.pipeline.close()

    async def process_batch(self, msgs: list[Msg]) -> None:
        """Decode, run the pipeline, publish survivors, ack inputs (or dead-letter them)."""
        t0 = time.perf_counter()
        decoded: list[tuple[Msg, list[Experience]]] = []
        for m in msgs:
            try:
                decoded.append((m, decode_group(m.data)))
            except SchemaError as exc:
                await self.bus.dead_letter(self.from_stage, m, f"{self.name}: {exc}")
                self.counters["dead_lettered_messages"] += 1
        if not decoded:
            return
        exps = [e for _, group in decoded for e in group]
        group_msg_id: dict[str, str] = {}
        for m, group in decoded:
            mid = (m.headers or {}).get(H_MSG_ID) or f"{m.subject}:{m.metadata.sequence.stream}"
            for e in group:
                group_msg_id.setdefault(
                    e.group_id, mid
                )  # keep "#<part>": parts must not dedup each other
        out, metrics, reason = await self._process_with_retry(
            exps, retries=self.max_retries if len(decoded) == 1 else 1
        )
        if out is None:
            if len(decoded) > 1:  # isolate the poison message: every input on its own
                for m, _ in decoded:
                    await self.process_batch([m])
                return
            await self.bus.dead_letter(self.from_stage, decoded[0][0], reason)
            self.counters["dead_lettered_messages"] += 1
            return
        groups: dict[str, list[Experience]] = defaultdict(list)
        for e in out:
            groups[e.group_id].append(e)
        try:
            for gid, group in groups.items():
                base = group_msg_id.get(gid) or f"group:{gid}"
                await self.bus.publish_group(
                    self.to_stage, group, msg_id=f"{self.to_stage}:{base}", group_id=gid
                )
        except RftError as exc:  # e.g. an operator left something unencodable in `info`
            if len(decoded) > 1:
                for m, _ in decoded:
                    await self.process_batch([m])
                return
            await self.bus.dead_letter(
                self.from_stage, decoded[0][0], f"{self.name}: output not publishable: {exc}"
            )
            self.counters["dead_lettered_messages"] += 1
            return
        for m, _ in decoded:
            await m.ack()
        dt = time.perf_counter() - t0
        self.batches += 1
        self.counters["messages_in"] += len(decoded)
        self.counters["messages_out"] += len(groups)
        self.counters["experiences_in"] += len(exps)
        self.counters["experiences_out"] += len(out)
        values = {
            "operator/messages_in": float(len(decoded)),
            "operator/messages_out": float(len(groups)),
            "operator/experiences_in": float(len(exps)),
            "operator/experiences_out": float(len(out)),
            "operator/experiences_filtered": float(len(exps) - len(out)),
            "time/operator_batch": dt,
        }
        values.update({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        if self.on_progress is not None:
            self.on_progress(dict(self.counters))
        try:
            await self.bus.publish_metrics(self.role, self.batches, values)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop the stage
            log.warning("%s: metrics publish failed: %s", self.name, exc)

    async def _process_with_retry(
        self, exps: list[Experience], *, retries: int
    ) -> tuple[list[Experience] | None, dict[str, Any], str]:
        """Run the pipeline, retrying with backoff; on final failure return ``(None, {}, reason)``."""
        delay = 0.5
        last: BaseException | None = None
        for attempt in range(retries + 1):
            try:
                out, metrics = await self.pipeline.process(exps)
                return out, metrics, ""
            except Exception as exc:  # noqa: BLE001 - user operators may raise anything
                last = exc
                log.warning(
                    "%s: pipeline failed (attempt %d/%d): %s",
                    self.name,
                    attempt + 1,
                    retries + 1,
                    exc,
                )
                if attempt < retries:
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 10.0)
        reason = (
            f"{self.name} stage {self.from_stage}->{self.to_stage}: {type(last).__name__}: {last}"
        )
        cause = last.__cause__ if last is not None else None
        if cause is not None:
            reason += f" (caused by {type(cause).__name__}: {cause})"
        return None, {}, reason
