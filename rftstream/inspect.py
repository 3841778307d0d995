"""Readable summaries of run messages, for ``rftstream decode`` and ``rftstream tail``.

Pure functions, no I/O: a message body (and its headers) in, a JSON-able dict
out. ``nats stream view RFT_<RUN>_EXP --translate "rftstream decode"`` pipes
each body through :func:`summarize_body`.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rftstream.errors import SchemaError
from rftstream.experience import SCHEMA_NAME, decode_group_msg, from_record
from rftstream.messages import DLQ_HEADERS, METRICS_SCHEMA, TASK_SCHEMA


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
