"""examples/plain_nats_operator.py — a stage written with plain nats-py — spliced into a live run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, provision
from tests.integration._util import (
    read_experiences,
    read_stream,
    run_actors_to_end,
    small_config,
    user_env,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "plain_nats_operator.py"


def test_plain_nats_operator_feeds_the_trainer(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    cfg = small_config(tmp_path, tiny_model_path, buffer__train_batch_size=8, buffer__total_steps=2)
    cfg["buffer"]["batch_size"] = 4
    cfg["data_processor"] = {"experience_pipeline": {"input_stage": "plain"}}
    run = prepare_run(config_from_dict(cfg))
    anyio.run(provision, run, nats_url, backend="asyncio")
    log = tmp_path / "plain.log"
    with open(log, "w") as out:
        op = subprocess.Popen(
            [sys.executable, str(SCRIPT), nats_url, "itest", "raw", "plain"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=user_env(tiny_model_path),
        )
    try:
        steps = run_actors_to_end(run, nats_url, timeout=240)
        op.wait(timeout=30)  # it stops by itself once the run is finished
    finally:
        if op.poll() is None:
            op.kill()
    assert op.returncode == 0, log.read_text()[-3000:]
    counts = json.loads(log.read_text().strip().splitlines()[-1])
    assert [r["step"] for r in steps] == [1, 2]

    async def check() -> None:
        raw = await read_stream(nats_url, "rft.itest.exp.raw")
        plain = await read_stream(nats_url, "rft.itest.exp.plain")
        train = await read_experiences(nats_url, "rft.itest.exp.train")
        assert counts["kept_groups"] == len(plain) and counts["kept_groups"] + counts[
            "dropped_groups"
        ] <= len(raw)
        # everything the trainer consumed passed the plain operator: no all-zero group, advantages set downstream
        groups: dict[str, list[float]] = {}
        for e in train:
            groups.setdefault(e.group_id, []).append(e.reward or 0.0)
            assert e.advantages is not None
        assert groups and all(any(r > 0 for r in rs) for rs in groups.values())
        plain_ids = {e.group_id for m in plain for e in decode_group(m.data)}
        assert set(groups) <= plain_ids

    anyio.run(check, backend="asyncio")
