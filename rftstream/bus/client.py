"""The thin NATS adapter: connect, provision, publish, pull, KV.

Everything NATS-specific is here; nats errors are translated to
:class:`rftstream.errors.BusError` naming the subject, stream or consumer.
nats-py is asyncio-native, so code using :class:`Bus` runs on anyio's asyncio
backend.

Blocking and cancellation:

* :meth:`Bus.publish` waits for room under ``max_inflight_bytes`` (only when
  there is none: it does not yield to the event loop otherwise) and for the
  stream's ack (each attempt bounded by ``timeout``, retried with the same
  ``Nats-Msg-Id``, so a retried publish is stored once). Cancelling it may
  leave the message stored or not; republishing with the same id is always
  safe. Its bytes are given back synchronously, cancelled or not.
* :meth:`PullConsumer.fetch` waits up to ``timeout`` and returns ``[]`` when
  nothing arrived. Messages are never acked here: the caller acks (or naks,
  terms, or lets ``ack_wait`` redeliver them).

The hot paths cost about what raw nats-py costs, or less (see
``benchmarks/bus.py``): every await that is not a wait for the server is
avoided (an ``anyio.Condition`` around every publish made each one take
several event-loop turns, each as long as whatever else the loop runs, e.g.
a consumer decoding a batch), publish replies come through one inbox
subscription (:class:`_Replies`) and fetches read the subscription's queue
directly (nats-py's ``fetch`` makes a task, a uuid and a ``wait_for`` per
message).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from rftstream.bus.connect import ConnectionWatch, open_connection
from rftstream.bus.limits import StreamFullError, is_stream_full, purge_acked, stream_limits
from rftstream.bus.resilient import ResilientJetStream
from rftstream.bus.state import RunState
from rftstream.config.schema import NatsConfig
from rftstream.config.secrets import redact_url
from rftstream.errors import BusError, PayloadTooLargeError, RunNotFoundError
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
from rftstream.subjects import (
    KV_TRAINER_INPUT,
    META_TO_STAGE,
    RAW_STAGE,
    TRAIN_STAGE,
    RunNames,
)

log = logging.getLogger(__name__)

SCHEMA_META = "rft.experience.v1"


_STATUS = api.Header.STATUS
_HEARTBEAT = "100"
_END_STATUSES = ("404", "408", "409")  # no messages, request expired, request ended (conflict)
_UNAVAILABLE_PAUSE = 0.25  # s a fetch answered 503 (no consumer leader) waits before returning


class _PubAckMsg(msgspec.Struct, gc=False):
    """A JetStream publish reply: the ack, or ``error`` (code, err_code, description)."""

    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


_PUBACK_DECODER = msgspec.json.Decoder(_PubAckMsg)


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


class _Replies:
    """Request/reply for JetStream publishes on one connection.

    ``nc.request`` makes a NUID and reads ``os.urandom`` for every request's
    token and waits through ``asyncio.wait_for``; here one wildcard inbox
    subscription (made on first use) serves every publish, a token is a
    counter, and the wait is one timer. The subscription is restored with the
    connection after a reconnect; a reply lost meanwhile is a timeout.
    """

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self._prefix = ""
        self._sub: Any = None
        self._starting: anyio.Event | None = None
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._count = 0

    async def _start(self) -> None:
        while self._sub is None:
            if self._starting is not None:  # another publish is subscribing
                await self._starting.wait()
                continue
            self._starting = anyio.Event()
            try:
                prefix = self.nc.new_inbox()
                self._sub = await self.nc.subscribe(f"{prefix}.*", cb=self._on_reply)
                self._prefix = prefix
            finally:
                self._starting.set()
                self._starting = None

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._pending.pop(msg.subject[len(self._prefix) + 1 :], None)
        if fut is None or fut.done():
            return  # a reply after its timeout or cancel
        if not msg.data and msg.headers and msg.headers.get(_STATUS) == "503":
            fut.set_exception(nats.js.errors.NoStreamResponseError())  # no stream for the subject
        else:
            fut.set_result(msg)

    async def request(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> Msg:
        """Publish with a reply subject; block until the reply, at most ``timeout`` s.

        Raises ``nats.errors.TimeoutError`` after ``timeout``. Cancelling it
        forgets the request (the message may be stored or not).
        """
        if self._sub is None:
            await self._start()
        self._count += 1
        token = str(self._count)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = fut
        try:
            await self.nc.publish(subject, data, reply=f"{self._prefix}.{token}", headers=headers)
            timer = loop.call_later(timeout, _expire, fut)
            try:
                return await fut
            finally:
                timer.cancel()
        finally:
            self._pending.pop(token, None)


class _Waiter:
    __slots__ = ("n", "event", "granted")

    def __init__(self, n: int) -> None:
        self.n = n
        self.event = anyio.Event()
        self.granted = False


class InflightLimiter:
    """Caps the bytes of publishes awaiting their ack (DESIGN §8: thousands of
    large messages in flight make the server answer 429 and drop).

    :meth:`acquire` returns at once, without yielding to the event loop, while
    ``inflight + n <= limit`` and nobody is waiting; otherwise it blocks in
    FIFO order until releases make room (one message larger than the limit is
    let through alone, when nothing else is in flight). :meth:`release` is
    synchronous: it never blocks, so a ``finally`` of a cancelled publish gives
    its bytes back without a shielded scope, and it hands the room directly
    to the waiters it wakes. Cancelling a blocked :meth:`acquire` takes
    nothing (or gives back what was granted at the same moment).
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.inflight = 0
        self._waiters: deque[_Waiter] = deque()

    def _fits(self, n: int) -> bool:
        return self.inflight == 0 or self.inflight + n <= self.limit

    @property
    def waiting(self) -> int:
        """Acquires blocked for room."""
        return len(self._waiters)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.inflight += n
            return
        waiter = _Waiter(n)
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(n)
            else:
                self._waiters.remove(waiter)
                self._wake()  # the head left: the next ones may fit now
            raise

    def release(self, n: int) -> None:
        self.inflight -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0].n):
            waiter = self._waiters.popleft()
            self.inflight += waiter.n
            waiter.granted = True
            waiter.event.set()


