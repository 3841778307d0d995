"""drain_step against a real nats-server, where the cut lies past a filtered consumer's last
message: the server's ack floor stops before the cut, and the durable counts as drained by
its pending counts. The other cases (messages after the cut, an open cut) run on the
in-memory transport in tests/unit/test_drain_step.py."""

from __future__ import annotations

import anyio
import pytest

from rftstream.actors.common import drain_step
from rftstream.bus.client import Bus
from rftstream.config import config_from_dict
from rftstream.runtime import prepare_run, provision
from tests.integration._util import small_config

pytestmark = pytest.mark.integration


async def _drain(consumer, cut: int) -> tuple[list[int], int]:
    """Drain to the end: (stream sequences processed, messages skipped)."""
    processed: list[int] = []
    skipped = 0
    with anyio.fail_after(30):
        while True:
            step = await drain_step(consumer, cut, batch=3, timeout=0.2)
            if step.done:
                return processed, skipped
            skipped += step.skipped
            for m in step.mine:
                processed.append(m.metadata.sequence.stream)
                await m.ack()


def test_drain_to_a_cut_past_the_filtered_consumers_last_message(
    tmp_path, tiny_model_path: str, nats_url: str
) -> None:
    """The durable has not delivered anything yet: nothing unacked is not "drained" while
    messages up to the cut wait to be delivered. The last message of the stream is on
    another subject, so the cut is not one of this consumer's sequences."""
    run = prepare_run(config_from_dict(small_config(tmp_path, tiny_model_path)))

    async def main() -> tuple[list[int], int, list[int]]:
        await provision(run, nats_url)
        n = run.names
        async with await Bus.connect(nats_url, n, run.cfg.nats, "t") as bus:
            seqs = []
            for i in range(5):  # nothing on exp.a after the cut
                ack = await bus.publish(n.exp_subject("a"), b"x", msg_id=f"a{i}")
                seqs.append(int(ack.seq))
                await bus.publish(n.exp_subject("b"), b"y", msg_id=f"b{i}")
            cut = seqs[4] + 1  # on exp.b
            await bus.ensure_consumer(
                n.exp_stream, "d", n.exp_subject("a"), description="t", role="t", start_seq=1
            )
            consumer = await bus.pull(n.exp_stream, "d")
            processed, skipped = await _drain(consumer, cut)
            return processed, skipped, [s for s in seqs if s <= cut]

    processed, skipped, expected = anyio.run(main, backend="asyncio")
    assert processed == expected and len(expected) == 5
    assert skipped == 0
