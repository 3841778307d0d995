"""The NATS JetStream transport: :class:`~rftstream.bus.transport.Transport` over nats-py.

nats errors end here: every method raises the neutral errors of
:mod:`rftstream.errors` (a closed connection as the :class:`ConnectionWatch`'s
error naming the servers and the reconnect window). JetStream API requests
retry what a cluster's leader elections cause (:class:`ResilientJetStream`);
publishes go through :class:`Replies` under an :class:`InflightLimiter` and
pulls through :class:`JetStreamPull`'s direct fetch, so the hot paths cost
what raw nats-py costs, or less (``benchmarks/bus.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KeyValue

from rftstream.bus.jetstream.connect import ConnectionWatch
from rftstream.bus.jetstream.publish import PUBACK_DECODER, InflightLimiter, Replies
from rftstream.bus.jetstream.pull import JetStreamPull
from rftstream.bus.jetstream.records import (
    consumer_config,
    consumer_state,
    stream_config,
    stream_state,
)
from rftstream.bus.jetstream.resilient import ResilientJetStream
from rftstream.bus.transport import (
    H_KV_OPERATION,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    KvEntry,
    PubAck,
    StoredMsg,
    StreamSpec,
    StreamState,
    unsubscribe_quietly,
)
from rftstream.config.secrets import redact_url
from rftstream.errors import (
    BucketNotFound,
    BusError,
    BusTimeout,
    BusUnavailable,
    CasConflict,
    ConsumerNotFound,
    KeyNotFound,
    MessageNotFound,
    NotFound,
    StreamFullError,
    StreamNotFound,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# JSStreamStoreFailedF: what the server answers a publish to a full `discard: new` stream
STREAM_FULL_ERR_CODE = 10077
# JSStreamWrongLastSequenceErrF / JSStreamWrongLastSequenceConstantErr: the key moved on
_WRONG_LAST_SEQUENCE = (10071, 10164)


def is_stream_full(exc: nats.js.errors.APIError) -> bool:
    """Whether a publish error is the server's "maximum bytes/messages exceeded" (discard new)."""
    desc = str(getattr(exc, "description", "") or "")
    return (
        getattr(exc, "err_code", None) == STREAM_FULL_ERR_CODE
        or "maximum " in desc
        and ("exceeded" in desc)
    )


def _lost_race(exc: Exception) -> bool:
    """Whether a failed conditional KV write failed only because another writer was first."""
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in _WRONG_LAST_SEQUENCE


def _value(policy: Any) -> str:
    return str(getattr(policy, "value", policy))


@contextmanager
def _translated(
    what: str, missing: type[NotFound] = NotFound, watch: ConnectionWatch | None = None
) -> Iterator[None]:
    """Raise nats errors of the block as the neutral ones, naming ``what``."""
    try:
        yield
    except nats.js.errors.NotFoundError as exc:
        raise missing(f"{what}: not found") from exc
    except (nats.errors.TimeoutError, TimeoutError) as exc:
        raise BusTimeout(f"{what}: timed out") from exc
    except nats.js.errors.ServiceUnavailableError as exc:
        raise BusUnavailable(f"{what}: unavailable: {exc}") from exc
    except nats.errors.ConnectionClosedError as exc:
        if watch is not None:
            raise watch.closed_error(what) from exc
        raise BusError(f"{what}: connection closed") from exc
    except nats.errors.Error as exc:
        raise BusError(f"{what}: {exc}") from exc


#: JetStream's "insufficient storage resources available" (a stream's reservation refused)
_NO_STORAGE = 10047
#: JetStream's "error creating store for stream" (the stream's directory could not be made)
_STORE_FAILED = 10049
#: attempts at creating a stream (or KV bucket) whose store the server failed to make
_STORE_ATTEMPTS = 4
_STORE_PAUSE = 0.05  # s before the second attempt; doubled each time


