"""The splice protocol's KV loops against a real nats-server's KV: an owner that finds another
process's claim (written with a compare-and-set on the server's revision) stops serving
instead of overwriting it. The other operator-side loops run on the in-memory transport in
tests/unit/test_splice_operator_loops.py, the decisions on a fake clock in
tests/unit/test_splice_protocol_steps.py; tests/integration/test_unsplice.py runs a whole
splice and unsplice on the server.
"""

from __future__ import annotations

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
from rftstream.control.splice import operator_side as splice
from rftstream.control.splice.protocol import Timing
from rftstream.errors import RftError
from rftstream.subjects import KV_STAGE
from tests.kv_json import json_entry, read_json, update_json, write_json

pytestmark = pytest.mark.integration

STAGE = "filtered"
TIMING = Timing(owner_refresh_s=0.3)  # the owner refreshes its claim every 0.3 s


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


def with_state(nats_url: str, body: Callable[[RunState], Awaitable[None]]) -> None:
    async def main() -> None:
        nc = await nats.connect(nats_url)
        try:
            transport = JetStreamTransport(nc, retry_window=5.0, max_inflight_bytes=1 << 20)
            await body(RunState(await transport.kv("proto", create=True)))
        finally:
            await nc.close()

    anyio.run(main, backend="asyncio")


def test_an_owner_taken_over_stops_serving_instead_of_overwriting(nats_url: str) -> None:
    async def body(state: RunState) -> None:
        key = KV_STAGE.format(stage=STAGE)
        await write_json(state, key, _stage_record(_owner(_dead_pid())))
        mine = (await splice.claim_stage(state, STAGE, "filter-a", TIMING)).owner
        assert mine.pid == os.getpid() and mine.actor == "filter-a"
        other = {**_owner(), "actor": "filter-b", "host": "elsewhere", "token": "b"}
        stopped = anyio.Event()

        async def serve() -> None:
            with pytest.raises(RftError, match="took the stage over") as err:
                await splice.refresh_owner(state, STAGE, mine, TIMING)
            assert "filter-b" in str(err.value) and "elsewhere" in str(err.value)
            stopped.set()

        with anyio.fail_after(20):  # it used to overwrite the other claim forever
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                await anyio.sleep(TIMING.owner_refresh_s * 1.5)  # it refreshed its claim
                refreshed = (await read_json(state, key))["owner"]
                assert refreshed["token"] == mine.token and refreshed["ts"] > mine.ts
                # another process took the stage over (it looked stale to that one)
                record, rev = await json_entry(state, key)
                assert await update_json(state, key, {**record, "owner": other}, rev)
                await stopped.wait()
        assert (await read_json(state, key))["owner"] == other  # not overwritten

    with_state(nats_url, body)
