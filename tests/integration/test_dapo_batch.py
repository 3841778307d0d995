"""`dapo_dynamic_sampling` keeps filling until the batch quota is met: with zero-variance groups
dropped upstream, the streaming trainer waits for a full batch, so every step trains exactly
``train_batch_size`` experiences and none of a dropped group (checked by experience id with a
spy on the real DeepSpeed trainer's step)."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run, provision, run_actors
from rftstream.subjects import KV_TRAINER_STARVING, KV_TRAINER_STEP
from tests.integration._util import _group, small_config, wait_drained
from tests.kv_json import read_json

pytestmark = pytest.mark.integration


def _mixed(task: int) -> list:
    low, high = _group(task, 0.0, 4), _group(task, 1.0, 4)
    return [low[0], low[1], high[2], high[3]]


def test_every_step_is_a_full_batch_of_groups_with_signal(
    tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rftstream.training.policy_trainer import PolicyTrainer

    data = small_config(tmp_path, tiny_model_path)
    data["buffer"].update({"train_batch_size": 8, "total_steps": 3})
    data["data_processor"] = {
        "experience_pipeline": {"operators": [{"name": "dapo_dynamic_sampling"}]}
    }
    run = prepare_run(config_from_dict(data))
    steps: list[list[str]] = []
    real_step = PolicyTrainer.train_step

    def spy(self: PolicyTrainer, exps: list) -> dict[str, float]:
        steps.append([e.eid.uid for e in exps])
        return real_step(self, exps)

    monkeypatch.setattr(PolicyTrainer, "train_step", spy)
    errors: list[BaseException] = []
    records: list[dict] = []

    def job() -> None:
        try:
            anyio.run(
                lambda: run_actors(
                    run, nats_url, roles=("operator", "trainer"), on_step=records.append
                ),
                backend="asyncio",
            )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    flat = [_group(100 + i, float(i % 2)) for i in range(8)]  # zero variance: all 0 or all 1
    mixed = [_mixed(i) for i in range(6)]  # 6 groups of 4 = exactly 3 batches of 8

    async def produce() -> None:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "producer") as bus:
            state = RunState(await bus.kv())
            # wave 1: one group with signal among flat ones: half a batch survives
            for g in [flat[0], mixed[0], flat[1], flat[2]]:
                await bus.publish_group("raw", g, msg_id=f"raw-{g[0].eid.task}")

            def no_errors() -> None:
                assert not errors, errors

            with anyio.fail_after(180):
                await wait_drained(
                    bus.transport.js,
                    run.names.exp_stream,
                    "op_raw_to_train",
                    timeout=180,
                    check=no_errors,
                )
                while True:  # nothing more comes in: the durable stays drained meanwhile
                    no_errors()
                    starving = await read_json(state, KV_TRAINER_STARVING)
                    if isinstance(starving, dict) and starving.get("since"):
                        break
                    await anyio.sleep(0.2)
            # everything is through the filter and the trainer waits: no short step was taken
            assert steps == [] and await read_json(state, KV_TRAINER_STEP) is None
            # wave 2: the rest, flat groups interleaved
            for i, g in enumerate(mixed[1:]):
                for h in [g, flat[3 + i]]:
                    await bus.publish_group("raw", h, msg_id=f"raw-{h[0].eid.task}")

    thread = threading.Thread(target=job)
    thread.start()
    try:
        anyio.run(produce, backend="asyncio")
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive() and not errors, errors
    assert [len(s) for s in steps] == [8, 8, 8]
    trained = [u for s in steps for u in s]
    assert sorted(trained) == sorted(e.eid.uid for g in mixed for e in g)
    dropped = {e.eid.uid for g in flat for e in g}
    assert not dropped & set(trained)
    assert [r["experience/trained"] for r in records] == [8, 8, 8]
