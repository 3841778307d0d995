"""The rftstream-level bus: experience groups, dead letters, metrics and run state over a transport.

:class:`Bus` knows the run's names (streams, subjects, durables, KV bucket) and
what travels on them; the messages themselves go through a
:class:`~rftstream.bus.transport.Transport`: NATS JetStream
(:meth:`Bus.connect`, :mod:`rftstream.bus.jetstream`) or the in-memory one of
unit tests (:meth:`Bus.in_memory`, :mod:`rftstream.bus.memory`). No client
library's types or errors reach this module: errors are the neutral ones of
:mod:`rftstream.errors`.

Blocking and cancellation:

* :meth:`Bus.publish` waits for the stream's ack (each attempt bounded by
  ``timeout``, retried with the same ``Nats-Msg-Id``, so a retried publish is
  stored once); the JetStream transport also waits for room under
  ``max_inflight_bytes``. Cancelling it may leave the message stored or not;
  republishing with the same id is always safe.
* :meth:`PullSubscription.fetch` waits up to ``timeout`` and returns ``[]`` when
  nothing arrived. Messages are never acked there: the caller acks (or naks,
  terms, or lets ``ack_wait`` redeliver them).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio

from rftstream.bus.jetstream import connect_transport
from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.bus.transport import (
    ConsumerSpec,
    ConsumerState,
    Delivery,
    KeyValueStore,
    OrderedReader,
    PubAck,
    PullSubscription,
    StoredMsg,
    StreamSpec,
    StreamState,
    Transport,
    Watch,
)
from rftstream.config.schema import NatsConfig
from rftstream.config.stream_limits import stream_limits
from rftstream.errors import (
    BucketNotFound,
    BusError,
    BusTimeout,
    BusUnavailable,
    ConsumerNotFound,
    PayloadTooLargeError,
    RunNotFoundError,
    StreamFullError,
)
from rftstream.headers import H_MSG_ID, headers_size
from rftstream.subjects import (
    META_TO_STAGE,
    RAW_STAGE,
    TRAIN_STAGE,
    TRAINER_ROLE,
    RunNames,
)
from rftstream.wire import (
    H_DLQ_ACTOR,
    H_DLQ_BODY_BYTES,
    H_DLQ_BODY_HASH,
    H_DLQ_BODY_TRUNCATED,
    H_DLQ_DELIVERIES,
    H_DLQ_REASON,
    H_DLQ_SEQ,
    H_DLQ_STAGE,
    H_DLQ_SUBJECT,
    TRAINER_INPUT,
    WEIGHTS_MANIFEST_SCHEMA,
    WEIGHTS_SCHEMA,
    MetricsMsg,
    encode_json,
)

if TYPE_CHECKING:  # experience imports torch: a bus user that publishes no group needs none
    from rftstream.experience import EncodedMessage, Experience

log = logging.getLogger(__name__)

# a dead letter keeps at most this prefix of the body it copies (its headers say the
# original size and hash): a stream of poison messages must not fill the DLQ stream
DEAD_LETTER_BODY_LIMIT = 64 * 1024
PUBLISH_TIMEOUT_S = 10.0  # one publish attempt waits this long for its ack
PUBLISH_RETRIES = 5  # attempts after the first before the retry window decides

SCHEMA_META = "rft.experience.v1"

#: what a :class:`Bus` calls when a publish finds its stream full, before it retries: the
#: bus and the subject. It may free room (purge what consumers acked) and must not raise
#: for a failure to: the retry waits either way.
StreamFullHook = Callable[["Bus", str], Awaitable[None]]


class Bus:
    """One actor's connection to the run's streams, consumers and KV bucket."""

    def __init__(
        self,
        transport: Transport,
        names: RunNames,
        cfg: NatsConfig,
        actor: str,
        *,
        on_stream_full: StreamFullHook | None = None,
    ) -> None:
        """``on_stream_full``: called before a publish refused by a full stream is retried
        (:data:`StreamFullHook`; an actor that publishes experience passes
        :func:`rftstream.retention.purge_on_full`); ``None``: the retry only waits."""
        self.transport = transport
        self.names = names
        self.cfg = cfg
        self.actor = actor
        self.on_stream_full = on_stream_full
        self._kv: KeyValueStore | None = None

    # ------------------------------------------------------------ lifecycle
    @classmethod
    async def connect(
        cls,
        url: str | None,
        names: RunNames,
        cfg: NatsConfig,
        actor: str,
        *,
        on_stream_full: StreamFullHook | None = None,
    ) -> Bus:
        """Connect to ``url`` (``None``/empty: the servers of ``cfg``) with the credentials,
        TLS and reconnect window of ``cfg`` (:func:`rftstream.bus.jetstream.connect.open_connection`).

        Raises one :class:`BusError` naming the servers and the kind of auth when the
        first connect fails (seconds, not a hang). A connection lost later is retried
        for ``nats.reconnect_window`` seconds; after that, operations raise
        :class:`BusError` naming the servers and the window.
        """
        transport = await connect_transport(
            cfg, url, name=f"rftstream:{names.run}:{actor}", actor=actor
        )
        return cls(transport, names, cfg, actor, on_stream_full=on_stream_full)

    @classmethod
    def in_memory(cls, names: RunNames, cfg: NatsConfig | None = None, actor: str = "test") -> Bus:
        """A bus on a fresh :class:`~rftstream.bus.memory.MemoryTransport` (one process;
        for unit tests of the logic above the bus). Share ``bus.transport`` between
        several :class:`Bus` objects to give each actor its own."""
        return cls(MemoryTransport(), names, cfg or NatsConfig(), actor)

    @property
    def server_url(self) -> str:
        """The URL of the server this connection uses now, without its password."""
        return self.transport.server_url

    async def close(self) -> None:
        """Flush and close. Safe to call twice."""
        await self.transport.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.close()

    @property
    def max_payload(self) -> int:
        """The smaller of the configured and the server's ``max_payload``."""
        return min(self.cfg.max_payload, self.transport.max_payload)

    # ------------------------------------------------------------ provisioning
    def _meta(self, role: str, schema: str) -> dict[str, str]:
        return {
            "rft.run": self.names.run,
            "rft.run_name": self.names.name or self.names.run,
            "rft.role": role,
            "rft.schema": schema,
            "rft.created_by": self.actor,
        }

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
        to_stage: str | None = None,
    ) -> None:
        """Create the durable pull consumer if missing (idempotent).

        ``start_seq``: deliver from that stream sequence on (a spliced stage
        takes over exactly where the trainer stopped reading); else everything.
        ``to_stage``: the stage an operator durable writes, kept in its metadata
        (``rft.to_stage``) for the run's account.
        """
        metadata = self._meta(role, SCHEMA_META)
        if to_stage is not None:
            metadata[META_TO_STAGE] = to_stage
        await self.transport.ensure_consumer(
            stream,
            ConsumerSpec(
                durable=durable,
                filter_subject=filter_subject,
                description=description,
                metadata=metadata,
                ack_wait=ack_wait or self.cfg.ack_wait,
                start_seq=start_seq,
            ),
        )

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
        limits = self.cfg.streams
        common: dict[str, Any] = {
            "num_replicas": self.cfg.num_replicas,
            "max_msg_size": self.cfg.max_payload,
            "duplicate_window": self.cfg.dedup_window,
        }
        await self.transport.ensure_stream(
            StreamSpec(
                name=n.tasks_stream,
                description=f"rftstream run {n.run}: tasks (work queue; explorers pull, ack when the task's group is published)",
                subjects=(n.tasks_subject,),
                retention="work_queue",
                metadata=self._meta("tasks", "rft.task.v1"),
                **common,
                **stream_limits(limits.tasks),
            ),
            "nats.streams.tasks",
        )
        await self.transport.ensure_stream(
            StreamSpec(
                name=n.exp_stream,
                description=(
                    f"rftstream run {n.run}: experience groups per pipeline stage "
                    "(exp.raw from explorers, exp.<stage> from operators, exp.train for the trainer)"
                ),
                subjects=(n.exp_wildcard,),
                retention="limits",
                metadata=self._meta("experience", SCHEMA_META),
                **common,
                **stream_limits(limits.experience),
            ),
            "nats.streams.experience",
        )
        await self.transport.ensure_stream(
            StreamSpec(
                name=n.dlq_stream,
                description=f"rftstream run {n.run}: dead letters; reason in header Rft-Dlq-Reason",
                subjects=(n.dlq_wildcard,),
                retention="limits",
                metadata=self._meta("dead-letter", "original message"),
                **common,
                **stream_limits(limits.dead_letter),
            ),
            "nats.streams.dead_letter",
        )
        await self.transport.ensure_stream(
            StreamSpec(
                name=n.metrics_stream,
                description=f"rftstream run {n.run}: metrics of every actor (JSON rft.metrics.v1)",
                subjects=(n.metrics_wildcard,),
                retention="limits",
                metadata=self._meta("metrics", "rft.metrics.v1"),
                **{**common, "max_msg_size": -1},
                **stream_limits(limits.metrics),
            ),
            "nats.streams.metrics",
        )
        weights = limits.weights
        await self.transport.ensure_stream(
            StreamSpec(
                name=n.weights_stream,
                description=(
                    f"rftstream run {n.run}: the policy's weights versions "
                    "(<incarnation>.<version>.data chunks, then .manifest; JSON manifests "
                    f"{WEIGHTS_MANIFEST_SCHEMA}); explorers read them by sequence"
                ),
                subjects=(n.weights_wildcard,),
                retention="limits",
                metadata=self._meta("weights", WEIGHTS_SCHEMA),
                storage=weights.storage,
                allow_direct=True,
                **common,
                **stream_limits(weights),
            ),
            "nats.streams.weights",
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
                to_stage=to_stage,
            )
        moved = await RunState(await self.kv()).present(TRAINER_INPUT)
        if not moved:  # a splice moved the trainer elsewhere: never recreate `trainer` then
            await self.ensure_consumer(
                n.exp_stream,
                n.trainer_consumer,
                n.exp_subject(TRAIN_STAGE),
                description=f"run {n.run}: the trainer reads exp.train",
                role=TRAINER_ROLE,
            )

    async def kv(self, *, create: bool = True) -> KeyValueStore:
        """The run's state bucket (created on first use).

        ``create=False`` (read-only commands) never creates it: raises
        :class:`RunNotFoundError` naming the run and the server when it does not exist.
        """
        if self._kv is not None:
            return self._kv
        bucket = self.names.kv_bucket
        try:
            self._kv = await self.transport.kv(
                bucket,
                create=create,
                description=f"rftstream run {self.names.run}: status, steps, weights pointer, heartbeats",
                replicas=self.cfg.num_replicas,
            )
        except BucketNotFound as exc:
            raise RunNotFoundError(
                f"run {self.names.display} has no state on this server "
                f"({self.server_url}): no KV bucket {bucket} "
                "(wrong run name or server, or "
                "credentials of another account?)"
            ) from exc
        return self._kv

    async def state(self, *, create: bool = True) -> RunState:
        """The run's :class:`RunState` (see :meth:`kv`)."""
        return RunState(await self.kv(create=create))

    # -- streams and consumers: what actors and operations look at or remove ------------
    # (each one JetStream API round trip, or the in-memory twin's; see Transport)

    async def stream_state(self, stream: str, subjects_filter: str | None = None) -> StreamState:
        """The stream's state (messages per subject with ``subjects_filter``). Raises
        ``StreamNotFound``."""
        return await self.transport.stream_state(stream, subjects_filter=subjects_filter)

    async def consumers(self, stream: str) -> list[ConsumerState]:
        """Every consumer of ``stream`` that answers. Raises ``StreamNotFound``."""
        return await self.transport.consumers(stream)

    def unreachable_durables(self, stream: str) -> list[str]:
        """Durables the last :meth:`consumers` of ``stream`` left out (did not answer)."""
        return self.transport.unreachable_durables(stream)

    async def consumer_state(self, stream: str, durable: str) -> ConsumerState:
        """Raises ``ConsumerNotFound`` (also when the stream is missing)."""
        return await self.transport.consumer_state(stream, durable)

    async def delete_consumer(self, stream: str, durable: str) -> None:
        """Raises ``ConsumerNotFound``."""
        await self.transport.delete_consumer(stream, durable)

    async def delete_stream(self, stream: str) -> None:
        """Delete ``stream`` with its consumers (replacing a run). Raises ``StreamNotFound``."""
        await self.transport.delete_stream(stream)

    async def delete_state(self) -> None:
        """Delete the run's state bucket (replacing a run); the next :meth:`kv` creates a
        fresh one. Raises ``BucketNotFound``."""
        self._kv = None
        await self.transport.delete_kv(self.names.kv_bucket)

    async def last_msg(self, stream: str, subject: str) -> StoredMsg:
        """The newest message on ``subject``. Raises ``MessageNotFound``."""
        return await self.transport.last_msg(stream, subject)

    async def get_msg(self, stream: str, seq: int, *, direct: bool = False) -> StoredMsg:
        """The message at ``seq`` (``direct``: the stream's direct-get API). Raises
        ``MessageNotFound``."""
        return await self.transport.get_msg(stream, seq, direct=direct)

    async def purge(self, stream: str, subject: str, below_seq: int) -> None:
        """Remove the messages of ``subject`` below stream sequence ``below_seq``."""
        await self.transport.purge(stream, subject, below_seq)

    async def read(
        self,
        stream: str | None,
        subject: str,
        *,
        start_seq: int = 1,
        headers_only: bool = False,
        description: str = "",
    ) -> OrderedReader:
        """An ordered reader of ``subject`` that acks nothing (``description``: who reads,
        shown by ``rftstream streams``). Raises ``StreamNotFound``."""
        return await self.transport.read(
            stream,
            subject,
            start_seq=start_seq,
            headers_only=headers_only,
            description=description,
        )

    async def watch(
        self,
        stream: str,
        subject: str,
        callback: Callable[[Delivery], Awaitable[None]],
        *,
        start_seq: int | None = None,
        start_time: datetime | None = None,
        headers_only: bool = False,
        description: str = "",
    ) -> Watch:
        """Push ``subject`` to ``callback`` in order (see :meth:`read`)."""
        return await self.transport.watch(
            stream,
            subject,
            callback,
            start_seq=start_seq,
            start_time=start_time,
            headers_only=headers_only,
            description=description,
        )

    async def pull(self, stream: str, durable: str) -> PullSubscription:
        """Bind to an existing durable pull consumer (see :meth:`provision`)."""
        try:
            return await self.transport.pull(stream, durable)
        except ConsumerNotFound as exc:
            raise BusError(
                f"consumer {stream}/{durable} does not exist; provision the run first"
            ) from exc

    # ------------------------------------------------------------ publishing
    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        timeout: float = PUBLISH_TIMEOUT_S,
        retries: int = PUBLISH_RETRIES,
    ) -> PubAck:
        """Publish to the stream of ``subject`` and wait for the ack.

        Checks payload + headers against ``max_payload`` first (the NATS client
        checks only the payload; an over-size message would make the server
        drop the connection), raising :class:`PayloadTooLargeError`. Blocks
        until the stream acks (each attempt at most ``timeout`` s). A timed-out
        publish (or one answered "unavailable", or with no stream) is retried up
        to ``retries`` times and, past them, until ``nats.retry_window`` is over,
        with the same ``Nats-Msg-Id`` (the stream deduplicates it), then raises
        :class:`BusError`; a full ``discard: new`` stream is retried ``retries``
        times (each after :attr:`on_stream_full`, which may free room) and then raises
        :class:`StreamFullError`; a rejection raises :class:`BusError` at once.
        Cancelling it may leave the message stored or not.
        """
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs[H_MSG_ID] = msg_id
        size = len(data) + (headers_size(hdrs) if hdrs else 0)
        return await self._publish_sized(subject, data, hdrs or None, size, timeout, retries)

    async def _publish_sized(
        self,
        subject: str,
        data: bytes,
        hdrs: dict[str, str] | None,
        size: int,
        timeout: float,
        retries: int,
    ) -> PubAck:
        """:meth:`publish` of headers that carry their ``Nats-Msg-Id`` already, ``size``
        bytes with them (never modified here)."""
        if size > self.max_payload:
            raise PayloadTooLargeError(
                f"{self.actor}: message to {subject} is {size} bytes with headers; max_payload is {self.max_payload}"
            )
        delay = 0.2
        # a timeout is retried `retries` times and, past them, until the retry window of
        # the API calls is over (a cluster's leader election, a reconnect)
        give_up = time.monotonic() + self.cfg.retry_window
        attempt = -1
        while True:
            attempt += 1
            try:
                return await self.transport.publish(subject, data, hdrs, timeout)
            except BusTimeout as exc:
                if attempt >= retries and time.monotonic() >= give_up:
                    raise BusError(
                        f"{self.actor}: publish to {subject} timed out {attempt + 1} times "
                        f"(nats.retry_window {self.cfg.retry_window:g} s)"
                    ) from exc
            except StreamFullError as exc:
                if attempt < retries or time.monotonic() < give_up:
                    if self.on_stream_full is not None:  # may free room; then wait for consumers
                        await self.on_stream_full(self, subject)
                else:
                    raise StreamFullError(
                        f"{self.actor}: publish to {subject} refused: its stream is full "
                        f"({exc}); it waits for consumers, or raise the "
                        f"stream's nats.streams.<stream>.max_bytes / max_msgs"
                    ) from exc
            except BusUnavailable as exc:
                if attempt >= retries and time.monotonic() >= give_up:
                    raise BusError(f"{self.actor}: publish to {subject} rejected: {exc}") from exc
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def publish_encoded(self, subject: str, msg: EncodedMessage) -> PubAck:
        """:meth:`publish` of a message :func:`~rftstream.experience.pack_group` made (its
        headers and size taken as they are: they carry its ``Nats-Msg-Id``)."""
        if msg.size < 0 or msg.headers.get(H_MSG_ID) != msg.msg_id:
            return await self.publish(subject, msg.data, headers=msg.headers, msg_id=msg.msg_id)
        return await self._publish_sized(
            subject, msg.data, msg.headers, msg.size, PUBLISH_TIMEOUT_S, PUBLISH_RETRIES
        )

    async def publish_group(
        self, stage: str, exps: Sequence[Experience], *, msg_id: str, group_id: str | None = None
    ) -> int:
        """Publish one task group to ``exp.<stage>`` (split under max_payload). Returns messages stored (not dups).

        Encodes the group (:func:`pack_group`), then publishes its parts one after
        the other through :meth:`publish`, blocking for each one's ack. Cancelled
        or failed part-way, some parts may be stored: publishing the same group
        again with the same ``msg_id`` stores only the others.
        """
        from rftstream.experience import pack_group

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

    async def dead_letter(self, stage: str, msg: Delivery, reason: str) -> None:
        """Copy ``msg`` to ``dlq.<stage>`` with the reason in headers, then ``term`` it.

        The original headers are kept (but its ``Nats-Msg-Id`` is prefixed, so the
        copy is deduplicated on its own); terminating stops redelivery. The copy keeps
        at most the first :data:`DEAD_LETTER_BODY_LIMIT` bytes of the body (less if
        ``max_payload`` leaves less room); headers give the original body's size
        (``Rft-Dlq-Body-Bytes``) and hash (``Rft-Dlq-Body-Hash``, see
        :func:`body_digest`), and ``Rft-Dlq-Body-Truncated: true`` marks a shortened
        copy. Blocks until the copy is acked (as :meth:`publish`), then for the term.
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
        data = bytes(msg.data)
        hdrs.update(
            {
                H_DLQ_REASON: reason_line,
                H_DLQ_STAGE: stage,
                H_DLQ_ACTOR: self.actor,
                H_DLQ_SUBJECT: msg.subject,
                H_DLQ_SEQ: seq,
                H_DLQ_DELIVERIES: deliveries,
                H_DLQ_BODY_BYTES: str(len(data)),
                H_DLQ_BODY_HASH: body_digest(data),
                H_DLQ_BODY_TRUNCATED: "true",  # dropped below when the body fits
            }
        )
        room = max(0, self.max_payload - headers_size(hdrs) - 1024)
        keep = min(DEAD_LETTER_BODY_LIMIT, room)
        if len(data) > keep:
            data = data[:keep]
        else:
            del hdrs[H_DLQ_BODY_TRUNCATED]
        orig_id = (msg.headers or {}).get(H_MSG_ID) or f"{msg.subject}:{seq}"
        await self.publish(
            self.names.dlq_subject(stage), data, headers=hdrs, msg_id=f"dlq:{stage}:{orig_id}"
        )
        try:
            await msg.term()
        except Exception:  # noqa: BLE001 - not a stream message (core publish)
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


def body_digest(data: bytes) -> str:
    """``"xxh3_128:<hex>"`` of ``data`` (``"sha256:<hex>"`` where ``xxhash`` is not
    installed): the ``Rft-Dlq-Body-Hash`` of a dead letter, to match its original."""
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash is a dependency
        import hashlib

        return "sha256:" + hashlib.sha256(data).hexdigest()
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)
