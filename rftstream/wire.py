"""Every record on the bus except experiences, as typed msgspec structs. Pure, no I/O.

All of them travel as msgspec JSON, so ``nats stream view`` and ``nats kv get``
show them readably, and each is decoded into its struct, so a drifted shape is
an error at the reader instead of a ``KeyError`` somewhere later. Experience
groups (large, binary) are in :mod:`rftstream.experience`. Schemas evolve
append-only. In order:

* the JSON codec (:func:`encode_json`, :func:`decode_json`);
* the data plane: tasks (:class:`TaskMsg`), metrics (:class:`MetricsMsg`) and
  the headers of dead letters (``H_DLQ_*``);
* the trainer's records in the run's KV bucket (``rft_<run>_state``):
  ``weights.latest``, ``weights.pending``, ``weights.keyframe_request``,
  ``trainer.checkpoint``,
  ``trainer.trained_unacked`` (the weights themselves, on the weights stream:
  :mod:`rftstream.weights.codec`);
* the control plane: what actors write to that bucket and read back, with
  typed key handles (:class:`Key`): the splice protocol's records, then the
  explorer side's (taskset claim, heartbeat, ``trainer.starving``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec

from rftstream.errors import SchemaError
from rftstream.subjects import (
    KV_EVAL_FINAL,
    KV_EVAL_STEP,
    KV_EXPLORER_DONE,
    KV_EXPLORER_FLIGHT,
    KV_EXPLORER_STEP,
    KV_HEARTBEAT,
    KV_SPLICE,
    KV_STAGE,
    KV_STATUS,
    KV_TASKSET,
    KV_TASKSET_CLAIM,
    KV_TOPOLOGY,
    KV_TRAINER_ACKED_BELOW,
    KV_TRAINER_CHECKPOINT,
    KV_TRAINER_DONE,
    KV_TRAINER_INPUT,
    KV_TRAINER_STARTED,
    KV_TRAINER_STARVING,
    KV_TRAINER_STEP,
    KV_TRAINER_UNACKED,
    KV_TRAINER_WAITING,
    KV_WEIGHTS,
    KV_WEIGHTS_KEYFRAME,
    KV_WEIGHTS_PENDING,
)

# --- JSON codec

_JSON = msgspec.json.Encoder()


def encode_json(obj: msgspec.Struct) -> bytes:
    """Encode a struct as JSON bytes."""
    return _JSON.encode(obj)


def decode_json(data: bytes, typ: type[Any], what: str) -> Any:
    """Decode JSON bytes as ``typ``; :class:`SchemaError` names ``what`` on failure."""
    try:
        return msgspec.json.decode(data, type=typ)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"{what}: cannot decode as {typ.__name__}: {exc}") from exc


# --- data plane: tasks, metrics, dead letters (streams)

TASK_SCHEMA = "rft.task.v1"
METRICS_SCHEMA = "rft.metrics.v1"
# the weights stream (rftstream.weights.codec): binary payload chunks, then a JSON manifest
WEIGHTS_SCHEMA = "rft.weights.v1"
WEIGHTS_MANIFEST_SCHEMA = "rft.weights.manifest.v1"

# DLQ headers
H_DLQ_REASON = "Rft-Dlq-Reason"
H_DLQ_STAGE = "Rft-Dlq-Stage"
H_DLQ_ACTOR = "Rft-Dlq-Actor"
H_DLQ_SUBJECT = "Rft-Dlq-Subject"
H_DLQ_SEQ = "Rft-Dlq-Stream-Seq"
H_DLQ_DELIVERIES = "Rft-Dlq-Deliveries"
# the original body: its size in bytes, "<algorithm>:<hex>" of it (xxh3_128 or sha256), and
# "true" when the dead letter keeps only a prefix of it (rftstream.bus.client.DEAD_LETTER_BODY_LIMIT)
H_DLQ_BODY_BYTES = "Rft-Dlq-Body-Bytes"
H_DLQ_BODY_HASH = "Rft-Dlq-Body-Hash"
H_DLQ_BODY_TRUNCATED = "Rft-Dlq-Body-Truncated"
DLQ_HEADERS = (
    H_DLQ_REASON,
    H_DLQ_STAGE,
    H_DLQ_ACTOR,
    H_DLQ_SUBJECT,
    H_DLQ_SEQ,
    H_DLQ_DELIVERIES,
    H_DLQ_BODY_BYTES,
    H_DLQ_BODY_HASH,
    H_DLQ_BODY_TRUNCATED,
)


class TaskMsg(msgspec.Struct, kw_only=True):
    """One task in the task stream: a raw taskset row plus where it came from."""

    taskset: str
    index: int  # row index in the taskset
    epoch: int
    seq: int  # position in the publishing order (epoch * len + shuffled position)
    raw_task: dict[str, Any]
    is_eval: bool = False
    schema: str = TASK_SCHEMA
    # appended: the row's ``task_id`` (its eid.task): the index, or "<taskset>:<index>"
    # when several training tasksets are mixed (row indices then repeat across tasksets)
    task_id: int | str | None = None


class MetricsMsg(msgspec.Struct, kw_only=True):
    """Metrics of one actor at one moment (a step, a batch, a heartbeat)."""

    actor: str
    role: str  # explorer | operator | trainer
    ts: float
    step: int
    values: dict[str, float]
    schema: str = METRICS_SCHEMA


# --- the trainer's KV records: weights.latest, trainer.checkpoint, trainer.trained_unacked


class WeightsPointer(msgspec.Struct, kw_only=True):
    """KV record ``weights.latest``: where version N of the policy lives."""

    version: int
    method: str  # jetstream | checkpoint | memory
    # jetstream: "nats:<stream>/<manifest sequence>"; checkpoint: the file's path;
    # memory: "memory://<run>/<version>"
    uri: str
    sha256: str = ""
    step: int = 0
    ts: float = 0.0
    # appended: which start of the trainer published it (0, then +1 at each restart). An
    # explorer takes a pointer of a newer incarnation whatever its version: a trainer that
    # resumed from an earlier checkpoint publishes versions lower than its predecessor's
    incarnation: int = 0
    # appended (jetstream): the stream sequence of the version's manifest, the bytes it
    # travels as (payload) and would without deltas or compression (raw), the keyframe its
    # delta chain starts from, and its digest (xxh3-128 over the tensors' hashes)
    manifest_seq: int = 0
    payload_bytes: int = 0
    raw_bytes: int = 0
    keyframe: int = 0
    digest: str = ""

    def newer_than(self, incarnation: int, version: int) -> bool:
        """Whether these weights replace weights ``version`` of trainer ``incarnation``."""
        return (self.incarnation, self.version) > (incarnation, version)


class WeightsPending(msgspec.Struct, kw_only=True):
    """KV record ``weights.pending``: the trainer's newest weights version, written after
    its step and before it acks the step's batch, while the version may still be on its
    way to the weights stream (``sync_method: jetstream`` publishes in the background).
    ``max_staleness`` counts versions from it, not from ``weights.latest``."""

    version: int
    incarnation: int
    ts: float


class KeyframeRequest(msgspec.Struct, kw_only=True):
    """KV record ``weights.keyframe_request``: explorer ``actor`` refused weights ``version``
    of trainer ``incarnation`` (a corrupt or lost part of its delta chain) and cannot
    rebuild the deltas after it; the trainer's next version is a keyframe."""

    actor: str
    incarnation: int
    version: int
    reason: str
    ts: float


