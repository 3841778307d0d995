"""rftstream's bus against raw nats-py JetStream: same bytes, same concurrency.

One private nats-server (:class:`rftstream.bus.EmbeddedNatsServer`), groups of
8 experiences x 256 tokens (logprobs, advantages, action mask, reward; about
23 KB encoded), each measurement on fresh streams and a fresh durable created
by ``Bus.provision`` (so both sides use the same stream and consumer config).

* rftstream: ``Bus.publish_group`` (encode, summary headers, ``Nats-Msg-Id``,
  size checks, in-flight byte cap, bounded ack wait) from ``PUBLISHERS``
  concurrent tasks; ``Bus.pull`` + ``PullSubscription.fetch(FETCH_BATCH)`` +
  ``decode_group`` (``Experience`` objects; each array becomes a tensor when
  first read, as the raw side's arrays stay ``memoryview``s) + ``ack``.
* raw nats-py: ``js.publish`` of the same encoded bytes and headers (one
  pre-encoded body, a fresh ``Nats-Msg-Id`` per message) from the same number
  of concurrent tasks; ``js.pull_subscribe`` on the same durable +
  ``fetch(FETCH_BATCH)`` + ``msgspec`` decode of the same bytes + ``ack``.

Scenarios: producer and consumer at once (the headline: one process, two
connections, as two actors of ``rftstream up`` would be), publish alone,
consume alone (a stream pre-filled with the same bytes), and, to tell the bus
from the codec, producer and consumer at once with rftstream's bus carrying the
pre-encoded body (``Bus.publish``) and decoding as the raw side does, and producer and
consumer at once with both consumers reading every array as a tensor (what a trainer
does; the raw side with ``torch.from_numpy(numpy.frombuffer(...))`` per array). In each round the two
sides of a scenario run back to back, so each round's ratio rftstream / raw
compares runs under the same load from other processes; the table shows the
medians of the rounds (and the range of the ratios). Target: >= 0.8x with
producer and consumer concurrent.

Usage: ``python benchmarks/bus.py [--quick]``. Prints a table; exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from statistics import median

import anyio
import msgspec
import nats
import nats.errors
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from rftstream.bus import Bus, EmbeddedNatsServer
from rftstream.config.schema import NatsConfig
from rftstream.experience import (
    H_MSG_ID,
    ExperienceGroupMsg,
    decode_group,
    pack_group,
)
from rftstream.subjects import RAW_STAGE, TRAIN_STAGE, RunNames

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import make_group  # noqa: E402 - the group of benchmarks/run.py, in 8 x 256 tokens

console = Console(width=132)

PUBLISHERS = 32  # concurrent publishing tasks (publishes awaiting their ack), both sides
FETCH_BATCH = 64  # messages per fetch, both sides (the trainer feed's default)
FETCH_TIMEOUT = 1.0
TARGET = 0.8  # rftstream / raw, producer and consumer concurrent

_RAW_DECODER = msgspec.msgpack.Decoder(ExperienceGroupMsg)


class Workload:
    """The group, and its encoded body and headers exactly as ``Bus.publish_group`` sends them."""

    def __init__(self) -> None:
        self.group = make_group(n=8, length=256, prompt=64)
        (part,) = pack_group(self.group, actor="bench", msg_id_prefix="x", max_payload=1 << 23)
        self.body = part.data
        self.headers = {k: v for k, v in part.headers.items() if k != H_MSG_ID}


# ---------------------------------------------------------------- the two sides
async def _workers(n: int, fn: Callable[[int], Awaitable[object]]) -> None:
    """Call ``fn(i)`` for i in range(n) from ``PUBLISHERS`` concurrent tasks."""
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await fn(i)

    async with anyio.create_task_group() as tg:
        for _ in range(PUBLISHERS):
            tg.start_soon(worker)


async def rft_publish(bus: Bus, wl: Workload, n: int, tag: str, codec: bool = True) -> None:
    if codec:

        async def one(i: int) -> None:
            await bus.publish_group(RAW_STAGE, wl.group, msg_id=f"{tag}.{i}")

    else:  # the bus alone: the pre-encoded body and headers, as the raw side sends them
        subject = bus.names.exp_subject(RAW_STAGE)

        async def one(i: int) -> None:
            await bus.publish(subject, wl.body, headers=wl.headers, msg_id=f"{tag}.{i}")

    await _workers(n, one)


async def raw_publish(js, subject: str, wl: Workload, n: int, tag: str) -> None:  # noqa: ANN001
    async def one(i: int) -> None:
        await js.publish(
            subject, wl.body, timeout=10.0, headers={**wl.headers, H_MSG_ID: f"{tag}.{i}"}
        )

    await _workers(n, one)


async def rft_consume(
    bus: Bus, names: RunNames, n: int, codec: bool = True, read_arrays: bool = False
) -> int:
    consumer = await bus.pull(names.exp_stream, names.stage_consumer(RAW_STAGE, TRAIN_STAGE))
    got = exps = 0
    while got < n:
        for m in await consumer.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT):
            if read_arrays:  # every array as a tensor, as a trainer reads them
                for e in decode_group(m.data):
                    e.tokens, e.logprobs, e.advantages, e.action_mask  # noqa: B018
                    exps += 1
            elif codec:
                exps += len(decode_group(m.data))
            else:  # the bus alone: decoded as the raw side decodes
                exps += len(_RAW_DECODER.decode(m.data).experiences)
            await m.ack()
            got += 1
    await consumer.unsubscribe()
    return exps


def _raw_tensors(msg: ExperienceGroupMsg) -> int:
    """What a hand-written raw consumer does to read every array as a tensor (as rftstream's)."""
    for r in msg.experiences:
        torch.from_numpy(np.frombuffer(r.tokens, "<i4"))
        torch.from_numpy(np.frombuffer(r.logprobs, "<f4"))
        torch.from_numpy(np.frombuffer(r.advantages, "<f4"))
        torch.from_numpy(np.frombuffer(r.action_mask, "u1").astype(np.bool_))
    return len(msg.experiences)


async def raw_consume(js, names: RunNames, n: int, read_arrays: bool = False) -> int:  # noqa: ANN001
    sub = await js.pull_subscribe(
        names.exp_subject(RAW_STAGE),
        durable=names.stage_consumer(RAW_STAGE, TRAIN_STAGE),
        stream=names.exp_stream,
    )
    got = exps = 0
    while got < n:
        try:
            msgs = await sub.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        for m in msgs:
            msg = _RAW_DECODER.decode(m.data)
            exps += _raw_tensors(msg) if read_arrays else len(msg.experiences)
            await m.ack()
            got += 1
    await sub.unsubscribe()
    return exps


# ---------------------------------------------------------------- one measurement
@dataclass
class Run:
    rate: float  # groups per second
    py_us: float  # CPU of this process per group (both actors; us)
    server_us: float | None  # CPU of nats-server per group (us; None off Linux)


def _server_cpu(pid: int | None) -> float | None:
    """CPU seconds nats-server has used (Linux /proc), or None."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def measure(
    url: str, pid: int | None, run: str, side: str, scenario: str, wl: Workload, n: int
) -> Run:
    """One (side, scenario) on fresh streams of run ``run``; checks all was stored and acked."""
    names = RunNames(run)
    cfg = NatsConfig()
    durable = names.stage_consumer(RAW_STAGE, TRAIN_STAGE)
    async with await Bus.connect(url, names, cfg, "setup") as setup:
        await setup.provision()
        subject = names.exp_subject(RAW_STAGE)
        if scenario == "consume":  # pre-fill (not timed): the same bytes either way
            await raw_publish(setup.transport.js, subject, wl, n, f"{run}.pre")
        if side == "rftstream":  # two actors' connections, as Bus.connect makes them
            pbus = await Bus.connect(url, names, cfg, "producer")
            cbus = await Bus.connect(url, names, cfg, "consumer")
            codec = scenario != "bus"
            produce = lambda: rft_publish(pbus, wl, n, run, codec)  # noqa: E731
            read = scenario == "tensors"
            consume = lambda: rft_consume(cbus, names, n, codec, read)  # noqa: E731
            conns = [pbus.transport.nc, cbus.transport.nc]
        else:  # two plain nats-py connections, default options
            pnc, cnc = await nats.connect(url), await nats.connect(url)
            produce = lambda: raw_publish(pnc.jetstream(), subject, wl, n, run)  # noqa: E731
            read = scenario == "tensors"
            consume = lambda: raw_consume(cnc.jetstream(), names, n, read)  # noqa: E731
            conns = [pnc, cnc]
        try:
            s0, c0, t0 = _server_cpu(pid), time.process_time(), time.perf_counter()
            async with anyio.create_task_group() as tg:
                if scenario != "consume":
                    tg.start_soon(produce)
                if scenario != "publish":
                    tg.start_soon(consume)
            dt, cpu, s1 = time.perf_counter() - t0, time.process_time() - c0, _server_cpu(pid)
        finally:
            for nc in conns:
                await nc.close()
        info = await setup.transport.js.stream_info(names.exp_stream)
        assert info.state.messages == n, info.state  # every publish stored once
        if scenario != "publish":  # every message delivered and acked (acks land async)
            with anyio.fail_after(30):
                while True:
                    c = await setup.transport.js.consumer_info(names.exp_stream, durable)
                    if c.num_pending == 0 and c.num_ack_pending == 0:
                        break
                    await anyio.sleep(0.05)
        for stream in names.streams:  # keep the disk small
            await setup.transport.js.delete_stream(stream)
    server = None if s0 is None or s1 is None else 1e6 * (s1 - s0) / n
    return Run(n / dt, 1e6 * cpu / n, server)


SCENARIOS = (
    ("concurrent", "producer + consumer at once"),
    ("publish", "publish alone"),
    ("consume", "consume alone"),
    ("bus", "at once, bus only (no codec)"),
    ("tensors", "at once, reading every array"),
)


async def bench(url: str, pid: int | None, n: int, rounds: int) -> dict[str, dict[str, list]]:
    """Per scenario, one entry a round: each side's :class:`Run` and the rate ratio.

    In every round the two sides of a scenario run back to back (the order
    alternating between rounds), so a ratio compares runs under the same load.
    """
    wl = Workload()
    out: dict[str, dict[str, list]] = {
        s: {"rftstream": [], "raw": [], "ratio": []} for s, _ in SCENARIOS
    }
    k = 0
    for r in range(rounds):
        for scenario, _ in SCENARIOS:
            order = ("raw", "rftstream") if r % 2 == 0 else ("rftstream", "raw")
            runs = {}
            for side in order:
                k += 1
                runs[side] = await measure(url, pid, f"bench{k}", side, scenario, wl, n)
                out[scenario][side].append(runs[side])
            out[scenario]["ratio"].append(runs["rftstream"].rate / runs["raw"].rate)
    return out


def _cpu(runs: list[Run]) -> str:
    py = median(r.py_us for r in runs)
    servers = [r.server_us for r in runs if r.server_us is not None]
    return f"{py:,.0f} + {median(servers):,.0f}" if servers else f"{py:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier figures)")
    ap.add_argument("--groups", type=int, default=None, help="groups per measurement")
    ap.add_argument("--rounds", type=int, default=None, help="measurements per figure")
    args = ap.parse_args(argv)
    n = args.groups or (2_000 if args.quick else 5_000)
    rounds = args.rounds or (3 if args.quick else 5)
    wl = Workload()
    with tempfile.TemporaryDirectory() as d, EmbeddedNatsServer(d) as server:
        with console.status("bus vs raw nats-py (private nats-server)…"):
            res = anyio.run(bench, server.url, server.pid, n, rounds, backend="asyncio")
    table = Table(
        title=(
            f"rftstream bus vs raw nats-py: groups of {len(wl.group)} x 256 tokens "
            f"({len(wl.body):,} B + {len(wl.headers) + 1} headers), {PUBLISHERS} publishers, "
            f"fetch {FETCH_BATCH}, {n:,} groups a run, medians of {rounds} rounds"
        ),
        caption="CPU: microseconds per group of this process + of nats-server (load-independent)",
    )
    table.add_column("scenario")
    table.add_column("rftstream groups/s", justify="right")
    table.add_column("raw groups/s", justify="right")
    table.add_column("ratio (range)", justify="right")
    table.add_column("target", justify="right")
    table.add_column("CPU rftstream", justify="right")
    table.add_column("CPU raw", justify="right")
    for scenario, label in SCENARIOS:
        r = res[scenario]
        ratio = median(r["ratio"])
        target = ""
        if scenario == "concurrent":
            target = f">= {TARGET}x: {'PASS' if ratio >= TARGET else 'MISS'}"
        table.add_row(
            label,
            f"{median(x.rate for x in r['rftstream']):,.0f}",
            f"{median(x.rate for x in r['raw']):,.0f}",
            f"{ratio:.2f}x ({min(r['ratio']):.2f}-{max(r['ratio']):.2f})",
            target,
            _cpu(r["rftstream"]),
            _cpu(r["raw"]),
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
