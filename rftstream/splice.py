"""Splicing an operator in front of the trainer, and removing it again, while a run goes on.

``rftstream operator NAME --splice --to Y`` puts a new stage between the
stage ``X`` the trainer reads and the trainer; ``rftstream operator --unsplice
Y`` (or Ctrl-C / SIGTERM on the spliced operator) takes it out again. Neither
loses an experience or trains one twice. The protocol lives in the run's KV
bucket; every key is readable with ``nats kv get rft_<run>_state KEY``:

``splice``
    The one topology change in flight, ``{"id", "kind", "state", ...}``.
    Writers move it on with compare-and-set, so two parties never both win.
``trainer.input``
    ``{"stage", "consumer", "retired": [{"consumer", "cut_seq", "splice_id"}]}``:
    the stage the trainer reads and the consumers it still drains (absent:
    ``train`` through the durable ``trainer``). Written by the trainer only.
``stage.<Y>``
    A spliced stage: ``{"operator", "args", "from_stage", "to_stage",
    "durable", "owner": {"actor", "pid", "host", "ts", "token"}}``. The owner
    (the process serving it) refreshes ``ts`` every few seconds; a process
    that finds another owner there (it took a stale stage over) stops serving.
``topology``
    ``[{"op": "splice"|"unsplice", "from", "to", "by", "seq", "ts", "splice_id"}, ...]``.

Splice (``kind: "splice"``): the operator writes ``state: "requested"``; the
trainer claims it between two fetches, takes ``S``, the last stream sequence
its consumer delivered, creates its durable on ``exp.Y`` (from the stream's
next sequence) and answers ``"cut"`` with ``start_seq = S + 1``. The
operator's durable on ``exp.X`` starts there. Messages up to ``S`` stay the
trainer's: the old consumer is *retired* and drained up to ``S``, then deleted.

Unsplice (``kind: "unsplice"``), the exact inverse:

1. ``"asked"`` (only from ``--unsplice``): the owner of ``exp.Y`` sees it.
2. The owner stops fetching in every replica; each finishes and acks its
   batch. ``C`` = the last sequence its durable delivered. ``"requested"``.
3. The trainer claims it, creates a durable on ``exp.X`` from ``C + 1``, reads
   that from now on and retires its ``exp.Y`` consumer with an *open* cut (it
   takes everything there). ``"cut"``.
4. The owner drains: messages up to ``C`` that are still unacked (delivered to
   a crashed replica, lost in transit) are redelivered and processed; later
   ones, which the trainer now reads itself, are acked unprocessed. When its
   ack floor reaches ``C`` it takes ``D``, the last sequence on ``exp.Y``, and
   writes ``"drained"`` with ``drain_until = D``, deletes its durable and the
   ``stage.Y`` record.
5. The trainer drains ``exp.Y`` up to ``D``, deletes that consumer: ``"done"``.

A spliced operator that dies (SIGKILL) is restarted with the same ``--splice``
command: it finds ``stage.Y`` and resumes its durable (or an unsplice that was
under way) instead of splicing again. While it is down, the trainer writes
``trainer.waiting`` with the command to run, which ``rftstream status`` shows.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from rftstream.bus.state import END_STATUSES, RunState
from rftstream.errors import RftError
from rftstream.subjects import (
    KV_SPLICE,
    KV_STAGE,
    KV_TOPOLOGY,
    KV_TRAINER_INPUT,
    RAW_STAGE,
    TRAIN_STAGE,
    check_stage,
)

log = logging.getLogger(__name__)

__all__ = [
    "KV_SPLICE",
    "KV_STAGE",
    "KV_TOPOLOGY",
    "KV_TRAINER_INPUT",
    "SpliceCut",
    "stage_chain",
    "trainer_durable",
]

OWNER_REFRESH_S = 2.0
OWNER_STALE_S = 15.0  # an owner not seen for this long is gone
TRAINER_PATIENCE_S = 90.0  # how long a request waits without any live trainer
ASKED_STALE_S = 60.0  # an "asked" nobody took up may be replaced after this long
ACTIVE = ("asked", "requested", "claimed")


def trainer_durable(stage: str) -> str:
    """The trainer's usual durable consumer on ``stage`` (``trainer`` on ``train``)."""
    return "trainer" if stage == TRAIN_STAGE else f"trainer_{stage}".replace("-", "_")


