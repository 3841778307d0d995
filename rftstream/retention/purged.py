"""The ledger of purged experience: what :func:`rftstream.retention.limits.purge_acked` removed.

The run's account (:mod:`rftstream.operations.account`) counts experiences by id from
what the experience stream holds. Purging acked experience
(``nats.streams.experience.purge_acked``) removes the oldest part of each
subject, so before purging a subject below a sequence the purger records, in
the run's KV bucket under ``purged.<stage>``, a cumulative
:class:`PurgedPrefix`: every message of ``exp.<stage>`` below ``below_seq`` is
(or is about to be) purged, how many messages that was, how many experiences
they carried (their ``Rft-Count`` header, read headers-only) and how many
carried no count (not an experience group: malformed).

The record is written *before* the purge: a purger that dies in between leaves
a record whose prefix is still partly stored, and the account ignores stored
messages below ``below_seq`` (they were counted). Several purgers of one
subject serialize on the key's revision (compare-and-put); each adds only the
messages at or above the sequence the record it replaces ends at.

A stage whose reader changed at a splice's cut (:mod:`rftstream.retention.reader_history`)
was read by two parties; the record also keeps its counts below each such cut
(``splits``), so the account can tell what each reader was given.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from rftstream.bus.state import RunState
from rftstream.bus.transport import Transport
from rftstream.errors import BusError
from rftstream.headers import H_COUNT
from rftstream.wire import Key

#: KV key prefix of the purge records: ``purged.<stage>``
PURGED_PREFIX = "purged."
_READ_IDLE_S = 2.0  # an ordered headers-only read that delivers nothing this long is done
_CAS_TRIES = 20


class PurgedPrefix(msgspec.Struct, frozen=True):
    """Every message of one stage's subject below ``below_seq``: gone (or going) from the stream.

    ``experiences`` sums their ``Rft-Count`` headers; ``malformed`` counts those without one.
    ``splits``: for a sequence at which the stage changed reader (a splice's cut), the
    ``(messages, experiences, malformed)`` below it.
    """

    below_seq: int = 1
    messages: int = 0
    experiences: int = 0
    malformed: int = 0
    splits: dict[int, tuple[int, int, int]] = msgspec.field(default_factory=dict)

    def below(self, seq: int) -> tuple[int, int, int] | None:
        """``(messages, experiences, malformed)`` of the purged messages below ``seq``
        (None: a cut this record did not keep, recorded after the purge passed it)."""
        if seq >= self.below_seq:
            return (self.messages, self.experiences, self.malformed)
        if seq <= 1:
            return (0, 0, 0)
        return self.splits.get(seq)


#: the KV record of one stage's purge: ``PURGED.of(stage=...)``
PURGED: Key[PurgedPrefix] = Key(PURGED_PREFIX + "{stage}", PurgedPrefix)


def extend(
    prev: PurgedPrefix,
    rows: Sequence[tuple[int, int | None]],
    point: int,
    cuts: Sequence[int] = (),
) -> PurgedPrefix:
    """``prev`` extended to every message below ``point``: ``rows`` are ``(seq, count)`` of
    the subject's stored messages (``count`` None: no ``Rft-Count``); only those at or above
    ``prev.below_seq`` and below ``point`` are added. ``cuts``: the sequences at which the
    stage changed reader; each one from ``prev.below_seq`` to ``point`` gets its split. Pure."""
    if point <= prev.below_seq:
        return prev
    new = [(seq, n) for seq, n in rows if prev.below_seq <= seq < point]

    def totals(below: int) -> tuple[int, int, int]:
        part = [n for seq, n in new if seq < below]
        return (
            prev.messages + len(part),
            prev.experiences + sum(n for n in part if n is not None),
            prev.malformed + sum(1 for n in part if n is None),
        )

    splits = dict(prev.splits)
    splits.update({c: totals(c) for c in cuts if prev.below_seq <= c <= point and c > 1})
    messages, experiences, malformed = totals(point)
    return PurgedPrefix(point, messages, experiences, malformed, splits)


def _count(headers: dict[str, str] | None) -> int | None:
    raw = (headers or {}).get(H_COUNT, "")
    return int(raw) if raw.isdigit() else None


async def read_counts(
    transport: Transport, stream: str, subject: str, start: int, point: int
) -> list[tuple[int, int | None]]:
    """``(seq, Rft-Count)`` of the messages of ``subject`` from ``start`` to below ``point``,
    read headers-only by an ordered ephemeral consumer (bodies are never sent). Blocks for
    one consumer's life, plus ``_READ_IDLE_S`` when no message of the subject is at or
    after ``start`` (the read ends when none comes for that long)."""
    reader = await transport.read(
        stream,
        subject,
        start_seq=max(1, start),
        headers_only=True,
        description=f"purge ledger: counts the experiences of {subject} below sequence {point} "
        "before they are purged (headers only)",
    )
    rows: list[tuple[int, int | None]] = []
    try:
        while True:
            msg = await reader.next(_READ_IDLE_S)
            if msg is None:
                break  # nothing at or after `start` on the subject (or nothing more)
            seq = int(msg.metadata.sequence.stream)
            if seq >= point:
                break
            rows.append((seq, _count(msg.headers)))
            if msg.metadata.num_pending == 0:
                break
    finally:
        await reader.close()
    return rows


async def record_purge(
    state: RunState,
    transport: Transport,
    stream: str,
    subject: str,
    stage: str,
    first_seq: int,
    point: int,
    stored: int,
    cuts: Sequence[int] = (),
) -> PurgedPrefix:
    """Record that ``exp.<stage>`` (``subject``) is purged below ``point``, before the purge.

    ``first_seq`` is the stream's first sequence and ``stored`` the subject's message count
    (0: nothing to read); ``cuts``: where the stage changed reader (see :func:`extend`). Retries a lost compare-and-put race with the winner's record.
    Returns the record written (or the newer one found). Raises :class:`BusError`.
    """
    key = PURGED.of(stage=stage)
    rows: list[tuple[int, int | None]] | None = None
    for _ in range(_CAS_TRIES):
        found, revision = await state.entry(key)
        prev = found or PurgedPrefix()
        if point <= prev.below_seq:
            return prev
        start = max(prev.below_seq, first_seq)
        if rows is None or (rows and rows[0][0] > start):
            rows = await read_counts(transport, stream, subject, start, point) if stored else []
        new = extend(prev, rows, point, cuts)
        if await state.cas(key, new, revision) is not None:
            return new
    raise BusError(f"KV key {key.name}: {_CAS_TRIES} purgers raced to record {subject}; gave up")


async def read_purged(state: RunState) -> dict[str, PurgedPrefix]:
    """Every stage's purge record (empty when nothing was ever purged)."""
    out: dict[str, PurgedPrefix] = {}
    for key in await state.keys(PURGED_PREFIX):
        stage = key[len(PURGED_PREFIX) :]
        record = await state.get(PURGED.of(stage=stage))
        if record is not None:
            out[stage] = record
    return out
