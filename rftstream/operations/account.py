"""The run's account: where every explored experience ended up.

:func:`account_run` reads the run's streams (every message on ``exp.>`` and
``dlq.>``, both kept by limits retention), its consumers' ack floors and the
trainer's last metrics record, and reconciles them per pipeline stage, by
experience id:

* ``explored``: the distinct experiences on ``exp.raw`` (plus the raw messages
  whose body is not an experience group: ``malformed``);
* for each reader of a stage (an operator durable ``op_<from>_to_<to>``, or the trainer),
  over the stream sequences it read (all of them, or, where a splice moved the stage
  between the trainer and an operator, those the KV ``topology`` gives it:
  :mod:`rftstream.retention.reader_history`):
  ``in`` (distinct experiences on ``exp.<from>``), ``out`` (those of them on
  ``exp.<to>``; for the trainer, what reached it, its rows together checked against its
  ``experience/trained_total``),
  ``dead`` (in messages dead-lettered from that stage: a ``dlq.*`` copy whose
  ``Rft-Dlq-Subject`` / ``Rft-Dlq-Stream-Seq`` name the original), ``pending``
  (in messages past the durable's ack floor that the server still counts unacked: after a
  server restart the floor can lag acks that landed, see :attr:`Durable.delivered`) and
  ``filtered`` (the rest: what
  the operators dropped);
* problems: an experience id twice on one subject (stored twice), one on a
  stage's output that is not on its input (from nowhere), a trainer that
  trained more than it was given (trained twice) or less (lost).

The identity ``trained + filtered + dead-lettered + pending = explored`` holds
when there is no problem (:attr:`RunAccount.balanced`). ``pending`` is exact
when the durables ack in order. While a run goes on, a trainer with resumable
checkpoints holds trained messages unacked until its next checkpoint: those are
pending at its stage and counted once, as trained (:attr:`RunAccount.trained_held`).

Pure reconciliation (:func:`reconcile`) is separate from reading NATS
(:func:`account_run`), which only reads: an ordered ephemeral consumer per
stream, nothing acked.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import ConsumerState
from rftstream.errors import BusError, SchemaError, StreamNotFound
from rftstream.experience import H_COUNT, decode_group_msg
from rftstream.retention.purged import PurgedPrefix, read_purged
from rftstream.retention.reader_history import (
    TRAINED,
    Segment,
    durable_range,
    holds,
    reader_segments,
)
from rftstream.subjects import META_TO_STAGE, RAW_STAGE, TRAIN_STAGE, reads_for_trainer
from rftstream.wire import (
    H_DLQ_REASON,
    H_DLQ_SEQ,
    H_DLQ_STAGE,
    H_DLQ_SUBJECT,
    TOPOLOGY,
    MetricsMsg,
    TopologyEdge,
)

TRAINED_TOTAL = "experience/trained_total"
log = logging.getLogger(__name__)

_READ_IDLE_S = 0.5  # an ordered consumer that delivers nothing for this long has caught up


@dataclass(frozen=True)
class StoredMessage:
    """One message of the experience stream, as far as the account needs it.

    ``uids`` is None for a body that is not an experience group (``error`` says why).
    """

    seq: int
    stage: str
    uids: tuple[str, ...] | None
    error: str = ""


@dataclass(frozen=True)
class DeadLetter:
    """One message of the dead-letter stream: where its original was, and why it died."""

    stage: str
    subject: str  # the original's subject
    seq: int | None  # the original's stream sequence (None: not a JetStream message)
    reason: str
    experiences: int | None = None  # its Rft-Count header (None: none, a malformed body)


@dataclass(frozen=True)
class Durable:
    """A durable consumer of the experience stream: which stage it reads and how far it acked."""

    name: str
    from_stage: str
    to_stage: str  # the stage it publishes to ("trained" for the trainer's durable)
    ack_floor: int  # every stream sequence up to this one is acked
    pending_messages: int  # not delivered yet plus delivered and not acked
    trainer: bool = False
    # the last stream sequence handed out, and how many handed out are not acked yet (None:
    # not known; then every message past the ack floor counts as pending). nats-server moves
    # the ack floor only over contiguous acks: after a restart whose redeliveries left a gap
    # it stays behind acks that did land (it catches up once nothing is pending), so past the
    # floor only ``ack_pending`` delivered messages are really unacked
    delivered: int | None = None
    ack_pending: int | None = None


@dataclass
class StageAccount:
    """What happened at one stage: the experiences in, and where each went."""

    from_stage: str
    to_stage: str
    durable: str
    trainer: bool
    experiences_in: int = 0
    out: int = 0  # on exp.<to>; for the trainer: trained
    filtered: int = 0
    dead: int = 0
    pending: int = 0
    messages_in: int = 0
    malformed_in: int = 0  # messages whose body is not an experience group
    malformed_dead: int = 0
    malformed_pending: int = 0
    dead_reasons: Counter[str] = field(default_factory=Counter)
    # the purged prefix of exp.<from> (counted from its record, not by id)
    purged_messages: int = 0
    purged_experiences: int = 0
    checked_from_seq: int = 0  # stream sequences from here on were checked by experience id
    # messages past the durable's ack floor that are acked all the same (the floor lags, see
    # Durable.delivered); its unacked ones are taken to be the latest delivered
    acked_above_floor: int = 0
    # the stream sequences of exp.<from> this reader read, [lo, hi) (hi None: to the end);
    # a splice hands part of a stage to an operator (see rftstream.retention.reader_history)
    segments: list[tuple[int, int | None]] = field(default_factory=lambda: [(0, None)])

    @property
    def whole(self) -> bool:
        """Whether this reader read its stage from the first message on."""
        return self.segments == [(0, None)]

    def sequences(self) -> str:
        """Its segments as text, e.g. ``1-50, 91-``."""
        return ", ".join(f"{max(lo, 1)}-{'' if hi is None else hi - 1}" for lo, hi in self.segments)


@dataclass(frozen=True)
class TaskAccount:
    """The tasks of a run: published on ``tasks``, and where they went.

    The tasks stream is a work queue: a task leaves it when an explorer acks it
    (explored: its group published to ``exp.raw``) or gives it up (dead-lettered
    to ``dlq.tasks``, then terminated).
    """

    published: int  # the tasks stream's last sequence: every task stored
    queued: int  # still stored: not handed out yet, or held by an explorer
    failed: int  # on dlq.tasks

    @property
    def explored(self) -> int:
        """Tasks that left the queue and were not dead-lettered: their groups were published."""
        return self.published - self.queued - self.failed

    def problems(self) -> list[str]:
        """What cannot be (more tasks failed than ever left the queue)."""
        if self.explored < 0:
            return [
                f"{self.failed} task(s) on dlq.tasks but only {self.published - self.queued} "
                "left the tasks queue"
            ]
        return []


@dataclass
class RunAccount:
    """Every experience of one run, reconciled (see the module docstring)."""

    run: str
    explored: int
    malformed: int  # raw messages whose body is not an experience group
    trained: int | None  # the trainer's experience/trained_total (None: no trainer record)
    stages: list[StageAccount]
    problems: list[str]
    dead_letters: int = 0  # messages on dlq.>
    dead_by: Counter[tuple[str, str]] = field(default_factory=Counter)  # (stage, reason)
    purged: dict[str, PurgedPrefix] = field(default_factory=dict)  # stage -> purge record
    tasks: TaskAccount | None = None
    notes: list[str] = field(default_factory=list)  # what the reader should know, not a fault
    # experiences trained whose messages the trainer still holds unacked (pending at its
    # stage until its next resumable checkpoint): counted as trained, not as pending
    trained_held: int = 0

    @property
    def filtered(self) -> int:
        return sum(s.filtered for s in self.stages)

    @property
    def dead_lettered(self) -> int:
        """Experiences dead-lettered at any stage (malformed messages are counted apart)."""
        return sum(s.dead for s in self.stages)

    @property
    def pending(self) -> int:
        """Experiences not settled yet (less those trained and held: they count as trained)."""
        return sum(s.pending for s in self.stages) - self.trained_held

    @property
    def malformed_dead(self) -> int:
        return sum(s.malformed_dead for s in self.stages)

    @property
    def malformed_pending(self) -> int:
        return sum(s.malformed_pending for s in self.stages)

    @property
    def settled(self) -> bool:
        """Nothing is pending anywhere (a finished run's account)."""
        return sum(s.pending for s in self.stages) == 0 and self.malformed_pending == 0

    @property
    def balanced(self) -> bool:
        """``trained + filtered + dead + pending == explored`` for experiences, every malformed
        raw message dead-lettered or pending, and no problem (nothing twice, nothing lost)."""
        return (
            not self.problems
            and self.trained is not None
            and self.trained + self.filtered + self.dead_lettered + self.pending == self.explored
            and self.malformed_dead + self.malformed_pending == self.malformed
        )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (``rftstream account --json``)."""
        return {
            "run": self.run,
            "explored": self.explored,
            "trained": self.trained,
            "filtered": self.filtered,
            "dead_lettered": self.dead_lettered,
            "pending": self.pending,
            "trained_held": self.trained_held,
            "malformed": self.malformed,
            "malformed_dead_lettered": self.malformed_dead,
            "dead_letters": self.dead_letters,
            "balanced": self.balanced,
            "settled": self.settled,
            "problems": list(self.problems),
            "notes": [*self.notes, *self.floor_notes()],
            "tasks": None
            if self.tasks is None
            else {
                "published": self.tasks.published,
                "explored": self.tasks.explored,
                "failed": self.tasks.failed,
                "queued": self.tasks.queued,
            },
            "purged": {
                stage: {
                    "below_seq": r.below_seq,
                    "messages": r.messages,
                    "experiences": r.experiences,
                    "malformed": r.malformed,
                    "splits": {str(seq): list(n) for seq, n in sorted(r.splits.items())},
                }
                for stage, r in self.purged.items()
            },
            "stages": [
                {
                    "from": s.from_stage,
                    "to": s.to_stage,
                    "durable": s.durable,
                    "in": s.experiences_in,
                    "out": s.out,
                    "filtered": s.filtered,
                    "dead_lettered": s.dead,
                    "pending": s.pending,
                    "messages_in": s.messages_in,
                    "malformed_in": s.malformed_in,
                    "malformed_dead_lettered": s.malformed_dead,
                    "malformed_pending": s.malformed_pending,
                    "purged_messages": s.purged_messages,
                    "purged_experiences": s.purged_experiences,
                    "checked_by_id_from_seq": s.checked_from_seq,
                    "acked_above_floor": s.acked_above_floor,
                    "sequences": [[lo, hi] for lo, hi in s.segments],
                    "dead_reasons": dict(s.dead_reasons),
                }
                for s in self.stages
            ],
            "dead_letters_by": [
                {"stage": st, "reason": r, "count": n} for (st, r), n in self.dead_by.most_common()
            ],
        }

    def floor_notes(self) -> list[str]:
        """One line per durable whose ack floor lags acks that landed (after a restart)."""
        return [
            f"exp.{s.from_stage}: {s.acked_above_floor} message(s) past durable {s.durable}'s "
            "ack floor are acked (nats-server moves the floor over contiguous acks only, and "
            "catches up once nothing is pending); its unacked ones are taken to be the latest "
            "delivered"
            for s in self.stages
            if s.acked_above_floor
        ]

    def __str__(self) -> str:
        lines = [f"run {self.run}: account of every experience"]
        head = f"  {'stage':<22}{'in':>7}{'out':>7}{'filtered':>9}{'dead':>6}{'pending':>8}"
        lines.append(head + f"{'malformed':>10}")
        for s in self.stages:
            name = f"{s.from_stage} -> {'trained' if s.trainer else s.to_stage}"
            lines.append(
                f"  {name:<22}{s.experiences_in:>7}{s.out:>7}{s.filtered:>9}{s.dead:>6}"
                f"{s.pending:>8}{s.malformed_in:>10}"
            )
        trained = "?" if self.trained is None else str(self.trained)
        lines.append(
            f"  explored {self.explored} = trained {trained} + filtered {self.filtered} + "
            f"dead-lettered {self.dead_lettered} + pending {self.pending}"
        )
        if self.malformed:
            lines.append(
                f"  malformed raw messages {self.malformed}: dead-lettered {self.malformed_dead}, "
                f"pending {self.malformed_pending}"
            )
        for stage, rec in sorted(self.purged.items()):
            lines.append(
                f"  exp.{stage} purged below sequence {rec.below_seq}: {rec.messages} messages, "
                f"{rec.experiences} experiences counted from the purge record"
            )
        for s in self.stages:
            if not s.whole:
                reader = "the trainer" if s.trainer else f"the operator writing exp.{s.to_stage}"
                lines.append(f"  exp.{s.from_stage} sequences {s.sequences()}: read by {reader}")
        lines.extend(f"  {note}" for note in [*self.notes, *self.floor_notes()])
        for (stage, reason), n in self.dead_by.most_common(8):
            lines.append(f"  dead letters at {stage} ({n}x): {reason}")
        lines.extend(f"  problem: {p}" for p in self.problems)
        verdict = "balanced" if self.balanced else "NOT balanced"
        lines.append(f"  {verdict}{'' if self.settled else ' (messages still pending)'}")
        return "\n".join(lines)


def reconcile(
    run: str,
    messages: list[StoredMessage],
    dead_letters: list[DeadLetter],
    durables: list[Durable],
    trained: int | None,
    purged: dict[str, PurgedPrefix] | None = None,
    tasks: TaskAccount | None = None,
    topology: Sequence[TopologyEdge] = (),
) -> RunAccount:
    """Build the account from what the streams hold (pure: no I/O).

    ``purged`` (stage -> its purge record) marks each subject's prefix below
    ``below_seq`` as purged: its messages are counted from the record (every
    consumer of the subject had acked them, the purge's precondition), stored
    messages below it are ignored, and the rest is checked by experience id.
    ``topology`` (the KV list of splices and unsplices, oldest first) says which
    stream sequences of a stage the trainer read and which a spliced operator
    read (:mod:`rftstream.retention.reader_history`): each reader gets its own row, and
    the trainer's rows together must add up to what it trained.
    """
    purged = purged or {}
    by_stage: dict[str, list[StoredMessage]] = defaultdict(list)
    for m in messages:
        if m.seq >= _below(purged, m.stage):
            by_stage[m.stage].append(m)
    problems: list[str] = []
    notes: list[str] = []
    uids_on: dict[str, set[str]] = {}
    for stage, msgs in by_stage.items():
        counts = Counter(u for m in msgs if m.uids is not None for u in m.uids)
        twice = [u for u, n in counts.items() if n > 1]
        if twice:
            problems.append(
                f"{len(twice)} experience(s) stored twice on exp.{stage} (e.g. {twice[0]})"
            )
        uids_on[stage] = set(counts)
    dead_seqs: dict[str, dict[int, str]] = defaultdict(dict)
    # stage -> (original sequence, experiences or None: malformed) dead-lettered from its prefix
    dead_purged: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
    dead_by: Counter[tuple[str, str]] = Counter()
    for d in dead_letters:
        dead_by[(d.stage, d.reason)] += 1
        stage = d.subject.rsplit(".", 1)[-1] if ".exp." in d.subject else None
        if stage is None or d.seq is None:
            continue
        if d.seq < _below(purged, stage):
            dead_purged[stage].append((d.seq, d.experiences))
        else:
            dead_seqs[stage][d.seq] = d.reason
    for stage, rec in purged.items():
        for dur in durables:
            if dur.from_stage == stage and dur.ack_floor + 1 < rec.below_seq:
                problems.append(
                    f"exp.{stage} was purged below sequence {rec.below_seq} but durable "
                    f"{dur.name} had acked only up to {dur.ack_floor}: unacked experience purged"
                )
    readers = reader_segments(
        {(d.from_stage, d.to_stage) for d in durables if not d.trainer},
        _trainer_stage(durables),
        topology,
    )
    stages: list[StageAccount] = []
    depth = _stage_depths(readers)
    # where each stage was first read: a splice's new stage from the splice's sequence on
    first_read: dict[str, int] = {}
    for (stage, _), segments in readers.items():
        for s in segments:
            first_read[stage] = min(first_read.get(stage, s.lo), s.lo)
    for (from_stage, reader), segments in sorted(
        readers.items(), key=lambda kv: _chain_order(kv[0], kv[1], depth)
    ):
        trainer = reader == TRAINED
        live = [
            d
            for d in durables
            if d.from_stage == from_stage
            and d.trainer == trainer
            and (trainer or d.to_stage == reader)
        ]
        acc = StageAccount(from_stage, reader, ", ".join(d.name for d in live) or "-", trainer)
        acc.segments = [(s.lo, s.hi) for s in segments]
        rec = purged.get(from_stage, PurgedPrefix())
        p_msgs, p_exps, p_malformed, split_known = _purged_part(
            rec, segments, first_read.get(from_stage, 0)
        )
        if not split_known:
            notes.append(
                f"exp.{from_stage} was purged past a splice's cut before the cut was recorded "
                "(a run of an older release): its purged prefix is counted at its first reader"
            )
        acc.purged_messages, acc.purged_experiences = p_msgs, p_exps
        acc.checked_from_seq = rec.below_seq
        msgs = [m for m in by_stage.get(from_stage, []) if holds(segments, m.seq)]
        acc.messages_in = len(msgs) + p_msgs
        in_uids = {u for m in msgs if m.uids is not None for u in m.uids}
        acc.experiences_in = len(in_uids) + p_exps
        dead_here = dead_seqs.get(from_stage, {})
        prefix_dead = [n for seq, n in dead_purged.get(from_stage, []) if holds(segments, seq)]
        dead_from_prefix = sum(n for n in prefix_dead if n is not None)
        dead_uids: set[str] = set()
        not_dead: list[StoredMessage] = []
        acc.malformed_in = p_malformed
        acc.malformed_dead = sum(n is None for n in prefix_dead)
        for m in msgs:
            if m.seq in dead_here:
                if m.uids is None:
                    acc.malformed_dead += 1
                else:
                    dead_uids.update(m.uids)
                acc.dead_reasons[dead_here[m.seq]] += 1
            else:
                not_dead.append(m)
            if m.uids is None:
                acc.malformed_in += 1
        out_uids: set[str] = set()
        from_prefix = 0  # experiences out of this stage that came from its purged prefix
        if not trainer:
            downstream = uids_on.get(reader, set())
            out_uids = downstream & in_uids
            nowhere = downstream - in_uids
            if not _fed_by_others((from_stage, reader), readers):
                down_rec = purged.get(reader, PurgedPrefix())
                if p_msgs:  # by id, these may come from the purged prefix
                    from_prefix = len(nowhere)
                elif nowhere:
                    problems.append(
                        f"{len(nowhere)} experience(s) on exp.{reader} were never on "
                        f"exp.{from_stage} (e.g. {sorted(nowhere)[0]})"
                    )
                from_prefix += down_rec.experiences
            acc.out = len(out_uids) + from_prefix
        pending_msgs: list[StoredMessage] = []
        for dur in live:  # a reader whose durable is gone acked all it read
            served = durable_range(segments, dur.ack_floor)
            past_floor = [
                m
                for m in not_dead
                if m.seq > dur.ack_floor and served is not None and served.holds(m.seq)
            ]
            held, acked_above = _unacked_messages(dur, past_floor, out_uids)
            pending_msgs.extend(held)
            acc.acked_above_floor += acked_above
        pending_uids = {u for m in pending_msgs if m.uids is not None for u in m.uids}
        acc.malformed_pending = sum(m.uids is None for m in pending_msgs)
        pending_uids -= out_uids | dead_uids
        acc.dead = len(dead_uids) + dead_from_prefix
        acc.pending = len(pending_uids)
        if trainer:
            acc.out = acc.experiences_in - acc.dead - acc.pending  # what reached it, settled
        else:
            by_id = len(in_uids - out_uids - dead_uids - pending_uids)
            acc.filtered = by_id + p_exps - dead_from_prefix - from_prefix
            if acc.filtered < 0:
                problems.append(
                    f"{-acc.filtered} more experience(s) left exp.{from_stage} for "
                    f"exp.{reader} than arrived (counted from the purged prefix): "
                    "from nowhere or stored twice"
                )
                acc.filtered = 0
        stages.append(acc)
    trainer_problems, trained_held = _trainer_problems([s for s in stages if s.trainer], trained)
    problems.extend(trainer_problems)
    if trained_held:
        notes.append(
            f"{trained_held} pending experience(s) at the trainer are trained already: it holds "
            "their messages unacked until its next resumable checkpoint (counted as trained)"
        )
    if not any(d.trainer for d in durables):
        problems.append("no trainer durable on the experience stream")
    if not any(s.from_stage == RAW_STAGE for s in stages):
        problems.append("no durable reads exp.raw")
    raw = by_stage.get(RAW_STAGE, [])
    raw_rec = purged.get(RAW_STAGE, PurgedPrefix())
    if tasks is not None:
        problems.extend(tasks.problems())
    return RunAccount(
        run=run,
        explored=len(uids_on.get(RAW_STAGE, set())) + raw_rec.experiences,
        malformed=sum(1 for m in raw if m.uids is None) + raw_rec.malformed,
        trained=trained,
        stages=stages,
        problems=problems,
        dead_letters=len(dead_letters),
        dead_by=dead_by,
        purged=dict(purged),
        tasks=tasks,
        notes=list(dict.fromkeys(notes)),
        trained_held=trained_held,
    )


def _trainer_problems(rows: list[StageAccount], trained: int | None) -> tuple[list[str], int]:
    """What the trainer's rows (one per stage it read) and its trained count cannot both be,
    and how many experiences it trained that are still pending (held unacked until its next
    resumable checkpoint: a running account).

    One row: it trained what it was given (its ``out`` becomes ``trained``). Several (a run
    that spliced an operator in front of it): together they must add up to ``trained``.
    Trained beyond what reached it is "trained twice" only past what is pending there."""
    if not rows:
        return [], 0
    if trained is None:
        return ["the trainer published no experience/trained_total record"], 0
    reached = sum(s.out for s in rows)
    if len(rows) == 1:
        rows[0].out = trained
    held = min(max(0, trained - reached), sum(s.pending for s in rows))
    where = " and ".join(f"exp.{s.from_stage}" for s in rows)
    if reached + held < trained:
        return [
            f"the trainer trained {trained} experiences but only {reached + held} reached it and "
            f"were not dead-lettered: {trained - reached - held} trained twice (or counted twice)"
        ], held
    if reached > trained:
        return [
            f"{reached - trained} experience(s) on {where} were neither trained, dead-lettered "
            "nor pending: lost"
        ], held
    return [], held


def _below(purged: dict[str, PurgedPrefix], stage: str) -> int:
    """The first stream sequence of ``exp.<stage>`` the account checks by id."""
    rec = purged.get(stage)
    return rec.below_seq if rec is not None else 0


def _purged_part(
    rec: PurgedPrefix, segments: list[Segment], first_read: int = 0
) -> tuple[int, int, int, bool]:
    """``(messages, experiences, malformed)`` of ``rec``'s purged prefix inside ``segments``,
    and whether the record knew every cut needed (if not, the part before an unknown cut
    counts at the first segment). ``first_read``: the sequence the stage's first reader
    began at (a stage a splice made: the splice's); everything below it counts there."""
    whole = (rec.messages, rec.experiences, rec.malformed)
    total = [0, 0, 0]
    known = True
    for s in segments:
        if s.lo >= rec.below_seq:
            continue
        high = rec.below(rec.below_seq if s.hi is None else min(s.hi, rec.below_seq))
        low = (0, 0, 0) if s.lo <= first_read else rec.below(s.lo)
        known = known and high is not None and low is not None
        for i, (h, lo) in enumerate(zip(high or whole, low or whole, strict=True)):
            total[i] += h - lo
    return total[0], total[1], total[2], known


def _trainer_stage(durables: list[Durable]) -> str | None:
    """The stage the trainer reads when no splice was recorded (None: no trainer durable)."""
    stages = [d.from_stage for d in durables if d.trainer]
    if TRAIN_STAGE in stages:
        return TRAIN_STAGE
    return stages[0] if stages else None


def _stage_depths(readers: dict[tuple[str, str], list[Segment]]) -> dict[str, int]:
    """How many operator stages each stage lies behind ``raw`` (``raw``: 0)."""
    depth: dict[str, int] = {RAW_STAGE: 0}
    for _ in range(len(readers)):
        for stage, reader in readers:
            if stage in depth and reader != TRAINED and reader not in depth:
                depth[reader] = depth[stage] + 1
    return depth


def _chain_order(
    key: tuple[str, str], segments: list[Segment], depth: dict[str, int]
) -> tuple[int, int, int, str]:
    """Order readers along the chain from ``raw`` (by the depth of the stage they read, then
    their first sequence); the trainer's last, a stage off the chain after the chain."""
    stage, reader = key
    return int(reader == TRAINED), depth.get(stage, len(depth)), segments[0].lo, reader


def _fed_by_others(key: tuple[str, str], readers: dict[tuple[str, str], list[Segment]]) -> bool:
    return any(k != key and k[1] == key[1] for k in readers)


async def _read_all(bus: Bus, stream: str, subject: str) -> list[Any]:
    """Every message stored on ``subject`` of ``stream`` (ordered, ephemeral; nothing acked).

    Whole, or an error: an ordered consumer that goes quiet for ``_READ_IDLE_S`` while the
    server still counted messages after its last one (``num_pending``; a cluster whose
    stream leader changed, a loaded server) is subscribed again after what it delivered,
    until it has caught up or ``nats.retry_window`` s have passed.

    Raises:
        BusError: the messages did not all arrive within ``nats.retry_window`` s.
    """
    out: list[Any] = []
    deadline = time.monotonic() + max(bus.cfg.retry_window, 5 * _READ_IDLE_S)
    after = 0  # the stream sequence of the last message read
    while True:
        try:
            info = await bus.stream_state(stream, subjects_filter=subject)
        except StreamNotFound:
            return out
        if not out and not sum(info.subjects.values()):
            return out  # nothing stored on the subject
        reader = await bus.read(
            stream,
            subject,
            start_seq=after + 1,
            description=f"rftstream account of run {bus.names.run}: reads every message of "
            f"{subject} once, acks nothing",
        )
        caught_up = False
        try:
            while True:
                msg = await reader.next(_READ_IDLE_S)
                if msg is None:
                    break
                out.append(msg)
                after = int(msg.metadata.sequence.stream)
                if msg.metadata.num_pending == 0:
                    caught_up = True
                    break
        finally:
            await reader.close()
        if caught_up:
            return out
        if time.monotonic() >= deadline:
            raise BusError(
                f"reading {subject} of stream {stream}: {len(out)} message(s) arrived, the "
                f"server counts more after sequence {after}; gave up after "
                f"{bus.cfg.retry_window:g} s (nats.retry_window)"
            )
        log.info("reading %s: quiet after sequence %d with more stored; reading on", subject, after)


def _stored(msg: Any, prefix: str) -> StoredMessage:
    stage = msg.subject[len(prefix) :]
    try:
        group = decode_group_msg(msg.data)
        uids = tuple(
            f"{r.eid.batch}/{r.eid.task}/{r.eid.run}/{r.eid.step}/{r.eid.suffix}"
            for r in group.experiences
        )
        return StoredMessage(int(msg.metadata.sequence.stream), stage, uids)
    except SchemaError as exc:
        return StoredMessage(int(msg.metadata.sequence.stream), stage, None, str(exc))


def _durable(info: ConsumerState, bus: Bus, stages: set[str]) -> Durable | None:
    """The stages a durable of the experience stream connects (None: not one of the run's).

    The stage it reads is its filter subject; the stage it writes is its ``rft.to_stage``
    metadata, or for a durable created without it, the rest of its name after
    ``op_<from>_to_`` (names replace ``-`` by ``_``: matched against ``stages``, the
    stages the stream holds).
    """
    prefix = f"rft.{bus.names.run}.exp."
    subject = info.filter_subject
    name = info.name if info.durable else ""
    if not subject.startswith(prefix) or not name:
        return None
    from_stage = subject[len(prefix) :]
    meta = info.metadata
    if reads_for_trainer(name, subject, meta):
        return Durable(
            name,
            from_stage,
            "trained",
            _floor(info),
            _pending(info),
            trainer=True,
            delivered=info.delivered,
            ack_pending=info.num_ack_pending,
        )
    to_stage = meta.get(META_TO_STAGE, "") or _to_stage_from_name(name, from_stage, stages)
    if not to_stage:
        return None
    return Durable(
        name,
        from_stage,
        to_stage,
        _floor(info),
        _pending(info),
        delivered=info.delivered,
        ack_pending=info.num_ack_pending,
    )


def _to_stage_from_name(name: str, from_stage: str, stages: set[str]) -> str:
    """``<to>`` of a durable named ``op_<from>_to_<to>`` (``-`` written ``_``); "" if not one."""
    head = f"op_{from_stage}_to_".replace("-", "_")
    if not name.startswith(head) or len(name) == len(head):
        return ""
    rest = name[len(head) :]
    for stage in sorted(stages):
        if stage.replace("-", "_") == rest:
            return stage
    return rest


def _unacked_messages(
    dur: Durable, past_floor: list[StoredMessage], out_uids: set[str]
) -> tuple[list[StoredMessage], int]:
    """Which of ``past_floor`` (the durable's messages past its ack floor, in stream order,
    none dead-lettered) are still unacked, and how many of them are acked all the same.

    Those past ``delivered`` were never handed out: unacked. Of the delivered ones, the
    server says ``ack_pending`` are unacked; when more lie past the floor, the floor lags
    (see :attr:`Durable.delivered`) and the unacked ones are taken to be the latest delivered
    whose experiences did not reach the next stage (in-flight messages are the newest ones;
    an operator acks a message after publishing its output)."""
    if dur.delivered is None or dur.ack_pending is None:
        return past_floor, 0
    undelivered = [m for m in past_floor if m.seq > dur.delivered]
    delivered = [m for m in past_floor if m.seq <= dur.delivered]
    if len(delivered) <= dur.ack_pending:
        return past_floor, 0
    candidates = [m for m in delivered if m.uids is None or not out_uids.intersection(m.uids)]
    held = candidates[len(candidates) - dur.ack_pending :] if dur.ack_pending else []
    return held + undelivered, len(delivered) - dur.ack_pending


def _floor(info: ConsumerState) -> int:
    return info.ack_floor


def _pending(info: ConsumerState) -> int:
    return info.num_pending + info.num_ack_pending


async def _trained_total(bus: Bus) -> int | None:
    """``experience/trained_total`` of the trainer's newest record (highest step, then latest)."""
    best: tuple[int, float, int] | None = None
    for msg in await _read_all(bus, bus.names.metrics_stream, bus.names.metrics_wildcard):
        try:
            rec = msgspec.json.decode(msg.data, type=MetricsMsg)
        except msgspec.DecodeError:
            continue
        if rec.role != "trainer" or TRAINED_TOTAL not in rec.values:
            continue
        key = (rec.step, rec.ts, int(rec.values[TRAINED_TOTAL]))
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


async def _tasks(bus: Bus) -> TaskAccount | None:
    """The tasks stream's published and still-queued tasks, and the dead-lettered ones."""
    try:
        info = await bus.stream_state(bus.names.tasks_stream)
    except StreamNotFound:
        return None
    try:
        dlq = await bus.stream_state(
            bus.names.dlq_stream, subjects_filter=bus.names.dlq_subject("tasks")
        )
        failed = sum(dlq.subjects.values())
    except StreamNotFound:
        failed = 0
    return TaskAccount(published=info.last_seq, queued=info.messages, failed=failed)


async def account_run(bus: Bus) -> RunAccount:
    """Read the run's streams, durables, purge records and trainer metrics, and reconcile them.

    Only reads (ordered ephemeral consumers; nothing acked). Blocks for as long as
    reading every stored experience and dead letter takes (about half a second
    more per stream, to see that the end was reached). Raises ``BusError`` when
    NATS cannot be reached, :class:`~rftstream.errors.RunNotFoundError` when the
    run has no state on the server.
    """
    names = bus.names
    prefix = f"rft.{names.run}.exp."
    state = RunState(await bus.kv(create=False))
    # the purge records first: a purge after this read leaves stored what it recorded
    purged = await read_purged(state)
    topology = await state.get(TOPOLOGY) or []
    # the durables next: a message stored after its ack floor was read counts as pending
    try:
        infos = await bus.consumers(names.exp_stream)
        exp_info = await bus.stream_state(names.exp_stream, subjects_filter=names.exp_wildcard)
        stages = {s[len(prefix) :] for s in exp_info.subjects}
    except StreamNotFound:
        infos, stages = [], set()
    durables: list[Durable] = []
    for info in infos:
        dur = _durable(info, bus, stages)
        if dur is not None:
            durables.append(dur)
    trained = await _trained_total(bus)
    messages = [
        _stored(m, prefix) for m in await _read_all(bus, names.exp_stream, names.exp_wildcard)
    ]
    dead: list[DeadLetter] = []
    for m in await _read_all(bus, names.dlq_stream, names.dlq_wildcard):
        h = m.headers or {}
        seq = h.get(H_DLQ_SEQ, "")
        count = h.get(H_COUNT, "")
        dead.append(
            DeadLetter(
                stage=h.get(H_DLQ_STAGE, m.subject.rsplit(".", 1)[-1]),
                subject=h.get(H_DLQ_SUBJECT, ""),
                seq=int(seq) if seq.isdigit() else None,
                reason=h.get(H_DLQ_REASON, "no reason given"),
                experiences=int(count) if count.isdigit() else None,
            )
        )
    account = reconcile(
        names.run,
        messages,
        dead,
        durables,
        trained,
        purged,
        await _tasks(bus),
        topology=topology,
    )
    unreachable = bus.unreachable_durables(names.exp_stream)
    if unreachable:  # their stages are missing from the account, not lost
        account.problems.append(
            f"consumers {', '.join(sorted(unreachable))} of {names.exp_stream} did not answer "
            "(a cluster node down?): their stages are not counted"
        )
    return account
