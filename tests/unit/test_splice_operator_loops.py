"""The splice protocol's operator-side loops (:mod:`rftstream.control.splice.operator_side`) on the
in-memory transport's KV, one party at a time: the other parties (trainer, owner,
``--unsplice``) are played by the test writing their KV records, on a shortened
:class:`~rftstream.control.splice.protocol.Timing`.

What is checked: ``--unsplice`` gives up (with the restart command) when the stage's owner is
gone in any state and when the run ended; an ask nobody took is abandoned; a request a trainer
claimed is waited for on both the splice and the unsplice side. The decisions themselves (on a
fake clock) are unit-tested in test_splice_protocol_steps.py; the loops against nats-server's
KV in tests/integration/test_splice_protocol.py.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import anyio
import pytest

from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.control.splice import operator_side as splice
from rftstream.control.splice.protocol import Claim, Timing
from rftstream.errors import RftError
from rftstream.subjects import KV_SPLICE, KV_STAGE, KV_STATUS
from rftstream.wire import SPLICE, SpliceCut, SpliceRequested
from tests.kv_json import read_json, write_json

pytestmark = pytest.mark.anyio

STAGE = "filtered"
FAST = Timing(check_every_s=0.02)  # a waiting party reads status and heartbeat every 20 ms


def _owner(*, alive: bool) -> dict[str, Any]:
    """This process (alive), or a process on another host not seen for hours (gone)."""
    if alive:
        return {"actor": "filter", "pid": os.getpid(), "host": socket.gethostname()}
    return {"actor": "filter", "pid": 1, "host": "elsewhere", "ts": 0.0, "token": "t0"}


def _stage_record(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "operator": "reward_filter",
        "args": {"threshold": 0.5},
        "from_stage": "train",
        "to_stage": STAGE,
        "durable": "op_train_filtered",
        "start_seq": 5,
        "owner": {"ts": time.time(), "token": "t0", **owner},
    }


def _unsplice(state_: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": "u1",
        "kind": "unsplice",
        "state": state_,
        "operator": "reward_filter",
        "from_stage": "train",
        "to_stage": STAGE,
        "cut_seq": 9,
        "ts": time.time(),
        **extra,
    }


async def _state(stage_owner_alive: bool | None = None) -> RunState:
    """A fresh bucket; with a ``stage.filtered`` record owned by a live or gone process."""
    state = RunState(await MemoryTransport().kv("proto", create=True))
    if stage_owner_alive is not None:
        owner = _owner(alive=stage_owner_alive)
        await write_json(state, KV_STAGE.format(stage=STAGE), _stage_record(owner))
    return state


@pytest.mark.parametrize("taken", ["requested", "claimed", "cut"])
async def test_unsplice_gives_up_when_the_owner_died_after_taking_the_request(taken: str) -> None:
    state = await _state(stage_owner_alive=False)
    await write_json(state, KV_SPLICE, _unsplice(taken))
    with anyio.fail_after(5), pytest.raises(RftError) as err:  # it used to wait forever
        await splice.wait_unsplice(state, "u1", STAGE, timing=FAST)
    message = str(err.value)
    assert "stopped in the middle of removing itself" in message, message
    assert "--splice --to filtered" in message and repr(taken) in message, message
    assert (await read_json(state, KV_SPLICE))["state"] == taken  # left for the restart


async def test_unsplice_abandons_an_ask_whose_owner_died() -> None:
    state = await _state(stage_owner_alive=False)
    await write_json(state, KV_SPLICE, _unsplice("asked"))
    with anyio.fail_after(5), pytest.raises(RftError, match="then retry"):
        await splice.wait_unsplice(state, "u1", STAGE, timing=FAST)
    assert (await read_json(state, KV_SPLICE))["state"] == "abandoned"


async def test_unsplice_gives_up_when_the_run_ended() -> None:
    state = await _state(stage_owner_alive=True)
    await write_json(state, KV_SPLICE, _unsplice("cut"))
    await write_json(state, KV_STATUS, "finished")
    with anyio.fail_after(5), pytest.raises(RftError, match="the run is finished"):
        await splice.wait_unsplice(state, "u1", STAGE, timing=FAST)


async def test_unsplice_reports_a_missing_trainer_while_the_request_waits_for_one() -> None:
    state = await _state(stage_owner_alive=True)
    await write_json(state, KV_SPLICE, _unsplice("claimed"))
    with anyio.fail_after(5), pytest.raises(splice.TrainerGone, match="restarted trainer"):
        await splice.wait_unsplice(state, "u1", STAGE, patience=0.05, timing=FAST)
    assert (await read_json(state, KV_SPLICE))["state"] == "claimed"  # the owner's to keep


async def test_abandon_only_what_nobody_took() -> None:
    state = await _state()
    assert await splice.abandon(state, "u1", "why") is None  # no request at all
    await write_json(state, KV_SPLICE, _unsplice("requested"))
    assert await splice.abandon(state, "other", "why") is None  # not that one
    assert await splice.abandon(state, "u1", "gone") == "abandoned"
    value = await read_json(state, KV_SPLICE)
    assert value["state"] == "abandoned" and value["reason"] == "gone"
    assert await splice.abandon(state, "u1", "again") == "abandoned"  # already
    await write_json(state, KV_SPLICE, _unsplice("claimed"))
    assert await splice.abandon(state, lambda r: r.to_stage == STAGE, "x") == "claimed"
    assert (await read_json(state, KV_SPLICE))["state"] == "claimed"


class _Spy(logging.Handler):
    """Sets ``seen`` when the requester logs that a claimed request lost its trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "a trainer claimed the request, then stopped" in record.getMessage():
            self.seen.set()


@pytest.fixture
def spy() -> Any:
    handler = _Spy()
    logging.getLogger("rftstream.control.splice").addHandler(handler)
    yield handler
    logging.getLogger("rftstream.control.splice").removeHandler(handler)


@pytest.mark.parametrize("kind", ["splice", "unsplice"])
async def test_a_claimed_request_outlives_its_trainer_on_both_sides(kind: str, spy: _Spy) -> None:
    """A trainer claims the request and dies; the requester keeps waiting (it does not give up
    with TrainerGone) and takes the answer of the trainer that comes back."""
    state = await _state()
    got: list[Any] = []

    async def requester() -> None:
        if kind == "splice":
            cut = await splice.request_splice(
                state, "reward_filter", STAGE, patience=0.05, timing=FAST
            )
        else:
            await write_json(state, KV_SPLICE, _unsplice("requested"))
            cut = await splice.wait_unsplice_cut(state, "u1", STAGE, patience=0.05, timing=FAST)
        got.append(cut)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(requester)
            while True:  # the trainer: claim the request, then die (no heartbeat)
                record, rev = await state.entry(SPLICE)
                if isinstance(record, SpliceRequested):
                    assert await splice.apply(state, record, rev, Claim()) is not None
                    break
                await anyio.sleep(0.01)
            await spy.seen.wait()  # the requester saw no trainer, and did not abandon it
            value = await read_json(state, KV_SPLICE)
            assert value["state"] == "claimed" and not got
            answer = {"state": "cut", "from_stage": "train", "start_seq": 7}
            await write_json(state, KV_SPLICE, {**value, **answer})  # a restarted trainer answers
    assert len(got) == 1
    if kind == "splice":
        assert (got[0].from_stage, got[0].to_stage, got[0].start_seq) == ("train", STAGE, 7)
    else:
        assert isinstance(got[0], SpliceCut) and got[0].id == "u1"
