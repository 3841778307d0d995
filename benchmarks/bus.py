"""rftstream's bus against a tuned raw nats-py JetStream client, in separate processes.

What is measured
----------------
Messages per second (and MiB/s) of experience groups through one JetStream
stream and one durable pull consumer, for four message sizes (8 KiB, 64 KiB,
256 KiB and 1 MiB encoded groups: 8 experiences each, the tokens per
experience chosen to hit the size). The headline scenario is the trainer's:
a producer and a consumer at once, the consumer reading every array of every
experience as a tensor. The other scenarios split it up: publish alone,
consume alone (a stream pre-filled with the same bytes, untimed), and the bus
alone (producer and consumer at once, a pre-encoded body, no decoding).

Processes and clock
-------------------
The parent starts one nats-server (:class:`rftstream.bus.EmbeddedNatsServer`)
and four worker processes (``multiprocessing`` spawn): a producer and a
consumer for each side. Every measurement uses fresh streams and a fresh
durable made by ``Bus.provision`` (the same stream and consumer config for
both sides: file storage, ``max_msg_size`` 8 MiB, a dedup window, explicit
acks), and each worker opens its own NATS connection for it. A worker sets up
(connects, binds the consumer, builds its group of tensors, flushes) and says
"ready"; when every worker of the measurement is ready the parent starts its
clock and says "go"; the clock stops when the consumer's message "the last of
the N messages is acked" arrives (the consumer flushes after its last ack, so
the server has every ack), or, publishing alone, the producer's "the last ack
came". Then the parent checks, untimed, that the stream holds exactly N
messages and that the durable has nothing pending and nothing unacked.

The two sides
-------------
* rftstream: ``Bus.publish_group`` (encode the tensors, summary headers,
  ``Nats-Msg-Id``, size checks, the ``max_inflight_bytes`` cap of
  ``NatsConfig``'s default 16 MiB, ack wait with retries) from ``--window``
  concurrent tasks, each publishing one group after the other; ``Bus.pull`` +
  ``PullSubscription.fetch(batch)`` + ``decode_group`` + reading
  ``tokens``, ``logprobs``, ``advantages`` and ``action_mask`` of every
  ``Experience`` + ``ack``.
* raw nats-py, as its best users write it: ``js.publish_async`` with a
  window of ``--window`` acks in flight (``publish_async_max_pending``), every
  body encoded by hand from the same tensors (``tensor.numpy().tobytes()``
  into the same msgspec structs, positionally; the parent checks the bytes are
  identical to rftstream's) and sent with the same headers (computed once, a
  fresh ``Nats-Msg-Id`` per message, so the server deduplicates both sides
  alike); two consumers, each round's raw figure being the faster of them
  (``--raw-consumer both``): nats-py's ``PullSubscription.fetch(batch)`` on the
  same durable, and pull requests of ``batch`` messages pipelined on a core
  subscription with a callback (no task per message; two requests in flight at
  first, another whenever at most one batch is asked for and not delivered);
  per message ``msgspec`` decode (no schema check) +
  ``torch.from_numpy(numpy.frombuffer(...))`` per array (the mask straight as
  ``bool``, without rftstream's normalising copy) + ``ack``.

Fairness choices: the same bytes on the wire (body and headers), the same
stream and consumer, the same publish window and fetch batch (``--fetch-msgs``
messages, at most ``--fetch-mib`` MiB per fetch), one process and one
connection per actor on both sides, the same interpreter and libraries, the same
``malloc`` settings (those rftstream's actor processes set,
:mod:`rftstream.utils.malloc`; the raw client's figures are the same with glibc's
defaults, ``--glibc-malloc``, while rftstream's producer then spends about a fifth more
CPU per 64 KiB message: its bodies live until their acks). Where
the raw client could do less work than rftstream it does (no schema check, no
summary headers to compute, no mask copy, no byte cap on its window, the
faster of two consumers); nothing is added to both sides to dilute the ratio
(the arrays are wrapped as tensors, not summed). Each round runs both sides of
every (size, scenario) back to back, the order rotating, so a round's ratio
rftstream / raw compares runs under the same load; the table shows medians over
``--rounds`` rounds (5 by default: on this two-core machine a round's ratio spreads
0.6-1.0x, and the median of three moved by 0.1x between runs of the same code) and the
range of the ratios. Before the rounds, an untimed
warm-up runs every worker once at every size (a fresh process's first runs are
slower: allocator, caches, lazy imports). A headline run lasts about
``--seconds`` (2; ``--quick`` 0.25), the other scenarios' half that; a
consumer never fetches more than is left to come (a fetch for more would wait
out its timeout at the end). CPU per message (producer, consumer, nats-server;
from ``/proc``) does not depend on the load of other processes.

Target: in the headline scenario, rftstream moves at least 0.8x the messages
per second of the tuned raw client at EVERY size (median ratio over the
rounds). Exit status: 0 PASS, 1 MISS, 2 error.

Usage: ``python benchmarks/bus.py [--quick] [--rounds N] [--sizes 8K,1M] [--profile DIR] [--glibc-malloc]``.
``--profile DIR`` writes a cProfile file per worker and measurement (timings then
are slowed down and do not count).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from statistics import median
from typing import Any

import anyio
import msgspec
import nats
import nats.errors
import numpy as np
import torch
from nats.aio.msg import Msg
from rich.console import Console
from rich.table import Table

from rftstream.bus import Bus, EmbeddedNatsServer
from rftstream.config.schema import NatsConfig
from rftstream.experience import (
    EID,
    H_MSG_ID,
    SCHEMA_NAME,
    Experience,
    ExperienceGroupMsg,
    ExperienceRecord,
    WireEID,
    decode_group,
    pack_group,
)
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, find_nats_server
from rftstream.subjects import RAW_STAGE, TRAIN_STAGE, RunNames
from rftstream.utils.malloc import (
    MMAP_THRESHOLD,
    OPT_OUT,
    TOP_PAD,
    TRIM_THRESHOLD,
    tune_malloc,
)

console = Console(width=230, highlight=False)

TARGET = 0.8  # rftstream / raw, headline scenario, at every size
HEADLINE = "arrays"
SCENARIOS: dict[str, str] = {  # name -> label; the headline first
    "arrays": "HEADLINE: at once, arrays read",
    "publish": "publish alone",
    "consume": "consume alone, arrays read",
    "bus": "at once, bus only (no codec)",
}
EXPS_PER_GROUP = 8
ACTOR = "producer"  # the producer's actor name: rftstream writes it into the body
FETCH_TIMEOUT = 1.0  # s a fetch waits when nothing is there
SIDES = ("rftstream", "raw")
# rates guessed to size a measurement (2 cores, both sides alike): their messages a second
GUESS_MSGS, GUESS_MIB = 8_000, 200


class BenchError(RuntimeError):
    """A measurement that failed (a worker's error, a lost message, a timeout)."""


# ---------------------------------------------------------------- pure helpers
def size_label(nbytes: int) -> str:
    """``8 KiB``, ``1 MiB``: a target size as the table names it."""
    if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    if nbytes % 1024 == 0:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} B"


