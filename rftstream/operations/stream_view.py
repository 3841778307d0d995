"""Reading a run from outside: stream/consumer figures and tailing a stage.

Used by ``rftstream streams`` and ``rftstream tail``; what they show is what
``nats stream info`` / ``nats consumer info`` / ``nats sub`` show, decoded.
Both only read: no consumer they create is durable, nothing is acked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rftstream.bus.client import Bus
from rftstream.errors import BusError, StreamNotFound
from rftstream.presentation.message_summaries import summarize_message


@dataclass
class ConsumerRow:
    name: str
    filter: str
    pending: int  # not yet delivered ("lag")
    ack_pending: int  # delivered, not yet acked
    redelivered: int
    description: str  # who reads and why (an ephemeral reader's name is the server's)
    durable: bool = True


@dataclass
class StreamRow:
    name: str
    description: str
    messages: int
    bytes: int
    subjects: dict[str, int]
    consumers: list[ConsumerRow] = field(default_factory=list)
    missing: bool = False


async def streams_report(bus: Bus) -> list[StreamRow]:
    """Every stream of the run with per-subject depths and each consumer's lag."""
    rows = []
    for name in bus.names.streams:
        try:
            info = await bus.stream_state(name, subjects_filter=">")
        except StreamNotFound:
            rows.append(StreamRow(name, "(not created yet)", 0, 0, {}, missing=True))
            continue
        row = StreamRow(
            name=name,
            description=info.description,
            messages=info.messages,
            bytes=info.bytes,
            subjects=dict(sorted(info.subjects.items())),
        )
        for c in await bus.consumers(name):
            row.consumers.append(
                ConsumerRow(
                    name=c.name,
                    filter=c.filter_subject,
                    pending=c.num_pending,
                    ack_pending=c.num_ack_pending,
                    redelivered=c.num_redelivered,
                    description=c.description,
                    durable=c.durable,
                )
            )
        rows.append(row)
    return rows


async def tail(
    bus: Bus,
    subject: str,
    *,
    lines: int,
    follow: bool,
    emit: Callable[[dict[str, Any]], None],
    idle_timeout: float = 1.0,
) -> int:
    """Print the last ``lines`` messages on ``subject``, then (``follow``) new ones.

    An ordered, ephemeral consumer reads from the stream's start; only the last
    ``lines`` are kept until it has caught up. Blocks; returns the number of
    messages emitted when not following (cancel it to stop following).
    """
    try:
        reader = await bus.read(
            None,
            subject,
            description=f"rftstream tail of run {bus.names.run} ({bus.actor}): reads {subject}, "
            "acks nothing",
        )
    except StreamNotFound as exc:
        raise BusError(
            f"{bus.actor}: no stream holds {subject} on this server: the run "
            f"{bus.names.run!r} does not exist there, or the credentials belong to another "
            "account"
        ) from exc
    recent: deque[dict[str, Any]] = deque(maxlen=max(lines, 0) or None)
    emitted = 0
    caught_up = False

    def flush() -> None:
        nonlocal emitted
        for item in recent:
            emit(item)
            emitted += 1
        recent.clear()

    try:
        while True:
            msg = await reader.next(idle_timeout)
            if msg is None:
                if not caught_up:
                    caught_up = True
                    flush()
                if not follow:
                    return emitted
                continue
            md = msg.metadata
            item = summarize_message(msg.subject, md.sequence.stream, msg.headers, msg.data)
            if caught_up:
                emit(item)
                emitted += 1
            else:
                recent.append(item)
                if md.num_pending == 0:
                    caught_up = True
                    flush()
                    if not follow:
                        return emitted
    finally:
        await reader.close()
