"""Publishes that fail for NATS reasons, injected into a :class:`Bus` (unit and integration
tests of the operator host and the explorer giving work back on a publish failure)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rftstream.bus.client import Bus
from rftstream.errors import BusError
from rftstream.experience import H_MSG_ID, decode_group

FAILS = 2  # attempts of each second part that fail


def flaky_publish(bus: Bus, stage: str) -> list[str]:
    """Make ``bus`` fail the first ``FAILS`` publishes of every part ``#1`` to ``exp.<stage>``
    (as the bus does after its own retries); returns the ids it failed, one per failure."""
    real = bus._publish_sized  # where every publish goes (publish_group's parts too)
    subject = bus.names.exp_subject(stage)
    attempts: Counter[str] = Counter()
    failed: list[str] = []

    async def publish(subj: str, data: bytes, hdrs: dict[str, str] | None, *a: Any) -> Any:
        msg_id = (hdrs or {}).get(H_MSG_ID)
        if subj == subject and msg_id is not None and msg_id.endswith("#1"):
            attempts[msg_id] += 1
            if attempts[msg_id] <= FAILS:
                failed.append(msg_id)
                raise BusError(f"{bus.actor}: publish to {subj} timed out 6 times (injected)")
        return await real(subj, data, hdrs, *a)

    bus._publish_sized = publish  # type: ignore[method-assign]
    return failed


def stored_once(msgs: list[Any]) -> list[str]:
    """Every experience uid on ``msgs``, checking that no message id is stored twice."""
    ids = [m.headers[H_MSG_ID] for m in msgs]
    assert len(ids) == len(set(ids)), ids
    return [e.eid.uid for m in msgs for e in decode_group(m.data)]
