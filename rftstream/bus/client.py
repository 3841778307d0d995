"""The thin NATS adapter: connect, provision, publish, pull, KV.

Everything NATS-specific is here; nats errors are translated to
:class:`rftstream.errors.BusError` naming the subject, stream or consumer.
nats-py is asyncio-native, so code using :class:`Bus` runs on anyio's asyncio
backend.

Blocking and cancellation:

* :meth:`Bus.publish` waits for the server's ack (bounded by ``timeout`` and
  retried with the same ``Nats-Msg-Id``, so a retried publish is stored once)
  and for room under ``max_inflight_bytes``. Cancelling it may leave the
  message stored or not; republishing with the same id is always safe.
* :meth:`PullConsumer.fetch` waits up to ``timeout`` and returns ``[]`` when
  nothing arrived. Messages are never acked here: the caller acks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KeyValue

from rftstream.bus.state import RunState
from rftstream.config.schema import NatsConfig
from rftstream.errors import BusError, PayloadTooLargeError
from rftstream.experience import H_MSG_ID, EncodedMessage, Experience, headers_size, pack_group
from rftstream.messages import (
    H_DLQ_ACTOR,
    H_DLQ_DELIVERIES,
    H_DLQ_REASON,
    H_DLQ_SEQ,
    H_DLQ_STAGE,
    H_DLQ_SUBJECT,
    MetricsMsg,
    encode_json,
)
from rftstream.subjects import KV_TRAINER_INPUT, RAW_STAGE, TRAIN_STAGE, RunNames

log = logging.getLogger(__name__)

SCHEMA_META = "rft.experience.v1"


class InflightLimiter:
    """Caps the bytes of publishes awaiting their ack.

    :meth:`acquire` blocks while ``inflight + n > limit`` (one message larger
    than the limit is let through alone).
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.inflight = 0
        self._cond = anyio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            while self.inflight > 0 and self.inflight + n > self.limit:
                await self._cond.wait()
            self.inflight += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.inflight -= n
            self._cond.notify_all()


