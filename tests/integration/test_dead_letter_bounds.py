"""Dead letters keep a bounded prefix of a huge body, against a real nats-server.

A 900 KB message dead-lettered by :meth:`Bus.dead_letter` is stored in the DLQ
stream as its first :data:`DEAD_LETTER_BODY_LIMIT` bytes, with headers giving the
original size and hash and marking the copy truncated; a small message is copied
whole and not marked. The originals are terminated (no redelivery).
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import msgspec
import pytest
import xxhash

from rftstream.bus.client import DEAD_LETTER_BODY_LIMIT, Bus, body_digest
from rftstream.config.schema import NatsConfig
from rftstream.experience import H_MSG_ID, headers_size
from rftstream.subjects import RunNames
from rftstream.wire import (
    H_DLQ_BODY_BYTES,
    H_DLQ_BODY_HASH,
    H_DLQ_BODY_TRUNCATED,
    H_DLQ_REASON,
    H_DLQ_STAGE,
)

pytestmark = pytest.mark.integration

NAMES = RunNames("dlqb")
BIG = random.Random(7).randbytes(900_000)
SMALL = b'{"not": "an experience group"}'


async def _bus(url: str, **cfg: Any) -> Bus:
    bus = await Bus.connect(url, NAMES, msgspec.structs.replace(NatsConfig(), **cfg), "op")
    await bus.provision()
    return bus


async def _dead_letter_all(bus: Bus, bodies: dict[str, bytes]) -> None:
    """Publish ``bodies`` to ``exp.raw`` (msg id -> body), fetch them from the raw -> train
    consumer and dead-letter each one."""
    for msg_id, body in bodies.items():
        await bus.publish(
            NAMES.exp_subject("raw"), body, headers={"Rft-Origin": msg_id}, msg_id=msg_id
        )
    sub = await bus.pull(NAMES.exp_stream, NAMES.stage_consumer("raw", "train"))
    got = []
    with anyio.fail_after(10):
        while len(got) < len(bodies):
            got += await sub.fetch(len(bodies) - len(got), timeout=1.0)
    for msg in got:
        await bus.dead_letter("raw", msg, "op: not a rft.experience.v1 message")


async def _stored_dead_letters(bus: Bus) -> dict[str, Any]:
    """The DLQ stream's messages by the original's ``Rft-Origin`` header, and its state."""
    state = await bus.transport.stream_state(NAMES.dlq_stream)
    out = {}
    for seq in range(state.first_seq, state.last_seq + 1):
        m = await bus.transport.get_msg(NAMES.dlq_stream, seq)
        out[(m.headers or {})["Rft-Origin"]] = m
    return {"state": state, **out}


def test_a_huge_body_is_cut_to_the_limit_and_a_small_one_kept_whole(nats_url: str) -> None:
    async def main() -> None:
        async with await _bus(nats_url) as bus:
            await _dead_letter_all(bus, {"big": BIG, "small": SMALL})
            stored = await _stored_dead_letters(bus)
            consumer = await bus.transport.consumer_state(
                NAMES.exp_stream, NAMES.stage_consumer("raw", "train")
            )
        assert stored["state"].messages == 2

        big = stored["big"]
        h = big.headers
        assert big.data == BIG[:DEAD_LETTER_BODY_LIMIT]
        assert len(big.data) == DEAD_LETTER_BODY_LIMIT == 64 * 1024
        assert h[H_DLQ_BODY_TRUNCATED] == "true"
        assert int(h[H_DLQ_BODY_BYTES]) == len(BIG) == 900_000
        assert h[H_DLQ_BODY_HASH] == "xxh3_128:" + xxhash.xxh3_128_hexdigest(BIG)
        assert h[H_DLQ_BODY_HASH] == body_digest(BIG)
        assert (h[H_DLQ_STAGE], h[H_DLQ_REASON]) == ("raw", "op: not a rft.experience.v1 message")
        assert h[H_MSG_ID] == "dlq:raw:big"

        small = stored["small"]
        h = small.headers
        assert small.data == SMALL
        assert H_DLQ_BODY_TRUNCATED not in h
        assert int(h[H_DLQ_BODY_BYTES]) == len(SMALL)
        assert h[H_DLQ_BODY_HASH] == "xxh3_128:" + xxhash.xxh3_128_hexdigest(SMALL)

        # the whole DLQ stream: two bounded copies, not 900 KB
        assert stored["state"].bytes < 2 * (DEAD_LETTER_BODY_LIMIT + 4096)
        # both originals were terminated: nothing pending, nothing waiting for an ack
        assert (consumer.num_pending, consumer.num_ack_pending) == (0, 0)

    anyio.run(main, backend="asyncio")


def test_a_max_payload_below_the_limit_bounds_the_copy_too(nats_url: str) -> None:
    """With ``nats.max_payload`` 16 KiB, a 16 000-byte body (which fits as an original)
    is cut so that the dead letter with its extra headers still fits."""
    body = random.Random(8).randbytes(16_000)

    async def main() -> None:
        async with await _bus(nats_url, max_payload=16 * 1024) as bus:
            await _dead_letter_all(bus, {"mid": body})
            stored = await _stored_dead_letters(bus)
        m = stored["mid"]
        assert 0 < len(m.data) < len(body) and body.startswith(m.data)
        assert len(m.data) + headers_size(m.headers) <= 16 * 1024
        assert m.headers[H_DLQ_BODY_TRUNCATED] == "true"
        assert int(m.headers[H_DLQ_BODY_BYTES]) == len(body)
        assert m.headers[H_DLQ_BODY_HASH] == body_digest(body)

    anyio.run(main, backend="asyncio")