@dataclass(frozen=True)
class SpliceCut:
    """Where a spliced operator takes over: ``exp.<from_stage>`` from ``start_seq`` on."""

    id: str
    from_stage: str
    to_stage: str
    start_seq: int


def in_flight(value: Any) -> bool:
    """True while ``value`` (the ``splice`` record) is a change not finished yet."""
    if not isinstance(value, dict):
        return False
    st = value.get("state")
    if st in ACTIVE:
        return True
    return value.get("kind") == "unsplice" and st in ("cut", "drained")


def unsplice_in_flight(value: Any, stage: str | None = None) -> bool:
    """True while ``value`` (the ``splice`` record) is an unsplice not finished yet, of
    ``exp.<stage>`` when ``stage`` is given."""
    return (
        in_flight(value)
        and value.get("kind") == "unsplice"
        and (stage is None or value.get("to_stage") == stage)
    )


def owner_alive(record: dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether the process serving a spliced stage (``stage.<Y>`` record) still runs.

    A pid on this host is checked directly; otherwise the owner's last
    refresh must be younger than :data:`OWNER_STALE_S`.
    """
    owner = (record or {}).get("owner")
    if not isinstance(owner, dict):
        return False
    if owner.get("host") == socket.gethostname() and owner.get("pid"):
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, someone else's
    return (now or time.time()) - float(owner.get("ts", 0)) < OWNER_STALE_S


def owner_info(actor: str, token: str | None = None) -> dict[str, Any]:
    """This process as the owner of a stage; ``token`` tells two claims of one process apart."""
    return {
        "actor": actor,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "ts": time.time(),
        "token": token or uuid.uuid4().hex[:12],
    }


def same_owner(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two ``owner`` entries are the same claim (process and token)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    return all(a.get(k) == b.get(k) for k in ("pid", "host", "token"))


def restart_hint(record: dict[str, Any]) -> str:
    """The command that resumes the operator of a spliced stage."""
    import json
    import shlex

    args = record.get("args")
    parts = ["rftstream", "operator", str(record.get("operator"))]
    if args:
        parts += ["--args", json.dumps(args)]
    parts += ["--splice", "--to", str(record.get("to_stage"))]
    return " ".join(shlex.quote(p) for p in parts) + " --config C --nats-url U"


# ----------------------------------------------------------------- reading the state


async def trainer_input_record(state: RunState) -> dict[str, Any]:
    value = await state.get_json(KV_TRAINER_INPUT)
    return value if isinstance(value, dict) else {}


def input_of(record: Any) -> tuple[str, str]:
    """``(stage, durable)`` a ``trainer.input`` record names (``exp.train`` if none)."""
    if isinstance(record, dict) and record.get("stage"):
        stage = str(record["stage"])
        return stage, str(record.get("consumer") or trainer_durable(stage))
    return TRAIN_STAGE, trainer_durable(TRAIN_STAGE)


async def trainer_input(state: RunState) -> tuple[str, str]:
    """``(stage, durable)`` the trainer reads now."""
    return input_of(await trainer_input_record(state))


async def stage_record(state: RunState, stage: str) -> dict[str, Any] | None:
    value = await state.get_json(KV_STAGE.format(stage=stage))
    return value if isinstance(value, dict) else None


def stage_chain(
    values: dict[str, Any], input_stage: str = RAW_STAGE, output_stage: str = TRAIN_STAGE
) -> list[dict[str, Any]]:
    """The stages from ``exp.raw`` to the trainer, from a dump of the KV bucket.

    Each item: ``{"stage", "operator"}`` (operator None for the configured
    stages). Walks back from the stage the trainer reads through the spliced
    stages' ``from_stage``.
    """
    current, _ = input_of(values.get(KV_TRAINER_INPUT))
    spliced: list[dict[str, Any]] = []
    seen: set[str] = set()
    while current not in seen:
        seen.add(current)
        rec = values.get(KV_STAGE.format(stage=current))
        if not isinstance(rec, dict):
            break
        spliced.append({"stage": current, "operator": rec.get("operator")})
        current = str(rec.get("from_stage"))
    spliced_names = {s["stage"] for s in spliced}
    stages = dict.fromkeys([input_stage, output_stage, current])
    base = [{"stage": s, "operator": None} for s in stages if s not in spliced_names]
    return base + list(reversed(spliced))


async def trainer_alive(state: RunState, now: float | None = None) -> bool:
    """A trainer heartbeat younger than 30 s exists and the trainer is not done.

    A trainer's last heartbeat carries its end ``status`` (finished, stopped,
    failed); such a heartbeat does not count, however fresh.
    """
    now = now or time.time()
    for hb in (await state.heartbeats()).values():
        if hb.get("role") != "trainer" or hb.get("status"):
            continue
        if now - float(hb.get("ts", 0)) < 30.0:
            return True
    return False


async def _wait_for(
    state: RunState,
    what: str,
    done: Callable[[dict[str, Any]], bool],
    *,
    splice_id: str,
    patience: float = TRAINER_PATIENCE_S,
) -> dict[str, Any]:
    """Poll ``splice`` until ``done(value)``; raise when the record is replaced or no
    trainer has been alive for ``patience`` s (or the run ended)."""
    last_alive = time.monotonic()
    checked = 0.0
    while True:
        value = await state.get_json(KV_SPLICE)
        if not isinstance(value, dict) or value.get("id") != splice_id:
            raise RftError(f"{what}: the request was replaced by another: {value}")
        if done(value):
            return value
        if value.get("state") in ("abandoned", "refused"):
            raise RftError(f"{what}: {value.get('reason') or value.get('state')}")
        now = time.monotonic()
        if now - checked > 3.0:
            checked = now
            status = await state.status()
            if status in END_STATUSES:
                raise RftError(f"{what}: the run is {status}")
            if await trainer_alive(state):
                last_alive = now
            elif now - last_alive > patience:
                raise TrainerGone(
                    f"{what}: no trainer has been running for {patience:.0f}s "
                    f"(no fresh trainer heartbeat; run status {status!r})"
                )
        await anyio.sleep(0.2)


class TrainerGone(RftError):
    """No trainer answers a splice or unsplice request."""


async def _wait_answer(
    state: RunState,
    what: str,
    done: Callable[[dict[str, Any]], bool],
    *,
    splice_id: str,
    patience: float = TRAINER_PATIENCE_S,
) -> dict[str, Any]:
    """:func:`_wait_for` the trainer's answer to a request this process wrote.

    When no trainer has been alive for ``patience`` s, the request is
    abandoned (compare-and-set) and :class:`TrainerGone` raised, unless a
    trainer claimed it meanwhile: a claimed request is completed by a
    restarted trainer, so this keeps waiting for it (logging a warning each
    ``patience`` s), until the run ends.
    """
    while True:
        try:
            return await _wait_for(state, what, done, splice_id=splice_id, patience=patience)
        except TrainerGone:
            st = await abandon(state, splice_id, "no trainer answered")
            if st in (None, "abandoned"):
                raise
            if st == "claimed":
                log.warning(
                    "%s: a trainer claimed the request, then stopped; a restarted trainer "
                    "completes it: waiting for one (run `rftstream status` to see the run)",
                    what,
                )


async def _wait_quiet(state: RunState, what: str, patience: float = 60.0) -> tuple[Any, int | None]:
    """Wait until no other topology change is in flight; ``(value, revision)`` of ``splice``."""
    deadline = time.monotonic() + patience
    while True:
        value, rev = await state.get_entry(KV_SPLICE)
        if not in_flight(value):
            return value, rev
        age = time.time() - float(value.get("ts", 0))
        if value.get("state") == "asked" and age > ASKED_STALE_S:
            return value, rev  # nobody took it up: it may be replaced
        if time.monotonic() > deadline:
            raise RftError(
                f"{what}: another change ({value.get('kind', 'splice')} of exp."
                f"{value.get('to_stage')}, state {value.get('state')}) has been under way for "
                f"{age:.0f}s; try again when it is done (`rftstream status` shows it)"
            )
        await anyio.sleep(0.3)


# ----------------------------------------------------------------- splice: operator side


async def request_splice(
    state: RunState,
    operator: str,
    to_stage: str,
    *,
    args: dict[str, Any] | None = None,
    actor: str | None = None,
    patience: float = TRAINER_PATIENCE_S,
) -> SpliceCut:
    """Operator side: ask the trainer to cut over to ``to_stage``; wait for its answer.

    Blocks (polling the KV bucket) until the trainer has switched; raises
    :class:`RftError` when the trainer already reads ``to_stage``, another
    change is under way for over a minute, the run ends, or no trainer has
    been alive for ``patience`` s. If no trainer answers, the request is
    abandoned (compare-and-set); one a trainer claimed meanwhile is waited
    for (see :func:`_wait_answer`).
    """
    check_stage(to_stage)
    current, _ = await trainer_input(state)
    if to_stage == current:
        raise RftError(f"the trainer already reads exp.{to_stage}; choose another --to stage")
    if to_stage in (RAW_STAGE, TRAIN_STAGE):
        raise RftError(f"--to {to_stage}: choose a new stage name, not {to_stage!r}")
    _, rev = await _wait_quiet(state, f"splice {operator} -> exp.{to_stage}")
    request = {
        "id": uuid.uuid4().hex[:12],
        "kind": "splice",
        "state": "requested",
        "operator": operator,
        "args": args or {},
        "to_stage": to_stage,
        "owner": owner_info(actor or operator),
        "ts": time.time(),
    }
    if await state.compare_and_put(KV_SPLICE, request, rev) is None:
        raise RftError("another splice or unsplice was requested at the same moment; try again")
    what = f"splice {operator} -> exp.{to_stage}"
    value = await _wait_answer(
        state, what, lambda v: v.get("state") == "cut", splice_id=request["id"], patience=patience
    )
    return SpliceCut(
        id=request["id"],
        from_stage=str(value["from_stage"]),
        to_stage=to_stage,
        start_seq=int(value["start_seq"]),
    )


async def abandon(
    state: RunState,
    which: str | Callable[[dict[str, Any]], bool],
    reason: str,
) -> str | None:
    """Mark a request abandoned unless the trainer took it up meanwhile (compare-and-set).

    ``which``: the request's id, or a test on the ``splice`` record. Returns
    the request's state afterwards: ``"abandoned"`` (by this call or
    before), the state the trainer moved it on to (``"claimed"``, ``"cut"``,
    ``"refused"``, ...), or None when ``splice`` holds no such request.
    """
    match = which if callable(which) else (lambda v: v.get("id") == which)
    while True:
        value, rev = await state.get_entry(KV_SPLICE)
        if not (isinstance(value, dict) and match(value)):
            return None
        st = value.get("state")
        if st not in ("asked", "requested"):
            return str(st)
        new = {**value, "state": "abandoned", "reason": reason, "ts_abandoned": time.time()}
        if await state.compare_and_put(KV_SPLICE, new, rev) is not None:
            return "abandoned"
        # moved on meanwhile: look at its new state


# ----------------------------------------------------------------- unsplice: asking and owning


async def ask_unsplice(state: RunState, stage: str) -> str:
    """``--unsplice``: ask the owner of ``exp.<stage>`` to take itself out. Returns the id.

    Raises :class:`RftError` when the stage is not spliced, is not the one
    the trainer reads (remove the later ones first), or its owner is not
    running (with the command that restarts it).
    """
    check_stage(stage)
    record = await stage_record(state, stage)
    if record is None:
        raise RftError(
            f"--unsplice {stage}: exp.{stage} is not a spliced stage "
            "(`rftstream status` shows the chain)"
        )
    current, _ = await trainer_input(state)
    value = await state.get_json(KV_SPLICE)
    resuming = unsplice_in_flight(value, stage)
    if current != stage and not resuming:
        raise RftError(
            f"--unsplice {stage}: the trainer reads exp.{current}, which is spliced after "
            f"exp.{stage}; remove exp.{current} first"
        )
    if not owner_alive(record):
        raise RftError(
            f"--unsplice {stage}: its operator {record.get('operator')!r} is not running "
            f"(owner {(record.get('owner') or {}).get('actor')!r} last seen "
            f"{time.time() - float((record.get('owner') or {}).get('ts', 0)):.0f}s ago). "
            f"Start it again with `{restart_hint(record)}` (it resumes where it stopped), "
            "then remove it with Ctrl-C or --unsplice"
        )
    if resuming:
        return str(value["id"])  # type: ignore[index]
    _, rev = await _wait_quiet(state, f"unsplice exp.{stage}")
    ask = {
        "id": uuid.uuid4().hex[:12],
        "kind": "unsplice",
        "state": "asked",
        "operator": record.get("operator"),
        "to_stage": stage,
        "from_stage": record.get("from_stage"),
        "ts": time.time(),
    }
    if await state.compare_and_put(KV_SPLICE, ask, rev) is None:
        raise RftError("another splice or unsplice was requested at the same moment; try again")
    return str(ask["id"])


async def wait_unsplice(
    state: RunState, splice_id: str, stage: str, *, patience: float = TRAINER_PATIENCE_S
) -> dict[str, Any]:
    """``--unsplice``: wait until the owner has drained (``"drained"`` or ``"done"``). Blocks.

    Raises :class:`RftError` when the stage's owner is not running, whatever
    the state of the request (with the command that restarts it: before it
    took the request up, the request is abandoned; after, the restarted
    operator finishes the removal itself), when the run ends, and
    (:class:`TrainerGone`) when no trainer has been running for ``patience``
    s while the request waits for one (the operator keeps it: a restarted
    trainer completes it).
    """
    what = f"--unsplice {stage}"
    last_alive = time.monotonic()
    checked = 0.0
    while True:
        value = await state.get_json(KV_SPLICE)
        if not isinstance(value, dict) or value.get("id") != splice_id:
            raise RftError(f"{what}: the request was replaced by another: {value}")
        st = value.get("state")
        if st in ("drained", "done"):
            return value
        if st in ("abandoned", "refused"):
            raise RftError(f"{what}: {value.get('reason') or st}")
        record = await stage_record(state, stage)
        if record is not None and not owner_alive(record):
            hint = restart_hint(record)
            if st == "asked":
                took = await abandon(state, splice_id, "the stage's operator stopped running")
                if took in (None, "abandoned"):
                    raise RftError(
                        f"{what}: its operator stopped before removing itself; start it "
                        f"again with `{hint}`, then retry"
                    )
                st = took
            raise RftError(
                f"{what}: its operator stopped in the middle of removing itself (request "
                f"{splice_id} is {st!r}); start it again with `{hint}`: it resumes the "
                "removal and finishes it"
            )
        now = time.monotonic()
        if now - checked > 3.0:
            checked = now
            status = await state.status()
            if status in END_STATUSES:
                raise RftError(f"{what}: the run is {status}; the stage was not removed")
            if st not in ("requested", "claimed") or await trainer_alive(state):
                last_alive = now
            elif now - last_alive > patience:
                raise TrainerGone(
                    f"{what}: no trainer has been running for {patience:.0f}s (request "
                    f"{splice_id} is {st!r}); the operator keeps the request, and a restarted "
                    "trainer completes it"
                )
        await anyio.sleep(0.3)


async def claim_stage(state: RunState, stage: str, actor: str) -> dict[str, Any]:
    """Owner side: become the process serving a spliced stage (its record must exist).

    Raises :class:`RftError` when another live process owns it. The record
    returned carries this claim's ``owner`` (pass it to :func:`refresh_owner`).
    """
    key = KV_STAGE.format(stage=stage)
    record, rev = await state.get_entry(key)
    if not isinstance(record, dict):
        raise RftError(f"exp.{stage} is not a spliced stage")
    current = record.get("owner") or {}
    mine = (current.get("pid"), current.get("host")) == (os.getpid(), socket.gethostname())
    if owner_alive(record) and not mine:
        owner = record["owner"]
        raise RftError(
            f"exp.{stage} is already served by {owner.get('actor')!r} (pid {owner.get('pid')} "
            f"on {owner.get('host')}, seen {time.time() - float(owner.get('ts', 0)):.0f}s ago); "
            "stop it first (Ctrl-C removes the stage, SIGKILL leaves it spliced)"
        )
    new = {**record, "owner": owner_info(actor)}
    if await state.compare_and_put(key, new, rev) is None:
        raise RftError(f"exp.{stage}: another process claimed it at the same moment")
    return new


async def refresh_owner(state: RunState, stage: str, owner: dict[str, Any]) -> None:
    """Keep this process's claim on ``stage.<Y>`` fresh every :data:`OWNER_REFRESH_S` s.

    ``owner``: the ``owner`` entry :func:`claim_stage` wrote. Returns when the
    record is gone (unspliced); runs until cancelled otherwise. Raises
    :class:`RftError` when another process owns the stage now (it claimed it
    while this one looked gone): this process must stop serving it, so two
    never process one stage. A KV error is logged and retried at the next
    refresh.
    """
    key = KV_STAGE.format(stage=stage)
    actor = str(owner.get("actor"))
    while True:
        await anyio.sleep(OWNER_REFRESH_S)
        try:
            record, rev = await state.get_entry(key)
            if not isinstance(record, dict):
                return  # unspliced
            if not same_owner(record.get("owner"), owner):
                break
            new = {**record, "owner": owner_info(actor, token=owner.get("token"))}
            await state.compare_and_put(key, new, rev)  # lost to a writer: checked next time
        except Exception as exc:  # noqa: BLE001 - KV trouble: the next refresh retries
            log.warning("%s: could not refresh its claim on exp.%s: %s", actor, stage, exc)
    other = record.get("owner") or {}
    raise RftError(
        f"exp.{stage}: {other.get('actor')!r} (pid {other.get('pid')} on {other.get('host')}) "
        f"took the stage over while {actor!r} (pid {owner.get('pid')}) looked gone (no refresh "
        f"for {OWNER_STALE_S:.0f}s); this process stops serving it"
    )


async def request_unsplice(
    state: RunState,
    splice_id: str,
    *,
    operator: str,
    from_stage: str,
    to_stage: str,
    cut_seq: int,
) -> None:
    """Owner side, step 2: the hosts stopped at ``cut_seq``; ask the trainer to read
    ``exp.<from_stage>`` from ``cut_seq + 1`` and wait until it does (step 3)."""
    value, rev = await state.get_entry(KV_SPLICE)
    if isinstance(value, dict) and value.get("id") == splice_id:
        base = value  # the owner takes up an "asked"
    else:
        if in_flight(value) and not (
            isinstance(value, dict)
            and value.get("state") == "asked"
            and time.time() - float(value.get("ts", 0)) > ASKED_STALE_S
        ):
            raise RftError(
                f"unsplice exp.{to_stage}: another change is under way ({value}); try again"
            )
        base = {"id": splice_id, "kind": "unsplice", "ts": time.time()}
    request = {
        **base,
        "kind": "unsplice",
        "state": "requested",
        "operator": operator,
        "from_stage": from_stage,
        "to_stage": to_stage,
        "cut_seq": int(cut_seq),
        "ts_requested": time.time(),
    }
    if await state.compare_and_put(KV_SPLICE, request, rev) is None:
        raise RftError(f"unsplice exp.{to_stage}: the splice record changed meanwhile; try again")
    await wait_unsplice_cut(state, splice_id, to_stage)


async def wait_unsplice_cut(
    state: RunState, splice_id: str, to_stage: str, *, patience: float = TRAINER_PATIENCE_S
) -> dict[str, Any]:
    """Owner side: wait until the trainer reads the upstream stage again (``"cut"``). Blocks.

    No trainer for a while: the request is abandoned and :class:`TrainerGone`
    raised, unless a trainer claimed it (then this keeps waiting, see
    :func:`_wait_answer`), exactly as for a splice.
    """
    return await _wait_answer(
        state,
        f"unsplice exp.{to_stage}",
        lambda v: v.get("state") in ("cut", "drained", "done"),
        splice_id=splice_id,
        patience=patience,
    )


async def finish_unsplice(state: RunState, splice_id: str, stage: str, drain_until: int) -> None:
    """Owner side, step 4: everything up to the cut is processed; ``exp.<stage>`` ends at
    ``drain_until``. Deletes the ``stage.<Y>`` record."""
    value, rev = await state.get_entry(KV_SPLICE)
    if not (isinstance(value, dict) and value.get("id") == splice_id):
        raise RftError(f"unsplice exp.{stage}: the splice record changed meanwhile: {value}")
    if value.get("state") == "cut":
        new = {
            **value,
            "state": "drained",
            "drain_until": int(drain_until),
            "ts_drained": time.time(),
        }
        if await state.compare_and_put(KV_SPLICE, new, rev) is None:
            raise RftError(f"unsplice exp.{stage}: the splice record changed meanwhile")
    await state.delete(KV_STAGE.format(stage=stage))


# ----------------------------------------------------------------- trainer side


def pending_for_trainer(value: Any, rev: int | None) -> tuple[dict[str, Any], int] | None:
    """The request the trainer has to act on, with its revision, if ``value`` (the
    ``splice`` record at revision ``rev``) is one."""
    if not isinstance(value, dict) or rev is None:
        return None
    st = value.get("state")
    if st in ("requested", "claimed"):
        return value, rev
    if value.get("kind") == "unsplice" and st == "drained":
        return value, rev
    return None


async def claim(state: RunState, request: dict[str, Any], revision: int) -> int | None:
    """Trainer side: take the request (compare-and-set), so it can no longer be abandoned."""
    if request.get("state") == "claimed":
        return revision
    return await state.compare_and_put(
        KV_SPLICE, {**request, "state": "claimed", "ts_claimed": time.time()}, revision
    )


async def record_topology(
    state: RunState,
    op: str,
    from_stage: str,
    to_stage: str,
    by: Any,
    seq: int,
    splice_id: str | None = None,
) -> None:
    """Append one change to ``topology``; once per ``splice_id`` (a retried answer adds none)."""
    topology = await state.get_json(KV_TOPOLOGY)
    edges = list(topology) if isinstance(topology, list) else []
    if splice_id is not None and any(
        isinstance(e, dict) and e.get("splice_id") == splice_id for e in edges
    ):
        return
    edges.append(
        {
            "op": op,
            "from": from_stage,
            "to": to_stage,
            "by": by,
            "seq": int(seq),
            "ts": time.time(),
            "splice_id": splice_id,
        }
    )
    await state.put_json(KV_TOPOLOGY, edges)


async def answer(run_state: RunState, request: dict[str, Any], **fields: Any) -> None:
    """Trainer side: move the request on (its new ``state`` and the answer's fields)."""
    value = await run_state.get_json(KV_SPLICE)
    if not (isinstance(value, dict) and value.get("id") == request.get("id")):
        raise RftError(f"the splice record changed while the trainer answered it: {value}")
    await run_state.put_json(KV_SPLICE, {**value, **fields, "ts_answered": time.time()})


async def put_stage_record(
    state: RunState, request: dict[str, Any], from_stage: str, durable: str, start_seq: int
) -> None:
    """Trainer side, at a splice cut: ``stage.<Y>`` exists from the moment the trainer reads it."""
    to_stage = str(request["to_stage"])
    await state.put_json(
        KV_STAGE.format(stage=to_stage),
        {
            "operator": request.get("operator"),
            "args": request.get("args") or {},
            "from_stage": from_stage,
            "to_stage": to_stage,
            "durable": durable,
            "start_seq": int(start_seq),
            "splice_id": request.get("id"),
            "owner": request.get("owner") or {"actor": request.get("operator"), "ts": 0},
        },
    )
