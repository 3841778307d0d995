"""Purging acked experience keeps the server's deduplication across a restart.

A nats-server killed and restarted rebuilds its duplicate window from the messages it
still stores: an id whose message was purged is forgotten. An operator whose ack of a
raw message was lost with the kill forwards that message again with the same
``Nats-Msg-Id``; if the first copy was trained and purged meanwhile, the repeat is stored
as new experience (the trainer drops it, but the run's account counts it twice). So the
purge keeps everything stored after an operator's first unacked message (a forward is
stored after its source) and what is younger than ``nats.streams.experience.keep_acked_s``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import msgspec
import pytest

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer
from rftstream.retention.limits import purge_acked
from rftstream.subjects import TRAIN_STAGE, RunNames
from tests.integration._util import _group

pytestmark = pytest.mark.integration

NAMES = RunNames("dedup")


def _kill_and_restart(server: EmbeddedNatsServer) -> None:
    proc = server._proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    server._proc = None
    server.start()  # same port, same store


async def _restart(server: EmbeddedNatsServer, bus: Bus) -> None:
    """SIGKILL the server, start it again on its store, wait for ``bus`` to reconnect."""
    await anyio.to_thread.run_sync(_kill_and_restart, server)
    with anyio.fail_after(20):
        while not bus.transport.nc.is_connected:
            await anyio.sleep(0.1)


async def _purge(bus: Bus, cfg: NatsConfig) -> int:
    """The explorers' purge of acked experience, once; the messages it purged."""
    res = await purge_acked(
        bus.transport,
        NAMES.exp_stream,
        cfg.streams.experience,
        await bus.state(),
        NAMES.exp_wildcard[:-1],
    )
    return res.purged


@pytest.mark.parametrize(
    ("keep_acked_s", "purged", "repeat_stored"),
    [(60.0, 0, 0), (0.0, 3, 1)],
    ids=["young-kept", "purged-at-once"],
)
def test_a_forward_repeated_after_a_restart_is_deduplicated_only_while_its_first_copy_is_stored(
    tmp_path: Path, keep_acked_s: float, purged: int, repeat_stored: int
) -> None:
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    cfg = msgspec.convert(
        {
            "reconnect_window": 30.0,
            "streams": {
                "experience": {"keep_acked_msgs": 0, "keep_acked_s": keep_acked_s},
            },
        },
        NatsConfig,
    )

    async def main() -> None:
        async with await Bus.connect(server.url, NAMES, cfg, "operator") as bus:
            await bus.provision()
            for task in range(3):
                await bus.publish_group(TRAIN_STAGE, _group(task, 1.0), msg_id=f"train:raw:{task}")
            trainer = await bus.pull(NAMES.exp_stream, NAMES.trainer_consumer)
            for m in await trainer.fetch(3, timeout=2):
                await m.ack_sync()
            assert await _purge(bus, cfg) == purged
            await _restart(server, bus)
            # the operator's forward of raw task 1, again, after its ack was lost
            stored = await bus.publish_group(TRAIN_STAGE, _group(1, 1.0), msg_id="train:raw:1")
            assert stored == repeat_stored
            state = await bus.transport.stream_state(NAMES.exp_stream)
            assert state.last_seq == 3 + repeat_stored

    try:
        anyio.run(main, backend="asyncio")
    finally:
        server.stop()


def test_the_forward_of_an_unacked_message_stays_for_deduplication_across_restarts(
    tmp_path: Path,
) -> None:
    """However old: raw 1's ack was lost, so its forward (train 2, trained) stays stored,
    and a repeat of the forward after two restarts is still refused."""
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    server.start()
    cfg = msgspec.convert(
        {
            "reconnect_window": 30.0,
            "streams": {"experience": {"keep_acked_msgs": 0, "keep_acked_s": 0.0}},
        },
        NatsConfig,
    )

    async def main() -> None:
        async with await Bus.connect(server.url, NAMES, cfg, "operator") as bus:
            await bus.provision()
            await bus.publish_group("raw", _group(7, 1.0), msg_id="raw:7")
            operator = await bus.pull(NAMES.exp_stream, NAMES.stage_consumer("raw", TRAIN_STAGE))
            assert len(await operator.fetch(1, timeout=2)) == 1  # its ack never comes
            await bus.publish_group(TRAIN_STAGE, _group(7, 1.0), msg_id="train:raw:7")
            trainer = await bus.pull(NAMES.exp_stream, NAMES.trainer_consumer)
            for m in await trainer.fetch(1, timeout=2):
                await m.ack_sync()
            assert await _purge(bus, cfg) == 0  # train 2 is trained, but after raw 1 (unacked)
            for _ in range(2):
                await _restart(server, bus)
            assert await bus.publish_group(TRAIN_STAGE, _group(7, 1.0), msg_id="train:raw:7") == 0

    try:
        anyio.run(main, backend="asyncio")
    finally:
        server.stop()