class CheckpointRecord(msgspec.Struct, kw_only=True):
    """KV record ``trainer.checkpoint``: the newest complete resumable checkpoint.

    The run's commit point for resuming: written after the checkpoint is complete on
    disk and before the trainer acks the experience it contains, so a restarted trainer
    resumes from exactly this one (see :mod:`rftstream.training.checkpoint`).
    """

    step: int
    version: int
    incarnation: int
    path: str  # the checkpoint's directory (resume/global_step_<step>)
    ts: float


class AckedBelow(msgspec.Struct, kw_only=True):
    """KV record ``trainer.acked_below``: every message on durable ``durable``'s subject
    below stream sequence ``below`` is acked, though the server's ack floor may say less.

    nats-server moves a consumer's ack floor over contiguous acks only; after a server
    crash a gap in its restored state can hold the floor back for as long as the consumer
    has anything unacked, which for a prefetching trainer is always, and acked experience
    above it would never be purged. The trainer writes this when the server's count of
    its unacked messages equals the messages it holds (so those are the only ones) and the
    lowest of them lies past the floor (:meth:`rftstream.actors.feed.ExperienceFeed.acked_below`).
    Acks are permanent, so the record stays true; explorers purge by the higher of the two.
    """

    durable: str
    below: int
    ts: float = 0.0