async def create_riding_out_store_races(what: str, create: Callable[[], Awaitable[T]]) -> T:
    """``await create()`` (a stream or KV bucket creation), again after a short pause when
    the server answers "error creating store for stream" (10049), at most
    ``_STORE_ATTEMPTS`` times in all (0.35 s of pauses); then that answer is raised.

    Why: when an account's last stream is deleted, nats-server removes the account's
    now-empty ``<store>/<account>/streams`` directory in a goroutine of its own
    (``stream.stop``). A stream created in that moment has the directory pulled from
    under its ``MkdirAll`` and is refused with 10049 (the server logs "could not create
    storage directory"); asked again, it succeeds. A lasting cause (a read-only store)
    fails every attempt and reaches the caller unchanged. Other errors are raised at
    once. Blocks for the attempts; cancelling it cancels the one in flight.
    """
    pause = _STORE_PAUSE
    for attempt in range(2, _STORE_ATTEMPTS + 1):
        try:
            return await create()
        except nats.js.errors.APIError as exc:
            if exc.err_code != _STORE_FAILED:
                raise
            log.info("%s: %s; asking again (attempt %d)", what, exc.description, attempt)
        await anyio.sleep(pause)
        pause *= 2
    return await create()  # the last attempt: its answer, whatever it is, is the caller's


def _no_room_hint(error: str, spec: StreamSpec, key: str) -> str:
    """The server refused a stream because its JetStream store cannot reserve the
    stream's ``max_bytes``: say so, with the keys and commands that make room."""
    memory = spec.storage == "memory"
    store = "max_memory_store" if memory else "max_file_store"
    return (
        f"{error}. The server reserves each stream's max_bytes ({spec.max_bytes} bytes "
        f"for {key}.max_bytes) in its JetStream {'memory' if memory else 'store'}, and "
        f"has less than that left under its {store} (by default 75% of the free "
        f"{'memory' if memory else 'disk of its store_dir'}), what other streams, other "
        f"runs' too, reserve already deducted. Lower {key}.max_bytes, remove finished runs (`rftstream clean`), "
        f"or give the server more room ({store} in its jetstream block)"
    )


class _JetStreamKV:
    """A KV bucket (:class:`~rftstream.bus.transport.KeyValueStore`) over nats-py's ``KeyValue``."""

    def __init__(self, kv: KeyValue, js: ResilientJetStream, nc: NatsClient, bucket: str) -> None:
        self._kv = kv
        self._js = js
        self._nc = nc
        self.bucket = bucket

    async def get(self, key: str) -> KvEntry:
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError) as exc:
            raise KeyNotFound(f"KV {self.bucket}/{key}: no value") from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"KV {self.bucket}/{key}: read failed: {exc!r}") from exc
        if entry.value is None:
            raise KeyNotFound(f"KV {self.bucket}/{key}: no value")
        return KvEntry(key, entry.value, int(entry.revision or 0), entry.created)

    async def put(self, key: str, value: bytes) -> int:
        with _translated(f"KV {self.bucket}/{key}: write"):
            return int(await self._kv.put(key, value))

    async def _conditional(self, key: str, write: Callable[[], Awaitable[int]]) -> int:
        try:
            return int(await write())
        except (nats.errors.Error, TimeoutError) as exc:
            if _lost_race(exc):
                raise CasConflict(f"KV {self.bucket}/{key}: another writer was first") from exc
            raise BusError(f"KV {self.bucket}/{key}: conditional write failed: {exc}") from exc

    async def create(self, key: str, value: bytes) -> int:
        return await self._conditional(key, lambda: self._kv.create(key, value))

    async def update(self, key: str, value: bytes, last: int) -> int:
        return await self._conditional(key, lambda: self._kv.update(key, value, last=last))

    async def delete(self, key: str) -> None:
        try:
            await self._kv.delete(key)
        except nats.js.errors.KeyNotFoundError:
            pass
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"KV {self.bucket}/{key}: delete failed: {exc}") from exc

    async def keys(self, prefix: str = "") -> list[str]:
        """One stream-info request for the bucket stream's subjects, rather than
        ``KeyValue.keys()``: that one runs a watcher whose "no more keys" marker can
        race ahead of a just-stored key and then reports none."""
        pre = f"$KV.{self.bucket}."
        # a subject filter must end on a token boundary: "heartbeat.>" but not "explorer>"
        token_prefix = prefix if prefix.endswith(".") else ""
        try:
            info = await self._js.stream_info(
                f"KV_{self.bucket}", subjects_filter=f"{pre}{token_prefix}>"
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"KV {self.bucket}/{prefix}*: listing keys failed: {exc}") from exc
        keys = (s[len(pre) :] for s in (info.state.subjects or {}))
        return sorted(k for k in keys if k.startswith(prefix))

    async def on_write(
        self, keys: tuple[str, ...], callback: Callable[[], Awaitable[None]]
    ) -> _Subscriptions:
        """Plain NATS subscriptions on the keys' subjects (``$KV.<bucket>.<key>``): no
        JetStream consumer, nothing stored."""

        async def changed(_msg: Msg) -> None:
            await callback()

        subs = _Subscriptions()
        for key in keys:
            subs.subs.append(await self._nc.subscribe(f"$KV.{self.bucket}.{key}", cb=changed))
        return subs

    async def on_value(
        self, keys: tuple[str, ...], callback: Callable[[str, bytes | None], None]
    ) -> _Subscriptions:
        """Plain NATS subscriptions on the keys' subjects, as :meth:`on_write`; each
        message is a write as published (a ``KV-Operation`` header marks a delete or
        purge). nats-py queues a subscription's messages as it parses them and runs
        their callbacks in parse order with the callback of a request's reply, so a
        write parsed before a reply is handed on before the reply's waiter resumes."""
        pre = f"$KV.{self.bucket}."

        async def written(msg: Msg) -> None:
            op = (msg.headers or {}).get(H_KV_OPERATION)
            callback(msg.subject[len(pre) :], None if op in ("DEL", "PURGE") else msg.data)

        subs = _Subscriptions(self._nc)
        for key in keys:
            subs.subs.append(await self._nc.subscribe(pre + key, cb=written))
        return subs


