"""The lean publish path (bus/jetstream/publish.py) writes exactly the bytes nats-py's own
Client.publish writes, for the headers an experience message carries and for odd ones."""

from __future__ import annotations

import anyio
import nats.errors
import pytest
from nats.aio.client import Client

from rftstream.bus.jetstream.publish import hpub_parts, publish


def _offline_client() -> Client:
    """A client that queues what it would send (connected, no flusher): nothing leaves."""
    nc = Client()
    nc._status = Client.CONNECTED
    nc._flush_queue = None
    return nc


HEADERS = [
    {"Rft-Schema": "rft.experience.v1", "Rft-Task": "taskset/0/17", "Nats-Msg-Id": "raw:t:0:17"},
    {" Padded ": "  value with spaces  ", "Multi": "line\r\nbreak\nhere", "Empty": ""},
    {"Unicode": "reward ≥ 0.5", "": "an empty key is skipped"},
]


@pytest.mark.parametrize("headers", HEADERS)
@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 40])
def test_the_bytes_equal_nats_py_publish(headers: dict[str, str], payload: bytes) -> None:
    async def sent(lean: bool) -> bytes:
        nc = _offline_client()
        if lean:
            await publish(nc, "rft.x.exp.raw", payload, reply="_INBOX.a.1", headers=headers)
        else:
            await nc.publish("rft.x.exp.raw", payload, reply="_INBOX.a.1", headers=headers)
        assert nc.stats["out_msgs"] == 1 and nc.stats["out_bytes"] == len(payload)
        assert nc._pending_data_size == sum(map(len, nc._pending))
        return b"".join(nc._pending)

    ours, theirs = anyio.run(sent, True), anyio.run(sent, False)
    assert ours == theirs
    assert b"".join(hpub_parts("rft.x.exp.raw", "_INBOX.a.1", payload, headers)) == theirs


def test_a_key_nats_py_refuses_is_refused() -> None:
    with pytest.raises(nats.errors.BadHeaderError):
        hpub_parts("s", "r", b"", {"bad key": "v"})


def test_while_not_connected_it_is_nats_py_publish() -> None:
    nc = Client()  # never connected: nats-py refuses (no reconnect buffer)

    async def go() -> None:
        await publish(nc, "s", b"x", reply="r", headers={"A": "b"})

    with pytest.raises(nats.errors.Error):
        anyio.run(go)


def test_the_payload_is_queued_as_it_is_not_copied() -> None:
    payload = bytes(range(256)) * 256

    async def go() -> list[bytes]:
        nc = _offline_client()
        await publish(nc, "s", payload, reply="r", headers={"A": "b"})
        return nc._pending

    assert any(part is payload for part in anyio.run(go))


def test_past_the_pending_limit_it_flushes_as_nats_py_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nats-py's ``_send_command`` forces a flush once the pending bytes pass
    ``pending_size``; the lean path, which queues the parts itself, does the same."""
    forced: list[bool] = []

    async def flush(self: Client, force_flush: bool = False) -> None:
        forced.append(force_flush)

    monkeypatch.setattr(Client, "_flush_pending", flush)

    async def go(limit: int) -> None:
        nc = _offline_client()
        nc._max_pending_size = limit
        await publish(nc, "s", b"x" * 1000, reply="r", headers={"A": "b"})

    anyio.run(go, 1 << 20)
    assert forced == []
    anyio.run(go, 500)
    assert forced == [True]