class TrainedUnacked(msgspec.Struct, kw_only=True):
    """KV record ``trainer.trained_unacked``: messages the trainer trained but holds unacked
    until its next checkpoint, as two running totals (``trained - acked`` are held).

    ``trained`` is written after it grows (never ahead of the truth), ``acked`` before
    the acks it counts are sent (never behind): a reader that reads ``trained`` before
    the consumer's counts and ``acked`` after them gets a lower bound of the trained
    messages those counts include (see :func:`rftstream.control.staleness.experience_backlog`).
    """

    trained: int = 0
    acked: int = 0
    ts: float = 0.0


# --- control plane: typed KV key handles

T = TypeVar("T")


@dataclass(frozen=True)
class Key(Generic[T]):
    """A KV key and the type of its value: ``await state.get(TRAINER_INPUT)`` is a
    ``TrainerInput | None``. ``name`` may be a template (``stage.{stage}``): :meth:`of`
    fills it in."""

    name: str
    type: Any  # the value's type: a Struct, a tagged union of Structs, list[Struct], ...

    def of(self, **fields: str) -> Key[T]:
        """The key with the template's ``{fields}`` filled in (same value type)."""
        return Key(self.name.format(**fields), self.type)

    def convert(self, value: Any) -> T | None:
        """An already decoded JSON value (a KV dump's) as this key's record; None when it
        is absent or has another shape (``rftstream status`` shows what it can)."""
        if value is None:
            return None
        try:
            return msgspec.convert(value, self.type)  # type: ignore[no-any-return]
        except msgspec.ValidationError:
            return None


# --- splice protocol: splice, trainer.input, stage.<Y>, topology, trainer.waiting/started/done (H-splice)
# The protocol itself is in rftstream.control.splice (its docstring), its transitions in
# rftstream.control.splice.protocol.

SpliceKind = Literal["splice", "unsplice"]


class Owner(msgspec.Struct, kw_only=True):
    """The process serving a spliced stage (or asking for a splice). ``token`` tells two
    claims of one process apart; ``ts`` is refreshed while it serves."""

    actor: str
    pid: int = 0
    host: str = ""
    ts: float = 0.0
    token: str = ""

    def same_claim(self, other: Owner | None) -> bool:
        """Whether ``other`` is this very claim (process and token)."""
        return other is not None and (self.pid, self.host, self.token) == (
            other.pid,
            other.host,
            other.token,
        )


class _SpliceRecord(msgspec.Struct, tag_field="state", kw_only=True):
    """Fields every state of the ``splice`` record has (``state`` is the tag).

    ``from_stage``: the stage the operator reads (a splice learns it at its cut);
    ``args``/``owner``: the operator's arguments and the process that asked for a
    splice; ``cut_seq``: where an unsplice's owner stopped reading ``from_stage``;
    ``ts``: when it was asked or requested; ``ts_changed``: its last transition.
    """

    id: str
    kind: SpliceKind = "splice"
    operator: str = ""
    to_stage: str = ""
    from_stage: str | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    owner: Owner | None = None
    cut_seq: int | None = None
    ts: float = 0.0
    ts_changed: float = 0.0


