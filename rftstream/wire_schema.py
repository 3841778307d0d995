"""The experience message as a JSON Schema: ``rft.experience.v1``, machine-readable.

:func:`experience_schema` builds it from the msgspec structs that encode and decode
the message (:class:`~rftstream.experience.ExperienceGroupMsg`), so it cannot drift
from the wire: a field added there without a description here fails
:func:`experience_schema`. The published copy is ``rftstream/schemas/rft.experience.v1.json``
(``rftstream schema`` prints it; a test checks that it equals what this module builds).

The body is MessagePack, not JSON. The schema describes the decoded value, with
these annotations for what JSON cannot say:

* ``x-msgpack: "bin"``: a msgpack *bin* value (in a JSON mirror of the message:
  base64, hence ``contentEncoding``); ``x-dtype`` its element type (``<i4``:
  int32 little-endian, ``<f4``: float32 little-endian, ``u1``: one byte, 0 or 1),
  ``x-length`` its element count;
* a field equal to its default is left out of the map (msgspec ``omit_defaults``):
  a reader takes the ``default`` given here;
* ``x-headers``: the NATS headers every experience message carries;
* ``x-subject``: where such messages are published.

Pure; no I/O.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from typing import Any

import msgspec

from rftstream.experience import SCHEMA_NAME, ExperienceGroupMsg
from rftstream.headers import (
    H_ACTOR,
    H_COUNT,
    H_MODEL_VERSION,
    H_MSG_ID,
    H_PART,
    H_REWARD_MEAN,
    H_SCHEMA,
    H_TASK,
    H_TOKENS,
)

SCHEMA_FILE = f"{SCHEMA_NAME}.json"

_RESPONSE = "len(tokens) - prompt_length"

#: (dtype, length, description) of each array field
_ARRAYS: dict[str, tuple[str, str, str]] = {
    "tokens": ("<i4", "len(tokens)", "Token ids of the whole sequence: prompt, then response."),
    "logprobs": (
        "<f4",
        _RESPONSE,
        "Log-probability of each response token under the policy that sampled it, at the "
        "sampling temperature, before top-k / top-p and before any ban (vLLM's raw "
        "log-probabilities; see allowed_logprobs).",
    ),
    "token_level_reward": ("<f4", _RESPONSE, "A reward per response token (optional)."),
    "advantages": (
        "<f4",
        _RESPONSE,
        "Advantage per response token, written by an advantage operator (GRPO: the group's "
        "normalised reward times action_mask).",
    ),
    "returns": ("<f4", _RESPONSE, "Return per response token (optional)."),
    "action_mask": (
        "u1",
        _RESPONSE,
        "1 where a response token is trained on, 0 where not (e.g. a tool's output in a "
        "multi-turn rollout). Absent: every response token is trained on.",
    ),
    "chosen": ("<i4", "len(chosen)", "DPO: token ids of the chosen response."),
    "rejected": ("<i4", "len(rejected)", "DPO: token ids of the rejected response."),
    "allowed_logprobs": (
        "<f4",
        _RESPONSE,
        "Where the sampler banned tokens (min_tokens: end and stop tokens before that many "
        "new tokens), per response token the log of the probability it could still draw "
        "from, log(1 - p(banned_ids)), under the distribution logprobs are of; 0 where "
        "nothing was banned. The sampled distribution's log-probability of a token is "
        "logprobs - allowed_logprobs. Absent: no token was drawn under a ban.",
    ),
    "banned_ids": (
        "<i4",
        "len(banned_ids)",
        "The token ids the sampler banned where allowed_logprobs is below 0 (absent with it).",
    ),
}

_FIELDS: dict[str, str] = {
    "schema": f'Always "{SCHEMA_NAME}". Any other value: not this schema, reject it.',
    "group_id": 'The task\'s id "batch/task": every rollout of one task shares it.',
    "experiences": "The experiences of (this part of) the task's group, one per rollout "
    "(multi-turn workflows: one per turn).",
    "part": "Which part of a group split over several messages (0-based).",
    "parts": "How many messages the group was split into (1: not split).",
    "producer": "The actor that published the message (an explorer's or operator's name).",
    "eid": "The experience id: [batch, task, run, step, suffix]; its uid is the five joined "
    'with "/".',
    "prompt_length": "How many leading tokens are the prompt.",
    "reward": "The rollout's scalar reward (null: not scored).",
    "info": "Free-form metadata of the workflow (msgpack map; strings, numbers, lists, maps).",
    "metrics": "Numeric metrics of the rollout, e.g. accuracy.",
    "response_text": "The decoded response (optional).",
    "prompt_text": "The decoded prompt (optional).",
    "messages": "The chat messages of the rollout (optional), OpenAI style.",
    "chosen_text": "DPO: the chosen response's text.",
    "rejected_text": "DPO: the rejected response's text.",
    "model_version": "The weights version (trainer step) the rollout was sampled with.",
    **{name: desc for name, (_, _, desc) in _ARRAYS.items()},
}

_EID_ITEMS = (
    ("batch", "The explorer step (or taskset batch) that produced the task."),
    ("task", "The task's index in that batch."),
    ("run", "The rollout's index in the task's group."),
    ("step", "The turn's index (multi-turn workflows; else 0)."),
    ("suffix", "A unique tail."),
)

HEADERS: dict[str, str] = {
    H_SCHEMA: f'"{SCHEMA_NAME}"',
    H_TASK: "The group id (group_id of the body).",
    H_MODEL_VERSION: "The lowest model_version of the message's experiences.",
    H_COUNT: "How many experiences the body carries.",
    H_REWARD_MEAN: 'Their mean reward, 4 decimals ("nan": none scored).',
    H_TOKENS: "The sum of their token counts.",
    H_ACTOR: "The publishing actor (as producer in the body).",
    H_PART: 'Only on a split group: "<part+1>/<parts>".',
    H_MSG_ID: "JetStream's deduplication id; an operator derives its output's from its "
    'input\'s, e.g. "<stage>:<input id>".',
}


def _bin(dtype: str, length: str, description: str) -> dict[str, Any]:
    return {
        "type": "string",
        "contentEncoding": "base64",
        "x-msgpack": "bin",
        "x-dtype": dtype,
        "x-length": length,
        "description": description,
    }


def _annotate(prop: dict[str, Any], name: str) -> dict[str, Any]:
    """One property of msgspec's schema, described and with its arrays' dtypes."""
    if name not in _FIELDS:
        raise KeyError(f"wire field {name!r} has no description in rftstream.wire_schema")
    if name in _ARRAYS:
        arr = _bin(*_ARRAYS[name])
        if "anyOf" in prop:  # optional: bin or nil
            return {
                "anyOf": [arr, {"type": "null"}],
                "default": prop.get("default"),
                "description": arr.pop("description"),
            }
        return arr
    return {**prop, "description": _FIELDS[name]}


def experience_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one experience message body, with the annotations
    the module docstring lists. Raises KeyError naming a wire field left undescribed."""
    raw = msgspec.json.schema(ExperienceGroupMsg)
    defs = raw["$defs"]
    group = defs["ExperienceGroupMsg"]
    record = defs["ExperienceRecord"]
    eid = defs["WireEID"]
    for struct in (group, record):
        struct["properties"] = {k: _annotate(v, k) for k, v in struct["properties"].items()}
        struct.pop("title", None)
    group["description"] = (
        "One message body: (part of) one task's group of experiences, a msgpack map."
    )
    group["properties"]["schema"]["const"] = SCHEMA_NAME
    record["description"] = (
        "One experience, a msgpack map. Arrays are msgpack bin values of little-endian "
        "elements (x-dtype); tokens covers prompt and response, the per-token float arrays "
        "and action_mask the response only."
    )
    eid.pop("title", None)
    eid["description"] = (
        "The experience id, a msgpack array of five items: batch, task, run, step, suffix. "
        'Its uid is the five joined with "/"; its group id "batch/task".'
    )
    for item, (name, desc) in zip(eid["prefixItems"], _EID_ITEMS, strict=True):
        item["title"] = name
        item["description"] = desc
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:rftstream:schema:{SCHEMA_NAME}",
        "title": SCHEMA_NAME,
        "description": (
            "The body of every message on rft.<run>.exp.<stage> and (when it decodes) "
            "rft.<run>.dlq.<stage>: MessagePack, described here as its decoded value. "
            "x-msgpack bin fields hold little-endian arrays (x-dtype, x-length); a field "
            "equal to its default is left out. Fields are only ever appended, with "
            "defaults: a reader of v1 ignores map keys it does not know."
        ),
        "x-subject": "rft.<run>.exp.<stage>",
        "x-encoding": "msgpack",
        "x-headers": HEADERS,
        "$ref": "#/$defs/ExperienceGroupMsg",
        "$defs": {
            "ExperienceGroupMsg": group,
            "ExperienceRecord": record,
            "WireEID": eid,
        },
    }


def json_view(value: Any) -> Any:
    """A decoded msgpack body (``msgspec.msgpack.decode(body)``) as the schema's JSON view:
    every bin value base64 text, so a JSON Schema validator checks it. Pure."""
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: json_view(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_view(v) for v in value]
    return value


def schema_text() -> str:
    """:func:`experience_schema` as the published file's text (sorted keys kept in build
    order, 2-space indent, trailing newline)."""
    return json.dumps(experience_schema(), indent=2, ensure_ascii=False) + "\n"


def published_schema() -> str:
    """The schema file shipped in the package (``rftstream/schemas/``)."""
    return (resources.files("rftstream") / "schemas" / SCHEMA_FILE).read_text()