class PullConsumer:
    """A bound pull subscription on a durable consumer (shared by all replicas).

    Messages are never acked here: the caller acks (or naks, terms, or lets
    ``ack_wait`` expire) each message :meth:`fetch` returned.
    """

    def __init__(
        self, sub: Any, stream: str, durable: str, watch: ConnectionWatch | None = None
    ) -> None:
        self._sub = sub
        self.stream = stream
        self.durable = durable
        self._watch = watch  # names the reason when the connection was given up
        # nats-py's fetch waits for every message through `Subscription.next_msg`,
        # which makes a uuid, a task and a `wait_for` per message (about 25 us, as
        # much as decoding a group): `fetch` reads the subscription's queue itself
        # when the nats-py in use has the attributes it needs.
        inner = getattr(sub, "_sub", None)
        self._queue: asyncio.Queue[Msg] | None = getattr(inner, "_pending_queue", None)
        self._nc: NatsClient | None = getattr(sub, "_nc", None)
        self._nms: str | None = getattr(sub, "_nms", None)
        self._deliver: str | None = getattr(sub, "_deliver", None)
        self._stash: list[Msg] = []  # taken by a fetch that was cancelled: returned first
        self._direct = (
            isinstance(self._queue, asyncio.Queue)
            and hasattr(inner, "_pending_size")
            and self._nc is not None
            and isinstance(self._nms, str)
            and isinstance(self._deliver, str)
        )

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Fetch up to ``batch`` messages, waiting up to ``timeout`` s; ``[]`` if none came.

        Blocks until ``batch`` messages are in hand, or the server says it has
        no more for now (returning what came), or ``timeout`` passes. Messages
        delivered for an earlier fetch that gave up are returned first.
        Nothing is acked. Cancelling it loses nothing: the messages it had
        already taken, and any delivered after the cancel, go to the next fetch
        (or, never fetched, are redelivered after ``ack_wait``). A pull answered 503 (the
        consumer has no leader: a cluster node died and its group is electing one) returns
        ``[]`` after a short pause; messages already in hand go to the next fetch. Raises
        :class:`BusError` when the connection is closed or the server rejects the pull request.
        """
        if batch < 1:
            raise ValueError(f"fetch: batch must be >= 1, got {batch}")
        if timeout <= 0:
            raise ValueError(f"fetch: timeout must be > 0, got {timeout}")
        try:
            if self._direct:
                msgs: list[Msg] = []
                try:
                    await self._fetch_direct(msgs, batch, timeout)
                except BaseException:
                    self._stash[:0] = msgs  # cancelled with messages in hand: next fetch
                    raise
                return msgs
            return list(await self._sub.fetch(batch=batch, timeout=timeout))
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except nats.js.errors.ServiceUnavailableError:
            # 503: the consumer has no leader right now (a cluster node died and its raft
            # group is electing another): nothing for now, the caller fetches again
            log.info("%s/%s: no consumer leader (503); fetching again", self.stream, self.durable)
            await anyio.sleep(min(timeout, _UNAVAILABLE_PAUSE))
            return []
        except nats.errors.ConnectionClosedError as exc:
            what = f"consumer {self.stream}/{self.durable}"
            if self._watch is not None:
                raise self._watch.closed_error(what) from exc
            raise BusError(f"{what}: connection closed") from exc
        except nats.js.errors.APIError as exc:
            raise BusError(f"consumer {self.stream}/{self.durable}: pull rejected: {exc}") from exc

    # -- the direct fetch: nats-py's protocol (a no-wait probe, then one lingering
    # request), reading the subscription's queue without a task per message
    def _took(self, msg: Msg) -> Msg:
        self._sub._sub._pending_size -= len(msg.data)
        self._queue.task_done()  # type: ignore[union-attr] # the subscription's drain() joins it
        return msg

    async def _next(self, deadline: float) -> Msg | None:
        """The next delivered message (or status), or None at ``deadline``."""
        queue = self._queue
        assert queue is not None
        if not queue.empty():
            return self._took(queue.get_nowait())
        left = deadline - time.monotonic()
        if left > 0:
            # asyncio.Queue.get is cancel-safe: cancelled, it has taken nothing
            with anyio.move_on_after(left):
                return self._took(await queue.get())
        if self._nc is not None and self._nc.is_closed:
            raise nats.errors.ConnectionClosedError
        return None

    async def _request(self, batch: int, expires: float | None, no_wait: bool) -> None:
        req: dict[str, Any] = {"batch": batch}
        if expires is not None:
            req["expires"] = max(int(expires * 1e9) - 100_000, 1)  # ns, ends before we give up
        if no_wait:
            req["no_wait"] = True
        await self._nc.publish(self._nms, json.dumps(req).encode(), self._deliver)  # type: ignore[union-attr,arg-type]

    async def _collect(self, msgs: list[Msg], batch: int, deadline: float, probe: bool) -> None:
        """Append deliveries of the pending request to ``msgs`` until it ends, ``batch`` or ``deadline``."""
        while len(msgs) < batch:
            msg = await self._next(deadline)
            if msg is None:
                return
            status = msg.headers.get(_STATUS) if msg.headers else None
            if not status:
                msgs.append(msg)
            elif status == _HEARTBEAT:
                continue
            elif status not in _END_STATUSES:
                raise nats.js.errors.APIError.from_msg(msg)
            elif probe or msgs:
                return  # this request is over: no more messages for now
            # else a lingering request ended empty-handed (a stale 408 of an earlier
            # fetch, a 409): wait out the deadline rather than make the caller spin

    async def _fetch_direct(self, msgs: list[Msg], batch: int, timeout: float) -> None:
        """Fill ``msgs`` (in place: a cancelled fetch's messages are not lost, see :meth:`fetch`)."""
        queue = self._queue
        assert queue is not None
        deadline = time.monotonic() + timeout
        while self._stash and len(msgs) < batch:
            msgs.append(self._stash.pop(0))
        while len(msgs) < batch and not queue.empty():
            msg = self._took(queue.get_nowait())
            if not (msg.headers and msg.headers.get(_STATUS)):
                msgs.append(msg)  # statuses left over were meant for earlier requests
        if len(msgs) >= batch:
            return
        # the probe: what is there now, at once (nats-server holds a no_wait request
        # that has `expires` until something arrives: `expires` only when empty-handed)
        await self._request(batch - len(msgs), None if msgs else timeout, no_wait=True)
        await self._collect(msgs, batch, deadline, probe=True)
        if msgs:
            return
        left = deadline - time.monotonic()
        if left < 0.001:
            return
        await self._request(batch, left, no_wait=False)  # lingers until messages or `left`
        await self._collect(msgs, batch, deadline, probe=False)

    async def info(self) -> api.ConsumerInfo:
        return await self._sub.consumer_info()

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # noqa: BLE001 - closing; nothing to do
            pass


def _value(policy: Any) -> str:
    return str(getattr(policy, "value", policy))


class Bus:
    """One actor's connection to the run's streams, consumers and KV bucket."""

    def __init__(self, nc: NatsClient, names: RunNames, cfg: NatsConfig, actor: str) -> None:
        self.nc = nc
        # API requests retry what a cluster's leader elections cause (bus/resilient.py)
        self.js: JetStreamContext = ResilientJetStream(
            nc, timeout=10.0, retry_window=cfg.retry_window
        )
        self.names = names
        self.cfg = cfg
        self.actor = actor
        self._limiter = InflightLimiter(cfg.max_inflight_bytes)
        self._replies = _Replies(nc)
        self._kv: KeyValue | None = None
        self.watch: ConnectionWatch | None = None  # set by connect()

    # ------------------------------------------------------------ lifecycle
    @classmethod
    async def connect(cls, url: str | None, names: RunNames, cfg: NatsConfig, actor: str) -> Bus:
        """Connect to ``url`` (``None``/empty: the servers of ``cfg``) with the credentials,
        TLS and reconnect window of ``cfg`` (:func:`rftstream.bus.connect.open_connection`).

        Raises one :class:`BusError` naming the servers and the kind of auth when the
        first connect fails (seconds, not a hang). A connection lost later is retried
        for ``nats.reconnect_window`` seconds; after that, operations raise
        :class:`BusError` naming the servers and the window.
        """
        nc, watch = await open_connection(
            cfg, url, name=f"rftstream:{names.run}:{actor}", actor=actor
        )
        bus = cls(nc, names, cfg, actor)
        bus.watch = watch
        return bus

    @property
    def server_url(self) -> str:
        """The URL of the server this connection uses now, without its password."""
        url = self.nc.connected_url
        return redact_url(url.geturl()) if url is not None else "?"

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

    def _closed_error(self, what: str) -> BusError:
        if self.watch is not None:
            return self.watch.closed_error(f"{self.actor}: {what}")
        return BusError(f"{self.actor}: {what}: connection closed")

    @property
    def max_payload(self) -> int:
        """The smaller of the configured and the server's ``max_payload``."""
        server = self.nc.max_payload or self.cfg.max_payload
        return min(self.cfg.max_payload, server)

    # ------------------------------------------------------------ provisioning
    def _meta(self, role: str, schema: str) -> dict[str, str]:
        return {
            "rft.run": self.names.run,
            "rft.run_name": self.names.name or self.names.run,
            "rft.role": role,
            "rft.schema": schema,
            "rft.created_by": self.actor,
        }

    async def _ensure_stream(self, cfg: api.StreamConfig, key: str) -> None:
        """Create the stream, or update an existing one to ``cfg`` (limits from ``key``,
        e.g. ``nats.streams.experience``).

        Raises :class:`BusError` when the stream exists with another retention
        (NATS cannot change a work queue's), naming the stream and what to do.
        Lowering a ``discard: old`` limit below what is stored drops the oldest
        messages: logged as a warning naming the stream and key.
        """
        try:
            info = await self.js.stream_info(cfg.name)  # type: ignore[arg-type]
        except nats.js.errors.NotFoundError:
            try:
                await self.js.add_stream(cfg)
            except nats.js.errors.APIError as exc:
                raise BusError(f"cannot create stream {cfg.name} ({key}): {exc}") from exc
            return
        old = info.config
        if old.retention != cfg.retention:
            raise BusError(
                f"stream {cfg.name} exists with retention {_value(old.retention)}, this run "
                f"needs {_value(cfg.retention)} (NATS cannot change a work queue's, and rftstream never "
                f"changes one): delete the stream (`rftstream clean`, or `nats stream rm {cfg.name}`) first"
            )
        stored = int(info.state.bytes or 0)
        if cfg.discard == api.DiscardPolicy.OLD and 0 < (cfg.max_bytes or -1) < stored:
            log.warning(
                "stream %s holds %d bytes; %s.max_bytes %d makes the server drop the oldest",
                cfg.name,
                stored,
                key,
                cfg.max_bytes,
            )
        try:
            await self.js.update_stream(cfg)
        except nats.js.errors.APIError as exc:
            log.warning("stream %s exists and could not be updated to %s: %s", cfg.name, key, exc)

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
            metadata=metadata,
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
        limits = self.cfg.streams
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
                **stream_limits(limits.tasks),
            ),
            "nats.streams.tasks",
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
                **stream_limits(limits.experience),
            ),
            "nats.streams.experience",
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.dlq_stream,
                description=f"rftstream run {n.run}: dead letters; reason in header Rft-Dlq-Reason",
                subjects=[n.dlq_wildcard],
                retention=api.RetentionPolicy.LIMITS,
                metadata=self._meta("dead-letter", "original message"),
                **common,
                **stream_limits(limits.dead_letter),
            ),
            "nats.streams.dead_letter",
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.metrics_stream,
                description=f"rftstream run {n.run}: metrics of every actor (JSON rft.metrics.v1)",
                subjects=[n.metrics_wildcard],
                retention=api.RetentionPolicy.LIMITS,
                metadata=self._meta("metrics", "rft.metrics.v1"),
                **{**common, "max_msg_size": -1},
                **stream_limits(limits.metrics),
            ),
            "nats.streams.metrics",
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
        moved = await RunState(await self.kv()).get_raw(KV_TRAINER_INPUT) is not None
        if not moved:  # a splice moved the trainer elsewhere: never recreate `trainer` then
            await self.ensure_consumer(
                n.exp_stream,
                n.trainer_consumer,
                n.exp_subject(TRAIN_STAGE),
                description=f"run {n.run}: the trainer reads exp.train",
                role="trainer",
            )

    async def kv(self, *, create: bool = True) -> KeyValue:
        """The run's state bucket (created on first use).

        ``create=False`` (read-only commands) never creates it: raises
        :class:`RunNotFoundError` naming the run and the server when it does not exist.
        """
        if self._kv is not None:
            return self._kv
        bucket = self.names.kv_bucket
        try:
            self._kv = await self.js.key_value(bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError) as exc:
            if not create:
                raise RunNotFoundError(
                    f"run {self.names.display} has no state on this server "
                    f"({self.server_url}): no KV bucket {bucket} "
                    "(wrong run name or server, or "
                    "credentials of another account?)"
                ) from exc
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
        return PullConsumer(sub, stream, durable, self.watch)

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
        drop the connection), raising :class:`PayloadTooLargeError`. Blocks
        while ``max_inflight_bytes`` are awaiting acks, then until the stream
        acks (each attempt at most ``timeout`` s). A timed-out publish (or one
        answered 429/503, or with no stream) is retried up to ``retries`` times
        with the same ``Nats-Msg-Id`` (the stream deduplicates it), then raises
        :class:`BusError`; a rejection raises :class:`BusError` at once.
        Cancelling it may leave the message stored or not, and gives its bytes
        back at once.
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
            # a timeout is retried `retries` times and, past them, until the retry window of
            # the JetStream API calls is over (a cluster's leader election, a reconnect)
            give_up = time.monotonic() + self.cfg.retry_window
            attempt = -1
            while True:
                attempt += 1
                try:
                    return await self._js_publish(subject, data, hdrs or None, timeout)
                except (
                    nats.errors.TimeoutError,
                    TimeoutError,
                    nats.js.errors.NoStreamResponseError,
                ) as exc:
                    if attempt >= retries and time.monotonic() >= give_up:
                        raise BusError(
                            f"{self.actor}: publish to {subject} timed out {attempt + 1} times "
                            f"(nats.retry_window {self.cfg.retry_window:g} s)"
                        ) from exc
                except nats.errors.ConnectionClosedError as exc:
                    raise self._closed_error(f"publish to {subject}") from exc
                except nats.js.errors.APIError as exc:
                    full = is_stream_full(exc)
                    if full and (attempt < retries or time.monotonic() < give_up):
                        await self._free_experience(subject)  # then wait for consumers
                    elif full:
                        raise StreamFullError(
                            f"{self.actor}: publish to {subject} refused: its stream is full "
                            f"({exc.description}); it waits for consumers, or raise the "
                            f"stream's nats.streams.<stream>.max_bytes / max_msgs"
                        ) from exc
                    if (
                        full
                        or getattr(exc, "code", None) in (429, 503)
                        and (attempt < retries or time.monotonic() < give_up)
                    ):
                        pass
                    else:
                        raise BusError(
                            f"{self.actor}: publish to {subject} rejected: {exc}"
                        ) from exc
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
        finally:
            self._limiter.release(size)  # synchronous: a cancelled publish gives its bytes back

    async def _free_experience(self, subject: str) -> None:
        """A publish to ``subject`` found its stream full: when it is the experience
        stream, purge what every consumer acked (``nats.streams.experience.purge_acked``)
        before the retry. Best effort: a failure is logged and the retry waits as usual."""
        if not subject.startswith(self.names.exp_wildcard[:-1]):
            return
        exp = self.cfg.streams.experience
        if not exp.purge_acked:
            return
        try:
            state = RunState(await self.kv())
            prefix = self.names.exp_wildcard[:-1]
            await purge_acked(self.js, self.names.exp_stream, exp, state, prefix)
        except BusError as exc:
            log.warning("%s: %s", self.actor, exc)

    async def _js_publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> api.PubAck:
        """What ``js.publish`` does: one request, the stream's ack (or error) as the reply.

        Cheaper per message: the reply comes through :class:`_Replies` and the ack
        is parsed by msgspec (``json.loads`` + ``PubAck.from_response`` cost about
        7 us). Raises what ``js.publish`` raises: ``nats.errors.TimeoutError``
        after ``timeout``, ``NoStreamResponseError``, ``APIError`` subclasses.
        """
        msg = await self._replies.request(subject, data, headers, timeout)
        try:
            ack = _PUBACK_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise BusError(
                f"{self.actor}: publish to {subject}: unreadable ack {msg.data[:200]!r}"
            ) from exc
        if ack.error is not None:
            nats.js.errors.APIError.from_error(ack.error)  # raises
        return api.PubAck(
            stream=ack.stream, seq=ack.seq, domain=ack.domain, duplicate=ack.duplicate
        )

    async def publish_encoded(self, subject: str, msg: EncodedMessage) -> api.PubAck:
        return await self.publish(subject, msg.data, headers=msg.headers, msg_id=msg.msg_id)

    async def publish_group(
        self, stage: str, exps: Sequence[Experience], *, msg_id: str, group_id: str | None = None
    ) -> int:
        """Publish one task group to ``exp.<stage>`` (split under max_payload). Returns messages stored (not dups).

        Encodes the group (:func:`pack_group`), then publishes its parts one after
        the other through :meth:`publish`, blocking for each one's ack. Cancelled
        or failed part-way, some parts may be stored: publishing the same group
        again with the same ``msg_id`` stores only the others.
        """
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
