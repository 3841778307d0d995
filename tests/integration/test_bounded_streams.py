"""Stream limits from config, purging acked experience, back-pressure and loss reports,
against a real nats-server."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.js import api

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig
from rftstream.errors import BusError, StreamFullError
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer
from rftstream.retention.limits import ExperienceRoom
from rftstream.subjects import RunNames

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _nats(retry_window: float = 60.0, **streams: dict) -> NatsConfig:
    return msgspec.convert(
        {"max_payload": 16 * 1024, "streams": streams, "retry_window": retry_window}, NatsConfig
    )


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def test_limits_from_config_reach_every_stream(nats_url: str) -> None:
    cfg = _nats(
        tasks={"max_bytes": 1_000_000, "max_msgs": 500},
        experience={"max_bytes": 2_000_000, "max_age": 3600},
        dead_letter={"max_bytes": 300_000, "discard": "old"},
        metrics={"max_msgs": 50, "discard": "old"},
    )
    names = RunNames("lim")
    async with await Bus.connect(nats_url, names, cfg, "t") as bus:
        await bus.provision()
        seen = {s: (await bus.transport.js.stream_info(s)).config for s in names.streams}
    tasks, exp, dlq, metrics, weights = (seen[s] for s in names.streams)
    assert (tasks.max_bytes, tasks.max_msgs, tasks.discard) == (
        1_000_000,
        500,
        api.DiscardPolicy.NEW,
    )
    assert tasks.retention == api.RetentionPolicy.WORK_QUEUE
    assert (exp.max_bytes, exp.max_age, exp.discard) == (2_000_000, 3600, api.DiscardPolicy.NEW)
    assert (dlq.max_bytes, dlq.discard) == (300_000, api.DiscardPolicy.OLD)
    assert (metrics.max_msgs, metrics.max_bytes, metrics.discard) == (
        50,
        256 * 1024**2,
        api.DiscardPolicy.OLD,
    )


async def test_defaults_bound_every_stream(nats_url: str) -> None:
    """Every stream has a byte limit, but the weights stream: the trainer bounds it by
    removing what came before the newest keyframe (test_weights_bus)."""
    names = RunNames("deflim")
    async with await Bus.connect(nats_url, names, NatsConfig(), "t") as bus:
        await bus.provision()
        for s in names.streams:
            limit = (await bus.transport.js.stream_info(s)).config.max_bytes
            if s == names.weights_stream:
                assert limit == -1
            else:
                assert limit > 0, s


async def test_changed_limits_update_an_existing_stream(nats_url: str) -> None:
    names = RunNames("upd")
    async with await Bus.connect(
        nats_url, names, _nats(experience={"max_bytes": 10**6}), "a"
    ) as bus:
        await bus.provision()
    async with await Bus.connect(
        nats_url, names, _nats(experience={"max_bytes": 3 * 10**6}), "b"
    ) as bus:
        await bus.provision()
        assert (await bus.transport.js.stream_info(names.exp_stream)).config.max_bytes == 3 * 10**6


async def test_a_stream_with_another_retention_is_refused_by_name(nats_url: str) -> None:
    names = RunNames("ret")
    async with await Bus.connect(nats_url, names, NatsConfig(), "t") as bus:
        await bus.transport.js.add_stream(
            api.StreamConfig(name=names.tasks_stream, subjects=[names.tasks_subject])
        )  # limits retention: not the work queue this run needs
        with pytest.raises(
            BusError, match=f"stream {names.tasks_stream} exists with retention limits"
        ):
            await bus.provision()


async def test_full_stream_refuses_with_a_clear_error_then_takes_more_once_purged(
    nats_url: str,
) -> None:
    # a full stream is retried for nats.retry_window (consumers make room), then refused
    cfg = _nats(retry_window=0.0, experience={"max_bytes": 40_000, "purge_acked": False})
    names = RunNames("full")
    async with await Bus.connect(nats_url, names, cfg, "producer") as bus:
        await bus.provision()
        subject = names.exp_subject("raw")
        stored = 0
        with pytest.raises(
            StreamFullError, match=rf"publish to {subject} refused: its stream is full"
        ):
            for i in range(100):
                await bus.publish(subject, b"x" * 1000, msg_id=f"m{i}", retries=0)
                stored += 1
        info = await bus.transport.js.stream_info(names.exp_stream)
        assert info.state.messages == stored and info.state.bytes <= 40_000
        assert 30 <= stored < 40  # ~1 KB each (payload + headers) under 40 000 bytes
        # nothing stored was dropped: the first one is still there
        assert (await bus.transport.js.get_msg(names.exp_stream, 1)).data == b"x" * 1000


async def test_discard_old_loss_under_a_consumer_is_reported(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _nats(experience={"max_msgs": 10, "discard": "old", "purge_acked": False})
    names = RunNames("lossy")
    async with await Bus.connect(nats_url, names, cfg, "p") as bus:
        await bus.provision()
        for i in range(25):  # nobody reads exp.raw: 15 of them go unread
            await bus.publish(names.exp_subject("raw"), b"g", msg_id=f"g{i}")
        room = ExperienceRoom(bus.transport, names.exp_stream, cfg.streams.experience, "explorer-0")
        with caplog.at_level(logging.WARNING, logger="rftstream.retention.limits"):
            assert not await room.check()  # 10 of max_msgs 10: full
    # the operator's durable op_raw_to_train had acked nothing: 15 sequences passed it
    assert room.lost == 15
    text = caplog.text
    assert names.exp_stream in text and "before every consumer acked them" in text
    assert "op_raw_to_train (15)" in text


async def test_long_run_stays_under_its_bound_and_trains_everything(tmp_path: Path) -> None:
    """Explorers publish ~24x the stream's byte bound through an operator stage to a
    trainer; the stream (and the server's store on disk) stays bounded, nothing is lost."""
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE)
    url = server.start()
    bound = 64 * 1024
    # purged as soon as acked (keep_acked_s 0): the young messages' dedup is another test's
    cfg = _nats(experience={"max_bytes": bound, "keep_acked_msgs": 5, "keep_acked_s": 0})
    names = RunNames("longrun")
    n_groups, body = 400, 2000
    trained: list[str] = []
    peak = {"bytes": 0, "disk": 0}
    store = tmp_path / "nats" / "jetstream"
    try:
        async with (
            await Bus.connect(url, names, cfg, "explorer") as ex,
            await Bus.connect(url, names, cfg, "operator") as op,
            await Bus.connect(url, names, cfg, "trainer") as tr,
        ):
            await ex.provision()
            room = ExperienceRoom(
                ex.transport,
                names.exp_stream,
                cfg.streams.experience,
                "explorer",
                message_bytes=ex.max_payload,
            )

            async def explorer() -> None:
                for i in range(n_groups):
                    await room.wait()
                    await ex.publish(names.exp_subject("raw"), b"r" * body, msg_id=f"raw:{i}")

            async def operator() -> None:
                sub = await op.pull(names.exp_stream, names.stage_consumer("raw", "train"))
                done = 0
                while done < n_groups:
                    for m in await sub.fetch(16, 1.0):
                        i = m.headers["Nats-Msg-Id"].split(":")[1]
                        await op.publish(names.exp_subject("train"), m.data, msg_id=f"train:{i}")
                        await m.ack()
                        done += 1

            async def trainer() -> None:
                sub = await tr.pull(names.exp_stream, names.trainer_consumer)
                while len(trained) < n_groups:
                    msgs = await sub.fetch(8, 1.0)
                    await anyio.sleep(0.03)  # a slow trainer: the explorer must wait for it
                    for m in msgs:
                        trained.append(m.headers["Nats-Msg-Id"])
                        await m.ack()

            async def watch() -> None:
                while len(trained) < n_groups:
                    info = await ex.transport.js.stream_info(names.exp_stream)
                    peak["bytes"] = max(peak["bytes"], int(info.state.bytes))
                    peak["disk"] = max(peak["disk"], _dir_bytes(store))
                    await anyio.sleep(0.05)

            with anyio.fail_after(45):
                async with anyio.create_task_group() as tg:
                    for fn in (explorer, operator, trainer, watch):
                        tg.start_soon(fn)
            await room.check()  # the explorer's last purge, after the trainer's last ack
            final = await ex.transport.js.stream_info(names.exp_stream)
    finally:
        server.stop()
    published = n_groups * (body + 60)
    assert published > 10 * bound
    # everything trained exactly once, in spite of the bound
    assert sorted(trained) == sorted(f"train:{i}" for i in range(n_groups))
    assert peak["bytes"] <= bound
    assert peak["bytes"] >= 0.5 * bound  # the bound was approached: producers were held back
    assert room.lost == 0
    # only the window of acked messages stays at the end (keep_acked_msgs 5), and less
    # than one more purge batch (purges come in batches of keep_acked_msgs far from the bound)
    assert 5 <= final.state.messages < 2 * 5
    # the server's store on disk stays bounded too: a few of the bound, not the 0.8 MB published
    assert peak["disk"] < published / 4, (peak["disk"], published)


async def test_a_server_without_room_for_a_streams_reservation_names_the_key(
    tmp_path: Path,
) -> None:
    """Each stream reserves its max_bytes in the server's store: a store smaller than a
    run's defaults (3.5 GiB) refuses the stream, and the error says which key reserved
    how much and what makes room."""
    server = EmbeddedNatsServer(tmp_path / "nats", max_file_store=64 * 1024**2)
    server.start()
    try:
        async with await Bus.connect(server.url, RunNames("roomless"), NatsConfig(), "t") as bus:
            with pytest.raises(BusError) as err:
                await bus.provision()
        message = str(err.value)
        assert "insufficient storage" in message
        assert "nats.streams." in message and ".max_bytes" in message
        assert "bytes for nats.streams." in message
        assert "rftstream clean" in message and "max_file_store" in message
        # the same run with limits the store can hold provisions
        small = _nats(
            **{
                s: {"max_bytes": 4 * 1024**2}
                for s in ("tasks", "experience", "dead_letter", "metrics")
            }
        )
        async with await Bus.connect(server.url, RunNames("roomy"), small, "t") as bus:
            await bus.provision()
    finally:
        server.stop()
