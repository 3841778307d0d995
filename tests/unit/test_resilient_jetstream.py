"""Retrying what a cluster's leader elections cause: timeouts, no responders and 503s are
retried until the window ends; every other error is raised at once."""

from __future__ import annotations

import copy
import time

import nats.errors
import nats.js.errors
import pytest

from rftstream.bus.jetstream import resilient
from rftstream.bus.jetstream.resilient import is_transient, retry_transient

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _short_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resilient, "_PAUSE", 0.01)
    monkeypatch.setattr(resilient, "_MAX_PAUSE", 0.02)


def _api_error(code: int, err_code: int) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=code, err_code=err_code, description="x")


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (nats.errors.TimeoutError(), True),
        (nats.errors.NoRespondersError(), True),
        (nats.js.errors.ServiceUnavailableError(), True),
        (nats.js.errors.NoStreamResponseError(), True),
        (_api_error(503, 10008), True),  # JetStream system temporarily unavailable
        (nats.js.errors.NotFoundError(), False),
        (_api_error(400, 10058), False),  # stream name already in use, other config
        (ValueError("bad"), False),
    ],
)
def test_is_transient(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


async def test_transient_failures_are_retried_until_the_call_succeeds() -> None:
    failures = [nats.errors.TimeoutError(), _api_error(503, 10008), nats.errors.NoRespondersError()]
    calls = 0

    async def call() -> str:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return "ok"

    assert await retry_transient("probe", call, window=5) == "ok"
    assert calls == 4


async def test_other_errors_are_raised_at_once() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise nats.js.errors.NotFoundError()

    with pytest.raises(nats.js.errors.NotFoundError):
        await retry_transient("probe", call, window=5)
    assert calls == 1


async def test_the_last_transient_failure_is_raised_after_the_window() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise nats.errors.TimeoutError()

    start = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await retry_transient("probe", call, window=0.2)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 1.0, elapsed
    assert calls >= 3


def _listing(
    names: list[str], total: int, missing: list[str] = (), readers: list[str] = ()
) -> dict:
    """A CONSUMER.LIST answer: durables ``names``, ephemeral ``readers`` (no durable name)."""
    return {
        "total": total,
        "consumers": [
            {
                "stream_name": "S",
                "name": n,
                "created": "2026-11-25T12:00:00Z",
                "config": {"durable_name": n} if n in names else {},
            }
            for n in [*names, *readers]
        ],
        "missing": list(missing),
    }


class _ListingJetStream(resilient.ResilientJetStream):
    """The listing API answered by a script of responses (one per request)."""

    def __init__(self, answers: list[dict], window: float = 5.0) -> None:
        self.answers = answers
        self.requests: list[bytes] = []
        self._prefix, self._timeout, self.retry_window = "$JS.API", 1.0, window
        self.missing_consumers = {}
        self.ephemeral_consumers = {}

    async def _api_request(self, subject: str, req: bytes = b"", timeout: float = 5) -> dict:
        assert subject == "$JS.API.CONSUMER.LIST.S"
        self.requests.append(req)
        return copy.deepcopy(self.answers.pop(0))  # from_response changes what it reads


async def test_a_listing_with_missing_consumers_is_asked_again_and_paged() -> None:
    js = _ListingJetStream(
        [
            _listing(["a"], total=2, missing=["b"]),  # b's leader did not answer
            _listing([], total=2, missing=["b"]),
            _listing(["a"], total=2),  # again: page 1 of 2
            _listing(["b"], total=2),  # page 2
        ]
    )
    assert [c.name for c in await js.consumers_info("S")] == ["a", "b"]
    offsets = [b'{"offset": 0}', b'{"offset": 1}']
    assert js.requests == offsets * 2


async def test_a_consumer_a_second_page_repeats_is_listed_once() -> None:
    # total counts the missing consumer: the second page repeats one already listed
    js = _ListingJetStream([_listing(["a", "b"], total=3, missing=["c"]), _listing(["b"], total=3)])
    js.retry_window = 0.0
    assert [c.name for c in await js.consumers_info("S")] == ["a", "b"]
    assert js.missing_consumers == {"S": ["c"]}


async def test_consumers_still_missing_after_the_settle_time_are_left_out_and_named() -> None:
    js = _ListingJetStream([_listing(["a"], total=1, missing=["b"])] * 500, window=0.05)
    assert [c.name for c in await js.consumers_info("S")] == ["a"]
    assert js.missing_consumers == {"S": ["b"]}


async def test_a_missing_reader_known_as_ephemeral_does_not_hold_back_the_durables() -> None:
    """An R1 ordered reader on a node that stays down never answers again: once it was
    listed as ephemeral (or opened through this connection), the listing does not wait for
    it and the purge goes on; a missing name never seen stays unreachable."""
    js = _ListingJetStream(
        [
            _listing(["a"], total=2, readers=["r"]),
            # r's node died: `total` still counts it, so a second page is asked for
            _listing(["a"], total=2, missing=["r"]),
            _listing([], total=2, missing=["r"]),
        ]
        # x: never seen, so perhaps a durable; asked again until the settle time ends
        + [_listing(["a"], total=3, missing=["r", "x"]), _listing([], total=3)] * 500,
        window=0.05,
    )
    assert [c.name for c in await js.consumers_info("S")] == ["a", "r"]
    assert js.unreachable_durables("S") == []
    assert [c.name for c in await js.consumers_info("S")] == ["a"]
    assert len(js.requests) == 3, "a known reader missing is not asked again"
    assert js.missing_consumers == {"S": ["r"]} and js.unreachable_durables("S") == []
    await js.consumers_info("S")
    assert js.unreachable_durables("S") == ["x"]
    js.note_ephemeral("S", "x")  # opened through this connection
    assert js.unreachable_durables("S") == []


async def test_the_known_readers_are_only_those_listed_or_still_missing() -> None:
    js = _ListingJetStream(
        [_listing(["a"], total=2, readers=["r"]), _listing(["a"], total=1)], window=0.0
    )
    await js.consumers_info("S")
    assert js.ephemeral_consumers == {"S": {"r"}}
    await js.consumers_info("S")  # r closed and deleted by the server
    assert js.ephemeral_consumers == {"S": set()}
