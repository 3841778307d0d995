"""Run names of any length: safe stream names, the full name in the streams' metadata."""

from __future__ import annotations

import anyio
import nats
import pytest

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig
from rftstream.config.validate import run_id_from_name
from rftstream.subjects import RunNames

LONG = ("Qwen2.5 math. GRPO run with spaces and dots. " * 3)[:100]


@pytest.mark.parametrize("name", ["qwen2.5-1.5B-gsm8k", LONG])
def test_streams_of_a_long_name_carry_it_in_metadata(nats_url: str, name: str) -> None:
    assert len(LONG) == 100
    names = RunNames(run_id_from_name(name), name=name)

    async def main() -> dict[str, dict[str, str]]:
        bus = await Bus.connect(nats_url, names, NatsConfig(), "t")
        try:
            await bus.provision()
        finally:
            await bus.close()
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        out = {}
        for stream in names.streams:
            info = await js.stream_info(stream)
            out[stream] = dict(info.config.metadata or {})
        await nc.close()
        return out

    metadata = anyio.run(main, backend="asyncio")
    assert set(metadata) == set(names.streams)
    for stream, md in metadata.items():
        assert len(stream) < 32
        assert md["rft.run_name"] == name
        assert md["rft.run"] == names.run
    assert name in names.display and names.run in names.display
