"""A client survives a nats-server restart (same port, same store) within
`nats.reconnect_window`, with its JetStream state intact, and gives up after it with
an error naming the server and the window."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig
from rftstream.errors import BusError
from rftstream.experience import decode_group
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer
from rftstream.subjects import RunNames
from tests.integration._util import _group

pytestmark = pytest.mark.integration

NAMES = RunNames("recon")


def _kill(server: EmbeddedNatsServer, sig: signal.Signals) -> None:
    proc = server._proc
    assert proc is not None
    proc.send_signal(sig)
    proc.wait(timeout=10)
    server._proc = None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_survives_a_restart_within_the_window(tmp_path: Path, sig: signal.Signals) -> None:
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    cfg = msgspec.structs.replace(NatsConfig(), reconnect_window=30.0, ack_wait=5.0)

    async def main() -> None:
        async with await Bus.connect(server.url, NAMES, cfg, "t") as bus:
            await bus.provision()
            await bus.publish_group("raw", _group(1, 1.0), msg_id="before")
            consumer = await bus.pull(NAMES.exp_stream, NAMES.stage_consumer("raw", "train"))
            _kill(server, sig)
            await anyio.sleep(1.5)  # the client notices and starts reconnecting
            assert not bus.transport.nc.is_connected
            await anyio.to_thread.run_sync(server.start)  # same port, same store
            with anyio.fail_after(20):
                while not bus.transport.nc.is_connected:
                    await anyio.sleep(0.1)
            await bus.publish_group("raw", _group(2, 1.0), msg_id="after")
            got = []
            with anyio.fail_after(20):
                while len(got) < 2:
                    got += await consumer.fetch(5, timeout=1)
            assert sorted(decode_group(m.data)[0].eid.task for m in got) == [1, 2]
            for m in got:
                await m.ack_sync()
            assert bus.transport.connection is not None and bus.transport.connection.gave_up is None

    try:
        anyio.run(main, backend="asyncio")
    finally:
        server.stop()


def test_gives_up_after_the_window(tmp_path: Path) -> None:
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    cfg = msgspec.structs.replace(NatsConfig(), reconnect_window=2.0)

    async def main() -> None:
        async with await Bus.connect(server.url, NAMES, cfg, "t") as bus:
            await bus.provision()
            consumer = await bus.pull(NAMES.exp_stream, NAMES.stage_consumer("raw", "train"))
            _kill(server, signal.SIGKILL)
            t0 = time.monotonic()
            with anyio.fail_after(15), pytest.raises(BusError) as info:
                while True:  # what a consumer loop does: fetch, fetch, ...
                    await consumer.fetch(5, timeout=0.5)
            assert 2.0 <= time.monotonic() - t0 < 10
            text = str(info.value)
            assert server.url in text and "nats.reconnect_window = 2.0 s" in text, text
            with pytest.raises(BusError, match="reconnect_window"):
                await bus.publish_group("raw", _group(1, 1.0), msg_id="late")

    try:
        anyio.run(main, backend="asyncio")
    finally:
        server.stop()