class PullConsumer:
    """A bound pull subscription on a durable consumer (shared by all replicas)."""

    def __init__(self, sub: Any, stream: str, durable: str) -> None:
        self._sub = sub
        self.stream = stream
        self.durable = durable

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Fetch up to ``batch`` messages, waiting up to ``timeout`` s; ``[]`` if none came."""
        try:
            return list(await self._sub.fetch(batch=batch, timeout=timeout))
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except nats.errors.ConnectionClosedError as exc:
            raise BusError(f"consumer {self.stream}/{self.durable}: connection closed") from exc

    async def info(self) -> api.ConsumerInfo:
        return await self._sub.consumer_info()

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # noqa: BLE001 - closing; nothing to do
            pass


class Bus:
    """One actor's connection to the run's streams, consumers and KV bucket."""

    def __init__(self, nc: NatsClient, names: RunNames, cfg: NatsConfig, actor: str) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        self.names = names
        self.cfg = cfg
        self.actor = actor
        self._limiter = InflightLimiter(cfg.max_inflight_bytes)
        self._kv: KeyValue | None = None

    # ------------------------------------------------------------ lifecycle
    @classmethod
    async def connect(cls, url: str, names: RunNames, cfg: NatsConfig, actor: str) -> Bus:
        """Connect to ``url``; reconnects forever (long runs must survive server restarts)."""

        async def _on_error(exc: Exception) -> None:
            log.warning("%s: nats error: %s", actor, exc)

        try:
            nc = await nats.connect(
                servers=[url],
                name=f"rftstream:{names.run}:{actor}",
                connect_timeout=cfg.connect_timeout,
                max_reconnect_attempts=-1,
                reconnect_time_wait=1.0,
                error_cb=_on_error,
            )
        except Exception as exc:  # nats raises several unrelated types here
            raise BusError(f"{actor}: cannot connect to NATS at {url}: {exc}") from exc
        return cls(nc, names, cfg, actor)

    async def close(self) -> None:
        """Flush and close. Safe to call twice."""
        if self.nc.is_closed:
            return
        try:
            with anyio.move_on_after(5):
                await self.nc.drain()
        except Exception:  # noqa: BLE001
            pass
        if not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.close()

    @property
    def max_payload(self) -> int:
        """The smaller of the configured and the server's ``max_payload``."""
        server = self.nc.max_payload or self.cfg.max_payload
        return min(self.cfg.max_payload, server)

    # ------------------------------------------------------------ provisioning
    def _meta(self, role: str, schema: str) -> dict[str, str]:
        return {
            "rft.run": self.names.run,
            "rft.role": role,
            "rft.schema": schema,
            "rft.created_by": self.actor,
        }

    async def _ensure_stream(self, cfg: api.StreamConfig) -> None:
        try:
            await self.js.stream_info(cfg.name)  # type: ignore[arg-type]
        except nats.js.errors.NotFoundError:
            try:
                await self.js.add_stream(cfg)
            except nats.js.errors.APIError as exc:
                raise BusError(f"cannot create stream {cfg.name}: {exc}") from exc
            return
        try:
            await self.js.update_stream(cfg)
        except nats.js.errors.APIError as exc:
            log.warning("stream %s exists and could not be updated: %s", cfg.name, exc)

    async def ensure_consumer(
        self,
        stream: str,
        durable: str,
        filter_subject: str,
        *,
        description: str,
        role: str,
        ack_wait: float | None = None,
        start_seq: int | None = None,
    ) -> None:
        """Create the durable pull consumer if missing (idempotent).

        ``start_seq``: deliver from that stream sequence on (a spliced stage
        takes over exactly where the trainer stopped reading); else everything.
        """
        cfg = api.ConsumerConfig(
            durable_name=durable,
            description=description,
            deliver_policy=api.DeliverPolicy.ALL
            if start_seq is None
            else api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait or self.cfg.ack_wait,
            max_deliver=-1,
            filter_subject=filter_subject,
            max_ack_pending=10_000,
            metadata=self._meta(role, SCHEMA_META),
        )
        try:
            await self.js.consumer_info(stream, durable)
            return
        except nats.js.errors.NotFoundError:
            pass
        try:
            await self.js.add_consumer(stream, cfg)
        except nats.js.errors.APIError as exc:
            # a concurrent actor may have created it a moment ago
            try:
                await self.js.consumer_info(stream, durable)
            except nats.js.errors.NotFoundError:
                raise BusError(f"cannot create consumer {stream}/{durable}: {exc}") from exc

    async def provision(
        self,
        *,
        stages: Sequence[tuple[str, str]] = ((RAW_STAGE, TRAIN_STAGE),),
        task_ack_wait: float = 300.0,
    ) -> None:
        """Create (or update) the run's streams, default durables and KV bucket.

        Idempotent and safe to call from every actor at start. Durables are
        created here, before any producer starts, so nothing is missed.
        """
        n = self.names
        common: dict[str, Any] = {
            "storage": api.StorageType.FILE,
            "num_replicas": self.cfg.num_replicas,
            "max_msg_size": self.cfg.max_payload,
            "duplicate_window": self.cfg.dedup_window,
        }
        await self._ensure_stream(
            api.StreamConfig(
                name=n.tasks_stream,
                description=f"rftstream run {n.run}: tasks (work queue; explorers pull, ack when the task's group is published)",
                subjects=[n.tasks_subject],
                retention=api.RetentionPolicy.WORK_QUEUE,
                metadata=self._meta("tasks", "rft.task.v1"),
                **common,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.exp_stream,
                description=(
                    f"rftstream run {n.run}: experience groups per pipeline stage "
                    "(exp.raw from explorers, exp.<stage> from operators, exp.train for the trainer)"
                ),
                subjects=[n.exp_wildcard],
                retention=api.RetentionPolicy.LIMITS,
                metadata=self._meta("experience", SCHEMA_META),
                **common,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.dlq_stream,
                description=f"rftstream run {n.run}: dead letters; reason in header Rft-Dlq-Reason",
                subjects=[n.dlq_wildcard],
                retention=api.RetentionPolicy.LIMITS,
                metadata=self._meta("dead-letter", "original message"),
                **common,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.metrics_stream,
                description=f"rftstream run {n.run}: metrics of every actor (JSON rft.metrics.v1)",
                subjects=[n.metrics_wildcard],
                retention=api.RetentionPolicy.LIMITS,
                metadata=self._meta("metrics", "rft.metrics.v1"),
                **{**common, "max_msg_size": -1},
            )
        )
        await self.ensure_consumer(
            n.tasks_stream,
            n.explorer_consumer,
            n.tasks_subject,
            description=f"run {n.run}: explorers share this durable to pull tasks",
            role="explorer",
            ack_wait=task_ack_wait,
        )
        for from_stage, to_stage in stages:
            await self.ensure_consumer(
                n.exp_stream,
                n.stage_consumer(from_stage, to_stage),
                n.exp_subject(from_stage),
                description=f"run {n.run}: operator pipeline {from_stage} -> {to_stage}",
                role="operator",
            )
        moved = await RunState(await self.kv()).get_raw(KV_TRAINER_INPUT) is not None
        if not moved:  # a splice moved the trainer elsewhere: never recreate `trainer` then
            await self.ensure_consumer(
                n.exp_stream,
                n.trainer_consumer,
                n.exp_subject(TRAIN_STAGE),
                description=f"run {n.run}: the trainer reads exp.train",
                role="trainer",
            )

    async def kv(self) -> KeyValue:
        """The run's state bucket (created on first use)."""
        if self._kv is not None:
            return self._kv
        bucket = self.names.kv_bucket
        try:
            self._kv = await self.js.key_value(bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            try:
                self._kv = await self.js.create_key_value(
                    api.KeyValueConfig(
                        bucket=bucket,
                        description=f"rftstream run {self.names.run}: status, steps, weights pointer, heartbeats",
                        history=5,
                        replicas=self.cfg.num_replicas,
                        storage=api.StorageType.FILE,
                    )
                )
            except nats.js.errors.APIError:
                self._kv = await self.js.key_value(bucket)
        return self._kv

    async def pull(self, stream: str, durable: str) -> PullConsumer:
        """Bind to an existing durable pull consumer (see :meth:`provision`)."""
        try:
            sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        except nats.js.errors.NotFoundError as exc:
            raise BusError(
                f"consumer {stream}/{durable} does not exist; provision the run first"
            ) from exc
        return PullConsumer(sub, stream, durable)

    # ------------------------------------------------------------ publishing
    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        timeout: float = 10.0,
        retries: int = 5,
    ) -> api.PubAck:
        """Publish to JetStream and wait for the ack.

        Checks payload + headers against ``max_payload`` first (the client
        checks only the payload; an over-size message would make the server
        drop the connection). A timed-out publish is retried with the same
        ``Nats-Msg-Id`` (the stream deduplicates it).
        """
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs[H_MSG_ID] = msg_id
        size = len(data) + (headers_size(hdrs) if hdrs else 0)
        if size > self.max_payload:
            raise PayloadTooLargeError(
                f"{self.actor}: message to {subject} is {size} bytes with headers; max_payload is {self.max_payload}"
            )
        await self._limiter.acquire(size)
        try:
            delay = 0.2
            for attempt in range(retries + 1):
                try:
                    return await self.js.publish(
                        subject, data, timeout=timeout, headers=hdrs or None
                    )
                except (
                    nats.errors.TimeoutError,
                    TimeoutError,
                    nats.js.errors.NoStreamResponseError,
                ) as exc:
                    if attempt == retries:
                        raise BusError(
                            f"{self.actor}: publish to {subject} timed out {retries + 1} times"
                        ) from exc
                except nats.js.errors.APIError as exc:
                    if getattr(exc, "code", None) in (429, 503) and attempt < retries:
                        pass
                    else:
                        raise BusError(
                            f"{self.actor}: publish to {subject} rejected: {exc}"
                        ) from exc
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
            raise AssertionError("unreachable")
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled publish must give its bytes back
                await self._limiter.release(size)

    async def publish_encoded(self, subject: str, msg: EncodedMessage) -> api.PubAck:
        return await self.publish(subject, msg.data, headers=msg.headers, msg_id=msg.msg_id)

    async def publish_group(
        self, stage: str, exps: Sequence[Experience], *, msg_id: str, group_id: str | None = None
    ) -> int:
        """Publish one task group to ``exp.<stage>`` (split under max_payload). Returns messages stored (not dups)."""
        subject = self.names.exp_subject(stage)
        stored = 0
        for part in pack_group(
            exps,
            actor=self.actor,
            msg_id_prefix=msg_id,
            max_payload=self.max_payload,
            group_id=group_id,
        ):
            ack = await self.publish_encoded(subject, part)
            stored += 0 if ack.duplicate else 1
        return stored

    async def dead_letter(self, stage: str, msg: Msg, reason: str) -> None:
        """Copy ``msg`` to ``dlq.<stage>`` with the reason in headers, then ``term`` it.

        The original headers are kept (but its ``Nats-Msg-Id`` is prefixed, so the
        copy is deduplicated on its own); terminating stops redelivery.
        """
        hdrs = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        seq = ""
        deliveries = ""
        try:
            md = msg.metadata
            seq = str(md.sequence.stream)
            deliveries = str(md.num_delivered)
        except Exception:  # noqa: BLE001 - not a JetStream message
            pass
        reason_line = " ".join(reason.split())[:1000]
        hdrs.update(
            {
                H_DLQ_REASON: reason_line,
                H_DLQ_STAGE: stage,
                H_DLQ_ACTOR: self.actor,
                H_DLQ_SUBJECT: msg.subject,
                H_DLQ_SEQ: seq,
                H_DLQ_DELIVERIES: deliveries,
            }
        )
        orig_id = (msg.headers or {}).get(H_MSG_ID) or f"{msg.subject}:{seq}"
        data = msg.data
        if len(data) + headers_size(hdrs) > self.max_payload:
            data = data[: self.max_payload - headers_size(hdrs) - 1024]
        await self.publish(
            self.names.dlq_subject(stage), data, headers=hdrs, msg_id=f"dlq:{stage}:{orig_id}"
        )
        try:
            await msg.term()
        except Exception:  # noqa: BLE001 - not a JetStream message (core publish)
            pass

    async def publish_metrics(self, role: str, step: int, values: dict[str, float]) -> None:
        """Publish one metrics record to ``metrics.<actor>`` (JSON).

        Non-numeric and non-finite values (NaN, inf) are left out: JSON has no
        NaN, and one such value must not make the whole record undecodable.
        """
        clean = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        }
        body = encode_json(
            MetricsMsg(actor=self.actor, role=role, ts=time.time(), step=step, values=clean)
        )
        await self.publish(self.names.metrics_subject(self.actor), body)
