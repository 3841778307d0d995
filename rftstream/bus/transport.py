"""The transport seam: what :class:`~rftstream.bus.client.Bus` needs from a message store.

A transport is a stream store with subjects and sequences, durable pull
consumers, ordered (ephemeral) reads and a key-value store with revisions, as
NATS JetStream provides (:mod:`rftstream.bus.jetstream`, the only code that
imports ``nats``). :mod:`rftstream.bus.memory` implements the same semantics
in one process for unit tests of the logic above the bus.

Everything here is a :class:`typing.Protocol` or a plain record; errors are the
neutral ones of :mod:`rftstream.errors` (:class:`~rftstream.errors.StreamNotFound`,
:class:`~rftstream.errors.ConsumerNotFound`, :class:`~rftstream.errors.KeyNotFound`,
:class:`~rftstream.errors.CasConflict`, :class:`~rftstream.errors.BusTimeout`,
:class:`~rftstream.errors.BusUnavailable`, :class:`~rftstream.errors.StreamFullError`),
never a client library's. A transport's messages are :class:`Delivery` objects
as the client hands them over (nats-py's ``Msg`` satisfies it as it is: the
hot paths wrap nothing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol

Retention = Literal["limits", "work_queue", "interest"]
Discard = Literal["old", "new"]
Storage = Literal["file", "memory"]


# -------------------------------------------------------------- messages
class SequencePair(Protocol):
    """A message's position: ``stream`` sequence and the consumer's own ``consumer`` sequence."""

    @property
    def stream(self) -> int: ...

    @property
    def consumer(self) -> int: ...


class DeliveryMetadata(Protocol):
    """Where a delivered message stands in its stream and consumer."""

    @property
    def sequence(self) -> SequencePair: ...

    @property
    def num_delivered(self) -> int: ...

    @property
    def num_pending(self) -> int: ...

    @property
    def timestamp(self) -> datetime: ...


class Delivery(Protocol):
    """One message handed to a consumer.

    ``ack`` settles it; ``nak`` asks for redelivery (after ``delay`` s, or at
    once); ``in_progress`` restarts its ack wait; ``term`` stops redelivery
    without processing. Each is one send to the server (no reply awaited), so
    they block only for the send. A message never settled is redelivered once
    its consumer's ack wait passes.
    """

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def headers(self) -> dict[str, str] | None: ...

    @property
    def metadata(self) -> DeliveryMetadata: ...

    async def ack(self) -> None: ...

    async def ack_sync(self, timeout: float = ...) -> object:
        """Ack and wait (at most ``timeout`` s) for the server's confirmation."""
        ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def in_progress(self) -> None: ...

    async def term(self) -> None: ...


# -------------------------------------------------------------- records
@dataclass(slots=True)  # not frozen: made once per publish, on the hot path
class PubAck:
    """A stored publish: the stream and its sequence; ``duplicate`` when the message id was seen
    within the stream's duplicate window (nothing new stored)."""

    stream: str
    seq: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class StoredMsg:
    """A message read from a stream by sequence (not a delivery: nothing to ack)."""

    subject: str
    seq: int
    data: bytes
    headers: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class StreamState:
    """A stream's contents now. ``subjects``: messages per subject, only when asked for
    with a filter (else empty)."""

    first_seq: int = 0
    last_seq: int = 0
    messages: int = 0
    bytes: int = 0
    consumer_count: int = 0
    subjects: dict[str, int] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What a stream is to hold (:meth:`Transport.ensure_stream`). Limits of 0 or less: none."""

    name: str
    subjects: tuple[str, ...]
    description: str = ""
    retention: Retention = "limits"
    metadata: dict[str, str] = field(default_factory=dict)
    num_replicas: int = 1
    max_msg_size: int = -1
    duplicate_window: float = 120.0
    max_bytes: int = -1
    max_msgs: int = -1
    max_age: float = 0.0
    discard: Discard = "new"
    storage: Storage = "file"
    # reads by sequence may use the direct-get API (any replica answers; no JSON wrapping)
    allow_direct: bool = False


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A durable pull consumer with explicit acks (:meth:`Transport.ensure_consumer`).

    ``start_seq`` None delivers the whole stream, else from that sequence on;
    ``max_deliver`` -1 redelivers without limit.
    """

    durable: str
    filter_subject: str
    description: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    ack_wait: float = 30.0
    max_deliver: int = -1
    max_ack_pending: int = 10_000
    start_seq: int | None = None


@dataclass(frozen=True, slots=True)
class ConsumerState:
    """A consumer's position: everything up to ``ack_floor`` is acked, ``delivered`` is the
    last stream sequence handed out, ``num_pending`` still to deliver, ``num_ack_pending``
    handed out and not yet acked. ``durable`` False: an ordered (ephemeral) reader."""

    name: str
    durable: bool = True
    filter_subject: str = ""
    description: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    delivered: int = 0
    ack_floor: int = 0
    num_pending: int = 0
    num_ack_pending: int = 0
    num_redelivered: int = 0


