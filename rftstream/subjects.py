"""Names of every stream, subject, consumer and bucket of one run. Pure, no I/O.

One run id scopes everything, so many runs share one NATS deployment::

    RFT_<RUN>_TASKS    rft.<run>.tasks             work queue of tasks
    RFT_<RUN>_EXP      rft.<run>.exp.<stage>       raw, <stage>..., train
    RFT_<RUN>_DLQ      rft.<run>.dlq.<stage>       what an actor could not process
    RFT_<RUN>_METRICS  rft.<run>.metrics.<actor>   metrics of every actor
    RFT_<RUN>_WEIGHTS  rft.<run>.weights.<incarnation>.<version>.data|manifest
                                                   the policy's versions (sync_method jetstream)
    KV rft_<run>_state                             status, steps, weights, heartbeats
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_STAGE_RE = re.compile(r"^[a-z0-9_-]{1,32}$")
_RUN_RE = re.compile(r"^[a-z0-9_]{1,16}$")

RAW_STAGE = "raw"
TRAIN_STAGE = "train"


#: a durable's ``rft.role`` metadata that marks the trainer's (it publishes nothing back)
TRAINER_ROLE = "trainer"
#: the trainer's durable on ``exp.train`` (:attr:`RunNames.trainer_consumer`)
TRAINER_DURABLE = "trainer"


def reads_for_trainer(name: str, filter_subject: str, metadata: dict[str, str]) -> bool:
    """Whether the durable ``name`` of an experience stream is a trainer's (it trains what
    it reads and forwards nothing), not an operator's: its ``rft.role`` is the trainer's;
    or, for a durable of an older release without that metadata, its name is
    :data:`TRAINER_DURABLE`, or it reads ``exp.train`` and is not named ``op_...``.
    (The run's account and the purge rules both ask this.)"""
    role = metadata.get("rft.role", "")
    return (
        role == TRAINER_ROLE
        or name == TRAINER_DURABLE
        or (
            not role
            and filter_subject.endswith(f".exp.{TRAIN_STAGE}")
            and not name.startswith("op_")
        )
    )


def check_stage(stage: str) -> str:
    """Validate a pipeline stage name (one subject token: lower-case, digits, ``_``/``-``)."""
    if not _STAGE_RE.match(stage):
        raise ValueError(f"stage name {stage!r} must match [a-z0-9_-]{{1,32}}")
    return stage


@dataclass(frozen=True)
class RunNames:
    """All names of one run, derived from its run id (``[a-z0-9_]{1,16}``).

    ``name``: the run's full name (config key ``name``, any length), shown to
    users and kept in the streams' metadata; empty means the run id.
    """

    run: str
    name: str = ""

    @property
    def display(self) -> str:
        """The full run name, with the run id when they differ: ``qwen2.5-1.5B-gsm8k (qwen2_5_1_a1b2c3)``."""
        full = self.name or self.run
        return full if full == self.run else f"{full} ({self.run})"

    def __post_init__(self) -> None:
        if not _RUN_RE.match(self.run):
            raise ValueError(f"run id {self.run!r} must match [a-z0-9_]{{1,16}}")

    # streams ---------------------------------------------------------------
    @property
    def upper(self) -> str:
        return self.run.upper()

    @property
    def tasks_stream(self) -> str:
        return f"RFT_{self.upper}_TASKS"

    @property
    def exp_stream(self) -> str:
        return f"RFT_{self.upper}_EXP"

    @property
    def dlq_stream(self) -> str:
        return f"RFT_{self.upper}_DLQ"

    @property
    def metrics_stream(self) -> str:
        return f"RFT_{self.upper}_METRICS"

    @property
    def weights_stream(self) -> str:
        return f"RFT_{self.upper}_WEIGHTS"

    @property
    def streams(self) -> tuple[str, ...]:
        return (
            self.tasks_stream,
            self.exp_stream,
            self.dlq_stream,
            self.metrics_stream,
            self.weights_stream,
        )

    # subjects --------------------------------------------------------------
    @property
    def tasks_subject(self) -> str:
        return f"rft.{self.run}.tasks"

    def exp_subject(self, stage: str) -> str:
        return f"rft.{self.run}.exp.{check_stage(stage)}"

    @property
    def exp_wildcard(self) -> str:
        return f"rft.{self.run}.exp.>"

    def dlq_subject(self, stage: str) -> str:
        return f"rft.{self.run}.dlq.{check_stage(stage)}"

    @property
    def dlq_wildcard(self) -> str:
        return f"rft.{self.run}.dlq.>"

    def metrics_subject(self, actor: str) -> str:
        return f"rft.{self.run}.metrics.{_token(actor)}"

    @property
    def metrics_wildcard(self) -> str:
        return f"rft.{self.run}.metrics.>"

    @property
    def weights_wildcard(self) -> str:
        return f"rft.{self.run}.weights.>"

    def weights_data_subject(self, incarnation: int, version: int) -> str:
        """The payload chunks of weights ``version`` of trainer start ``incarnation``."""
        return f"rft.{self.run}.weights.{int(incarnation)}.{int(version)}.data"

    def weights_manifest_subject(self, incarnation: int, version: int) -> str:
        """The manifest of weights ``version`` (published after its chunks)."""
        return f"rft.{self.run}.weights.{int(incarnation)}.{int(version)}.manifest"

    # consumers & buckets ---------------------------------------------------
    @property
    def explorer_consumer(self) -> str:
        return "explorers"

    def stage_consumer(self, from_stage: str, to_stage: str) -> str:
        """Durable consumer of the operator(s) reading ``from_stage`` for ``to_stage``."""
        return f"op_{check_stage(from_stage)}_to_{check_stage(to_stage)}".replace("-", "_")

    @property
    def trainer_consumer(self) -> str:
        return TRAINER_DURABLE

    @property
    def kv_bucket(self) -> str:
        return f"rft_{self.run}_state"


def _token(name: str) -> str:
    """Make an actor name usable as one subject token."""
    out = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    return out or "_"


# KV keys (dots are allowed in KV keys; `nats kv get rft_<run>_state status`)
#: consumer metadata of an operator durable: the stage it writes (names lose ``-``)
META_TO_STAGE = "rft.to_stage"
KV_STATUS = "status"  # running | finished | failed | stopped
KV_TASKSET = "taskset.published"  # JSON: {"count": N, "epochs": E}
KV_TASKSET_CLAIM = "taskset.published.claim"  # JSON: {"by", "ts", "seq"} (publishing progress)
KV_EVAL_STEP = "eval.step.{step}"  # claimed by the explorer that evaluates after that step
KV_EVAL_FINAL = "eval.final"  # claimed by the explorer that runs the final evaluation
KV_EXPLORER_STEP = "explorer.{name}.step"
KV_EXPLORER_DONE = "explorer.{name}.done"
# wire.ExplorerFlight: an explorer's tasks claimed and done, as two running totals (the
# staleness gates of several explorers count each other's tasks in flight by them)
KV_EXPLORER_FLIGHT = "explorers.in_flight.{name}"
KV_EXPLORER_FLIGHT_PREFIX = KV_EXPLORER_FLIGHT.format(name="")  # every explorer's record
KV_TRAINER_STEP = "trainer.step"
KV_TRAINER_STARTED = "trainer.started"  # wire.TrainerStarted
KV_TRAINER_DONE = "trainer.done"  # wire.TrainerDone
KV_TRAINER_STARVING = (
    "trainer.starving"  # {"since": ts, "held": messages} while it waits with less than a batch
)
KV_TRAINER_CHECKPOINT = "trainer.checkpoint"  # CheckpointRecord: where a restart resumes
KV_TRAINER_UNACKED = "trainer.trained_unacked"  # TrainedUnacked: trained, held until a checkpoint
# wire.AckedBelow: the trainer's durable acked everything below a sequence, where the
# server's ack floor lags (explorers purge by it)
KV_TRAINER_ACKED_BELOW = "trainer.acked_below"
KV_WEIGHTS = "weights.latest"  # wire.WeightsPointer: where the newest published version is
# wire.WeightsPending: the trainer's newest version, written before it acks the step's batch
# (it may still be on its way to the weights stream: sync_method jetstream publishes it after)
KV_WEIGHTS_PENDING = "weights.pending"
# wire.KeyframeRequest: an explorer that cannot rebuild the delta chain asks for a keyframe
KV_WEIGHTS_KEYFRAME = "weights.keyframe_request"
KV_HEARTBEAT = "heartbeat.{actor}"
KV_HEARTBEAT_PREFIX = KV_HEARTBEAT.format(actor="")  # every actor's heartbeat key starts so
# the trainer's input and the spliced stages (protocol: rftstream.control.splice). Their records'
# shapes are the structs of rftstream.wire; read and write them through its typed handles
# (wire.SPLICE, wire.TRAINER_INPUT, wire.STAGE.of(stage=...), ...), not these names.
KV_SPLICE = "splice"  # wire.SpliceRecord: the one topology change in flight
KV_TRAINER_INPUT = "trainer.input"  # wire.TrainerInput: the stage the trainer reads
KV_TOPOLOGY = "topology"  # list[wire.TopologyEdge]: every change so far
KV_STAGE = "stage.{stage}"  # wire.StageRecord: a spliced stage, its durable and owner
KV_TRAINER_WAITING = "trainer.waiting"  # wire.TrainerWaiting: a dead stage starves the trainer