def parse_sizes(text: str) -> list[int]:
    """``"8K,64K,1M"`` (or bytes) -> sizes in bytes, in the order given."""
    out = []
    for part in text.split(","):
        p = part.strip().upper().removesuffix("B").removesuffix("I")
        if not p:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20}.get(p[-1], 1)
        value = int(p[:-1] if mult > 1 else p) * mult
        if value < 1024 or value > 4 << 20:
            raise ValueError(f"size {part!r}: between 1K and 4M")
        out.append(value)
    if not out:
        raise ValueError("no sizes")
    return out


def messages_per_run(size: int, seconds: float, lo: int = 40) -> int:
    """Messages a measurement moves: about ``seconds`` at a guessed rate (at most
    ``GUESS_MSGS`` messages or ``GUESS_MIB`` MiB a second), at least ``lo``."""
    rate = min(GUESS_MSGS, GUESS_MIB * (1 << 20) / size)
    return max(lo, round(seconds * rate))


def fetch_batch(size: int, max_msgs: int, max_bytes: int) -> int:
    """Messages per fetch: ``max_msgs``, fewer when they would pass ``max_bytes``."""
    return max(1, min(max_msgs, max_bytes // size))


@dataclass
class Verdict:
    ratios: dict[int, float]  # size -> median ratio of the headline
    target: float

    @property
    def worst(self) -> tuple[int, float]:
        size = min(self.ratios, key=lambda s: self.ratios[s])
        return size, self.ratios[size]

    @property
    def passed(self) -> bool:
        return all(r >= self.target for r in self.ratios.values())

    def lines(self) -> list[str]:
        """One line per size, then the final one (the worst size decides)."""
        out = [
            f"bus, arrays read, {size_label(s)}: rftstream / tuned raw = {r:.2f}x "
            f"(target >= {self.target}x): {'PASS' if r >= self.target else 'MISS'}"
            for s, r in self.ratios.items()
        ]
        size, r = self.worst
        out.append(
            f"bus, arrays read, {size_label(size)} (worst of {len(self.ratios)} sizes): "
            f"rftstream / tuned raw = {r:.2f}x (target >= {self.target}x at every size): "
            f"{'PASS' if self.passed else 'MISS'}"
        )
        return out


# ---------------------------------------------------------------- the workload
def make_group(exps: int, length: int) -> list[Experience]:
    """``exps`` experiences of ``length`` tokens (a quarter prompt), with logprobs,
    advantages, an action mask and a reward; deterministic (ids included)."""
    rng = np.random.default_rng(0)
    prompt = max(1, length // 4)
    resp = length - prompt
    return [
        Experience(
            tokens=rng.integers(0, 150_000, size=length, dtype=np.int32),
            prompt_length=prompt,
            logprobs=rng.normal(size=resp).astype(np.float32),
            advantages=rng.normal(size=resp).astype(np.float32),
            action_mask=rng.random(resp) < 0.9,
            reward=float(i % 2),
            eid=EID(0, 1, i, 0, f"{i:012x}"),
        )
        for i in range(exps)
    ]


def encoded(exps: int, length: int) -> tuple[bytes, dict[str, str]]:
    """The body and headers (without ``Nats-Msg-Id``) ``Bus.publish_group`` sends."""
    (part,) = pack_group(
        make_group(exps, length), actor=ACTOR, msg_id_prefix="x", max_payload=1 << 23
    )
    return part.data, {k: v for k, v in part.headers.items() if k != H_MSG_ID}


def tokens_for(size: int, exps: int) -> int:
    """Tokens per experience that make a group of ``exps`` encode to about ``size`` bytes."""
    a, b = 64, 1024
    sa, sb = len(encoded(exps, a)[0]), len(encoded(exps, b)[0])
    length = max(8, round(a + (size - sa) * (b - a) / (sb - sa)))
    while len(encoded(exps, length)[0]) > size and length > 8:
        length -= 1
    return length


# ---------------------------------------------------------------- the raw client's code
_I4, _F4, _BOOL = np.dtype("<i4"), np.dtype("<f4"), np.dtype(np.bool_)
_RAW_ENCODER = msgspec.msgpack.Encoder()
_RAW_DECODER = msgspec.msgpack.Decoder(ExperienceGroupMsg)
_frombuffer, _from_numpy = np.frombuffer, torch.from_numpy


def raw_encode(group: Sequence[Experience], group_id: str, producer: str) -> bytes:
    """The body of ``group`` as a hand-written client encodes it: each tensor's bytes
    (``numpy().tobytes()``) into the wire structs, built positionally."""
    return _RAW_ENCODER.encode(
        ExperienceGroupMsg(
            SCHEMA_NAME,
            group_id,
            [
                ExperienceRecord(
                    WireEID(e.eid.batch, e.eid.task, e.eid.run, e.eid.step, e.eid.suffix),
                    e.tokens.numpy().tobytes(),
                    e.prompt_length,
                    e.logprobs.numpy().tobytes(),
                    e.reward,
                    None,
                    e.advantages.numpy().tobytes(),
                    None,
                    {},
                    {},
                    None,
                    None,
                    e.action_mask.numpy().tobytes(),
                )
                for e in group
            ],
            0,
            1,
            producer,
        )
    )


def raw_read_arrays(data: bytes) -> int:
    """Decode a body and wrap every array as a tensor (zero-copy); experiences read."""
    msg = _RAW_DECODER.decode(data)
    for r in msg.experiences:
        _from_numpy(_frombuffer(r.tokens, _I4))
        _from_numpy(_frombuffer(r.logprobs, _F4))
        _from_numpy(_frombuffer(r.advantages, _F4))
        _from_numpy(_frombuffer(r.action_mask, _BOOL))
    return len(msg.experiences)


def rft_read_arrays(data: bytes) -> int:
    """What a trainer does with a delivered group: ``decode_group``, every array as a tensor."""
    exps = decode_group(data)
    for e in exps:
        e.tokens, e.logprobs, e.advantages, e.action_mask  # noqa: B018
    return len(exps)


def _quiet_torch() -> None:
    """Emit torch's once-per-process "buffer not writable" warning now, silenced (both
    sides wrap read-only message bodies)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=_I4))


# ---------------------------------------------------------------- worker processes
@dataclass(frozen=True)
class Job:
    side: str  # rftstream | raw
    role: str  # producer | consumer
    scenario: str
    url: str
    run: str
    n: int  # messages
    exps: int
    length: int
    window: int
    batch: int
    raw_consumer: str  # pipelined | fetch (raw side)
    body: bytes  # pre-encoded (the bus-only scenario)
    headers: dict[str, str]  # without Nats-Msg-Id
    rft_inflight: int  # rftstream's NatsConfig.max_inflight_bytes
    limit: float  # s the timed part may take (past it: an error, exit 2)
    profile: str = ""  # a cProfile file to write, or ""


@dataclass(frozen=True)
class Result:
    msgs: int  # published and acked (producer) or fetched and acked (consumer)
    stored: int  # producer: acks that were not duplicates
    exps: int  # consumer: experiences read
    cpu_s: float  # this process's CPU between go and its end
    wall_s: float  # its own clock between go and its end


class Gate:
    """A worker's side of the handshake: ``ready`` -> wait for ``go`` -> ... -> ``end``."""

    def __init__(self, conn: Connection, profile: str) -> None:
        self.conn = conn
        self.profile = profile
        self._prof: cProfile.Profile | None = None
        self.cpu = self.wall = 0.0

    def ready_go(self) -> None:
        self.conn.send(("ready",))
        msg = self.conn.recv()  # blocks the loop on purpose: nothing is due before go
        if msg != ("go",):
            raise BenchError(f"expected go, got {msg!r}")
        if self.profile:
            self._prof = cProfile.Profile()
            self._prof.enable()
        self._cpu0, self._t0 = time.process_time(), time.perf_counter()

    def end(self) -> None:
        self.wall = time.perf_counter() - self._t0
        self.cpu = time.process_time() - self._cpu0
        self.conn.send(("end",))
        if self._prof is not None:
            self._prof.disable()
            self._prof.dump_stats(self.profile)


async def rft_producer(job: Job, gate: Gate) -> Result:
    names = RunNames(job.run)
    cfg = NatsConfig(max_inflight_bytes=job.rft_inflight)
    bus = await Bus.connect(job.url, names, cfg, ACTOR)
    try:
        subject = names.exp_subject(RAW_STAGE)
        group = make_group(job.exps, job.length)
        it = iter(range(job.n))
        stored = done = 0

        async def worker() -> None:
            nonlocal stored, done
            for i in it:
                if job.scenario == "bus":  # the bus alone: the pre-encoded body and headers
                    ack = await bus.publish(
                        subject, job.body, headers=job.headers, msg_id=f"{job.run}.{i}"
                    )
                    new = 0 if ack.duplicate else 1
                else:
                    new = await bus.publish_group(RAW_STAGE, group, msg_id=f"{job.run}.{i}")
                stored += new  # (not `stored += await ...`: that reads `stored` before the await)
                done += 1

        await bus.transport.nc.flush()
        gate.ready_go()
        with anyio.fail_after(job.limit):
            async with anyio.create_task_group() as tg:
                for _ in range(min(job.window, job.n)):
                    tg.start_soon(worker)
        gate.end()
    finally:
        await bus.close()
    return Result(done, stored, 0, gate.cpu, gate.wall)


async def raw_producer(job: Job, gate: Gate) -> Result:
    nc = await nats.connect(job.url)
    try:
        js = nc.jetstream(publish_async_max_pending=job.window)
        subject = RunNames(job.run).exp_subject(RAW_STAGE)
        group = make_group(job.exps, job.length)
        gid, bus_only = group[0].group_id, job.scenario == "bus"
        futures: list[asyncio.Future[Any]] = []
        await nc.flush()
        gate.ready_go()
        with anyio.fail_after(job.limit):
            for i in range(job.n):
                body = job.body if bus_only else raw_encode(group, gid, ACTOR)
                futures.append(
                    await js.publish_async(
                        subject, body, headers={**job.headers, H_MSG_ID: f"{job.run}.{i}"}
                    )
                )
            await js.publish_async_completed()
        gate.end()
        stored = sum(0 if f.result().duplicate else 1 for f in futures)  # raises a failed one
    finally:
        await nc.close()
    return Result(len(futures), stored, 0, gate.cpu, gate.wall)


async def rft_consumer(job: Job, gate: Gate) -> Result:
    names = RunNames(job.run)
    bus = await Bus.connect(job.url, names, NatsConfig(), "trainer")
    try:
        sub = await bus.pull(names.exp_stream, names.stage_consumer(RAW_STAGE, TRAIN_STAGE))
        read = job.scenario != "bus"
        got = exps = 0
        await bus.transport.nc.flush()
        gate.ready_go()
        with anyio.fail_after(job.limit):
            while got < job.n:
                # never more than is left: a fetch for more would wait out its timeout
                for m in await sub.fetch(min(job.batch, job.n - got), timeout=FETCH_TIMEOUT):
                    if read:
                        exps += rft_read_arrays(m.data)
                    await m.ack()
                    got += 1
            await bus.transport.nc.flush()  # every ack is at the server
        gate.end()
        await sub.unsubscribe()
    finally:
        await bus.close()
    return Result(got, 0, exps, gate.cpu, gate.wall)


async def raw_consumer_fetch(job: Job, gate: Gate, nc: Any, stream: str, durable: str) -> int:
    """nats-py's pull subscription: ``fetch(batch)`` on the durable, process, ack."""
    sub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
    read = job.scenario != "bus"
    got = exps = 0
    await nc.flush()
    gate.ready_go()
    with anyio.fail_after(job.limit):
        while got < job.n:
            try:
                msgs = await sub.fetch(min(job.batch, job.n - got), timeout=FETCH_TIMEOUT)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            for m in msgs:
                if read:
                    exps += raw_read_arrays(m.data)
                await m.ack()
                got += 1
        await nc.flush()
    gate.end()
    await sub.unsubscribe()
    return exps


async def raw_consumer_pipelined(job: Job, gate: Gate, nc: Any, stream: str, durable: str) -> int:
    """Pull requests of ``batch`` messages delivered to a core subscription's callback
    (no task per message), pipelined: two requests at first, then another whenever at
    most one batch is asked for and not yet delivered, so the server always holds one.
    Requests have no expiry (N messages will come) and never ask for more than N."""
    nms = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
    inbox = nc.new_inbox()
    read = job.scenario != "bus"
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    got = exps = requested = 0

    async def ask() -> None:
        nonlocal requested
        k = min(job.batch, job.n - requested)
        requested += k
        await nc.publish(nms, json.dumps({"batch": k}).encode(), reply=inbox)

    async def on_msg(m: Msg) -> None:
        nonlocal got, exps
        if finished.done():
            return
        try:
            if m.headers and m.headers.get("Status"):
                if m.headers["Status"] == "100":  # idle heartbeat
                    return
                raise BenchError(f"raw consumer: pull ended: {m.headers}")
            if read:
                exps += raw_read_arrays(m.data)
            await m.ack()
            got += 1
            if got == job.n:
                finished.set_result(None)
            elif requested < job.n and requested - got <= job.batch:
                await ask()
        except BaseException as exc:  # noqa: BLE001 - reported by the awaiting task
            if not finished.done():
                finished.set_exception(exc)

    sub = await nc.subscribe(inbox, cb=on_msg)
    await nc.flush()
    gate.ready_go()
    while requested < job.n and requested < 2 * job.batch:
        await ask()
    with anyio.fail_after(job.limit):
        await finished
        await nc.flush()
    gate.end()
    await sub.unsubscribe()
    return exps


async def raw_consumer(job: Job, gate: Gate) -> Result:
    names = RunNames(job.run)
    stream, durable = names.exp_stream, names.stage_consumer(RAW_STAGE, TRAIN_STAGE)
    nc = await nats.connect(job.url)
    try:
        if job.raw_consumer == "fetch":
            exps = await raw_consumer_fetch(job, gate, nc, stream, durable)
        else:
            exps = await raw_consumer_pipelined(job, gate, nc, stream, durable)
    finally:
        await nc.close()
    return Result(job.n, 0, exps, gate.cpu, gate.wall)


ROLES: dict[tuple[str, str], Callable[[Job, Gate], Awaitable[Result]]] = {
    ("rftstream", "producer"): rft_producer,
    ("rftstream", "consumer"): rft_consumer,
    ("raw", "producer"): raw_producer,
    ("raw", "consumer"): raw_consumer,
}


def worker_main(conn: Connection, side: str, role: str) -> None:
    """A worker process: run the jobs the parent sends until it sends None."""
    _quiet_torch()
    tune_malloc()  # both sides, as rftstream's actor processes start (--glibc-malloc: neither)
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            result = asyncio.run(ROLES[(side, role)](job, Gate(conn, job.profile)))
            conn.send(("done", result))
        except BaseException:  # noqa: BLE001 - reported to the parent, which exits 2
            conn.send(("error", f"{side} {role}: {traceback.format_exc()}"))
        gc.collect()


# ---------------------------------------------------------------- the parent
@dataclass
class Run:
    rate: float  # messages per second (parent's clock)
    cpu_us: dict[str, float]  # µs per message: producer, consumer, server
    contestant: str  # rftstream, raw/pipelined or raw/fetch


@dataclass
class Settings:
    sizes: list[int]
    scenarios: list[str]
    rounds: int
    window: int
    fetch_msgs: int
    fetch_bytes: int
    seconds: float  # a measurement's length, roughly (messages from guessed rates)
    raw_consumer: str
    profile: str
    rft_inflight: int  # rftstream's NatsConfig.max_inflight_bytes (its default unless asked)
    glibc_malloc: bool = False  # both sides' workers keep glibc's malloc defaults
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)  # size -> (exps, tokens)
    bodies: dict[int, tuple[bytes, dict[str, str]]] = field(default_factory=dict)

    def n(self, size: int, scenario: str = HEADLINE) -> int:
        """Messages a run moves: the other scenarios run half as long as the headline."""
        return messages_per_run(size, self.seconds * (1 if scenario == HEADLINE else 0.5))

    def batch(self, size: int) -> int:
        return fetch_batch(size, self.fetch_msgs, self.fetch_bytes)


def _server_cpu(pid: int | None) -> float | None:
    """CPU seconds nats-server has used (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Workers:
    """The four worker processes (spawn), one pipe each."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conns: dict[tuple[str, str], Connection] = {}
        self.procs: list[Any] = []
        for side in SIDES:
            for role in ("producer", "consumer"):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(child, side, role), name=f"{side}-{role}")
                p.start()
                child.close()
                self.conns[(side, role)] = parent
                self.procs.append(p)

    def recv(self, key: tuple[str, str], timeout: float) -> tuple[Any, ...]:
        conn = self.conns[key]
        if not conn.poll(timeout):
            raise BenchError(f"{key[0]} {key[1]}: no answer in {timeout:g} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise BenchError(f"{key[0]} {key[1]}: the worker process died") from None
        if msg[0] == "error":
            raise BenchError(msg[1])
        return msg  # type: ignore[no-any-return]

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


class Bench:
    """Measurements against one nats-server, with the workers and a setup connection."""

    def __init__(self, server: EmbeddedNatsServer, settings: Settings, workers: Workers) -> None:
        self.server = server
        self.s = settings
        self.workers = workers
        self.runner = asyncio.Runner()
        self.k = 0
        self.setup: Bus | None = None
        self.nc: Any = None

    async def _connect(self) -> None:
        self.setup = await Bus.connect(
            self.server.url, RunNames("benchsetup"), NatsConfig(), "setup"
        )
        self.nc = await nats.connect(self.server.url)

    async def _provision(self, run: str, n: int, size: int, prefill: bool) -> None:
        assert self.setup is not None
        bus = Bus(self.setup.transport, RunNames(run), NatsConfig(), "setup")
        await bus.provision()
        if prefill:  # consume alone: the same bytes, untimed
            body, headers = self.s.bodies[size]
            js = self.nc.jetstream(publish_async_max_pending=self.s.window)
            subject = bus.names.exp_subject(RAW_STAGE)
            for i in range(n):
                await js.publish_async(subject, body, headers={**headers, H_MSG_ID: f"{run}.{i}"})
            await js.publish_async_completed()

    async def _check_and_clean(self, run: str, n: int, consumed: bool) -> None:
        names = RunNames(run)
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(names.exp_stream)
            if info.state.messages != n:
                raise BenchError(f"{run}: the stream holds {info.state.messages} messages, not {n}")
            if consumed:  # every message delivered and acked (acks are applied async)
                durable = names.stage_consumer(RAW_STAGE, TRAIN_STAGE)
                deadline = time.monotonic() + 30
                while True:
                    c = await js.consumer_info(names.exp_stream, durable)
                    if c.num_pending == 0 and c.num_ack_pending == 0:
                        break
                    if time.monotonic() > deadline:
                        raise BenchError(
                            f"{run}: {c.num_pending} pending, {c.num_ack_pending} unacked"
                        )
                    await anyio.sleep(0.02)
        finally:
            for stream in (*names.streams, f"KV_{names.kv_bucket}"):
                try:
                    await js.delete_stream(stream)
                except nats.errors.Error:
                    pass

    def measure(self, contestant: str, scenario: str, size: int, n: int = 0) -> Run:
        """One measurement of ``contestant`` (``rftstream``, ``raw/pipelined`` or
        ``raw/fetch``) on fresh streams, of ``n`` messages (0: the scenario's number);
        checks everything was stored, delivered, acked."""
        side, _, raw_consumer = contestant.partition("/")
        self.k += 1
        run = f"b{self.k}"
        n = n or self.s.n(size, scenario)
        exps, length = self.s.shapes[size]
        body, headers = self.s.bodies[size]
        self.runner.run(self._provision(run, n, size, prefill=scenario == "consume"))
        roles = [r for r in ("producer", "consumer") if (r, scenario) not in _SKIP]
        limit = 60 + n * size / 5e6  # s: generous; a stuck worker is an error
        for role in roles:
            profile = ""
            if self.s.profile:
                profile = os.path.join(
                    self.s.profile, f"{side}-{role}-{scenario}-{size_label(size)}-{run}.prof"
                ).replace(" ", "")
            job = Job(
                side=side,
                role=role,
                scenario=scenario,
                url=self.server.url,
                run=run,
                n=n,
                exps=exps,
                length=length,
                window=self.s.window,
                batch=self.s.batch(size),
                raw_consumer=raw_consumer or "pipelined",
                body=body,
                headers=headers,
                rft_inflight=self.s.rft_inflight,
                limit=limit,
                profile=profile,
            )
            self.workers.conns[(side, role)].send(job)
        for role in roles:
            self.workers.recv((side, role), limit)  # ready
        s0 = _server_cpu(self.server.pid)
        t0 = time.perf_counter()
        for role in roles:
            self.workers.conns[(side, role)].send(("go",))
        ends: dict[str, float] = {}
        pending = {self.workers.conns[(side, r)]: r for r in roles}
        deadline = time.monotonic() + limit
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise BenchError(f"{side} {scenario} {size_label(size)}: no end in {limit:g} s")
            for conn in ready:
                role = pending.pop(conn)  # type: ignore[call-overload]
                self.workers.recv((side, role), 1)
                ends[role] = time.perf_counter()
        s1 = _server_cpu(self.server.pid)
        dt = (ends["consumer"] if "consumer" in ends else ends["producer"]) - t0
        results = {r: self.workers.recv((side, r), limit)[1] for r in roles}
        self.runner.run(self._check_and_clean(run, n, consumed="consumer" in roles))
        for role, res in results.items():
            if res.msgs != n:
                raise BenchError(f"{side} {role}: {res.msgs} messages, not {n}")
            if role == "producer" and res.stored != n:
                raise BenchError(f"{side} producer: {res.stored} stored of {n} (duplicates?)")
            if role == "consumer" and scenario != "bus" and res.exps != n * exps:
                raise BenchError(f"{side} consumer: read {res.exps} experiences, not {n * exps}")
        cpu = {r: 1e6 * res.cpu_s / n for r, res in results.items()}
        if s0 is not None and s1 is not None:
            cpu["server"] = 1e6 * (s1 - s0) / n
        return Run(n / dt, cpu, contestant)

    def contestants(self, scenario: str) -> list[str]:
        """Who runs ``scenario``: rftstream and the raw client, the raw client with each
        of its consumers (``--raw-consumer both``) when the scenario consumes."""
        mode = self.s.raw_consumer
        if scenario == "publish":  # no consumer: the raw consumers do not differ
            return ["rftstream", "raw/pipelined"]
        if mode == "both":
            return ["rftstream", "raw/pipelined", "raw/fetch"]
        return ["rftstream", f"raw/{mode}"]

    def run_all(self) -> dict[tuple[str, int], dict[str, list[Any]]]:
        """Per (scenario, size) and round: rftstream's run, the raw client's best run,
        and their ratio."""
        self.runner.run(self._connect())
        out: dict[tuple[str, int], dict[str, list[Any]]] = {
            (sc, sz): {"rftstream": [], "raw": [], "ratio": []}
            for sc in self.s.scenarios
            for sz in self.s.sizes
        }
        # warm-up, untimed: every worker process has run every size once (allocators,
        # caches and lazy imports settle), so no side's first measurement pays for it
        t = time.perf_counter()
        for size in self.s.sizes:
            for c in self.contestants(HEADLINE):
                self.measure(c, HEADLINE, size, max(20, self.s.n(size) // 10))
        console.print(f"warm-up: {time.perf_counter() - t:.0f} s")
        turn = 0
        for r in range(self.s.rounds):
            t, count = time.perf_counter(), 0
            for size in self.s.sizes:
                for scenario in self.s.scenarios:
                    who = self.contestants(scenario)
                    turn += 1
                    k = (turn + r) % len(who)  # the order rotates from round to round
                    runs = [self.measure(c, scenario, size) for c in who[k:] + who[:k]]
                    count += len(runs)
                    rft = next(x for x in runs if x.contestant == "rftstream")
                    raw = max(
                        (x for x in runs if x.contestant != "rftstream"), key=lambda x: x.rate
                    )
                    cell = out[(scenario, size)]
                    cell["rftstream"].append(rft)
                    cell["raw"].append(raw)
                    cell["ratio"].append(rft.rate / raw.rate)
            console.print(
                f"round {r + 1}/{self.s.rounds}: {count} runs in {time.perf_counter() - t:.0f} s"
            )
        return out

    def close(self) -> None:
        async def close() -> None:
            if self.setup is not None:
                await self.setup.close()
            if self.nc is not None:
                await self.nc.close()

        try:
            self.runner.run(close())
        finally:
            self.runner.close()


_SKIP = {("consumer", "publish"), ("producer", "consume")}  # roles a scenario runs without


# ---------------------------------------------------------------- report
def _versions() -> str:
    try:
        server = subprocess.run(
            [find_nats_server(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        server = "nats-server ?"
    from importlib.metadata import version

    return (
        f"nats-py {version('nats-py')}, {server}, msgspec {msgspec.__version__}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs"
    )


def print_config(s: Settings) -> None:
    mib = 1 << 20
    cfg = NatsConfig()
    lines = [
        f"bus benchmark: rftstream's bus vs a tuned raw nats-py client ({_versions()})",
        "  processes: parent (nats-server, clock) + per side one producer and one consumer "
        "process (multiprocessing spawn), each its own NATS connection; clock: from every "
        "worker ready to the consumer's last ack (flushed)",
        f"  rftstream: Bus.publish_group from {s.window} tasks (nats.max_inflight_bytes "
        f"{s.rft_inflight / mib:g} MiB caps the bytes awaiting acks"
        + (", its default" if s.rft_inflight == cfg.max_inflight_bytes else ", NOT its default")
        + "); Bus.pull + "
        "PullSubscription.fetch(batch) + decode_group + every array as a tensor + ack",
        f"  raw nats-py: js.publish_async, window {s.window} acks in flight "
        "(publish_async_max_pending), bodies encoded by hand from the same tensors; consumer: "
        + {
            "both": "each round the faster of (pipelined) pull requests of `batch`, two in "
            "flight, on a core subscription's callback and (fetch) nats-py's "
            "PullSubscription.fetch(batch)",
            "pipelined": "pull requests of `batch`, two in flight, on a core subscription's "
            "callback",
            "fetch": "nats-py's PullSubscription.fetch(batch)",
        }[s.raw_consumer]
        + "; msgspec decode + torch.from_numpy(np.frombuffer) per array + ack",
        f"  fetch batch: {s.fetch_msgs} messages, at most {s.fetch_bytes / mib:g} MiB: "
        + ", ".join(f"{s.batch(z)} ({size_label(z)})" for z in s.sizes),
        f"  stream/consumer: Bus.provision for both (file storage, max_msg_size "
        f"{cfg.max_payload / mib:g} MiB, dedup window {cfg.dedup_window:g} s, explicit acks); "
        f"server max_payload {cfg.max_payload / mib:g} MiB",
        "  sizes: "
        + "; ".join(
            f"{size_label(z)} = {s.shapes[z][0]} exps x {s.shapes[z][1]} tokens "
            f"({len(s.bodies[z][0]):,} B + headers), {s.n(z):,} msgs a headline run"
            for z in s.sizes
        ),
        "  malloc: "
        + (
            "glibc's defaults on both sides (--glibc-malloc)"
            if s.glibc_malloc
            else "both sides' workers with the settings rftstream's actor processes set "
            "(rftstream.utils.malloc: mmap threshold "
            f"{MMAP_THRESHOLD / mib:g} MiB, top pad {TOP_PAD / mib:g} MiB, trim threshold "
            f"{TRIM_THRESHOLD / mib:g} MiB; --glibc-malloc for glibc's defaults)"
        ),
        f"  rounds: {s.rounds} (all runs of a size and scenario back to back, the order "
        f"rotating); figures are medians; target: headline >= {TARGET}x at every size",
    ]
    for line in lines:
        console.print(line, soft_wrap=True)


def _cpu(runs: list[Run]) -> str:
    parts = []
    for key in ("producer", "consumer", "server"):
        vals = [r.cpu_us[key] for r in runs if key in r.cpu_us]
        parts.append(f"{median(vals):,.0f}" if vals else "-")
    return " + ".join(parts)


def _winners(runs: list[Run]) -> str:
    """Which raw consumer gave the raw figure, in how many rounds: ``pipelined 2, fetch 1``."""
    counts: dict[str, int] = {}
    for r in runs:
        mode = r.contestant.partition("/")[2]
        counts[mode] = counts.get(mode, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def report(s: Settings, res: dict[tuple[str, int], dict[str, list[Any]]], wall: float) -> Verdict:
    table = Table(
        title=f"rftstream bus vs tuned raw nats-py: medians of {s.rounds} rounds ({wall:.0f} s)",
        caption=(
            "MiB/s: message bodies (headers not counted, the same on both sides); CPU: "
            "microseconds per message of producer + consumer + nats-server; raw consumer: "
            "which one gave the raw figure, in how many rounds"
        ),
    )
    for name, justify in (
        ("scenario", "left"),
        ("size", "right"),
        ("msgs/run", "right"),
        ("rftstream msg/s", "right"),
        ("MiB/s", "right"),
        ("raw msg/s", "right"),
        ("MiB/s ", "right"),
        ("ratio (range)", "right"),
        ("target", "right"),
        ("CPU rftstream", "right"),
        ("CPU raw", "right"),
        ("raw consumer", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    ratios: dict[int, float] = {}
    for scenario in s.scenarios:
        for size in s.sizes:
            cell = res[(scenario, size)]
            ratio = median(cell["ratio"])
            body = len(s.bodies[size][0])
            rft = median(x.rate for x in cell["rftstream"])
            raw = median(x.rate for x in cell["raw"])
            target = ""
            if scenario == HEADLINE:
                ratios[size] = ratio
                target = f">= {TARGET}x: {'PASS' if ratio >= TARGET else 'MISS'}"
            table.add_row(
                SCENARIOS[scenario],
                size_label(size),
                f"{s.n(size, scenario):,}",
                f"{rft:,.0f}",
                f"{rft * body / (1 << 20):,.1f}",
                f"{raw:,.0f}",
                f"{raw * body / (1 << 20):,.1f}",
                f"{ratio:.2f}x ({min(cell['ratio']):.2f}-{max(cell['ratio']):.2f})",
                target,
                _cpu(cell["rftstream"]),
                _cpu(cell["raw"]),
                _winners(cell["raw"]) if scenario != "publish" else "",
            )
    console.print(table)
    return Verdict(ratios, TARGET)


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short measurements (about 1 minute)")
    ap.add_argument(
        "--rounds", type=int, default=5, help="rounds (median; >= 3 for a verdict; 5 by default)"
    )
    ap.add_argument("--sizes", default="8K,64K,256K,1M", help="encoded group sizes")
    ap.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"of {','.join(SCENARIOS)} (the headline always runs)",
    )
    ap.add_argument(
        "--seconds", type=float, default=None, help="a headline run, s (about; 2, --quick 0.25)"
    )
    ap.add_argument("--window", type=int, default=256, help="publishes awaiting acks")
    ap.add_argument("--fetch-msgs", type=int, default=256, help="messages per fetch")
    ap.add_argument("--fetch-mib", type=float, default=16, help="at most MiB per fetch")
    ap.add_argument(
        "--raw-consumer",
        choices=("both", "pipelined", "fetch"),
        default="both",
        help="the raw client's consumer; both: each round takes the faster",
    )
    ap.add_argument(
        "--rft-inflight-mib",
        type=float,
        default=NatsConfig().max_inflight_bytes / (1 << 20),
        help="rftstream's nats.max_inflight_bytes, MiB (its default; for experiments)",
    )
    ap.add_argument("--profile", default="", help="write cProfile files here (slow)")
    ap.add_argument(
        "--glibc-malloc",
        action="store_true",
        help="workers of both sides keep glibc's malloc defaults (default: both get the "
        "settings rftstream's actor processes set, rftstream.utils.malloc)",
    )
    return ap.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; known: {list(SCENARIOS)}")
    scenarios = [HEADLINE] + [x for x in SCENARIOS if x in scenarios and x != HEADLINE]
    seconds = args.seconds if args.seconds is not None else (0.25 if args.quick else 2.0)
    if args.rounds < 1 or args.window < 1 or args.fetch_msgs < 1:
        raise ValueError("--rounds, --window and --fetch-msgs must be >= 1")
    return Settings(
        sizes=parse_sizes(args.sizes),
        scenarios=scenarios,
        rounds=args.rounds,
        window=args.window,
        fetch_msgs=args.fetch_msgs,
        fetch_bytes=int(args.fetch_mib * (1 << 20)),
        seconds=seconds,
        raw_consumer=args.raw_consumer,
        rft_inflight=int(args.rft_inflight_mib * (1 << 20)),
        profile=args.profile,
        glibc_malloc=args.glibc_malloc,
    )


def prepare(s: Settings) -> None:
    """The group shape of every size, its body and headers; the raw encoder's bytes must
    be rftstream's."""
    for size in s.sizes:
        length = tokens_for(size, EXPS_PER_GROUP)
        s.shapes[size] = (EXPS_PER_GROUP, length)
        body, headers = encoded(EXPS_PER_GROUP, length)
        group = make_group(EXPS_PER_GROUP, length)
        if raw_encode(group, group[0].group_id, ACTOR) != body:
            raise BenchError(f"{size_label(size)}: the raw encoder's body differs from rftstream's")
        s.bodies[size] = (body, headers)


def main(argv: list[str] | None = None) -> int:
    try:
        s = settings_from(parse_args(argv))
        if s.glibc_malloc:  # the spawned workers inherit it: tune_malloc leaves glibc alone
            os.environ[OPT_OUT] = "0"
        if s.profile:
            os.makedirs(s.profile, exist_ok=True)
        prepare(s)
    except (ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_config(s)
    workers: Workers | None = None
    t0 = time.perf_counter()
    try:
        workers = Workers()
        with (
            tempfile.TemporaryDirectory() as d,
            EmbeddedNatsServer(d, max_file_store=SMALL_RUNS_FILE_STORE) as server,
        ):
            bench = Bench(server, s, workers)
            try:
                res = bench.run_all()
            except Exception:
                print(f"nats-server log, last lines:\n{server.log_tail(15)}", file=sys.stderr)
                raise
            finally:
                bench.close()
    except Exception:  # noqa: BLE001 - any failure is exit 2, with its traceback
        traceback.print_exc()
        print("bus benchmark: ERROR (exit 2)", file=sys.stderr)
        return 2
    finally:
        if workers is not None:
            workers.close()
    verdict = report(s, res, time.perf_counter() - t0)
    if s.rounds < 3:
        console.print(f"note: {s.rounds} round(s); the verdict wants >= 3 to mean much")
    for line in verdict.lines():
        console.print(line, soft_wrap=True)
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