class SpliceAsked(_SpliceRecord, tag="asked"):
    """An unsplice ``--unsplice`` asked for; the stage's owner has not taken it up yet."""


class SpliceRequested(_SpliceRecord, tag="requested"):
    """A splice the operator asked for, or an unsplice whose owner parked at ``cut_seq``:
    the trainer's turn."""


class SpliceClaimed(_SpliceRecord, tag="claimed"):
    """The trainer took the request up; it can no longer be abandoned."""


class SpliceCut(_SpliceRecord, tag="cut"):
    """The trainer switched. Splice: the operator reads ``from_stage`` from ``start_seq``.
    Unsplice: the trainer reads ``from_stage`` from ``cut_seq + 1``; the owner drains."""

    start_seq: int | None = None
    consumer: str | None = None


class SpliceDrained(_SpliceRecord, tag="drained"):
    """Unsplice: the owner processed everything up to ``cut_seq``; its stage ends at
    ``drain_until``, which the trainer drains before closing."""

    drain_until: int
    consumer: str | None = None


class SpliceDone(_SpliceRecord, tag="done"):
    """Unsplice: the trainer drained the removed stage; the change is over."""

    drain_until: int
    consumer: str | None = None


class SpliceRefused(_SpliceRecord, tag="refused"):
    """The trainer cannot do it (``reason``), e.g. it already reads that stage."""

    reason: str


class SpliceAbandoned(_SpliceRecord, tag="abandoned"):
    """Given up before a trainer (or owner) took it up (``reason``)."""

    reason: str


SpliceRecord = (
    SpliceAsked
    | SpliceRequested
    | SpliceClaimed
    | SpliceCut
    | SpliceDrained
    | SpliceDone
    | SpliceRefused
    | SpliceAbandoned
)


class RetiredConsumer(msgspec.Struct, kw_only=True):
    """A consumer the trainer stopped reading but still drains up to ``cut_seq`` (None: an
    unsplice's open cut, closed when the removed operator says where its stage ends)."""

    consumer: str
    cut_seq: int | None = None
    splice_id: str | None = None


class TrainerInput(msgspec.Struct, kw_only=True):
    """``trainer.input``: the stage the trainer reads, through which durable, and the
    consumers it still drains. Absent: ``exp.train`` through ``trainer``. Written by the
    trainer only; ``splice_id``/``from_stage``/``start_seq``: its last switch."""

    stage: str
    consumer: str
    retired: list[RetiredConsumer] = msgspec.field(default_factory=list)
    splice_id: str | None = None
    from_stage: str | None = None
    start_seq: int | None = None
    ts: float = 0.0


class StageRecord(msgspec.Struct, kw_only=True):
    """``stage.<Y>``: a spliced stage. Its operator reads ``from_stage`` through
    ``durable`` (from ``start_seq``) and writes ``to_stage``; ``owner`` refreshes its
    ``ts`` while it serves."""

    operator: str
    from_stage: str
    to_stage: str
    durable: str
    owner: Owner
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    start_seq: int = 1
    splice_id: str | None = None


class TopologyEdge(msgspec.Struct, kw_only=True):
    """One entry of ``topology``: a change of the stage chain, once per ``splice_id``."""

    op: SpliceKind
    from_stage: str = msgspec.field(name="from")
    to_stage: str = msgspec.field(name="to")
    by: str | None
    seq: int
    ts: float
    splice_id: str | None = None


class TrainerWaiting(msgspec.Struct, kw_only=True):
    """``trainer.waiting``: the trainer waits for ``stage``, whose operator is gone;
    ``message`` has the command that restarts it (``rftstream status`` shows it)."""

    stage: str
    message: str
    ts: float


class TrainerStarted(msgspec.Struct, kw_only=True):
    """``trainer.started``: a trainer process began (``ts``)."""

    actor: str
    ts: float


class TrainerDone(msgspec.Struct, kw_only=True):
    """``trainer.done``: the trainer ended at ``step`` with ``status``."""

    step: int
    status: str
    ts: float


