"""JetStream API calls that ride out a NATS cluster's leader elections.

When a node of a cluster dies, the streams and consumers it led (and maybe
the JetStream meta group) elect new leaders; until they have, API requests
(``STREAM.INFO``, ``CONSUMER.INFO``, KV gets and puts, pull requests) go
unanswered (a timeout) or are answered 503 ("no responders", "JetStream
system temporarily unavailable"). A client connected to the dead node sees
the same while it reconnects to a survivor. :class:`ResilientJetStream` is a
``JetStreamContext`` whose API requests, direct gets and (KV) publishes retry
such transient failures until ``retry_window`` seconds have passed since the
call began, then raise what the last attempt raised. Other errors (not found,
a rejected config, a wrong last sequence) are raised at once.

A retried KV ``put`` may store the value twice (a second revision, same
value); a retried conditional ``update`` whose first attempt was applied
raises wrong-last-sequence, which callers already treat as a lost race.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, JetStreamManager, api

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long a JetStream API call keeps retrying a transient failure (s)
DEFAULT_RETRY_WINDOW = 60.0
_PAUSE = 0.25  # s between attempts; doubled up to _MAX_PAUSE
_MAX_PAUSE = 2.0
#: JetStream's "no message found" (a get by time past the stream's last message)
_NO_MESSAGE = 10037
#: how long a consumer listing with unreachable consumers is asked again (s)
LISTING_SETTLE_S = 5.0


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is what a JetStream request gets while leaders are being elected
    or the connection is being re-established: a timeout, no responders, a 503."""
    if isinstance(
        exc,
        (
            nats.errors.TimeoutError,
            TimeoutError,
            nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError,
            nats.js.errors.NoStreamResponseError,
            nats.js.errors.ServiceUnavailableError,
        ),
    ):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.code == 503


async def retry_transient(
    what: str, call: Callable[[], Awaitable[T]], *, window: float = DEFAULT_RETRY_WINDOW
) -> T:
    """Await ``call()``; on a transient failure (:func:`is_transient`) call it again after
    a short pause, until ``window`` s have passed since the first attempt.

    Blocks for as long as that takes; raises the last attempt's exception after
    ``window`` s, and any other exception at once. Cancelling it cancels the attempt.
    """
    deadline = time.monotonic() + window
    pause = _PAUSE
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + pause >= deadline:
                raise
            log.info("%s: %s; retrying (cluster leader election?)", what, type(exc).__name__)
        await anyio.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE)


class _RetriedApiRequests:
    """Mixin: a JetStream manager's API requests retried for ``retry_window`` s
    (:func:`retry_transient`); put it before the nats-py class it wraps."""

    retry_window: float = DEFAULT_RETRY_WINDOW

    async def _api_request(
        self, req_subject: str, req: bytes = b"", timeout: float = 5
    ) -> dict[str, Any]:
        parent = super()._api_request  # type: ignore[misc]
        return await retry_transient(
            req_subject, lambda: parent(req_subject, req, timeout=timeout), window=self.retry_window
        )


class _ResilientManager(_RetriedApiRequests, JetStreamManager):
    """The plain ``JetStreamManager`` (what ``js._jsm`` gives) with retried API requests."""


