"""Decode rftstream experience messages with msgspec alone (no rftstream, no numpy, no torch).

The body of a message on ``rft.<run>.exp.<stage>`` is one msgpack map, schema
``rft.experience.v1`` (``rftstream schema`` prints its JSON Schema). The structs below
are that schema in msgspec: arrays arrive as msgpack ``bin`` values of little-endian
elements (``tokens``, ``chosen``, ``rejected``: int32; ``logprobs``, ``advantages``,
``returns``, ``token_level_reward``: float32; ``action_mask``: one byte, 0 or 1).
``tokens`` is the prompt and the response; the per-token arrays cover the response only.

Usage: ``python decode_experience.py BODY_FILE...`` (or one body on stdin). Prints one
JSON line per experience. Reading the bodies from NATS with nats-py::

    sub = await js.subscribe("rft.default.exp.train", ordered_consumer=True)
    msg = await sub.next_msg()
    for line in experiences(msg.data): print(json.dumps(line))
"""

from __future__ import annotations

import json
import sys
from array import array
from typing import Any

import msgspec

SCHEMA = "rft.experience.v1"


class Experience(msgspec.Struct, omit_defaults=True):
    eid: tuple[int | str, int | str, int, int, str]  # batch, task, run, step, suffix
    tokens: bytes  # int32 LE, prompt + response
    prompt_length: int
    logprobs: bytes | None = None  # float32 LE, response
    reward: float | None = None
    token_level_reward: bytes | None = None  # float32 LE, response
    advantages: bytes | None = None  # float32 LE, response
    returns: bytes | None = None  # float32 LE, response
    info: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    response_text: str | None = None
    prompt_text: str | None = None
    action_mask: bytes | None = None  # uint8 0/1, response (absent: all 1)
    messages: list[dict[str, Any]] | None = None
    chosen: bytes | None = None  # int32 LE
    rejected: bytes | None = None  # int32 LE
    chosen_text: str | None = None
    rejected_text: str | None = None
    model_version: int = 0
    allowed_logprobs: bytes | None = None  # float32 LE, response: log(1 - p(banned)), 0: no ban
    banned_ids: bytes | None = None  # int32 LE: the ids banned where allowed_logprobs < 0


class Group(msgspec.Struct):
    schema: str
    group_id: str
    experiences: list[Experience]
    part: int = 0
    parts: int = 1
    producer: str = ""


_DECODER = msgspec.msgpack.Decoder(Group)


def _array(data: bytes | None, code: str) -> list[float] | list[int] | None:
    """Little-endian bytes as a list of ``code`` elements (``i``: int32, ``f``: float32)."""
    if data is None:
        return None
    values = array(code)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def experiences(body: bytes) -> list[dict[str, Any]]:
    """One message body as a list of plain dicts, one per experience."""
    group = _DECODER.decode(body)
    if group.schema != SCHEMA:
        raise ValueError(f"not a {SCHEMA} message: schema {group.schema!r}")
    out = []
    for e in group.experiences:
        response = len(e.tokens) // 4 - e.prompt_length
        out.append(
            {
                "uid": "/".join(str(x) for x in e.eid),
                "group_id": group.group_id,
                "producer": group.producer,
                "prompt_length": e.prompt_length,
                "reward": e.reward,
                "model_version": e.model_version,
                "tokens": _array(e.tokens, "i"),
                "logprobs": _array(e.logprobs, "f"),
                "advantages": _array(e.advantages, "f"),
                "action_mask": [1] * response if e.action_mask is None else list(e.action_mask),
                "metrics": e.metrics,
            }
        )
    return out


def main(paths: list[str]) -> int:
    bodies = [open(p, "rb").read() for p in paths] if paths else [sys.stdin.buffer.read()]
    for body in bodies:
        for line in experiences(body):
            print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
