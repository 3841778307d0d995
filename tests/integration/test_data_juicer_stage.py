"""A ``data_juicer`` operator stage over a real nats-server: exp.raw -> exp.train."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.experience import EID, Experience
from rftstream.runtime import prepare_run, provision
from tests.integration._util import (
    operate_until_drained,
    read_experiences,
    read_stream,
    small_config,
)

pytestmark = pytest.mark.integration

RESPONSES = ["ok", "the answer is 42", "x" * 80, "forty two"]  # kept: 5 <= len <= 40


def group(task: int) -> list[Experience]:
    return [
        Experience(
            tokens=[5, 6, 7, 8, 9],
            prompt_length=2,
            reward=float(i % 2),
            logprobs=[-1.0, -1.0, -1.0],
            response_text=text,
            prompt_text="What is 6 times 7?",
            eid=EID(0, task, i),
        )
        for i, text in enumerate(RESPONSES)
    ]


def test_data_juicer_stage_filters_by_text(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["data_processor"] = {
        "experience_pipeline": {
            "operators": [
                {
                    "name": "data_juicer",
                    "args": {
                        "text_key": "response",
                        "operators": [{"text_length_filter": {"min_len": 5, "max_len": 40}}],
                    },
                }
            ]
        }
    }
    run = prepare_run(config_from_dict(cfg))

    async def main() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            await bus.publish_group("raw", group(1), msg_id="g1")
            await bus.publish_group("raw", group(2), msg_id="g2")
            await operate_until_drained(run, nats_url, bus)

    anyio.run(main, backend="asyncio")

    async def check() -> None:
        train = await read_experiences(nats_url, "rft.itest.exp.train")
        kept = sorted((e.eid.task, e.response_text) for e in train)
        expected = sorted((t, r) for t in (1, 2) for r in RESPONSES if 5 <= len(r) <= 40)
        assert kept == expected
        for e in train:
            assert e.info["text_len"] == len(e.response_text)  # DJ stats travel in info
            assert e.advantages is not None  # GRPO ran after the filter
        assert not await read_stream(nats_url, "rft.itest.dlq.>")

    anyio.run(check, backend="asyncio")