#: JetStream's header on a KV delete (``DEL``) or purge (``PURGE``) marker
H_KV_OPERATION = "KV-Operation"


@dataclass(frozen=True, slots=True)
class KvEntry:
    """A key's value, its revision (the bucket stream's sequence) and when it was written."""

    key: str
    value: bytes
    revision: int
    created: datetime | None = None


# -------------------------------------------------------------- endpoints
class PullSubscription(Protocol):
    """A bound durable pull consumer (many replicas may bind the same durable).

    Nothing is acked by the subscription: the caller settles every message
    :meth:`fetch` returned.
    """

    @property
    def stream(self) -> str: ...

    @property
    def durable(self) -> str: ...

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """Up to ``batch`` messages, waiting up to ``timeout`` s; ``[]`` when none came.

        Cancelled, it loses nothing: messages already taken go to the next fetch
        (or are redelivered after the ack wait). Raises ``BusError`` when the
        connection is gone or the pull is rejected.
        """
        ...

    async def info(self) -> ConsumerState:
        """The consumer's state now (one round trip). Raises ``ConsumerNotFound``."""
        ...

    async def unsubscribe(self) -> None:
        """Stop receiving; messages in hand stay unacked. Never raises."""
        ...


class OrderedReader(Protocol):
    """An ephemeral, ordered read of a subject (nothing acked, nothing kept on the server)."""

    async def next(self, timeout: float) -> Delivery | None:
        """The next message in stream order, or None when none came in ``timeout`` s."""
        ...

    async def close(self) -> None:
        """End the read. Never raises."""
        ...


class Watch(Protocol):
    """An ephemeral ordered push of a subject to a callback (see :meth:`Transport.watch`)."""

    async def info(self) -> ConsumerState:
        """What the watch was handed so far (``delivered``) and still has to get."""
        ...

    async def unsubscribe(self) -> None:
        """Stop the watch. Never raises."""
        ...


class Unsubscribe(Protocol):
    """What :meth:`KeyValueStore.on_write` returns."""

    async def unsubscribe(self) -> None: ...


class Notifications(Protocol):
    """What :meth:`KeyValueStore.on_value` and :meth:`Transport.on_consumers_changed`
    return."""

    def missed(self) -> bool:
        """Whether writes may have gone unseen since the previous call (the connection
        was lost and came back meanwhile): True once per such loss."""
        ...

    async def unsubscribe(self) -> None: ...


