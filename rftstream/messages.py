"""Wire schemas of the small messages (tasks, metrics, KV records). Pure, no I/O.

These travel as msgspec JSON so that ``nats stream view`` and ``nats kv get``
show them readably. Experience groups (large, binary) are in
:mod:`rftstream.experience`. Schemas evolve append-only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rftstream.errors import SchemaError

TASK_SCHEMA = "rft.task.v1"
METRICS_SCHEMA = "rft.metrics.v1"

# DLQ headers
H_DLQ_REASON = "Rft-Dlq-Reason"
H_DLQ_STAGE = "Rft-Dlq-Stage"
H_DLQ_ACTOR = "Rft-Dlq-Actor"
H_DLQ_SUBJECT = "Rft-Dlq-Subject"
H_DLQ_SEQ = "Rft-Dlq-Stream-Seq"
H_DLQ_DELIVERIES = "Rft-Dlq-Deliveries"
DLQ_HEADERS = (H_DLQ_REASON, H_DLQ_STAGE, H_DLQ_ACTOR, H_DLQ_SUBJECT, H_DLQ_SEQ, H_DLQ_DELIVERIES)


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


class WeightsPointer(msgspec.Struct, kw_only=True):
    """KV record ``weights.latest``: where version N of the policy lives."""

    version: int
    method: str  # checkpoint | memory
    uri: str  # file path for checkpoint, "memory://<run>/<version>" for memory
    sha256: str = ""
    step: int = 0
    ts: float = 0.0
    # appended: which start of the trainer published it (0, then +1 at each restart). An
    # explorer takes a pointer of a newer incarnation whatever its version: a trainer that
    # resumed from an earlier checkpoint publishes versions lower than its predecessor's
    incarnation: int = 0

    def newer_than(self, incarnation: int, version: int) -> bool:
        """Whether these weights replace weights ``version`` of trainer ``incarnation``."""
        return (self.incarnation, self.version) > (incarnation, version)


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


class TrainedUnacked(msgspec.Struct, kw_only=True):
    """KV record ``trainer.trained_unacked``: messages the trainer trained but holds unacked
    until its next checkpoint, as two running totals (``trained - acked`` are held).

    ``trained`` is written after it grows (never ahead of the truth), ``acked`` before
    the acks it counts are sent (never behind): a reader that reads ``trained`` before
    the consumer's counts and ``acked`` after them gets a lower bound of the trained
    messages those counts include (see :func:`rftstream.actors.common.experience_backlog`).
    """

    trained: int = 0
    acked: int = 0
    ts: float = 0.0


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