SPLICE: Key[SpliceRecord] = Key(KV_SPLICE, SpliceRecord)
TRAINER_INPUT: Key[TrainerInput] = Key(KV_TRAINER_INPUT, TrainerInput)
STAGE: Key[StageRecord] = Key(KV_STAGE, StageRecord)  # STAGE.of(stage=...)
TOPOLOGY: Key[list[TopologyEdge]] = Key(KV_TOPOLOGY, list[TopologyEdge])
TRAINER_WAITING: Key[TrainerWaiting] = Key(KV_TRAINER_WAITING, TrainerWaiting)
TRAINER_STARTED: Key[TrainerStarted] = Key(KV_TRAINER_STARTED, TrainerStarted)
TRAINER_DONE: Key[TrainerDone] = Key(KV_TRAINER_DONE, TrainerDone)


# --- explorer side: taskset claim, heartbeat, trainer.starving (H-explorer)


class TasksetRecord(msgspec.Struct, kw_only=True):
    """KV record ``taskset.published``: the taskset is in the task stream."""

    count: int
    epochs: int  # the most epochs of any training taskset
    rows: int  # rows of all training tasksets together
    by: str
    ts: float
    tasksets: dict[str, int] = msgspec.field(default_factory=dict)  # tasks per taskset name


class TasksetClaim(msgspec.Struct, kw_only=True):
    """KV record ``taskset.published.claim``: who publishes the taskset, and how far it got.

    ``seq``: every task before this position of the plan is stored in the task
    stream. The publisher rewrites the record (compare-and-set on its revision)
    after each chunk and every few seconds while it reads the files; another
    explorer takes over a claim whose record stopped changing
    (:mod:`rftstream.control.taskset_claim`).
    """

    by: str
    ts: float
    seq: int = 0
    taken_over_from: str = ""


class TrainerStarving(msgspec.Struct, kw_only=True):
    """KV record ``trainer.starving``, written by the trainer at each empty fetch.

    ``since``: when it started waiting with less than a batch (None: it is fed);
    ``held``: the messages it held when it said so (a flag older than what the
    trainer holds now is stale: see :meth:`rftstream.config.sync_policy.SyncPolicy.starving_trainer_overrides`).
    """

    since: float | None = None
    held: int = 0


class ExplorerDone(msgspec.Struct, kw_only=True):
    """KV record ``explorer.<name>.done``: the explorer stopped exploring, and why
    (``drained``: no tasks left; ``total_steps``: ``mode: explore`` reached its steps)."""

    step: int
    ts: float
    why: str


class ExplorerFlight(msgspec.Struct, kw_only=True):
    """KV record ``explorers.in_flight.<name>``: the tasks explorer ``<name>`` has claimed
    and finished, as two running totals (``claimed - done`` are in flight, or reserved
    by its staleness gate while it looks: ``reserved`` of them). The staleness gates of
    several explorers count each other's tasks in flight by them
    (:class:`rftstream.control.flights.FlightBoard`).

    ``claimed`` is written before the tasks it counts start (never behind), ``done``
    after the groups it counts are published, failed or given back (never ahead): a
    reader that takes ``done`` from a read before the experience queues' counts and
    ``claimed`` from a read after them gets an upper bound of the tasks whose groups
    those counts miss. ``since`` tells one run of the explorer from the next (its totals
    start again at 0); ``closed``: it stopped exploring and has nothing in flight.
    """

    claimed: int = 0
    done: int = 0
    reserved: int = 0
    started: int = 0  # tasks started so far: of two contending gates, fewer goes first
    # the oldest weights version of its tasks started and not done (-1: none): another
    # explorer publishes a group sampled with newer weights only after these are done
    oldest: int = -1
    since: float = 0.0
    ts: float = 0.0
    closed: bool = False

    @property
    def in_flight(self) -> int:
        return max(0, self.claimed - self.done)


