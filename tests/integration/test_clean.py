"""``rftstream clean`` against a real nats-server with several runs on it."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import msgspec
import pytest

from rftstream import cli
from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.clean import RunResources, parse_age, refusal
from rftstream.config.schema import NatsConfig
from rftstream.subjects import RunNames
from tests.kv_json import write_json


def _small_streams() -> NatsConfig:
    """Limits that three runs' reservations fit in on any test machine's disk (each
    stream reserves its max_bytes in the server's store, 3.5 GiB a run by default)."""
    return msgspec.convert(
        {"streams": {s: {"max_bytes": 8 * 1024**2} for s in STREAMS}}, NatsConfig
    )


STREAMS = ("tasks", "experience", "dead_letter", "metrics")


async def _make_run(url: str, run: str, status: str, beat_age: float | None) -> None:
    names = RunNames(run)
    async with await Bus.connect(url, names, _small_streams(), "t") as bus:
        await bus.provision()
        await bus.publish(names.exp_subject("raw"), b"x" * 500, msg_id=f"{run}:1")
        state = RunState(await bus.kv())
        await state.set_status(status)
        if beat_age is not None:
            await write_json(
                state,
                "heartbeat.trainer",
                {"actor": "trainer", "role": "trainer", "ts": time.time() - beat_age},
            )
        await bus.transport.js.create_object_store(f"rft_{run}_weights")


async def _streams(url: str) -> set[str]:
    async with await Bus.connect(url, RunNames("probe"), NatsConfig(), "probe") as bus:
        return {info.config.name for info in await bus.transport.js.streams_info()}


def _setup(url: str) -> None:
    async def main() -> None:
        await _make_run(url, "done", "finished", beat_age=120)
        await _make_run(url, "live", "running", beat_age=1)
        await _make_run(url, "crashed", "running", beat_age=600)

    anyio.run(main, backend="asyncio")


def _of(run: str, streams: set[str]) -> set[str]:
    return {s for s in streams if f"_{run.upper()}_" in s or f"_{run}_" in s}


def test_clean_removes_a_finished_run_and_refuses_live_and_unfinished_ones(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _setup(nats_url)
    before = anyio.run(_streams, nats_url, backend="asyncio")
    assert len(_of("done", before)) == 7  # 5 streams, KV bucket, object store

    assert cli.main(["clean", "--nats-url", nats_url, "--all", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and "done" in out
    assert "kept run live: live: last heartbeat" in out
    assert "kept run crashed: not finished (status running)" in out
    assert anyio.run(_streams, nats_url, backend="asyncio") == before  # a dry run removes nothing

    assert cli.main(["clean", "--nats-url", nats_url, "done"]) == 0
    after = anyio.run(_streams, nats_url, backend="asyncio")
    assert _of("done", after) == set()
    assert _of("live", after) == _of("live", before)  # another run's resources stay
    assert _of("crashed", after) == _of("crashed", before)

    assert cli.main(["clean", "--nats-url", nats_url, "live"]) == 1  # refused by name
    assert "kept run live: live" in capsys.readouterr().out
    assert _of("live", anyio.run(_streams, nats_url, backend="asyncio")) == _of("live", before)

    assert cli.main(["clean", "--nats-url", nats_url, "--force", "live", "crashed"]) == 0
    assert anyio.run(_streams, nats_url, backend="asyncio") == set()

    assert cli.main(["clean", "--nats-url", nats_url, "nosuchrun"]) == 2
    assert "no run 'nosuchrun'" in capsys.readouterr().out


def test_clean_files_deletes_the_checkpoints_of_the_config_run(
    nats_url: str, tmp_path: Path
) -> None:
    anyio.run(_make_run, nats_url, "default", "finished", None, backend="asyncio")
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_1"
    ckpt.mkdir(parents=True)
    args = ["clean", "--nats-url", nats_url, "--run-dir", str(tmp_path / "run"), "--files"]
    assert cli.main([*args, "--dry-run"]) == 0 and ckpt.exists()
    assert cli.main(args) == 0
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert _of("default", anyio.run(_streams, nats_url, backend="asyncio")) == set()


def test_ages_and_refusals() -> None:
    assert [parse_age(t) for t in ("90", "90s", "15m", "12h", "7d", "1.5w")] == [
        90.0,
        90.0,
        900.0,
        43200.0,
        604800.0,
        1.5 * 604800,
    ]
    with pytest.raises(ValueError, match="--older-than '7 days'"):
        parse_age("7 days")
    now = 10_000.0
    done = RunResources("r", status="finished", last_heartbeat=now - 100, last_activity=now - 100)
    assert refusal(done, now, force=False, older_than=None) is None
    assert "not older than 3600s" in refusal(done, now, force=True, older_than=3600)
    assert refusal(done, now, force=False, older_than=60) is None
    live = RunResources("r", status="finished", last_heartbeat=now - 5)
    assert "live" in refusal(live, now, force=False, older_than=None)
    assert refusal(live, now, force=True, older_than=None) is None
    assert "not finished" in refusal(
        RunResources("r", status="running"), now, force=False, older_than=None
    )
