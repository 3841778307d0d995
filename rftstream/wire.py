"""Every control record on the bus, as typed msgspec structs, with typed KV key handles.

The data plane's records (experiences, tasks, metrics, dead letters) are in
:mod:`rftstream.experience` and :mod:`rftstream.messages`; this module holds
the control plane: what actors write to the run's KV bucket
(``rft_<run>_state``) and read back. Every record is JSON (readable with
``nats kv get``), decoded into its struct, so a drifted shape is an error at
the reader instead of a ``KeyError`` somewhere later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from rftstream.subjects import (
    KV_EXPLORER_DONE,
    KV_EXPLORER_STEP,
    KV_HEARTBEAT,
    KV_TASKSET,
    KV_TASKSET_CLAIM,
    KV_TRAINER_STARVING,
)

# --- splice protocol: splice, trainer.input, stage.<Y>, topology, trainer.waiting/started/done (H-splice)

# --- explorer side: taskset claim, heartbeat, trainer.starving (H-explorer)
# Key[T]: the minimal typed key handle; if the splice section defines one too, the merge keeps one
T = TypeVar("T")


@dataclass(frozen=True)
class Key(Generic[T]):
    """A key of the run's KV bucket and the type of its record.

    ``name`` may be a template (``explorer.{name}.step``): :meth:`of` fills it in.
    Read with ``RunState.get_json(key.name, key.type)``.
    """

    name: str
    type: type[T]

    def of(self, **fields: object) -> Key[T]:
        """The concrete key of a templated one (``EXPLORER_STEP.of(name="e0")``)."""
        return Key(self.name.format(**fields), self.type)


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
    (:mod:`rftstream.taskset_claim`).
    """

    by: str
    ts: float
    seq: int = 0
    taken_over_from: str = ""


class TrainerStarving(msgspec.Struct, kw_only=True):
    """KV record ``trainer.starving``, written by the trainer at each empty fetch.

    ``since``: when it started waiting with less than a batch (None: it is fed);
    ``held``: the messages it held when it said so (a flag older than what the
    trainer holds now is stale: see :meth:`rftstream.sync.SyncPolicy.starving_trainer_overrides`).
    """

    since: float | None = None
    held: int = 0


class ExplorerDone(msgspec.Struct, kw_only=True):
    """KV record ``explorer.<name>.done``: the explorer stopped exploring, and why
    (``drained``: no tasks left; ``total_steps``: ``mode: explore`` reached its steps)."""

    step: int
    ts: float
    why: str


class Heartbeat(msgspec.Struct, kw_only=True):
    """KV record ``heartbeat.<actor>``: an actor is alive, with its own progress fields.

    On the bus the record is one flat JSON object: ``actor``, ``role``, ``ts`` and
    the actor's fields (``info``: an explorer's ``step``/``model_version``/...,
    a trainer's ``step``/``version``, an operator's counters) beside them.
    """

    actor: str
    role: str
    ts: float
    info: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def now(cls, actor: str, role: str, **info: Any) -> Heartbeat:
        """The heartbeat of ``actor`` stamped with the wall clock."""
        return cls(actor=actor, role=role, ts=time.time(), info=info)

    def to_value(self) -> dict[str, Any]:
        """The flat JSON object written to the KV."""
        return {"actor": self.actor, "role": self.role, "ts": self.ts, **self.info}

    @classmethod
    def from_value(cls, value: dict[str, Any], actor: str = "") -> Heartbeat:
        """A record read back (``actor``: the key's, for a record that lacks it)."""
        info = {k: v for k, v in value.items() if k not in ("actor", "role", "ts")}
        return cls(
            actor=str(value.get("actor") or actor),
            role=str(value.get("role") or ""),
            ts=float(value.get("ts") or 0.0),
            info=info,
        )


TASKSET_PUBLISHED: Key[TasksetRecord] = Key(KV_TASKSET, TasksetRecord)
TASKSET_CLAIM: Key[TasksetClaim] = Key(KV_TASKSET_CLAIM, TasksetClaim)
TRAINER_STARVING: Key[TrainerStarving] = Key(KV_TRAINER_STARVING, TrainerStarving)
EXPLORER_STEP: Key[int] = Key(KV_EXPLORER_STEP, int)  # the explorer's last step, a JSON int
EXPLORER_DONE: Key[ExplorerDone] = Key(KV_EXPLORER_DONE, ExplorerDone)
HEARTBEAT: Key[Heartbeat] = Key(KV_HEARTBEAT, Heartbeat)  # read with Heartbeat.from_value