async def unsubscribe_quietly(sub: Unsubscribe | None) -> None:
    """End ``sub`` (nothing for None), errors ignored: the connection may be gone."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception:  # noqa: BLE001 - the connection may be gone
        pass


class KeyValueStore(Protocol):
    """A bucket of keys; each write is a new revision (the bucket stream's sequence).

    Every method is one round trip. ``get`` of a deleted key raises ``KeyNotFound``;
    a conditional write that lost raises ``CasConflict``; other failures ``BusError``.
    """

    @property
    def bucket(self) -> str: ...

    async def get(self, key: str) -> KvEntry: ...

    async def put(self, key: str, value: bytes) -> int: ...

    async def create(self, key: str, value: bytes) -> int:
        """Write ``key`` only if it has no value (never written, or deleted)."""
        ...

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Write ``key`` only if its newest revision is ``last``."""
        ...

    async def delete(self, key: str) -> None:
        """Mark ``key`` deleted (no error if it has no value)."""
        ...

    async def keys(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` with an entry in the bucket, sorted (the newest entry
        may be a delete marker: ``get`` tells)."""
        ...

    async def on_write(
        self, keys: tuple[str, ...], callback: Callable[[], Awaitable[None]]
    ) -> Unsubscribe:
        """Call ``callback`` after each write of one of ``keys`` from now on (values not read)."""
        ...

    async def on_value(
        self, keys: tuple[str, ...], callback: Callable[[str, bytes | None], None]
    ) -> Notifications:
        """Call ``callback(key, value)`` for each write of one of ``keys`` from now on,
        with the key written and its value (None for a delete or purge); a key may be a
        pattern with subject wildcards (``explorers.in_flight.>``: every key under that
        prefix). In the order the writes reached the server. A write is handed on before
        any reply that reached this connection after it (on NATS both come down the one
        connection, in order, and the callback runs before the reply's waiter resumes): a
        value read after a reply is at least as new as every write that preceded the reply
        at the server. A conditional write the bucket refuses is handed on too: use it for
        keys written unconditionally."""
        ...


class Transport(Protocol):
    """A connection to a stream store: publishing, consumers, stream admin and KV buckets."""

    @property
    def max_payload(self) -> int:
        """The largest message (payload and headers) the server takes."""
        ...

    @property
    def server_url(self) -> str:
        """Where this connection goes now, without secrets (for messages)."""
        ...

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> PubAck:
        """Store one message and wait for the stream's ack, at most ``timeout`` s.

        A ``Nats-Msg-Id`` header deduplicates within the stream's duplicate window.
        Raises ``BusTimeout`` (no answer: stored or not; or no stream for the
        subject yet), ``BusUnavailable`` (overloaded, no leader),
        ``StreamFullError`` (a ``discard: new`` limit), ``BusError`` (rejected,
        connection gone).
        """
        ...

    async def pull(self, stream: str, durable: str) -> PullSubscription:
        """Bind a durable pull consumer. Raises ``ConsumerNotFound``."""
        ...

    async def read(
        self,
        stream: str | None,
        subject: str,
        *,
        start_seq: int = 1,
        headers_only: bool = False,
        description: str = "",
    ) -> OrderedReader:
        """Read ``subject`` (wildcards allowed) of ``stream`` (None: the stream that holds
        ``subject``) in order from ``start_seq``; ``description`` says who reads and why
        (an ephemeral consumer's name is the server's). Raises ``StreamNotFound``."""
        ...

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
        """Push ``subject`` of ``stream`` to ``callback`` in order, from ``start_seq`` (or
        messages stored from ``start_time``; neither: the whole stream); ``description`` as
        for :meth:`read`."""
        ...

    # -- provisioning and state
    async def ensure_stream(self, spec: StreamSpec, key: str) -> None:
        """Create the stream, or update an existing one to ``spec`` (``key`` names its config
        for messages). Raises ``BusError`` when it exists with another retention."""
        ...

    async def ensure_consumer(self, stream: str, spec: ConsumerSpec) -> None:
        """Create the durable if missing (an existing one is left as it is)."""
        ...

    async def stream_state(self, stream: str, subjects_filter: str | None = None) -> StreamState:
        """The stream's state; with ``subjects_filter`` its messages per matching subject.
        Raises ``StreamNotFound``."""
        ...

    async def streams(self) -> dict[str, StreamState]:
        """Every stream on the server, by name."""
        ...

    async def delete_stream(self, stream: str) -> None:
        """Delete a stream with its consumers. Raises ``StreamNotFound``."""
        ...

    async def purge(self, stream: str, subject: str, below_seq: int) -> None:
        """Remove the messages of ``subject`` below stream sequence ``below_seq``."""
        ...

    async def last_msg(self, stream: str, subject: str) -> StoredMsg:
        """The newest message on ``subject``. Raises ``MessageNotFound`` (or ``StreamNotFound``)."""
        ...

    async def first_seq_since(self, stream: str, since: datetime) -> int | None:
        """The stream sequence of the first message ``stream`` stored at or after ``since``
        (the server's timestamps); None when every stored message is older. Raises
        ``StreamNotFound``."""
        ...

    async def get_msg(self, stream: str, seq: int, *, direct: bool = False) -> StoredMsg:
        """The message at ``seq``. Raises ``MessageNotFound`` (or ``StreamNotFound``).

        ``direct``: through the direct-get API (the stream must allow it: its spec's
        ``allow_direct``): the bytes as stored, without the API's base64 JSON, which
        costs far more for large messages."""
        ...

    async def consumer_state(self, stream: str, durable: str) -> ConsumerState:
        """Raises ``ConsumerNotFound`` (also when the stream is missing)."""
        ...

    async def consumers(self, stream: str) -> list[ConsumerState]:
        """Every consumer of ``stream`` that answers (durable and ephemeral). Raises
        ``StreamNotFound``; see :meth:`unreachable_durables` for the ones left out."""
        ...

    def unreachable_durables(self, stream: str) -> list[str]:
        """Consumers the last :meth:`consumers` of ``stream`` left out because they did not
        answer (a cluster node down), by name, less those known to be ephemeral readers
        (they hold no ack floor; an R1 reader on a node that stays down never answers);
        none on a single server."""
        ...

    async def delete_consumer(self, stream: str, durable: str) -> None:
        """Raises ``ConsumerNotFound``."""
        ...

    async def on_consumers_changed(
        self, stream: str, callback: Callable[[], None]
    ) -> Notifications:
        """Call ``callback`` after each creation or deletion of a durable consumer of
        ``stream`` from now on (on NATS ephemeral ones too: the server's consumer
        advisories, which a standalone server queues before it answers the creator)."""
        ...

    async def kv(
        self, bucket: str, *, create: bool, description: str = "", replicas: int = 1
    ) -> KeyValueStore:
        """The bucket; created (keeping 5 revisions per key, on ``replicas`` servers) when
        missing and ``create``, else raises ``BucketNotFound``."""
        ...

    async def delete_kv(self, bucket: str) -> None:
        """Raises ``BucketNotFound``."""
        ...

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` ran or the connection was given up."""
        ...

    async def close(self) -> None:
        """Flush what is pending and disconnect. Safe to call twice."""
        ...
