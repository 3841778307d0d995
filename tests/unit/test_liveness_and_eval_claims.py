"""The control plane's heartbeat and eval-claim protocols: the live-name check as a pure
machine (no bus, no clock), its loop waking at a heartbeat's write, and one evaluator per
step on the in-memory bus."""

from __future__ import annotations

import time

import anyio
import pytest

from rftstream.bus.memory import MemoryTransport
from rftstream.bus.state import RunState
from rftstream.control.eval_claim import claim_eval, eval_claim_key, release_eval
from rftstream.control.liveness import (
    LIVE_HEARTBEAT_S,
    NameVerdict,
    name_verdict,
    refuse_a_live_name,
)
from rftstream.errors import RftError
from rftstream.wire import EVAL_FINAL, EvalClaim, Heartbeat

pytestmark = pytest.mark.anyio


def test_name_verdicts() -> None:
    now, until = 1000.0, 1006.0
    assert name_verdict(None, None, now, until) is NameVerdict.FREE  # nobody had it
    old = now - LIVE_HEARTBEAT_S - 1
    assert name_verdict(old, old, now, until) is NameVerdict.FREE  # long dead
    young = now - 2
    assert name_verdict(young, young, now, until) is NameVerdict.WATCH
    assert name_verdict(young, young + 5, now, until) is NameVerdict.TAKEN  # written again
    assert name_verdict(young, young, until, until) is NameVerdict.FREE  # watched, silent
    assert name_verdict(young, None, now, until) is NameVerdict.WATCH  # gone meanwhile
    assert name_verdict(now + 60, now + 60, now, until) is NameVerdict.FREE  # from the future


async def _state() -> RunState:
    return RunState(await MemoryTransport().kv("KV_t", create=True))


async def test_the_name_check_wakes_at_the_heartbeats_write_not_at_the_watch_end() -> None:
    state = await _state()
    await state.heartbeat(Heartbeat(actor="op", role="operator", ts=time.time()))

    async def beat_once() -> None:
        await anyio.sleep(0.2)
        await state.heartbeat(Heartbeat(actor="op", role="operator", ts=time.time() + 1))

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat_once)
        with pytest.raises(RftError, match="'op' is taken"):
            await refuse_a_live_name(state, "op", "operator", watch_s=30.0)
    assert time.monotonic() - t0 < 5.0  # woke at the write, long before the 30 s watch


async def test_one_explorer_claims_each_evaluation_and_a_failed_one_releases_it() -> None:
    state = await _state()
    key = eval_claim_key(4, final=False)
    assert key.name == "eval.step.4"
    assert eval_claim_key(4, final=True) is EVAL_FINAL
    assert eval_claim_key(4, final=False, claim_key="bench.step.4").name == "bench.step.4"
    first = EvalClaim(by="explorer_0", step=4, model_version=3, ts=1.0)
    second = EvalClaim(by="explorer_1", step=4, model_version=3, ts=1.0)
    assert await claim_eval(state, key, first)
    assert not await claim_eval(state, key, second)  # taken
    await release_eval(state, key, "explorer_0")  # its evaluation failed
    assert await claim_eval(state, key, second)
    assert (await state.get(key)) == second
