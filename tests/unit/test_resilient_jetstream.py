"""Retrying what a cluster's leader elections cause: timeouts, no responders and 503s are
retried until the window ends; every other error is raised at once."""

from __future__ import annotations

import time

import nats.errors
import nats.js.errors
import pytest

from rftstream.bus import resilient
from rftstream.bus.resilient import is_transient, retry_transient

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
