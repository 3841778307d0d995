"""``runtime.start_fresh`` against a real nats-server: what an earlier run of the same
name left on the server is replaced, kept (continuing) or refused (still alive)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.errors import RftError, RunNotFoundError, StreamNotFound
from rftstream.runtime import PreparedRun, prepare_run, start_fresh
from rftstream.wire import TRAINER_DONE, Heartbeat, TrainerDone
from tests.integration._util import small_config

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py runs on asyncio


def _run(tmp_path: Path, tiny_model_path: str) -> PreparedRun:
    return prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path)))


async def _earlier_run(run: PreparedRun, url: str, status: str, beat_age_s: float) -> None:
    """What an earlier ``up`` of the run left: its streams, a status and a heartbeat."""
    async with await Bus.connect(url, run.names, run.cfg.nats, "earlier") as bus:
        await bus.provision()
        state = await bus.state()
        await state.set_status(status)
        await state.heartbeat(
            Heartbeat(actor="trainer", role="trainer", ts=time.time() - beat_age_s)
        )
        await state.put(TRAINER_DONE, TrainerDone(step=3, status="finished", ts=time.time()))


async def test_a_new_run_replaces_a_finished_one(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = _run(tmp_path, tiny_model_path)
    assert await start_fresh(run, nats_url) is None  # nothing there yet
    await _earlier_run(run, nats_url, "finished", beat_age_s=0.0)
    note = await start_fresh(run, nats_url)
    assert note is not None and "replaced the earlier run" in note and "finished" in note
    async with await Bus.connect(nats_url, run.names, run.cfg.nats, "check") as bus:
        with pytest.raises(RunNotFoundError, match=run.names.kv_bucket):
            await bus.state(create=False)
        for stream in run.names.streams:
            with pytest.raises(StreamNotFound):
                await bus.stream_state(stream)


async def test_a_live_run_is_refused_and_a_continued_one_kept(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    run = _run(tmp_path, tiny_model_path)
    await _earlier_run(run, nats_url, "running", beat_age_s=1.0)
    with pytest.raises(RftError, match="is active on"):
        await start_fresh(run, nats_url)
    note = await start_fresh(run, nats_url, continuing=True, own_store=True)
    assert note is not None and "kept run" in note
    async with await Bus.connect(nats_url, run.names, run.cfg.nats, "check") as bus:
        state = await bus.state(create=False)
        assert await state.status() == "running"
        assert await state.get(TRAINER_DONE) is None  # the trainer's end record went
        await bus.stream_state(run.names.exp_stream)  # kept
