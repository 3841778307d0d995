"""Publishing to JetStream cheaply: request/reply through one inbox and a cap on bytes in flight.

:class:`Replies` replaces ``nc.request`` for JetStream publishes (one wildcard
inbox subscription, a counter for tokens, one timer per wait);
:class:`InflightLimiter` caps the bytes awaiting their acks (DESIGN §8). Both
sit on the publish hot path of :class:`~rftstream.bus.jetstream.transport.JetStreamTransport`.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api

_STATUS = api.Header.STATUS
# what nats-py's Client.publish checks a header key against and does to a value
_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_checked_keys: set[str] = set()
# the lean path needs these of nats-py's client (and the instance's _pending,
# _pending_data_size and _max_pending_size, checked per call); without them, Client.publish
_LEAN = all(hasattr(NatsClient, name) for name in ("_flush_pending", "is_draining_pubs"))
_CRLF = b"\r\n"


def hpub_parts(subject: str, reply: str, payload: bytes, headers: dict[str, str]) -> list[bytes]:
    """The protocol bytes of a publish with headers, as nats-py's ``Client.publish`` sends
    them (same key check, same value clean-up), in three parts never joined here (nats-py
    copies the payload twice): the ``HPUB`` line with the header block, the payload, the
    final CRLF.
    Raises ``nats.errors.Error`` (nats-py's ``BadHeaderError``) for a key nats-py refuses."""
    lines = ["NATS/1.0\r\n"]
    for k, v in headers.items():
        key = k.strip()
        if not key:
            continue
        if key not in _checked_keys:
            if not _HEADER_KEY.fullmatch(key):
                raise nats.errors.BadHeaderError(key)
            _checked_keys.add(key)
        lines.append(f"{key}: {v.strip().translate(_VALUE_NEWLINES)}\r\n")
    lines.append("\r\n")
    block = "".join(lines).encode()
    n = len(block)
    head = f"HPUB {subject} {reply} {n} {n + len(payload)}\r\n".encode()
    return [head + block, payload, _CRLF]


async def publish(
    nc: NatsClient, subject: str, payload: bytes, *, reply: str, headers: dict[str, str] | None
) -> None:
    """``nc.publish(subject, payload, reply=reply, headers=headers)``, leaner for headers.

    nats-py builds a header block with a regex check and four buffer appends per header
    and copies the payload twice into one command; on this hot path (every experience
    message carries ten headers) the command is :func:`hpub_parts`, its three parts queued
    on the client's own pending buffer side by side (the payload not copied: the flusher
    joins the buffer into one write anyway, and a copy of every body alive until its
    flush doubled a producer's memory traffic), and flushed by the client's flusher.
    Without headers, while not connected (nats-py buffers or refuses), draining or
    closed, it is ``nc.publish``."""
    if (
        not _LEAN
        or headers is None
        or not hasattr(nc, "_pending_data_size")
        or not nc.is_connected
        or nc.is_draining_pubs
        or len(payload) > nc.max_payload
    ):
        await nc.publish(subject, payload, reply=reply, headers=headers)
        return
    # the parts go in without a yield between them (another publish's bytes must never
    # land between them); then, as _send_command does, a forced flush past the limit
    head, body, crlf = hpub_parts(subject, reply, payload, headers)
    pending = nc._pending
    pending.append(head)
    pending.append(body)
    pending.append(crlf)
    nc._pending_data_size += len(head) + len(body) + len(crlf)
    if 0 < nc._max_pending_size < nc._pending_data_size:
        await nc._flush_pending(force_flush=True)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    flush_queue = nc._flush_queue
    if flush_queue is not None and flush_queue.empty():
        await nc._flush_pending()


class PubAckMsg(msgspec.Struct, gc=False):
    """A JetStream publish reply: the ack, or ``error`` (code, err_code, description)."""

    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


PUBACK_DECODER = msgspec.json.Decoder(PubAckMsg)


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


class Replies:
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
            await publish(self.nc, subject, data, reply=f"{self._prefix}.{token}", headers=headers)
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
