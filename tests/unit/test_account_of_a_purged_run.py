"""The run's account on the in-memory transport: a run whose experience stream was purged
(``keep_acked_msgs`` small) still balances, counted by id where stored and by the purge
records where not. Refusing a run with no state: tests/integration/test_account_purged.py."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config.schema import NatsConfig
from rftstream.experience import EID, Experience, encode_group, summary_headers
from rftstream.operations.account import account_run
from rftstream.retention.limits import ExperienceRoom
from rftstream.retention.purged import read_purged
from rftstream.subjects import RunNames

pytestmark = pytest.mark.anyio

GROUPS, SIZE = 30, 2  # raw groups of SIZE experiences; every third is filtered
MALFORMED_AT = (7, 19)  # raw message indices replaced by a body that is no group


def _group(i: int) -> tuple[bytes, dict[str, str]]:
    exps = [
        Experience(
            tokens=[5, 6, 7, 8],
            prompt_length=2,
            reward=1.0,
            eid=EID("b", i, r),
            logprobs=[-1.0] * 2,
        )
        for r in range(SIZE)
    ]
    return encode_group(exps), summary_headers(exps, actor="t", msg_id=f"raw:{i}")


async def test_a_purged_run_balances_by_id_and_by_record() -> None:
    cfg = msgspec.convert(
        {"streams": {"experience": {"purge_acked": True, "keep_acked_msgs": 3, "keep_acked_s": 0}}},
        NatsConfig,
    )
    names = RunNames("purgedacc")
    async with Bus.in_memory(names, cfg, "t") as bus:
        await bus.provision()
        state = RunState(await bus.kv())
        room = ExperienceRoom(
            bus.transport,
            names.exp_stream,
            cfg.streams.experience,
            "explorer",
            state=state,
            subject_prefix=names.exp_wildcard[:-1],
        )
        op = await bus.pull(names.exp_stream, names.stage_consumer("raw", "train"))
        tr = await bus.pull(names.exp_stream, names.trainer_consumer)
        trained = 0
        with anyio.fail_after(10):
            for i in range(GROUPS):
                await room.wait()
                if i in MALFORMED_AT:
                    await bus.publish(names.exp_subject("raw"), b"\x00junk", msg_id=f"raw:{i}")
                else:
                    body, headers = _group(i)
                    await bus.publish(names.exp_subject("raw"), body, headers=headers)
                for m in await op.fetch(4, 0.01):
                    n = int((m.headers or {}).get("Rft-Count", "0"))
                    if n == 0:
                        await bus.dead_letter("raw", m, "op: not a rft.experience.v1 message")
                        continue
                    idx = int(m.headers["Nats-Msg-Id"].split(":")[1])
                    if idx % 3 != 0:  # the operator filters every third group
                        h = dict(m.headers)
                        h["Nats-Msg-Id"] = f"train:{idx}"
                        await bus.publish(names.exp_subject("train"), m.data, headers=h)
                    await m.ack()
                for m in await tr.fetch(4, 0.01):
                    trained += int(m.headers["Rft-Count"])
                    await m.ack()
            await bus.publish_metrics("trainer", 1, {"experience/trained_total": trained})
            await room.check()  # a last purge after every ack
            purged = await read_purged(state)
            account = await account_run(bus)
    good = [i for i in range(GROUPS) if i not in MALFORMED_AT]
    # independent expectations: every good group explored; every third filtered
    assert trained == SIZE * sum(1 for i in good if i % 3 != 0)
    assert set(purged) == {"raw", "train"} and purged["raw"].messages > 10, purged
    assert room.purged > 0
    assert account.balanced, str(account)
    assert account.explored == SIZE * len(good)
    assert account.trained == trained
    assert account.filtered == SIZE * sum(1 for i in good if i % 3 == 0)
    assert (account.malformed, account.malformed_dead) == (len(MALFORMED_AT), len(MALFORMED_AT))
    raw, train = account.stages
    assert raw.purged_messages == purged["raw"].messages and raw.checked_from_seq > 1
    assert account.tasks is not None and account.tasks.published == 0
