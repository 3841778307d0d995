"""A bound JetStream pull consumer whose fetch reads the subscription's queue directly.

nats-py's ``fetch`` waits for every message through ``Subscription.next_msg``,
which makes a uuid, a task and a ``wait_for`` per message (about 25 us, as much
as decoding a group); :class:`JetStreamPull` speaks the same pull protocol (a
no-wait probe, then one lingering request) and takes deliveries off the queue
itself. The messages it returns are nats-py's ``Msg``, which satisfies
:class:`~rftstream.bus.transport.Delivery` as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api

from rftstream.bus.jetstream.connect import ConnectionWatch
from rftstream.bus.jetstream.records import consumer_state
from rftstream.bus.transport import ConsumerState
from rftstream.errors import BusError, ConsumerNotFound

log = logging.getLogger(__name__)

_STATUS = api.Header.STATUS
_HEARTBEAT = "100"
_END_STATUSES = ("404", "408", "409")  # no messages, request expired, request ended (conflict)
_UNAVAILABLE_PAUSE = 0.25  # s a fetch answered 503 (no consumer leader) waits before returning


class JetStreamPull:
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

    async def _next(self) -> Msg:
        """The next delivered message (or status), waiting as long as it takes (the
        caller's cancel scope bounds the wait). Cancel-safe: ``asyncio.Queue.get``,
        cancelled, has taken nothing."""
        queue = self._queue
        assert queue is not None
        return self._took(queue.get_nowait() if not queue.empty() else await queue.get())

    async def _request(self, batch: int, expires: float | None, no_wait: bool) -> None:
        req: dict[str, Any] = {"batch": batch}
        if expires is not None:
            req["expires"] = max(int(expires * 1e9) - 100_000, 1)  # ns, ends before we give up
        if no_wait:
            req["no_wait"] = True
        await self._nc.publish(self._nms, json.dumps(req).encode(), self._deliver)  # type: ignore[union-attr,arg-type]

    async def _collect(self, msgs: list[Msg], batch: int, deadline: float, probe: bool) -> None:
        """Append deliveries of the pending request to ``msgs`` until it ends, ``batch`` or
        ``deadline``. One timeout for the whole wait, not one per message (a cancel scope
        costs about 5 us, a tenth of what a consumer spends on a message)."""
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope:
            while len(msgs) < batch:
                msg = await self._next()
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
        # a wait that ran out may have run out because nothing can come any more
        if scope.cancelled_caught and self._nc is not None and self._nc.is_closed:
            raise nats.errors.ConnectionClosedError

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

    async def info(self) -> ConsumerState:
        """The consumer's state now (one API round trip). Raises :class:`ConsumerNotFound`."""
        try:
            return consumer_state(await self._sub.consumer_info())
        except nats.js.errors.NotFoundError as exc:
            raise ConsumerNotFound(f"consumer {self.stream}/{self.durable} is gone") from exc

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # noqa: BLE001 - closing; nothing to do
            pass
