"""Who read each stage of the experience stream, stream sequence by stream sequence.

A durable consumer that nobody splices (the operator host's ``op_raw_to_train``, a
standalone ``rftstream operator --from raw --to long``) reads its stage from the first
message to the last. The *chain* in front of the trainer is different: splicing an
operator in (``rftstream operator --splice --to filtered``) hands every message of the
trainer's stage from a cut on to that operator, and the trainer reads ``exp.filtered``
instead; removing it hands the stage back at another cut. The trainer records every such
change in the KV list ``topology`` (:class:`~rftstream.wire.TopologyEdge`, whose ``seq``
is the first stream sequence of the new reader), and :func:`reader_segments` turns that
list into who read what:

* a splice ``from S to T at k``: ``exp.S`` from ``k`` on is read by the operator writing
  ``T``, and ``exp.T`` by the trainer;
* an unsplice (recorded ``from T to S at u``): ``exp.S`` from ``u`` on is read by the
  trainer again (it also drains what the operator had written on ``exp.T``).

The stream's sequences are shared by all its subjects, so the cuts of one stage and the
sequences of another compare directly. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rftstream.wire import TopologyEdge

#: the reader name of the trainer (a segment's ``reader`` is otherwise the stage written)
TRAINED = "trained"


@dataclass(frozen=True)
class Segment:
    """Stream sequences ``lo`` up to (not including) ``hi`` of ``exp.<stage>``, read by
    ``reader``: the stage its operator writes, or :data:`TRAINED` (``hi`` None: on to the
    end)."""

    stage: str
    reader: str
    lo: int
    hi: int | None = None

    def holds(self, seq: int) -> bool:
        return self.lo <= seq and (self.hi is None or seq < self.hi)


def reader_segments(
    static: Iterable[tuple[str, str]], trainer_stage: str | None, edges: Sequence[TopologyEdge]
) -> dict[tuple[str, str], list[Segment]]:
    """Every reader of the experience stream, ``(stage, reader)``, with the sequences it read.

    ``static``: the ``(from, to)`` of durables no splice moved (each reads its whole stage);
    a pair that a splice edge names belongs to the chain instead. ``trainer_stage``: the
    stage the trainer reads when ``edges`` (the ``topology`` list, oldest first) is empty
    (None: no trainer). With edges, the trainer began on the first edge's ``from``.
    """
    spliced = {(e.from_stage, e.to_stage) for e in edges if e.op == "splice"}
    out: dict[tuple[str, str], list[Segment]] = {}
    for stage, reader in static:
        if (stage, reader) not in spliced:
            out[(stage, reader)] = [Segment(stage, reader, 0)]
    first = edges[0].from_stage if edges else trainer_stage
    if first is None:
        return out
    # the chain's readers of each stage, as (first sequence, reader) in the order recorded
    changes: dict[str, list[tuple[int, str]]] = defaultdict(list)
    changes[first].append((0, TRAINED))
    for e in edges:
        if e.op == "splice":
            changes[e.from_stage].append((e.seq, e.to_stage))
            if not changes[e.to_stage] or changes[e.to_stage][-1][1] != TRAINED:
                changes[e.to_stage].append((e.seq, TRAINED))
        else:  # recorded from the removed stage back to the stage read again
            changes[e.to_stage].append((e.seq, TRAINED))
    for stage, points in changes.items():
        for (lo, reader), nxt in zip(points, [*points[1:], None], strict=True):
            hi = None if nxt is None else nxt[0]
            if hi is not None and hi <= lo:
                continue  # replaced at once (or recorded out of order): read nothing
            segments = out.setdefault((stage, reader), [])
            if segments and segments[-1].hi == lo:  # the same reader on: one segment
                segments[-1] = Segment(stage, reader, segments[-1].lo, hi)
            else:
                segments.append(Segment(stage, reader, lo, hi))
    return out


def cut_seqs(edges: Sequence[TopologyEdge], stage: str) -> list[int]:
    """The stream sequences at which ``exp.<stage>`` changed reader (sorted, distinct),
    the splice that gave a new stage its first reader included."""
    cuts = {e.seq for e in edges if e.op == "splice" and stage in (e.from_stage, e.to_stage)}
    cuts |= {e.seq for e in edges if e.to_stage == stage and e.op == "unsplice"}
    return sorted(cuts)


def holds(segments: Sequence[Segment], seq: int) -> bool:
    """Whether one of ``segments`` holds stream sequence ``seq``."""
    return any(s.holds(seq) for s in segments)


def durable_range(segments: Sequence[Segment], ack_floor: int) -> Segment | None:
    """The segment a live durable of this reader serves: the last one beginning at or before
    the sequence after its ack floor (a durable starts with its floor just below its first
    sequence; past its segment's end it acks only messages it hands on, the trainer's
    retired durable those after its cut). A floor below every segment: the first."""
    before = [s for s in segments if s.lo <= ack_floor + 1]
    if before:
        return before[-1]
    return segments[0] if segments else None
