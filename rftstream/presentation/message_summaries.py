"""Readable summaries of run messages, for ``rftstream decode`` and ``rftstream tail``.

Pure functions, no I/O: a message body (and its headers) in, a JSON-able dict
out. ``nats stream view RFT_<RUN>_EXP --translate "rftstream decode"`` pipes
each body through :func:`summarize_body`.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rftstream.control.splice.protocol import in_flight, stage_chain
from rftstream.errors import SchemaError
from rftstream.experience import SCHEMA_NAME, decode_group_msg, from_record
from rftstream.subjects import KV_HEARTBEAT_PREFIX, KV_TRAINER_STEP, KV_WEIGHTS
from rftstream.wire import (
    DLQ_HEADERS,
    EXPLORER_FLIGHT,
    HEARTBEAT,
    METRICS_SCHEMA,
    SPLICE,
    STAGE,
    TASK_SCHEMA,
    TRAINER_DONE,
    TRAINER_INPUT,
    TRAINER_WAITING,
)


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return round(sum(vals) / len(vals), 4) if vals else None


def summarize_experience_body(body: bytes, *, max_text: int = 60) -> dict[str, Any]:
    """One line of facts about an experience-group body (raises :class:`SchemaError`)."""
    msg = decode_group_msg(body)
    exps = [from_record(r) for r in msg.experiences]
    rewards = [e.reward for e in exps]
    first = exps[0] if exps else None
    text = (first.response_text or "") if first else ""
    out: dict[str, Any] = {
        "schema": msg.schema,
        "group": msg.group_id,
        "count": len(exps),
        "reward_mean": _mean([r for r in rewards if r is not None]),
        "rewards": rewards,
        "model_versions": sorted({e.model_version for e in exps}),
        "tokens": sum(int(e.tokens.numel()) for e in exps),
        "response_lengths": [e.response_length for e in exps],
        "has_advantages": all(e.advantages is not None for e in exps) if exps else False,
        "producer": msg.producer,
    }
    if msg.parts > 1:
        out["part"] = f"{msg.part + 1}/{msg.parts}"
    if first is not None:
        out["first_response"] = text if len(text) <= max_text else text[: max_text - 1] + "…"
    return out


def summarize_body(body: bytes) -> dict[str, Any]:
    """Summarise any rftstream message body: experience group, task or metrics record.

    Raises :class:`SchemaError` naming what it tried when the body is none of them.
    """
    try:
        return summarize_experience_body(body)
    except SchemaError as exp_error:
        try:
            data = msgspec.json.decode(body)
        except msgspec.DecodeError:
            raise SchemaError(f"not an rftstream message ({exp_error})") from exp_error
        if isinstance(data, dict) and data.get("schema") in (TASK_SCHEMA, METRICS_SCHEMA):
            return data
        raise SchemaError(
            f"JSON body without a known rftstream schema (expected {SCHEMA_NAME}, {TASK_SCHEMA} or {METRICS_SCHEMA})"
        ) from exp_error


def summarize_message(
    subject: str, seq: int | None, headers: dict[str, str] | None, body: bytes
) -> dict[str, Any]:
    """A summary with where the message is: subject, stream sequence, DLQ reason if any."""
    out: dict[str, Any] = {"subject": subject}
    if seq is not None:
        out["seq"] = seq
    hdrs = headers or {}
    dlq = {k: v for k, v in hdrs.items() if k in DLQ_HEADERS}
    if dlq:
        out["dead_letter"] = dlq
    try:
        out.update(summarize_body(body))
    except SchemaError as exc:
        out["undecodable"] = str(exc)
        out["bytes"] = len(body)
    return out


def _int(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def status_report(
    values: dict[str, Any], now: float, input_stage: str = "raw", output_stage: str = "train"
) -> dict[str, Any]:
    """``rftstream status`` from a dump of the run's KV bucket (key -> decoded JSON value).

    ``trainer``: its step and version (its step: the newest of ``trainer.step``,
    its heartbeat's and the published weights' version). ``explorers``: each one's step,
    ``model_version`` (weights it generates with, from its heartbeat),
    ``staleness`` = trainer version - model_version and ``tasks_in_flight`` (its
    ``explorers.in_flight.<name>`` record; None without one). ``heartbeats``: every
    actor's role, age in seconds and the rest of its record. ``chain``: the
    stages from ``exp.<input_stage>`` to the trainer, spliced operators named.
    """
    heartbeats: list[dict[str, Any]] = []
    for key, value in values.items():
        if not key.startswith(KV_HEARTBEAT_PREFIX):
            continue
        beat = HEARTBEAT.convert(value)
        if beat is None:  # not an rftstream heartbeat: shown as it is, without an age
            name = key[len(KV_HEARTBEAT_PREFIX) :]
            info = value if isinstance(value, dict) else {"value": value}
            heartbeats.append({"actor": name, "role": "?", "age": None, "info": info})
            continue
        heartbeats.append(
            {
                "actor": beat.actor,
                "role": beat.role,
                "age": max(0.0, now - beat.ts),
                "info": beat.fields(),
            }
        )
    heartbeats.sort(key=lambda h: (h["role"], h["actor"]))
    weights = values.get(KV_WEIGHTS) if isinstance(values.get(KV_WEIGHTS), dict) else {}
    trainer_hb = next((h for h in heartbeats if h["role"] == "trainer"), None)
    # the trainer's version is its step (trainer.step is written every step; a heartbeat
    # or the published weights may lag behind it)
    known = [
        _int(values.get(KV_TRAINER_STEP)),
        _int((trainer_hb or {}).get("info", {}).get("version")),
        _int(weights.get("version")),
    ]
    version = max((v for v in known if v is not None), default=None)
    trainer = {
        "step": _int(values.get(KV_TRAINER_STEP)),
        "version": version,
        "heartbeat_age": trainer_hb["age"] if trainer_hb else None,
        "done": values.get(TRAINER_DONE.name),
    }
    names = {k.split(".")[1] for k in values if k.startswith("explorer.") and k.count(".") >= 2}
    names |= {h["actor"] for h in heartbeats if h["role"] == "explorer"}
    explorers = []
    for name in sorted(names):
        hb = next((h for h in heartbeats if h["role"] == "explorer" and h["actor"] == name), None)
        mv = _int((hb or {}).get("info", {}).get("model_version"))
        flight = EXPLORER_FLIGHT.convert(values.get(EXPLORER_FLIGHT.of(name=name).name))
        explorers.append(
            {
                "name": name,
                "step": _int(values.get(f"explorer.{name}.step")),
                "model_version": mv,
                "staleness": None if mv is None or version is None else version - mv,
                "heartbeat_age": hb["age"] if hb else None,
                "done": values.get(f"explorer.{name}.done") is not None,
                # what the others' staleness gates count (written while another explorer is about)
                "tasks_in_flight": None if flight is None else flight.in_flight,
            }
        )
    prefix = STAGE.name.split("{")[0]
    stages = {k[len(prefix) :]: STAGE.convert(v) for k, v in values.items() if k.startswith(prefix)}
    chain = stage_chain(
        TRAINER_INPUT.convert(values.get(TRAINER_INPUT.name)),
        {k: v for k, v in stages.items() if v is not None},
        input_stage,
        output_stage,
    )
    text = " -> ".join(s["stage"] + (f" ({s['operator']})" if s["operator"] else "") for s in chain)
    waiting = values.get(TRAINER_WAITING.name)
    change = values.get(SPLICE.name)
    return {
        "status": values.get("status"),
        "trainer": trainer,
        "weights": {
            "version": _int(weights.get("version")),
            "method": weights.get("method"),
            "age": max(0.0, now - float(weights["ts"])) if weights.get("ts") else None,
        },
        "explorers": explorers,
        "heartbeats": heartbeats,
        "stages": chain,
        "chain": text + " -> trainer",
        "change": change if in_flight(SPLICE.convert(change)) else None,
        "waiting": waiting.get("message") if isinstance(waiting, dict) else None,
    }
