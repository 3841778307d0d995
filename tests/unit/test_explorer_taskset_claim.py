"""The explorer's taskset claim while it publishes: each progress record is a conditional
KV write on the claim's revision.

A lost race or a rejected write means another explorer has the claim: the explorer
goes back to claiming (here it then finds the taskset published and stops). Any other
failure of the write (a timeout) propagates as the error it is. Logic above the bus:
the run state is a stand-in with the methods the publishing reads, scripted per call.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from rftstream.config.schema import Config
from rftstream.errors import BusError
from rftstream.messages import TaskMsg, TasksetClaim, TasksetRecord
from rftstream.subjects import KV_TASKSET, KV_TASKSET_CLAIM, RunNames

pytestmark = pytest.mark.anyio

TASKS = 100  # the built-in arithmetic taskset, one epoch: progress records at 64 and 100


class State:
    """``compare_and_put`` answers from ``outcomes`` in turn (an int: the new revision; None:
    another writer was first; an exception: raised)."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.kv = None
        self.outcomes = list(outcomes)
        self.writes: list[tuple[str, int | None, int]] = []  # key, expected revision, seq
        self.record: TasksetRecord | None = None
        self.taskset_reads = 0

    async def taskset(self) -> TasksetRecord | None:
        self.taskset_reads += 1
        if self.taskset_reads > 1 and self.record is None:  # another explorer finished it
            return TasksetRecord(count=TASKS, epochs=1, rows=TASKS, by="other", ts=0.0)
        return self.record

    async def compare_and_put(self, key: str, value: Any, revision: int | None) -> int | None:
        assert isinstance(value, TasksetClaim) and value.by == "me"
        self.writes.append((key, revision, value.seq))
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    async def put_json(self, key: str, value: Any) -> None:
        assert key == KV_TASKSET
        self.record = value


def _explorer() -> tuple[Any, list[TaskMsg]]:
    from rftstream.actors.explorer import Explorer

    explorer = Explorer(
        Config(),
        SimpleNamespace(names=RunNames("claim")),  # type: ignore[arg-type]
        model_path="unused",
        name="me",
    )
    explorer.claim_keepalive_s = 3600.0  # only the publishing's own progress records
    published: list[TaskMsg] = []

    async def publish(msg: TaskMsg) -> None:
        published.append(msg)

    explorer._publish_task = publish
    return explorer, published


def _wrapped(cause: Exception) -> BusError:
    """A BusError as RunState.compare_and_put raises it: from the KV write's error."""
    try:
        raise BusError(
            f"KV bucket/{KV_TASKSET_CLAIM}: conditional write failed: {cause}"
        ) from cause
    except BusError as exc:
        return exc


async def test_progress_advances_the_claim_revision() -> None:
    explorer, published = _explorer()
    state = State([7, 8, 9])
    await explorer.publish_taskset(state)
    assert state.writes == [
        (KV_TASKSET_CLAIM, None, 0),  # the claim: only if absent
        (KV_TASKSET_CLAIM, 7, 64),
        (KV_TASKSET_CLAIM, 8, TASKS),
    ]
    assert len(published) == TASKS
    assert state.record is not None and state.record.by == "me" and state.record.count == TASKS


@pytest.mark.parametrize(
    "lost",
    [
        None,  # another writer was first
        _wrapped(nats.js.errors.APIError(code=503, err_code=10077, description="rejected")),
    ],
    ids=["lost-race", "rejected-write"],
)
async def test_a_lost_claim_goes_back_to_claiming(lost: Any) -> None:
    explorer, published = _explorer()
    state = State([7, lost])
    await explorer.publish_taskset(state)  # claims again: finds the taskset published
    assert state.writes == [(KV_TASKSET_CLAIM, None, 0), (KV_TASKSET_CLAIM, 7, 64)]
    assert state.taskset_reads == 2
    assert len(published) == 64  # stopped publishing at the lost claim
    assert state.record is None  # the record is not this explorer's to write


async def test_a_timeout_propagates_as_itself() -> None:
    explorer, published = _explorer()
    state = State([7, _wrapped(nats.errors.TimeoutError())])
    with pytest.raises(nats.errors.TimeoutError):
        await explorer.publish_taskset(state)
    assert state.writes == [(KV_TASKSET_CLAIM, None, 0), (KV_TASKSET_CLAIM, 7, 64)]
    assert state.taskset_reads == 1 and state.record is None
