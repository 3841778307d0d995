"""A pipeline stage written against plain nats-py and msgspec: no rftstream import at all.

It reads experience groups from ``rft.<run>.exp.<src>`` through its own durable
pull consumer, drops groups in which every rollout failed (all rewards 0: they
carry no GRPO signal), and republishes the others unchanged, body and summary
headers, to ``rft.<run>.exp.<dst>``. Acks come after the republish, and the
``Nats-Msg-Id`` is derived from the input's, so a crash never loses or doubles a group.
The body is msgpack (schema ``rft.experience.v1``, ``rftstream schema`` prints it): the
two structs below read the rewards and ignore every other field.
It stops when the run's KV status says the run has ended.

Splice it into a run by making the configured pipeline read its output stage::

    data_processor:
      experience_pipeline:
        input_stage: plain        # raw -> (this script) -> plain -> group advantage -> train

    python examples/plain_nats_operator.py nats://127.0.0.1:4222 <run> raw plain
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
import nats
import nats.errors
import nats.js.errors


class Rewarded(msgspec.Struct):
    reward: float | None = None


class Group(msgspec.Struct):
    schema: str
    experiences: list[Rewarded]


DECODER = msgspec.msgpack.Decoder(Group)


async def main(url: str, run: str, src: str, dst: str) -> int:
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream = f"RFT_{run.upper()}_EXP"
    sub = await js.pull_subscribe(
        f"rft.{run}.exp.{src}", durable=f"plain_{src}_to_{dst}", stream=stream
    )
    kv = await js.key_value(f"rft_{run}_state")
    kept = dropped = 0
    while True:
        try:
            msgs = await sub.fetch(32, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either
            try:
                status = json.loads((await kv.get("status")).value)
            except nats.js.errors.KeyNotFoundError:
                status = ""
            if status in ("finished", "failed", "stopped"):
                break
            continue
        for msg in msgs:
            rewards = [e.reward or 0.0 for e in DECODER.decode(msg.data).experiences]
            if any(r > 0 for r in rewards):
                headers = dict(msg.headers or {})
                headers["Nats-Msg-Id"] = (
                    f"{dst}:{headers.get('Nats-Msg-Id', msg.metadata.sequence.stream)}"
                )
                await js.publish(f"rft.{run}.exp.{dst}", msg.data, headers=headers)
                kept += 1
            else:
                dropped += 1
            await msg.ack()
    print(json.dumps({"kept_groups": kept, "dropped_groups": dropped}), flush=True)
    await nc.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    sys.exit(asyncio.run(main(*sys.argv[1:5])))