class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """KV record ``heartbeat.<actor>``: an actor is alive, with its own progress fields.

    One flat JSON object (``nats kv get``): ``actor``, ``role``, ``ts`` and the fields
    of the actor's kind; a field another kind has is left out. Written every 5 s
    (:func:`rftstream.control.liveness.heartbeat_loop`); the trainer's last one carries
    how it ended (``status``), which tells a finished trainer from a live one.
    """

    actor: str
    role: str
    ts: float
    # explorers (and the bench evaluator): their last step, the weights they generate
    # with, the groups they published and the tasks that failed
    step: int | None = None
    model_version: int | None = None
    groups: int | None = None
    failed_tasks: int | None = None
    # the trainer: its version (the weights it last published) and, last, how it ended
    version: int | None = None
    status: str | None = None
    # operator hosts and spliced operators: the stages they read and write, and counts
    from_stage: str | None = None
    to_stage: str | None = None
    messages_in: int | None = None
    messages_out: int | None = None
    experiences_in: int | None = None
    experiences_out: int | None = None
    dead_lettered_messages: int | None = None
    failed_batches: int | None = None
    publish_failures: int | None = None
    skipped_after_cut: int | None = None

    def fields(self) -> dict[str, Any]:
        """The actor's own fields that it set (``rftstream status``'s ``info``)."""
        own = msgspec.structs.asdict(self)
        return {k: v for k, v in own.items() if v is not None and k not in _BEAT_IDENTITY}


_BEAT_IDENTITY = ("actor", "role", "ts")


class EvalClaim(msgspec.Struct, kw_only=True):
    """KV record ``eval.step.<n>`` / ``eval.final`` (``bench.step.<n>`` in mode bench): the
    explorer ``by`` evaluates that step with weights ``model_version``; created only if
    absent, so exactly one explorer does."""

    by: str
    step: int
    model_version: int
    ts: float


TASKSET_PUBLISHED: Key[TasksetRecord] = Key(KV_TASKSET, TasksetRecord)
TASKSET_CLAIM: Key[TasksetClaim] = Key(KV_TASKSET_CLAIM, TasksetClaim)
TRAINER_STARVING: Key[TrainerStarving] = Key(KV_TRAINER_STARVING, TrainerStarving)
EXPLORER_STEP: Key[int] = Key(KV_EXPLORER_STEP, int)  # the explorer's last step, a JSON int
EXPLORER_DONE: Key[ExplorerDone] = Key(KV_EXPLORER_DONE, ExplorerDone)
EXPLORER_FLIGHT: Key[ExplorerFlight] = Key(KV_EXPLORER_FLIGHT, ExplorerFlight)  # .of(name=...)
HEARTBEAT: Key[Heartbeat] = Key(KV_HEARTBEAT, Heartbeat)  # HEARTBEAT.of(actor=...)
EVAL_STEP: Key[EvalClaim] = Key(KV_EVAL_STEP, EvalClaim)  # EVAL_STEP.of(step=...)
EVAL_FINAL: Key[EvalClaim] = Key(KV_EVAL_FINAL, EvalClaim)

# --- the run's status and the trainer's progress records
STATUS: Key[str] = Key(KV_STATUS, str)  # running | finished | failed | stopped
TRAINER_STEP: Key[int] = Key(KV_TRAINER_STEP, int)  # the trainer's last finished step
WEIGHTS_LATEST: Key[WeightsPointer] = Key(KV_WEIGHTS, WeightsPointer)
WEIGHTS_PENDING: Key[WeightsPending] = Key(KV_WEIGHTS_PENDING, WeightsPending)
WEIGHTS_KEYFRAME: Key[KeyframeRequest] = Key(KV_WEIGHTS_KEYFRAME, KeyframeRequest)
TRAINER_CHECKPOINT: Key[CheckpointRecord] = Key(KV_TRAINER_CHECKPOINT, CheckpointRecord)
TRAINER_UNACKED: Key[TrainedUnacked] = Key(KV_TRAINER_UNACKED, TrainedUnacked)
TRAINER_ACKED_BELOW: Key[AckedBelow] = Key(KV_TRAINER_ACKED_BELOW, AckedBelow)
