"""rftstream benchmarks: figures and ratios against baselines measured in the same run.

1. Wire codec: an experience group (8 rollouts x 512 tokens with logprobs,
   masks, advantages) through msgspec with raw little-endian arrays, against
   JSON with lists of numbers (the obvious alternative).
2. Bus: experiences per second into JetStream and back out through a durable
   pull consumer, one message per task group (DESIGN §3) against one message per
   experience, on a private nats-server.

Usage: ``python benchmarks/run.py [--quick]``. Prints a table; exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable

import anyio
import numpy as np
from rich.console import Console
from rich.table import Table

from rftstream.bus import Bus, EmbeddedNatsServer
from rftstream.config.schema import NatsConfig
from rftstream.experience import EID, Experience, decode_group, encode_group
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE
from rftstream.subjects import RunNames

console = Console()


def make_group(n: int = 8, length: int = 512, prompt: int = 128) -> list[Experience]:
    rng = np.random.default_rng(0)
    resp = length - prompt
    return [
        Experience(
            tokens=rng.integers(0, 150_000, size=length, dtype=np.int32),
            prompt_length=prompt,
            logprobs=rng.normal(size=resp).astype(np.float32),
            advantages=rng.normal(size=resp).astype(np.float32),
            reward=float(i % 2),
            eid=EID(0, 1, i),
        )
        for i in range(n)
    ]


def json_encode(group: list[Experience]) -> bytes:
    return json.dumps(
        [
            {
                "eid": e.eid.uid,
                "tokens": e.tokens.tolist(),
                "prompt_length": e.prompt_length,
                "logprobs": e.logprobs.tolist(),
                "advantages": e.advantages.tolist(),
                "action_mask": e.action_mask.tolist(),
                "reward": e.reward,
            }
            for e in group
        ]
    ).encode()


def json_decode(data: bytes) -> list[dict]:
    rows = json.loads(data)
    for r in rows:
        r["tokens"] = np.asarray(r["tokens"], dtype=np.int32)
        r["logprobs"] = np.asarray(r["logprobs"], dtype=np.float32)
        r["advantages"] = np.asarray(r["advantages"], dtype=np.float32)
    return rows


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of ``fn`` over about ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def bench_codec(seconds: float) -> list[tuple[str, str, str]]:
    group = make_group()
    body = encode_group(group)
    jbody = json_encode(group)
    ours = rate(lambda: decode_group(encode_group(group)), seconds)
    base = rate(lambda: json_decode(json_encode(group)), seconds)
    return [
        (
            "codec: msgspec + raw arrays (groups/s, encode+decode)",
            f"{ours:,.0f}",
            f"{ours / base:.1f}x JSON",
        ),
        ("codec: JSON with number lists (baseline)", f"{base:,.0f}", "1.0x"),
        (
            "message size: msgspec / JSON (bytes)",
            f"{len(body):,} / {len(jbody):,}",
            f"{len(jbody) / len(body):.1f}x smaller",
        ),
    ]


async def _bus_round(url: str, run: str, per_message: int, groups: int) -> float:
    names = RunNames(run)
    group = make_group(n=8, length=256, prompt=64)
    async with await Bus.connect(url, names, NatsConfig(), "bench") as bus:
        await bus.provision()
        consumer = await bus.pull(names.exp_stream, names.stage_consumer("raw", "train"))
        t0 = time.perf_counter()
        sent = 0

        async def produce() -> None:
            nonlocal sent
            limiter = anyio.CapacityLimiter(32)

            async def one(i: int, chunk: list[Experience], j: int) -> None:
                async with limiter:
                    await bus.publish_group("raw", chunk, msg_id=f"g{i}.{j}")

            async with anyio.create_task_group() as tg:
                for i in range(groups):
                    for j in range(0, len(group), per_message):
                        tg.start_soon(one, i, group[j : j + per_message], j)
                        sent += 1

        received = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            target = groups * len(group)
            while received < target:
                for m in await consumer.fetch(256, timeout=1.0):
                    received += len(decode_group(m.data))
                    await m.ack()
        dt = time.perf_counter() - t0
        await consumer.unsubscribe()
        return received / dt


def bench_bus(groups: int) -> list[tuple[str, str, str]]:
    with (
        tempfile.TemporaryDirectory() as d,
        EmbeddedNatsServer(d, max_file_store=SMALL_RUNS_FILE_STORE) as server,
    ):
        grouped = anyio.run(_bus_round, server.url, "bench_group", 8, groups, backend="asyncio")
        single = anyio.run(_bus_round, server.url, "bench_single", 1, groups, backend="asyncio")
    return [
        (
            "bus: one message per task group (experiences/s, publish+consume)",
            f"{grouped:,.0f}",
            f"{grouped / single:.1f}x per-experience",
        ),
        ("bus: one message per experience (baseline)", f"{single:,.0f}", "1.0x"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier figures)")
    args = ap.parse_args(argv)
    seconds = 0.5 if args.quick else 2.0
    groups = 100 if args.quick else 600
    table = Table(title="rftstream benchmarks (same-run baselines)")
    table.add_column("what")
    table.add_column("figure", justify="right")
    table.add_column("ratio", justify="right")
    with console.status("codec…"):
        rows = bench_codec(seconds)
    with console.status("bus (private nats-server)…"):
        rows += bench_bus(groups)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
