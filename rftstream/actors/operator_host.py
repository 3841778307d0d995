"""The operator host: runs an experience pipeline between two stage subjects.

It pulls up to ``batch_messages`` groups from ``exp.<from>`` (a durable shared
by all replicas of this stage), runs the operators on all their experiences at
once, regroups the survivors by task group and publishes each group to
``exp.<to>`` with ``Nats-Msg-Id = "<to>:<input id>"`` (so a redelivered input
is never stored twice downstream); an input is acked as soon as the groups it
feeds are published (one the operators dropped whole, at the end of the batch).

Failures: a body that does not decode, or holds an experience unfit for any stage
(:func:`~rftstream.experience.experience_problem`: a NaN reward...), is dead-lettered at once. When the
pipeline raises (or runs longer than ``process_timeout``), a batch of several
messages is split and each message retried on its own: up to ``max_retries``
more attempts, waiting ``retry_backoff`` s, doubling (at most 10 s, or
``retry_backoff`` if larger). A message that still fails goes to
``dlq.<from>`` with the exception and the stage in its headers
(``Rft-Dlq-Reason``, ``Rft-Dlq-Stage``); the stage keeps running. Output
that cannot be published because of what it is (it does not encode, or one
experience exceeds ``max_payload``) dead-letters its input the same way.

A NATS failure (a publish that timed out after its retries, a 503, a lost
connection) dead-letters nothing: the batch's inputs are nak'ed (redelivered
after ``retry_backoff`` s, at least 1 s) and processed again; their outputs
carry the same ``Nats-Msg-Id`` s, so the parts a failed attempt had stored
already are deduplicated (for a deterministic pipeline: one that samples
may produce other parts the second time). Counted in
``operator/publish_failures``.

Metrics (one record per batch on ``metrics.<actor>``): messages and
experiences in and out, ``operator/experiences_filtered`` and, by the
operator that dropped them, ``operator/filtered/<operator>``;
``operator/dead_lettered`` (messages), ``operator/failed_batches``
(pipeline calls that raised) and ``operator/publish_failures`` (batches given
back after a NATS failure), each also as a ``_total`` over the host's life;
latency per batch (``time/operator_batch``), per message
(``time/operator_per_message``) and from a message's arrival on its stage to
its processing (``latency/message_mean``, ``latency/message_max``).

Stopping for an unsplice (see :mod:`rftstream.control.splice`): with a
:class:`DrainControl`, the hosts of one process stop fetching when asked
(after acking the batch in hand), wait for the cut ``C``, then drain: messages
up to ``C`` are processed, later ones acked unprocessed (the trainer reads
them itself), until every message up to ``C`` is acked
(:func:`~rftstream.actors.common.drain_step`).

Cancelling :meth:`OperatorHost.run` leaves the current batch unacked: it is
redelivered (to this or another replica) after ``ack_wait``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from rftstream.actors.common import InProgressTicker, drain_step
from rftstream.bus.client import Bus
from rftstream.bus.state import END_STATUSES, RunState
from rftstream.bus.transport import Delivery, PullSubscription
from rftstream.config.schema import Config
from rftstream.control.liveness import heartbeat_loop
from rftstream.errors import (
    BusError,
    ConfigError,
    CredentialsError,
    PayloadTooLargeError,
    SchemaError,
    error_text,
    lacks_credentials,
)
from rftstream.experience import H_MSG_ID, Experience, decode_group, experience_problem
from rftstream.retention import purge_on_full
from rftstream.subjects import RunNames
from rftstream.wire import Heartbeat

log = logging.getLogger(__name__)

_KEY = "data_processor.experience_pipeline"
MAX_BACKOFF_S = 10.0
#: empty fetches in a row (of ``fetch_timeout`` each) before a host looks whether the run
#: ended, and after it saw the end before it stops: the groups an explorer finishes before
#: it sees the end are handled, not left pending on the host's stage
QUIET_FETCHES_BEFORE_END = 4
QUIET_FETCHES_AFTER_END = 2


class DrainControl:
    """Stops the hosts of one stage in one process, then drains them up to a cut.

    :meth:`stop` asks every host to stop fetching; each finishes (and acks)
    the batch in hand and parks. ``all_parked`` is set once all have. The
    coordinator takes the cut and calls :meth:`set_cut`; the hosts then drain
    and return from ``run()``; ``all_drained`` is set when all have. A host
    that leaves for another reason (the run ended, an error) counts as both.
    Create it inside the event loop (it holds anyio events).
    """

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self.stopping = False
        self.cut: int | None = None
        self._parked = 0
        self._left = 0
        self.all_parked = anyio.Event()
        self.cut_known = anyio.Event()
        self.all_drained = anyio.Event()

    def stop(self) -> None:
        self.stopping = True

    def set_cut(self, cut: int) -> None:
        self.stopping = True
        self.cut = int(cut)
        self.cut_known.set()

    async def park(self) -> None:
        self._parked += 1
        self._check()
        try:
            await self.cut_known.wait()
        finally:
            self._parked -= 1

    def leave(self) -> None:
        self._left += 1
        self._check()

    def _check(self) -> None:
        if self._parked + self._left >= self.hosts:
            self.all_parked.set()
        if self._left >= self.hosts:
            self.all_drained.set()


@dataclass
class _Stats:
    """What one ``process_batch`` call did (published as one metrics record)."""

    messages_in: int = 0
    messages_out: int = 0
    experiences_in: int = 0
    experiences_out: int = 0
    filtered: int = 0
    dead_lettered: int = 0
    dead_lettered_exps: int = 0
    failed_batches: int = 0
    publish_failures: int = 0
    latencies: list[float] = field(default_factory=list)
    op_metrics: dict[str, float] = field(default_factory=dict)

    def add_metrics(self, metrics: dict[str, Any]) -> None:
        """Counts (``filtered/*``, ``*_count``, times) add up over the calls; others: the last."""
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            additive = key.startswith(("filtered/", "pipeline/")) or key.endswith("_count")
            self.op_metrics[key] = (
                self.op_metrics.get(key, 0.0) + float(value) if additive else float(value)
            )


@dataclass
class OperatorCounters:
    """What a host has done since it started (its heartbeat's counts)."""

    messages_in: int = 0
    messages_out: int = 0
    experiences_in: int = 0
    experiences_out: int = 0
    dead_lettered_messages: int = 0
    failed_batches: int = 0
    publish_failures: int = 0
    skipped_after_cut: int = 0  # acked unprocessed after a splice's cut

    def add(self, batch: _Stats) -> None:
        """Count one ``process_batch`` call in."""
        self.messages_in += batch.messages_in
        self.messages_out += batch.messages_out
        self.experiences_in += batch.experiences_in
        self.experiences_out += batch.experiences_out
        self.dead_lettered_messages += batch.dead_lettered
        self.failed_batches += batch.failed_batches
        self.publish_failures += batch.publish_failures


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
        retry_backoff: float = 0.5,
        process_timeout: float | None = None,
        fetch_timeout: float = 0.5,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        start_seq: int | None = None,
        control: DrainControl | None = None,
    ) -> None:
        if max_retries < 0:
            raise ConfigError(f"{_KEY}.max_retries", "must be >= 0", value=max_retries)
        if retry_backoff < 0:
            raise ConfigError(f"{_KEY}.retry_backoff", "must be >= 0", value=retry_backoff)
        if process_timeout is not None and not process_timeout > 0:
            raise ConfigError(
                f"{_KEY}.process_timeout", "must be > 0 (or null: no limit)", value=process_timeout
            )
        if batch_messages < 1:
            raise ConfigError(f"{_KEY}.batch_messages", "must be >= 1", value=batch_messages)
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
        self.retry_backoff = retry_backoff
        self.process_timeout = process_timeout
        self.fetch_timeout = fetch_timeout
        self.control = control
        self.counters = OperatorCounters()
        self.batches = 0

    @property
    def durable(self) -> str:
        return self.names.stage_consumer(self.from_stage, self.to_stage)

    async def run(self) -> None:
        """Process until the run ends (or, with a :class:`DrainControl`, until drained). Blocks.

        The run's end is looked for after :data:`QUIET_FETCHES_BEFORE_END` empty fetches
        in a row (2 s by default); once seen, the host stops after
        :data:`QUIET_FETCHES_AFTER_END` more in a row (1 s): an explorer that has not yet
        seen the end still publishes the groups it finishes, and those are handled, not
        left pending on this stage."""
        try:
            await self._run()
        finally:
            if self.control is not None:
                self.control.leave()

    async def _run(self) -> None:
        await self.bus.ensure_consumer(
            self.names.exp_stream,
            self.durable,
            self.names.exp_subject(self.from_stage),
            description=f"run {self.names.run}: operator pipeline {self.from_stage} -> {self.to_stage}",
            role="operator",
            start_seq=self.start_seq,
            to_stage=self.to_stage,
        )
        consumer = await self.bus.pull(self.names.exp_stream, self.durable)
        state = RunState(await self.bus.kv())
        ticker = InProgressTicker(self.bus.cfg.ack_wait / 3)
        await self.pipeline.prepare()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker.run)
                tg.start_soon(heartbeat_loop, state, self._heartbeat)
                await self._loop(consumer, state, ticker)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.unsubscribe()
                await self.pipeline.close()

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            actor=self.name,
            role=self.role,
            ts=time.time(),
            from_stage=self.from_stage,
            to_stage=self.to_stage,
            **asdict(self.counters),  # Heartbeat has a field of each counter's name
        )

    async def _loop(
        self, consumer: PullSubscription, state: RunState, ticker: InProgressTicker
    ) -> None:
        idle_checks = 0
        ended = False  # this host saw the run's end
        while True:
            control = self.control
            if control is not None and control.stopping and control.cut is None:
                await control.park()  # the batch in hand is acked; wait for the cut
            if control is not None and control.cut is not None:
                # after the cut the trainer reads exp.<from> itself: those are acked unprocessed
                step = await drain_step(
                    consumer, control.cut, batch=self.batch_messages, timeout=self.fetch_timeout
                )
                if step.done:
                    return
                self.counters.skipped_after_cut += step.skipped
                if step.mine:
                    await self._process_held(step.mine, ticker)
                continue
            msgs = await consumer.fetch(self.batch_messages, timeout=self.fetch_timeout)
            if not msgs:
                idle_checks += 1
                if ended:
                    if idle_checks >= QUIET_FETCHES_AFTER_END:
                        return
                elif idle_checks % QUIET_FETCHES_BEFORE_END == 0 and (
                    await state.status() in END_STATUSES
                ):
                    ended, idle_checks = True, 0
                continue
            idle_checks = 0  # quiet is counted in empty fetches in a row
            await self._process_held(msgs, ticker)

    async def _process_held(self, msgs: list[Delivery], ticker: InProgressTicker) -> None:
        for m in msgs:
            ticker.hold(m)
        try:
            await self.process_batch(msgs)
        finally:
            for m in msgs:
                ticker.release(m)

    async def process_batch(self, msgs: list[Delivery]) -> None:
        """Decode, run the pipeline, publish survivors, ack inputs (or dead-letter them).

        A NATS failure naks the inputs instead (see the module docstring).
        Publishes one metrics record for the batch.
        """
        t0 = time.perf_counter()
        now = time.time()
        stats = _Stats(messages_in=len(msgs))
        for m in msgs:
            try:
                stats.latencies.append(max(0.0, now - m.metadata.timestamp.timestamp()))
            except Exception:  # noqa: BLE001 - not a JetStream message
                pass
        try:
            await self._handle(msgs, stats)
        except BusError as exc:
            # NATS trouble, not the messages' fault: they come back and are processed again
            stats.publish_failures += 1
            delay = max(1.0, self.retry_backoff)
            log.warning(
                "%s: %s; giving the batch of %d back (redelivered in %.0fs)",
                self.name,
                exc,
                len(msgs),
                delay,
            )
            for m in msgs:
                try:
                    await m.nak(delay=delay)
                except Exception:  # noqa: BLE001 - acked already, or the connection is gone
                    pass
        dt = time.perf_counter() - t0
        self.batches += 1
        c = self.counters
        c.add(stats)
        values: dict[str, float] = {
            "operator/messages_in": float(stats.messages_in),
            "operator/messages_out": float(stats.messages_out),
            "operator/experiences_in": float(stats.experiences_in),
            "operator/experiences_out": float(stats.experiences_out),
            "operator/experiences_filtered": float(stats.filtered),
            "operator/dead_lettered": float(stats.dead_lettered),
            "operator/dead_lettered_experiences": float(stats.dead_lettered_exps),
            "operator/dead_lettered_total": float(c.dead_lettered_messages),
            "operator/failed_batches": float(stats.failed_batches),
            "operator/failed_batches_total": float(c.failed_batches),
            "operator/publish_failures": float(stats.publish_failures),
            "operator/publish_failures_total": float(c.publish_failures),
            "time/operator_batch": dt,
            "time/operator_per_message": dt / max(1, len(msgs)),
        }
        if stats.latencies:
            values["latency/message_mean"] = sum(stats.latencies) / len(stats.latencies)
            values["latency/message_max"] = max(stats.latencies)
        for key, value in stats.op_metrics.items():
            values[key] = value
            if key.startswith("filtered/"):
                values[f"operator/{key}"] = value  # by the operator (reason) that dropped them
        if self.on_progress is not None:
            self.on_progress(asdict(c))
        try:
            await self.bus.publish_metrics(self.role, self.batches, values)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop the stage
            log.warning("%s: metrics publish failed: %s", self.name, exc)

    async def _dead_letter(self, m: Delivery, reason: str, n_exps: int, stats: _Stats) -> None:
        await self.bus.dead_letter(self.from_stage, m, reason)
        stats.dead_lettered += 1
        stats.dead_lettered_exps += n_exps

    async def _handle(self, msgs: list[Delivery], stats: _Stats) -> None:
        """Process ``msgs`` as one pipeline call; on failure, each message on its own."""
        decoded: list[tuple[Delivery, list[Experience]]] = []
        for m in msgs:
            try:
                group = decode_group(m.data)
            except SchemaError as exc:
                await self._dead_letter(m, f"{self.name}: {exc}", 0, stats)
                continue
            problem = next((p for p in map(experience_problem, group) if p), None)
            if problem is not None:
                await self._dead_letter(m, f"{self.name}: {problem}", len(group), stats)
                continue
            decoded.append((m, group))
        if not decoded:
            return
        exps = [e for _, group in decoded for e in group]
        group_msg_id: dict[str, str] = {}
        for m, group in decoded:
            mid = (m.headers or {}).get(H_MSG_ID) or f"{m.subject}:{m.metadata.sequence.stream}"
            for e in group:
                # keep "#<part>": parts must not dedup each other
                group_msg_id.setdefault(e.group_id, mid)
        single = len(decoded) == 1
        out, metrics, reason = await self._process_with_retry(
            exps, stats, retries=self.max_retries if single else 0
        )
        if out is None:
            if not single:  # isolate the poison message: every input on its own
                for m, _ in decoded:
                    await self._handle([m], stats)
                return
            await self._dead_letter(decoded[0][0], reason, len(exps), stats)
            return
        groups: dict[str, list[Experience]] = defaultdict(list)
        for e in out:
            groups[e.group_id].append(e)
        # an input is acked as soon as every group it feeds is published, one the pipeline
        # dropped whole at the end: a message is counted upstream or downstream at every
        # moment, and in both only briefly (what max_staleness counts, see the explorer)
        feeds = [(m, {e.group_id for e in group} & groups.keys()) for m, group in decoded]
        waiting = [(m, gids) for m, gids in feeds if gids]
        acked: set[int] = set()
        try:
            for gid, group in groups.items():
                base = group_msg_id.get(gid) or f"group:{gid}"
                await self.bus.publish_group(
                    self.to_stage, group, msg_id=f"{self.to_stage}:{base}", group_id=gid
                )
                for m, gids in waiting:
                    gids.discard(gid)
                    if not gids and id(m) not in acked:
                        await m.ack()
                        acked.add(id(m))
        except (SchemaError, PayloadTooLargeError) as exc:
            # the output itself is at fault (e.g. an operator left something unencodable in
            # `info`); any other BusError is NATS trouble: process_batch gives the inputs back
            if not single:
                for m, _ in decoded:
                    if id(m) not in acked:  # each input not handed on yet, on its own
                        await self._handle([m], stats)
                return
            await self._dead_letter(
                decoded[0][0], f"{self.name}: output not publishable: {exc}", len(exps), stats
            )
            return
        for m, _ in decoded:
            if id(m) not in acked:
                await m.ack()
        stats.messages_out += len(groups)
        stats.experiences_in += len(exps)
        stats.experiences_out += len(out)
        stats.filtered += len(exps) - len(out)
        stats.add_metrics(metrics)

    async def _process_with_retry(
        self, exps: list[Experience], stats: _Stats, *, retries: int
    ) -> tuple[list[Experience] | None, dict[str, Any], str]:
        """Run the pipeline, retrying with backoff; on final failure return ``(None, {}, reason)``."""
        delay = self.retry_backoff
        last: BaseException | None = None
        for attempt in range(retries + 1):
            try:
                with anyio.fail_after(self.process_timeout):  # None: no deadline
                    out, metrics = await self.pipeline.process(exps)
                return out, metrics, ""
            except TimeoutError:  # the deadline: operators' own errors come as OperatorError
                last = TimeoutError(
                    f"the pipeline took longer than process_timeout={self.process_timeout:g}s"
                )
            except Exception as exc:  # noqa: BLE001 - user operators may raise anything
                last = exc
                if lacks_credentials(exc):  # no batch can succeed: stop the run, say why
                    raise CredentialsError(
                        f"{self.name} stage {self.from_stage}->{self.to_stage}: {exc} (an "
                        "operator without its credentials cannot process any batch, so the "
                        "run stops; the message stays unacked for when it can)"
                    ) from exc
            stats.failed_batches += 1
            log.warning(
                "%s: pipeline failed (attempt %d/%d): %s", self.name, attempt + 1, retries + 1, last
            )
            if attempt < retries:
                await anyio.sleep(delay)
                delay = min(delay * 2, max(MAX_BACKOFF_S, self.retry_backoff))
        assert last is not None
        reason = f"{self.name} stage {self.from_stage}->{self.to_stage}: {error_text(last)}"
        cause = last.__cause__
        if cause is not None and error_text(cause) not in reason:
            reason += f" (caused by {error_text(cause)})"
        if retries:
            reason += f" [{retries + 1} attempts]"
        return None, {}, reason


def replica_names(name: str, replicas: int) -> list[str]:
    """The actor names of a stage's ``replicas`` hosts: ``name`` alone, else ``<name>-<i>``."""
    return [name] if replicas == 1 else [f"{name}-{i}" for i in range(replicas)]


async def run_hosts(
    url: str,
    names: RunNames,
    cfg: Config,
    pipelines: Sequence[Any],
    *,
    name: str = "operator",
    from_stage: str | None = None,
    to_stage: str | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    start_seq: int | None = None,
    control: DrainControl | None = None,
) -> None:
    """One :class:`OperatorHost` per pipeline, concurrently, each on its own connection to
    ``url``, sharing the stage's durable (``from_stage``/``to_stage``: the pipeline's
    ``input_stage``/``output_stage`` when not given; retries, batch and timeout from
    ``data_processor.experience_pipeline``).

    The hosts are named as :func:`replica_names` says. Blocks until every host
    has returned (the run ended, or ``control`` drained them); cancelling cancels them all,
    their batches unacked (redelivered after ``ack_wait``)."""
    p = cfg.data_processor.experience_pipeline

    async def host(replica: str, pipeline: Any) -> None:
        async with await Bus.connect(
            url, names, cfg.nats, replica, on_stream_full=purge_on_full
        ) as bus:
            await OperatorHost(
                bus,
                pipeline,
                from_stage=from_stage or p.input_stage,
                to_stage=to_stage or p.output_stage,
                name=replica,
                batch_messages=p.batch_messages,
                max_retries=p.max_retries,
                retry_backoff=p.retry_backoff,
                process_timeout=p.process_timeout,
                on_progress=on_progress,
                start_seq=start_seq,
                control=control,
            ).run()

    async with anyio.create_task_group() as tg:
        for replica, pipeline in zip(replica_names(name, len(pipelines)), pipelines, strict=True):
            tg.start_soon(host, replica, pipeline)