class ResilientJetStream(_RetriedApiRequests, JetStreamContext):
    """A ``JetStreamContext`` whose API requests, message gets and publishes retry
    transient failures for up to ``retry_window`` s (see the module docstring)."""

    def __init__(self, conn: Any, *, timeout: float, retry_window: float) -> None:
        super().__init__(conn, timeout=timeout)
        self.retry_window = retry_window
        # per stream: consumers the last listing could not reach (see consumers_info)
        self.missing_consumers: dict[str, list[str]] = {}
        # per stream: names known to be ephemeral readers (listed without a durable name,
        # or opened through this connection); they hold no ack floor anyone waits for
        self.ephemeral_consumers: dict[str, set[str]] = {}

    def note_ephemeral(self, stream: str, name: str) -> None:
        """Remember that consumer ``name`` of ``stream`` is an ephemeral reader."""
        self.ephemeral_consumers.setdefault(stream, set()).add(name)

    def unreachable_durables(self, stream: str) -> list[str]:
        """The consumers the last listing of ``stream`` could not reach, less those known
        to be ephemeral readers: an R1 ordered reader on a node that stays down never
        answers again, and must not stop what needs only the durables' floors."""
        known = self.ephemeral_consumers.get(stream, set())
        return [name for name in self.missing_consumers.get(stream, []) if name not in known]

    @property
    def _jsm(self) -> JetStreamManager:
        jsm = _ResilientManager(conn=self._nc, prefix=self._prefix, timeout=self._timeout)
        jsm.retry_window = self.retry_window
        return jsm

    def _remember_ephemeral(
        self, stream: str, found: list[api.ConsumerInfo], missing: list[str]
    ) -> None:
        """Known ephemeral readers after a listing: those it lists without a durable name,
        and those known before that it could not reach (kept while they are missing, so
        the set stays as small as the listing)."""
        before = self.ephemeral_consumers.get(stream, set())
        listed = {c.name for c in found if not (c.config and c.config.durable_name)}
        self.ephemeral_consumers[stream] = listed | (before & set(missing))

    async def consumers_info(
        self, stream: str, offset: int | None = None
    ) -> list[api.ConsumerInfo]:
        """Every consumer of ``stream``, all pages (from ``offset``). In a cluster the
        listing names consumers whose leader did not answer in time under ``missing``
        (nats-py drops them): the list is asked again for up to :data:`LISTING_SETTLE_S`
        (a replicated durable has a new leader by then); consumers still missing after
        that (an R1 ephemeral watch on a dead node) are left out, logged, and kept in
        :attr:`missing_consumers` for callers that must not act on a partial list (the
        purge of acked experience; see :meth:`unreachable_durables`). Consumers known to
        be ephemeral readers are not waited for."""
        deadline = time.monotonic() + min(self.retry_window, LISTING_SETTLE_S)
        pause = _PAUSE
        while True:
            found: list[api.ConsumerInfo] = []
            missing: list[str] = []
            at = offset or 0
            while True:
                resp = await self._api_request(
                    f"{self._prefix}.CONSUMER.LIST.{stream}",
                    json.dumps({"offset": at}).encode(),
                    timeout=self._timeout,
                )
                page = resp.get("consumers") or []
                found += [api.ConsumerInfo.from_response(c) for c in page]
                missing += list(resp.get("missing") or [])
                at += len(page)
                if not page or at >= int(resp.get("total", 0) or 0):
                    break
            # `total` counts the missing ones too, so a second page may repeat one
            found = list({c.name: c for c in found}.values())
            missing = sorted(set(missing) - {c.name for c in found})
            self.missing_consumers[stream] = missing
            self._remember_ephemeral(stream, found, missing)
            if not self.unreachable_durables(stream):  # none, or only known readers
                return found
            if time.monotonic() + pause >= deadline:
                log.warning(
                    "stream %s: consumers %s did not answer the listing (their node down?)",
                    stream,
                    sorted(missing),
                )
                return found
            await anyio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)

    async def first_seq_since(self, stream: str, start_time: str) -> int | None:
        """The sequence of the first message of ``stream`` stored at or after ``start_time``
        (RFC 3339, UTC), from one ``STREAM.MSG.GET`` request by start time (retried as
        every API request); None when the server has no such message. The answer carries
        that message's body too (base64): one message, whatever its size."""
        try:
            resp = await self._api_request(
                f"{self._prefix}.STREAM.MSG.GET.{stream}",
                json.dumps({"start_time": start_time}).encode(),
                timeout=self._timeout,
            )
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == _NO_MESSAGE:
                return None
            raise
        return int(resp["message"]["seq"])

    async def get_msg(self, *args: Any, **kwargs: Any) -> api.RawStreamMsg:
        """``get_msg`` (direct gets included: they bypass ``_api_request``), retried."""
        parent = super().get_msg
        return await retry_transient(
            "get_msg", lambda: parent(*args, **kwargs), window=self.retry_window
        )

    async def publish(self, subject: str, payload: bytes = b"", **kwargs: Any) -> api.PubAck:
        """``publish`` (what KV puts, deletes and updates use), retried."""
        parent = super().publish
        return await retry_transient(
            f"publish {subject}",
            lambda: parent(subject, payload, **kwargs),
            window=self.retry_window,
        )
