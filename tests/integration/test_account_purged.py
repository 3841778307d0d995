"""Read-only commands against a real nats-server refuse a run with no state instead of
creating its streams or bucket. The account of a purged run: on the in-memory transport in
tests/unit/test_account_of_a_purged_run.py."""

from __future__ import annotations

import anyio
import pytest

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig
from rftstream.errors import RunNotFoundError
from rftstream.operations.account import account_run
from rftstream.subjects import RunNames

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_read_only_commands_do_not_create_a_missing_run(nats_url: str) -> None:
    names = RunNames("nosuchrun")
    async with await Bus.connect(nats_url, names, NatsConfig(), "account") as bus:
        with pytest.raises(RunNotFoundError, match="run nosuchrun has no state on this server"):
            await account_run(bus)
        with pytest.raises(RunNotFoundError, match="no KV bucket rft_nosuchrun_state"):
            await bus.kv(create=False)
        names_on_server = [s.config.name async for s in _streams(bus)]
    assert not any("NOSUCHRUN" in n or "nosuchrun" in n for n in names_on_server)


async def _streams(bus: Bus):  # noqa: ANN202 - async generator of StreamInfo
    for info in await bus.transport.js.streams_info():
        yield info


@pytest.mark.parametrize("command", ["account", "status", "streams"])
def test_read_only_cli_commands_name_a_missing_run(
    command: str, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rftstream.cli import main

    code = main([command, "--nats-url", nats_url, "--set", "name=ghostrun"])
    out = capsys.readouterr().out
    assert code == 2 and "run ghostrun has no state on this server" in " ".join(out.split())

    async def buckets() -> list[str]:
        async with await Bus.connect(nats_url, RunNames("x"), NatsConfig(), "t") as bus:
            return [i.config.name for i in await bus.transport.js.streams_info()]

    assert "KV_rft_ghostrun_state" not in anyio.run(buckets, backend="asyncio")
