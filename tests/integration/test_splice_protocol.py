"""The splice protocol's KV side against a real nats-server, one party at a time: the other
parties (trainer, owner, `--unsplice`) are played by the test writing their KV records.

What is checked: ``--unsplice`` gives up (with the restart command) when the stage's owner is
gone in any state and when the run ended; a request a trainer claimed is waited for on both
the splice and the unsplice side; an owner that finds another process's claim stops serving
instead of overwriting it. The decisions themselves (on a fake clock) are unit-tested in
tests/unit/test_splice_protocol_steps.py; these prove the KV loops around them.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
import pytest

from rftstream.bus.jetstream import JetStreamTransport
from rftstream.bus.state import RunState
from rftstream.errors import RftError
from rftstream.splice import operator_side as splice
from rftstream.splice.protocol import DEFAULT_TIMING, Claim
from rftstream.subjects import KV_SPLICE, KV_STAGE, KV_STATUS
from rftstream.wire import SPLICE, SpliceCut, SpliceRequested

pytestmark = pytest.mark.integration

STAGE = "filtered"


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def _owner(pid: int | None = None, token: str = "t0") -> dict[str, Any]:
    return {
        "actor": "filter",
        "pid": pid or os.getpid(),
        "host": socket.gethostname(),
        "ts": time.time(),
        "token": token,
    }


def _stage_record(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "operator": "reward_filter",
        "args": {"threshold": 0.5},
        "from_stage": "train",
        "to_stage": STAGE,
        "durable": "op_train_filtered",
        "start_seq": 5,
        "owner": owner,
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


def with_state(nats_url: str, body: Callable[[RunState], Awaitable[None]]) -> None:
    async def main() -> None:
        nc = await nats.connect(nats_url)
        try:
            transport = JetStreamTransport(nc, retry_window=5.0, max_inflight_bytes=1 << 20)
            await body(RunState(await transport.kv("proto", create=True)))
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")


@pytest.mark.parametrize("taken", ["requested", "claimed", "cut"])
def test_unsplice_gives_up_when_the_owner_died_after_taking_the_request(
    nats_url: str, taken: str
) -> None:
    async def body(state: RunState) -> None:
        await state.put_json(KV_STAGE.format(stage=STAGE), _stage_record(_owner(_dead_pid())))
        await state.put_json(KV_SPLICE, _unsplice(taken))
        with anyio.fail_after(20):  # it used to wait forever
            with pytest.raises(RftError) as err:
                await splice.wait_unsplice(state, "u1", STAGE)
        message = str(err.value)
        assert "stopped in the middle of removing itself" in message, message
        assert "--splice --to filtered" in message and repr(taken) in message, message
        assert (await state.get_json(KV_SPLICE))["state"] == taken  # left for the restart

    with_state(nats_url, body)


def test_unsplice_abandons_an_ask_whose_owner_died(nats_url: str) -> None:
    async def body(state: RunState) -> None:
        await state.put_json(KV_STAGE.format(stage=STAGE), _stage_record(_owner(_dead_pid())))
        await state.put_json(KV_SPLICE, _unsplice("asked"))
        with anyio.fail_after(20), pytest.raises(RftError, match="then retry"):
            await splice.wait_unsplice(state, "u1", STAGE)
        assert (await state.get_json(KV_SPLICE))["state"] == "abandoned"

    with_state(nats_url, body)


def test_unsplice_gives_up_when_the_run_ended(nats_url: str) -> None:
    async def body(state: RunState) -> None:
        await state.put_json(KV_STAGE.format(stage=STAGE), _stage_record(_owner()))  # alive: us
        await state.put_json(KV_SPLICE, _unsplice("cut"))
        await state.put_json(KV_STATUS, "finished")
        with anyio.fail_after(20), pytest.raises(RftError, match="the run is finished"):
            await splice.wait_unsplice(state, "u1", STAGE)

    with_state(nats_url, body)


def test_unsplice_reports_a_missing_trainer_while_the_request_waits_for_one(
    nats_url: str,
) -> None:
    async def body(state: RunState) -> None:
        await state.put_json(KV_STAGE.format(stage=STAGE), _stage_record(_owner()))
        await state.put_json(KV_SPLICE, _unsplice("claimed"))
        with anyio.fail_after(30), pytest.raises(splice.TrainerGone, match="restarted trainer"):
            await splice.wait_unsplice(state, "u1", STAGE, patience=0.1)
        assert (await state.get_json(KV_SPLICE))["state"] == "claimed"  # the owner's to keep

    with_state(nats_url, body)


def test_abandon_only_what_nobody_took(nats_url: str) -> None:
    async def body(state: RunState) -> None:
        assert await splice.abandon(state, "u1", "why") is None  # no request at all
        await state.put_json(KV_SPLICE, _unsplice("requested"))
        assert await splice.abandon(state, "other", "why") is None  # not that one
        assert await splice.abandon(state, "u1", "gone") == "abandoned"
        value = await state.get_json(KV_SPLICE)
        assert value["state"] == "abandoned" and value["reason"] == "gone"
        assert await splice.abandon(state, "u1", "again") == "abandoned"  # already
        await state.put_json(KV_SPLICE, _unsplice("claimed"))
        assert await splice.abandon(state, lambda r: r.to_stage == STAGE, "x") == "claimed"
        assert (await state.get_json(KV_SPLICE))["state"] == "claimed"

    with_state(nats_url, body)


class _Spy(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "a trainer claimed the request, then stopped" in record.getMessage():
            self.seen.set()


@pytest.mark.parametrize("kind", ["splice", "unsplice"])
def test_a_claimed_request_outlives_its_trainer_on_both_sides(nats_url: str, kind: str) -> None:
    """A trainer claims the request and dies; the requester keeps waiting (it does not give up
    with TrainerGone) and takes the answer of the trainer that comes back."""
    spy = _Spy()
    logging.getLogger("rftstream.splice").addHandler(spy)

    async def body(state: RunState) -> None:
        got: list[Any] = []

        async def requester() -> None:
            if kind == "splice":
                got.append(await splice.request_splice(state, "reward_filter", STAGE, patience=0.1))
            else:
                await state.put_json(KV_SPLICE, _unsplice("requested"))
                got.append(await splice.wait_unsplice_cut(state, "u1", STAGE, patience=0.1))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(requester)
                while True:  # the trainer: claim the request, then die (no heartbeat)
                    record, rev = await state.entry(SPLICE)
                    if isinstance(record, SpliceRequested):
                        assert await splice.apply(state, record, rev, Claim()) is not None
                        break
                    await anyio.sleep(0.05)
                await spy.seen.wait()  # the requester saw no trainer, and did not abandon it
                assert (await state.get_json(KV_SPLICE))["state"] == "claimed"
                value = await state.get_json(KV_SPLICE)  # a restarted trainer answers
                answer = {"state": "cut", "from_stage": "train", "start_seq": 7}
                await state.put_json(KV_SPLICE, {**value, **answer})
        assert len(got) == 1
        if kind == "splice":
            assert (got[0].from_stage, got[0].to_stage, got[0].start_seq) == ("train", STAGE, 7)
        else:
            assert isinstance(got[0], SpliceCut) and got[0].id == "u1"

    try:
        with_state(nats_url, body)
    finally:
        logging.getLogger("rftstream.splice").removeHandler(spy)


def test_an_owner_taken_over_stops_serving_instead_of_overwriting(nats_url: str) -> None:
    async def body(state: RunState) -> None:
        key = KV_STAGE.format(stage=STAGE)
        await state.put_json(key, _stage_record(_owner(_dead_pid())))
        mine = (await splice.claim_stage(state, STAGE, "filter-a")).owner
        assert mine.pid == os.getpid() and mine.actor == "filter-a"
        other = {**_owner(), "actor": "filter-b", "host": "elsewhere", "token": "b"}
        stopped = anyio.Event()

        async def serve() -> None:
            with pytest.raises(RftError, match="took the stage over") as err:
                await splice.refresh_owner(state, STAGE, mine)
            assert "filter-b" in str(err.value) and "elsewhere" in str(err.value)
            stopped.set()

        with anyio.fail_after(20):  # it used to overwrite the other claim forever
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                await anyio.sleep(DEFAULT_TIMING.owner_refresh_s * 1.5)  # it refreshed its claim
                refreshed = (await state.get_json(key))["owner"]
                assert refreshed["token"] == mine.token and refreshed["ts"] > mine.ts
                # another process took the stage over (it looked stale to that one)
                record, rev = await state.get_entry(key)
                assert await state.compare_and_put(key, {**record, "owner": other}, rev)
                await stopped.wait()
        assert (await state.get_json(key))["owner"] == other  # not overwritten

    with_state(nats_url, body)
