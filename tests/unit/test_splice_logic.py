"""Pure pieces of splicing: who owns a stage, what is in flight, the drain control (asyncio and trio)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import anyio
import pytest

from rftstream import splice
from rftstream.actors.operator_host import DrainControl


def test_owner_alive_by_pid_here_and_by_age_elsewhere() -> None:
    now = time.time()
    here = socket.gethostname()
    assert splice.owner_alive({"owner": {"pid": os.getpid(), "host": here, "ts": now}})
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    assert not splice.owner_alive({"owner": {"pid": dead_pid, "host": here, "ts": now}})
    # another machine: only the age of its last refresh counts
    fresh = {"owner": {"pid": 1, "host": "elsewhere", "ts": now - 1}}
    stale = {"owner": {"pid": 1, "host": "elsewhere", "ts": now - splice.OWNER_STALE_S - 1}}
    assert splice.owner_alive(fresh) and not splice.owner_alive(stale)
    assert not splice.owner_alive(None) and not splice.owner_alive({"owner": None})


def test_in_flight() -> None:
    for state in ("asked", "requested", "claimed"):
        assert splice.in_flight({"kind": "splice", "state": state})
    assert not splice.in_flight({"kind": "splice", "state": "cut"})  # a splice is done at its cut
    assert splice.in_flight({"kind": "unsplice", "state": "cut"})  # an unsplice still drains
    assert splice.in_flight({"kind": "unsplice", "state": "drained"})  # the trainer must close it
    for state in ("done", "abandoned", "refused"):
        assert not splice.in_flight({"kind": "unsplice", "state": state})
    assert not splice.in_flight(None) and not splice.in_flight([1])


def test_restart_hint_and_durable_names() -> None:
    hint = splice.restart_hint(
        {"operator": "reward_filter", "args": {"threshold": 0.5}, "to_stage": "filtered"}
    )
    assert hint == (
        "rftstream operator reward_filter --args '{\"threshold\": 0.5}' --splice --to filtered"
        " --config C --nats-url U"
    )
    assert splice.trainer_durable("train") == "trainer"
    assert splice.trainer_durable("my-stage") == "trainer_my_stage"


def test_stage_chain_walks_back_from_the_trainer() -> None:
    values = {
        "trainer.input": {"stage": "b"},
        "stage.b": {"operator": "opb", "from_stage": "a"},
        "stage.a": {"operator": "opa", "from_stage": "train"},
    }
    chain = splice.stage_chain(values)
    assert [(c["stage"], c["operator"]) for c in chain] == [
        ("raw", None),
        ("train", None),
        ("a", "opa"),
        ("b", "opb"),
    ]
    loop = {"trainer.input": {"stage": "x"}, "stage.x": {"operator": "o", "from_stage": "x"}}
    assert [c["stage"] for c in splice.stage_chain(loop)] == ["raw", "train", "x"]  # no hang


@pytest.mark.anyio
async def test_drain_control_parks_then_drains(anyio_backend) -> None:
    control = DrainControl(hosts=3)
    released: list[int] = []

    async def host(i: int) -> None:
        await control.park()
        released.append(i)
        control.leave()

    async with anyio.create_task_group() as tg:
        tg.start_soon(host, 0)
        tg.start_soon(host, 1)
        await anyio.sleep(0.05)
        assert not control.all_parked.is_set()  # the third host is still working
        control.leave()  # ... until it stops for another reason (it counts as parked)
        with anyio.fail_after(5):
            await control.all_parked.wait()
        assert released == [] and not control.all_drained.is_set()
        control.set_cut(41)
        with anyio.fail_after(5):
            await control.all_drained.wait()
    assert sorted(released) == [0, 1] and control.cut == 41 and control.stopping