class _Subscriptions:
    """Core NATS subscriptions ended together."""

    def __init__(self, nc: NatsClient | None = None) -> None:
        self.subs: list[Any] = []
        self._nc = nc
        self._reconnects = self._reconnect_count()

    def _reconnect_count(self) -> int:
        return int(self._nc.stats.get("reconnects", 0)) if self._nc is not None else 0

    def missed(self) -> bool:
        """Whether the connection came back from a loss since the previous call (what
        was published meanwhile never reached these subscriptions)."""
        now = self._reconnect_count()
        lost, self._reconnects = now != self._reconnects, now
        return lost

    async def unsubscribe(self) -> None:
        for sub in self.subs:
            await unsubscribe_quietly(sub)
        self.subs = []


class _OrderedRead:
    """An ordered ephemeral consumer read with ``next`` (:class:`OrderedReader`)."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def next(self, timeout: float) -> Delivery | None:
        try:
            return await self._sub.next_msg(timeout=timeout)  # type: ignore[no-any-return]
        except (nats.errors.TimeoutError, TimeoutError):
            return None
        except nats.errors.Error as exc:
            raise BusError(f"ordered read: {exc}") from exc

    async def close(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # noqa: BLE001 - closing
            pass


class _OrderedWatch:
    """An ordered ephemeral push consumer with a callback (:class:`Watch`)."""

    def __init__(self, sub: Any, what: str) -> None:
        self._sub = sub
        self._what = what

    async def info(self) -> ConsumerState:
        with _translated(self._what, ConsumerNotFound):
            return consumer_state(await self._sub.consumer_info())

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # noqa: BLE001 - closing
            pass


def _start(
    start_seq: int | None, start_time: datetime | None, description: str = ""
) -> api.ConsumerConfig | None:
    """An ordered consumer's config: where it starts (``start_seq``, ``start_time`` or, with
    neither, the stream's start) and its ``description`` (shown by ``nats consumer info``
    and ``rftstream streams`` beside its server-made name). None: all defaults."""
    kw: dict[str, Any] = {"description": description} if description else {}
    if start_seq is not None and start_seq > 1:
        return api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq, **kw
        )
    if start_time is not None:
        stamp = start_time.isoformat().replace("+00:00", "Z")
        return api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=stamp, **kw
        )
    return api.ConsumerConfig(**kw) if kw else None


class JetStreamTransport:
    """:class:`~rftstream.bus.transport.Transport` on one nats-py connection.

    ``retry_window``: how long JetStream API requests retry transient failures;
    ``max_inflight_bytes``: the cap on publishes awaiting their acks.
    """

    def __init__(
        self,
        nc: NatsClient,
        *,
        retry_window: float,
        max_inflight_bytes: int,
        watch: ConnectionWatch | None = None,
        actor: str = "",
    ) -> None:
        self.nc = nc
        self.js = ResilientJetStream(nc, timeout=10.0, retry_window=retry_window)
        self.connection = watch  # names the reason when the connection was given up
        self.actor = actor
        self._limiter = InflightLimiter(max_inflight_bytes)
        self._replies = Replies(nc)

    # ------------------------------------------------------------ connection
    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload or 0) or 1 << 62

    @property
    def server_url(self) -> str:
        url = self.nc.connected_url
        return redact_url(url.geturl()) if url is not None else "?"

    @property
    def is_closed(self) -> bool:
        return bool(self.nc.is_closed)

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            with anyio.move_on_after(5):
                await self.nc.drain()
        except Exception:  # noqa: BLE001
            pass
        if not self.nc.is_closed:
            await self.nc.close()

    def _who(self, what: str) -> str:
        """``what``, prefixed by the actor this connection serves (for publish errors)."""
        return f"{self.actor}: {what}" if self.actor else what

    def _closed(self, what: str) -> BusError:
        if self.connection is not None:
            return self.connection.closed_error(self._who(what))
        return BusError(self._who(f"{what}: connection closed"))

    @contextmanager
    def _api(self, what: str, missing: type[NotFound] = NotFound) -> Iterator[None]:
        with _translated(what, missing, self.connection):
            yield

    # ------------------------------------------------------------ publishing
    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> PubAck:
        """One JetStream publish: what ``js.publish`` does, cheaper per message.

        Blocks while ``max_inflight_bytes`` of payload are awaiting acks (without
        yielding when there is room; headers, a few hundred bytes, are not counted), then for the stream's ack through :class:`Replies` (parsed by
        msgspec: ``json.loads`` + ``PubAck.from_response`` cost about 7 us). The bytes
        are given back synchronously, cancelled or not.
        """
        size = len(data)
        await self._limiter.acquire(size)
        try:
            msg = await self._replies.request(subject, data, headers, timeout)
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise BusTimeout(f"publish to {subject}: no ack in {timeout:g} s") from exc
        except nats.js.errors.NoStreamResponseError as exc:  # retried as a timeout is
            raise BusTimeout(f"publish to {subject}: no stream answered") from exc
        except nats.errors.ConnectionClosedError as exc:
            raise self._closed(f"publish to {subject}") from exc
        except nats.errors.Error as exc:
            raise BusError(self._who(f"publish to {subject}: {exc}")) from exc
        finally:
            self._limiter.release(size)  # synchronous: a cancelled publish gives its bytes back
        try:
            ack = PUBACK_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise BusError(
                self._who(f"publish to {subject}: unreadable ack {msg.data[:200]!r}")
            ) from exc
        if ack.error is not None:
            try:
                nats.js.errors.APIError.from_error(ack.error)  # raises
            except nats.js.errors.APIError as exc:
                if is_stream_full(exc):
                    raise StreamFullError(exc.description or str(exc)) from exc
                if getattr(exc, "code", None) in (429, 503):
                    raise BusUnavailable(f"publish to {subject}: {exc}") from exc
                raise BusError(self._who(f"publish to {subject} rejected: {exc}")) from exc
        return PubAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))

    # ------------------------------------------------------------ consuming
    async def pull(self, stream: str, durable: str) -> JetStreamPull:
        with self._api(f"consumer {stream}/{durable}", ConsumerNotFound):
            sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        return JetStreamPull(sub, stream, durable, self.connection)

    async def read(
        self,
        stream: str | None,
        subject: str,
        *,
        start_seq: int = 1,
        headers_only: bool = False,
        description: str = "",
    ) -> _OrderedRead:
        with self._api(f"reading {subject} of stream {stream or '?'}", StreamNotFound):
            sub = await self.js.subscribe(
                subject,
                stream=stream,
                ordered_consumer=True,
                headers_only=headers_only or None,
                config=_start(start_seq, None, description),
            )
        self._note_reader(stream, sub)
        return _OrderedRead(sub)

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
    ) -> _OrderedWatch:
        what = f"watching {subject} of stream {stream}"
        with self._api(what, StreamNotFound):
            sub = await self.js.subscribe(
                subject,
                stream=stream,
                cb=callback,
                ordered_consumer=True,
                headers_only=headers_only or None,
                config=_start(start_seq, start_time, description),
            )
        self._note_reader(stream, sub)
        return _OrderedWatch(sub, what)

    def _note_reader(self, stream: str | None, sub: Any) -> None:
        """Remember the ordered consumer just made as an ephemeral reader of ``stream``
        (see :meth:`unreachable_durables`); nats-py keeps its name on the subscription."""
        name = getattr(sub, "_consumer", None)
        if stream and isinstance(name, str) and name:
            self.js.note_ephemeral(stream, name)

    # ------------------------------------------------------------ provisioning
    async def ensure_stream(self, spec: StreamSpec, key: str) -> None:
        """Create the stream, or update an existing one to ``spec``.

        Raises :class:`BusError` when the stream exists with another retention
        (NATS cannot change a work queue's), naming the stream and what to do.
        Lowering a ``discard: old`` limit below what is stored drops the oldest
        messages: logged as a warning naming the stream and ``key``.
        """
        cfg = stream_config(spec)
        try:
            with self._api(f"stream {spec.name}", StreamNotFound):
                info = await self.js.stream_info(spec.name)
        except StreamNotFound:
            try:
                with self._api(f"cannot create stream {spec.name} ({key})"):
                    await create_riding_out_store_races(
                        f"creating stream {spec.name}", lambda: self.js.add_stream(cfg)
                    )
            except BusError as exc:
                cause = exc.__cause__
                if getattr(cause, "err_code", None) != _NO_STORAGE:
                    raise
                raise BusError(_no_room_hint(str(exc), spec, key)) from exc
            return
        old = info.config
        if old.retention != cfg.retention:
            raise BusError(
                f"stream {spec.name} exists with retention {_value(old.retention)}, this run "
                f"needs {_value(cfg.retention)} (NATS cannot change a work queue's, and rftstream never "
                f"changes one): delete the stream (`rftstream clean`, or `nats stream rm {spec.name}`) first"
            )
        stored = int(info.state.bytes or 0)
        if spec.discard == "old" and 0 < spec.max_bytes < stored:
            log.warning(
                "stream %s holds %d bytes; %s.max_bytes %d makes the server drop the oldest",
                spec.name,
                stored,
                key,
                spec.max_bytes,
            )
        try:
            with self._api(f"updating stream {spec.name}"):
                await self.js.update_stream(cfg)
        except BusError as exc:
            log.warning("stream %s exists and could not be updated to %s: %s", spec.name, key, exc)

    async def ensure_consumer(self, stream: str, spec: ConsumerSpec) -> None:
        what = f"consumer {stream}/{spec.durable}"
        try:
            await self.consumer_state(stream, spec.durable)
            return
        except ConsumerNotFound:
            pass
        try:
            with self._api(f"cannot create {what}"):
                await self.js.add_consumer(stream, consumer_config(spec))
        except (BusTimeout, BusUnavailable):
            raise
        except BusError as exc:
            # a concurrent actor may have created it a moment ago
            try:
                await self.consumer_state(stream, spec.durable)
            except ConsumerNotFound:
                raise exc from None

    # ------------------------------------------------------------ streams
    async def stream_state(self, stream: str, subjects_filter: str | None = None) -> StreamState:
        with self._api(f"stream {stream}", StreamNotFound):
            return stream_state(await self.js.stream_info(stream, subjects_filter=subjects_filter))

    async def streams(self) -> dict[str, StreamState]:
        with self._api("listing the server's streams"):
            return {str(i.config.name): stream_state(i) for i in await self.js.streams_info()}

    async def delete_stream(self, stream: str) -> None:
        with self._api(f"deleting stream {stream}", StreamNotFound):
            await self.js.delete_stream(stream)

    async def purge(self, stream: str, subject: str, below_seq: int) -> None:
        with self._api(f"purging {subject} of stream {stream}", StreamNotFound):
            await self.js.purge_stream(stream, subject=subject, seq=below_seq)

    async def last_msg(self, stream: str, subject: str) -> StoredMsg:
        with self._api(f"last message on {subject} of stream {stream}", MessageNotFound):
            raw = await self.js.get_last_msg(stream, subject)
        return StoredMsg(raw.subject or subject, int(raw.seq or 0), raw.data or b"", raw.headers)

    async def first_seq_since(self, stream: str, since: datetime) -> int | None:
        """One ``STREAM.MSG.GET`` by ``start_time`` (see :meth:`ResilientJetStream.first_seq_since`)."""
        stamp = since.astimezone(UTC).isoformat().replace("+00:00", "Z")
        with self._api(f"first message of stream {stream} since {stamp}", StreamNotFound):
            return await self.js.first_seq_since(stream, stamp)

    async def get_msg(self, stream: str, seq: int, *, direct: bool = False) -> StoredMsg:
        with self._api(f"message {seq} of stream {stream}", MessageNotFound):
            raw = await self.js.get_msg(stream, seq, direct=direct)
        return StoredMsg(raw.subject or "", int(raw.seq or seq), raw.data or b"", raw.headers)

    # ------------------------------------------------------------ consumers
    async def consumer_state(self, stream: str, durable: str) -> ConsumerState:
        with self._api(f"consumer {stream}/{durable}", ConsumerNotFound):
            return consumer_state(await self.js.consumer_info(stream, durable))

    async def consumers(self, stream: str) -> list[ConsumerState]:
        with self._api(f"consumers of stream {stream}", StreamNotFound):
            return [consumer_state(i) for i in await self.js.consumers_info(stream)]

    def unreachable_durables(self, stream: str) -> list[str]:
        return self.js.unreachable_durables(stream)

    async def delete_consumer(self, stream: str, durable: str) -> None:
        with self._api(f"deleting consumer {stream}/{durable}", ConsumerNotFound):
            await self.js.delete_consumer(stream, durable)

    async def on_consumers_changed(
        self, stream: str, callback: Callable[[], None]
    ) -> _Subscriptions:
        """Core subscriptions on the server's ``$JS.EVENT.ADVISORY.CONSUMER.CREATED``
        and ``.DELETED`` advisories for ``stream``."""

        async def changed(_msg: Msg) -> None:
            callback()

        subs = _Subscriptions(self.nc)
        for event in ("CREATED", "DELETED"):
            subject = f"$JS.EVENT.ADVISORY.CONSUMER.{event}.{stream}.*"
            subs.subs.append(await self.nc.subscribe(subject, cb=changed))
        return subs

    # ------------------------------------------------------------ KV
    async def kv(
        self, bucket: str, *, create: bool, description: str = "", replicas: int = 1
    ) -> _JetStreamKV:
        try:
            with self._api(f"KV bucket {bucket}", BucketNotFound):
                kv = await self.js.key_value(bucket)
        except BucketNotFound:
            if not create:
                raise
            config = api.KeyValueConfig(
                bucket=bucket,
                description=description,
                history=5,
                replicas=replicas,
                storage=api.StorageType.FILE,
            )
            try:
                kv = await create_riding_out_store_races(
                    f"creating KV bucket {bucket}", lambda: self.js.create_key_value(config)
                )
            except nats.js.errors.APIError as exc:
                if exc.err_code == _STORE_FAILED:
                    raise BusError(f"cannot create KV bucket {bucket}: {exc}") from exc
                with self._api(f"KV bucket {bucket}", BucketNotFound):
                    kv = await self.js.key_value(bucket)  # created meanwhile by another actor
            except (nats.errors.Error, TimeoutError) as exc:
                raise BusError(f"cannot create KV bucket {bucket}: {exc}") from exc
        return _JetStreamKV(kv, self.js, self.nc, bucket)

    async def delete_kv(self, bucket: str) -> None:
        with self._api(f"deleting KV bucket {bucket}", BucketNotFound):
            await self.js.delete_key_value(bucket)
