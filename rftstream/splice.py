"""Splicing an operator in front of the trainer while a run goes on.

``rftstream operator NAME --splice`` puts a new stage between the stage the
trainer reads and the trainer, without losing an experience or training one
twice. The protocol lives in the run's KV bucket:

``splice``
    The one splice in flight. The operator writes ``{"id", "state":
    "requested", "operator", "to_stage"}``; the trainer answers by rewriting it
    with ``"state": "cut"``, ``"from_stage"`` (what it read until now) and
    ``"start_seq"``.
``trainer.input``
    ``{"stage", "consumer", "since_seq"}``: the stage the trainer reads now
    (absent: ``train`` through the durable ``trainer``).
``topology``
    ``[{"from", "to", "by", "ts"}, ...]``: every splice so far, for
    ``rftstream status``.

The cut: between two fetches the trainer stops reading its consumer and takes
``S``, the last stream sequence that consumer delivered. Everything after
``S`` on the old stage belongs to the new operator, whose durable starts at
``S + 1``; the trainer reads the new stage from then on. Messages up to ``S``
stay the trainer's: those it holds are trained and acked as usual, and one
delivered but lost in transit comes back to the old (now retired) consumer,
which the trainer keeps draining until its ack floor reaches ``S``, then
deletes. So each message is trained (or filtered) exactly once.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import anyio

from rftstream.bus.state import RunState
from rftstream.errors import RftError
from rftstream.subjects import TRAIN_STAGE, check_stage

KV_SPLICE = "splice"
KV_TRAINER_INPUT = "trainer.input"
KV_TOPOLOGY = "topology"


def trainer_durable(stage: str) -> str:
    """The trainer's durable consumer on ``stage`` (``trainer`` on ``train``)."""
    return "trainer" if stage == TRAIN_STAGE else f"trainer_{stage}"


@dataclass(frozen=True)
class SpliceCut:
    """Where a spliced operator takes over: ``exp.<from_stage>`` from ``start_seq`` on."""

    id: str
    from_stage: str
    to_stage: str
    start_seq: int


async def trainer_input(state: RunState) -> tuple[str, str]:
    """``(stage, durable)`` the trainer reads now."""
    value = await state.get_json(KV_TRAINER_INPUT)
    if isinstance(value, dict) and value.get("stage"):
        return str(value["stage"]), str(value.get("consumer") or trainer_durable(value["stage"]))
    return TRAIN_STAGE, trainer_durable(TRAIN_STAGE)


async def pending_request(state: RunState) -> dict[str, Any] | None:
    """The splice request waiting for the trainer, if any."""
    value = await state.get_json(KV_SPLICE)
    if isinstance(value, dict) and value.get("state") == "requested":
        return value
    return None


async def answer_request(
    state: RunState, request: dict[str, Any], from_stage: str, start_seq: int, consumer: str
) -> None:
    """Trainer side: record the cut, the trainer's new input and the topology edge."""
    to_stage = str(request["to_stage"])
    now = time.time()
    await state.put_json(
        KV_TRAINER_INPUT, {"stage": to_stage, "consumer": consumer, "since_seq": 0}
    )
    topology = await state.get_json(KV_TOPOLOGY)
    edges = list(topology) if isinstance(topology, list) else []
    edges.append({"from": from_stage, "to": to_stage, "by": request.get("operator"), "ts": now})
    await state.put_json(KV_TOPOLOGY, edges)
    await state.put_json(
        KV_SPLICE,
        {
            **request,
            "state": "cut",
            "from_stage": from_stage,
            "start_seq": int(start_seq),
            "ts_cut": now,
        },
    )


async def request_splice(
    state: RunState, operator: str, to_stage: str, *, timeout: float = 120.0
) -> SpliceCut:
    """Operator side: ask the trainer to cut over to ``to_stage``; wait for its answer.

    Blocks (polling the KV bucket) until the trainer has switched, at most
    ``timeout`` s; raises :class:`RftError` naming the run's state when no
    trainer answers (none running) or another splice is in flight.
    """
    check_stage(to_stage)
    current, _ = await trainer_input(state)
    if to_stage == current:
        raise RftError(f"the trainer already reads exp.{to_stage}; choose another --to stage")
    value = await state.get_json(KV_SPLICE)
    if isinstance(value, dict) and value.get("state") == "requested":
        age = time.time() - float(value.get("ts", 0))
        if age < timeout:
            raise RftError(
                f"another splice ({value.get('operator')} -> exp.{value.get('to_stage')}) is "
                f"waiting for the trainer since {age:.0f}s; try again when it is done"
            )
    request = {
        "id": uuid.uuid4().hex[:12],
        "state": "requested",
        "operator": operator,
        "to_stage": to_stage,
        "ts": time.time(),
    }
    await state.put_json(KV_SPLICE, request)
    with anyio.move_on_after(timeout):
        while True:
            value = await state.get_json(KV_SPLICE)
            if isinstance(value, dict) and value.get("id") == request["id"]:
                if value.get("state") == "cut":
                    return SpliceCut(
                        id=request["id"],
                        from_stage=str(value["from_stage"]),
                        to_stage=to_stage,
                        start_seq=int(value["start_seq"]),
                    )
            elif value is not None:
                raise RftError(f"the splice request was replaced by another: {value}")
            await anyio.sleep(0.2)
    await state.put_json(KV_SPLICE, {**request, "state": "abandoned"})
    raise RftError(
        f"no trainer answered the splice request within {timeout:.0f}s "
        f"(run status {await state.status()!r}); is the run's trainer running?"
    )
