"""``synchronizer.max_staleness`` holds with two explorers (``engine_num: 2``), over a real
nats-server: each gate counts the other explorer's tasks in flight, by the KV records of
``rftstream.control.flights``.

The tasks are slow (``SLOW_S`` each), so both explorers hold tasks at once. With
``max_staleness: 0`` and a trainer batch of one explorer step, a gate that saw only its
own tasks let both explorers take a step on the same weights: the second of those
batches was trained a version later (staleness 1 at most steps).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import pytest

from rftstream.config import config_from_dict
from rftstream.experience import H_ACTOR
from rftstream.runtime import prepare_run
from tests.integration._util import read_stream, run_actors_to_end, small_config
from workflows import WORKFLOWS, Experience, MathWorkflow

pytestmark = pytest.mark.integration

STEPS = 8
SLOW_S = 0.3


class SlowMath(MathWorkflow):
    """The math workflow, ``SLOW_S`` slower (a verifier that takes its time)."""

    async def run_async(self) -> list[Experience]:
        await anyio.sleep(SLOW_S)
        return await super().run_async()


WORKFLOWS.register_module("slow_math_two_explorers", SlowMath, force=True)


def test_max_staleness_holds_with_two_explorers(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    data = small_config(tmp_path, tiny_model_path, name="twoexp")
    data["buffer"]["total_steps"] = STEPS
    data["buffer"]["explorer_input"]["taskset"]["default_workflow_type"] = "slow_math_two_explorers"
    data["explorer"].update({"runner_num": 4, "rollout_model": {"engine_num": 2}})
    data["synchronizer"].update({"sync_method": "jetstream", "max_staleness": 0})
    run = prepare_run(config_from_dict(data))
    steps = run_actors_to_end(run, nats_url, timeout=300)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    staleness = [(r["step"], r["staleness/max"]) for r in steps]
    assert all(worst <= 0 for _, worst in staleness), staleness
    # both explorers generated what was trained
    raw = anyio.run(read_stream, nats_url, run.names.exp_subject("raw"), backend="asyncio")
    publishers = Counter((m.headers or {}).get(H_ACTOR) for m in raw)
    assert publishers["explorer"] > 0 and publishers["explorer-2"] > 0, publishers
