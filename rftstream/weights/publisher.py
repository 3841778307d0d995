"""The trainer's side of ``sync_method: jetstream``: versions out to the weights stream.

The trainer hands :meth:`WeightPublisher.submit` a snapshot of its weights in the
wire dtype (taking it is the only part of a sync the trainer waits for) and
goes on training. :meth:`WeightPublisher.run`, in the trainer's task group,
encodes it (:class:`~rftstream.weights.codec.Encoder`: keyframe or byte delta,
in worker threads) and publishes it on ``RFT_<RUN>_WEIGHTS`` while the next step
trains:

1. the payload, in chunks of at most ``max_payload`` on
   ``rft.<run>.weights.<incarnation>.<version>.data`` (encoding the next tensor
   while a chunk is being published);
2. then the :class:`~rftstream.weights.codec.Manifest` on ``....manifest``, which
   names every chunk's stream sequence;
3. then the KV pointer ``weights.latest`` (method ``jetstream``, the manifest's
   sequence), which explorers follow.

A version goes out once, whatever the number of explorers: each reads the
stream. If the trainer submits a version while the previous one is still going
out, it waits in a one-slot mailbox, and a newer one replaces it (an explorer
wants the newest; deltas are taken against the last version published, so
skipping is safe). A version of at most ``SMALL_VERSION_BYTES`` is encoded on the
event loop (the trainer publishes it inline, :meth:`WeightPublisher.publish_now`).
The first publish at least :data:`KEEP_REPLACED_S` after a keyframe removes
everything before that keyframe from the stream (explorers still reading the
older chain had that long). A delta is sent only while its chain is still in the
stream (not after a server restart of a ``storage: memory`` stream, or a user's
purge) and no explorer asked for a keyframe (KV ``weights.keyframe_request``:
it refused a version of the chain); otherwise a keyframe.

Every chunk and manifest carries a ``Nats-Msg-Id`` (``w:<incarnation>:<version>:
<attempt>:<chunk>``), so a publish retried after a timeout is stored once.
A publish that still fails (NATS gone past ``nats.retry_window``) raises
:class:`~rftstream.errors.WeightSyncError` from :meth:`run`, which ends the
trainer's task group: the run fails naming the version. Cancelling :meth:`run`
mid-version leaves chunks without a manifest; no pointer names them and the
next keyframe's purge removes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.bus.transport import Unsubscribe
from rftstream.errors import BusError, WeightSyncError
from rftstream.experience import H_ACTOR, H_SCHEMA
from rftstream.weights.codec import (
    MANIFEST_SCHEMA,
    SMALL_VERSION_BYTES,
    WEIGHTS_SCHEMA,
    EncodedTensor,
    Encoder,
    LoraWire,
    Manifest,
    VersionPlan,
    encode_manifest,
    version_digest,
    wire_dtype_name,
)
from rftstream.wire import WEIGHTS_KEYFRAME, KeyframeRequest, WeightsPointer

log = logging.getLogger(__name__)

H_WEIGHTS_VERSION = "Rft-Weights-Version"
H_WEIGHTS_INCARNATION = "Rft-Weights-Incarnation"
H_WEIGHTS_CHUNK = "Rft-Weights-Chunk"
H_WEIGHTS_KIND = "Rft-Weights-Kind"  # keyframe | delta
H_WEIGHTS_BYTES = "Rft-Weights-Bytes"  # the version's payload bytes (on the manifest)
_HEADROOM = 4096  # bytes of a chunk's max_payload left for its headers
BATCH_BYTES = 8 * 1024 * 1024  # raw bytes of tensors one worker-thread call encodes
CHAIN_CHECK_S = 2.0  # how often a delta's chain is checked to be still in the stream

KEEP_REPLACED_S = 30.0  # what a keyframe replaced stays this long for readers still on it


def _next_batch(tensors: Iterator[EncodedTensor]) -> list[EncodedTensor]:
    """Worker thread: encode tensors until :data:`BATCH_BYTES` of them or the last one."""
    batch: list[EncodedTensor] = []
    raw = 0
    for enc in tensors:
        batch.append(enc)
        raw += enc.entry.nbytes
        if raw >= BATCH_BYTES:
            break
    return batch


@dataclass(frozen=True)
class SyncRecord:
    """What one published version cost: ``blocking_s`` the trainer's own wait (its
    snapshot), ``encode_s`` the worker threads' encoding, ``publish_s`` from the
    submit to the pointer in KV; ``payload_bytes`` what went on the wire,
    ``raw_bytes`` the tensors' wire-dtype bytes."""

    version: int
    keyframe: bool
    raw_bytes: int
    payload_bytes: int
    chunks: int
    blocking_s: float
    encode_s: float
    publish_s: float


@dataclass
class _Job:
    version: int
    step: int
    snapshot: dict[str, torch.Tensor]
    blocking_s: float
    submitted: float


class WeightPublisher:
    """Publishes the trainer's versions on the weights stream (see the module docstring).

    ``incarnation``: this trainer start's (:class:`~rftstream.wire.WeightsPointer`);
    ``delta`` / ``keyframe_ratio``: ``synchronizer.weights_delta`` /
    ``weights_keyframe_ratio``; ``lora``: set when the snapshots are a LoRA adapter
    (explorers merge it onto their base weights).
    """

    def __init__(
        self,
        bus: Bus,
        state: RunState,
        *,
        incarnation: int = 0,
        delta: bool = True,
        keyframe_ratio: float = 1.0,
        lora: LoraWire | None = None,
    ) -> None:
        self.bus = bus
        self.state = state
        self.incarnation = incarnation
        self.lora = lora
        self.encoder = Encoder(delta=delta, keyframe_ratio=keyframe_ratio)
        self._pending: _Job | None = None
        self._busy = False
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._lock = anyio.Lock()  # one version encodes and goes out at a time
        self._published: list[SyncRecord] = []
        self._attempts: dict[int, int] = {}
        self._keyframe_first_seq = 0  # the newest keyframe's first chunk
        self._last_manifest_seq = 0
        # (first stream sequence, when) of each keyframe whose predecessors are still stored
        self._purge_pending: list[tuple[int, float]] = []
        self._keyframe_ts = 0.0  # wall clock of the newest keyframe (keyframe requests)
        # KV weights.keyframe_request is read again only after a write of it was seen
        self._request_writes: Unsubscribe | None = None
        self._request_written = True
        self._request: KeyframeRequest | None = None
        self._chain_checked = 0.0
        self.versions_total = 0
        self.bytes_total = 0
        self.skipped = 0  # submitted versions replaced by a newer one before going out

    # ------------------------------------------------------------ trainer side
    def submit(
        self, version: int, step: int, snapshot: dict[str, torch.Tensor], blocking_s: float = 0.0
    ) -> None:
        """Queue ``snapshot`` (tensors in the wire dtype; not changed afterwards) as
        ``version``; returns at once. Replaces a version submitted earlier that has not
        started going out."""
        if self._pending is not None:
            self.skipped += 1
        self._pending = _Job(version, step, snapshot, blocking_s, time.perf_counter())
        self._idle = anyio.Event()
        self._wake.set()

    async def flush(self) -> None:
        """Block until every submitted version is out (its pointer in KV). Needs
        :meth:`run` running; when it failed, its error ends the task group instead."""
        while self._pending is not None or self._busy:
            await self._idle.wait()

    async def publish_now(
        self, version: int, step: int, snapshot: dict[str, torch.Tensor], blocking_s: float = 0.0
    ) -> SyncRecord:
        """Publish ``version`` inline (without :meth:`run`: a resumed trainer's first
        weights). Blocks until its pointer is in KV. Raises :class:`WeightSyncError`."""
        return await self._publish(_Job(version, step, snapshot, blocking_s, time.perf_counter()))

    def take_published(self) -> list[SyncRecord]:
        """The versions that went out since the last call, oldest first."""
        out, self._published = self._published, []
        return out

    # ------------------------------------------------------------ background
    async def run(self) -> None:
        """Publish submitted versions until cancelled. Raises :class:`WeightSyncError` when
        one cannot go out (the run fails on it)."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._pending is not None:
                job, self._pending = self._pending, None
                self._busy = True
                try:
                    await self._publish(job)
                finally:
                    self._busy = False
            self._idle.set()

    async def _publish(self, job: _Job) -> SyncRecord:
        async with self._lock:
            try:
                record = await self._publish_locked(job)
            except BusError as exc:
                self.encoder.forget()  # explorers may miss it: the next one is a keyframe
                raise WeightSyncError(
                    f"weights v{job.version}: could not be published on "
                    f"{self.bus.names.weights_stream}: {exc}"
                ) from exc
        self._published.append(record)
        self.versions_total += 1
        self.bytes_total += record.payload_bytes
        return record

    async def _publish_locked(self, job: _Job) -> SyncRecord:
        names = self.bus.names
        plan = self.encoder.begin(job.version, job.snapshot)  # sizes only: no thread needed
        if plan.base is not None:
            why = await self._keyframe_needed()
            if why:
                log.info("weights v%d: sending a keyframe: %s", job.version, why)
                self.encoder.forget()
                plan = self.encoder.begin(job.version, job.snapshot)
        attempt = self._attempts.get(job.version, 0)
        self._attempts = {job.version: attempt + 1}  # only the newest version matters
        # a chunk and its headers (a few hundred bytes) fit max_payload
        chunk_bytes = max(1024, self.bus.max_payload - min(_HEADROOM, self.bus.max_payload // 4))
        entries, seqs = await self._publish_payload(job, plan, chunk_bytes, attempt)
        dtype = entries[0].dtype if entries else wire_dtype_name(torch.float32)
        manifest = Manifest(
            run=names.run,
            version=job.version,
            incarnation=self.incarnation,
            step=job.step,
            dtype=dtype,
            base=plan.base,
            keyframe=plan.keyframe,
            chain=plan.chain,
            tensors=entries,
            payload_bytes=plan.payload_bytes,
            raw_bytes=plan.raw_bytes,
            chunk_bytes=chunk_bytes,
            chunks=seqs,
            digest=version_digest(plan.hashes),
            lora=self.lora,
            ts=time.time(),
        )
        ack = await self.bus.publish(
            names.weights_manifest_subject(self.incarnation, job.version),
            encode_manifest(manifest),
            headers={
                H_SCHEMA: MANIFEST_SCHEMA,
                H_ACTOR: self.bus.actor,
                H_WEIGHTS_VERSION: str(job.version),
                H_WEIGHTS_INCARNATION: str(self.incarnation),
                H_WEIGHTS_KIND: "keyframe" if plan.base is None else "delta",
                H_WEIGHTS_BYTES: str(plan.payload_bytes),
            },
            msg_id=f"wm:{self.incarnation}:{job.version}:{attempt}",
        )
        self.encoder.commit(plan, job.snapshot, ack.seq)  # views of the snapshot: cheap
        await self.state.set_latest_weights(
            WeightsPointer(
                version=job.version,
                method="jetstream",
                uri=f"nats:{names.weights_stream}/{ack.seq}",
                step=job.step,
                ts=time.time(),
                incarnation=self.incarnation,
                manifest_seq=ack.seq,
                payload_bytes=plan.payload_bytes,
                raw_bytes=plan.raw_bytes,
                keyframe=plan.keyframe,
                digest=manifest.digest,
            )
        )
        self._last_manifest_seq = ack.seq
        await self._purge_replaced()
        if plan.base is None:  # what came before it goes once readers had time to finish
            self._keyframe_first_seq = seqs[0]
            self._keyframe_ts = time.time()
            self._purge_pending.append((seqs[0], time.monotonic()))
        return SyncRecord(
            version=job.version,
            keyframe=plan.base is None,
            raw_bytes=plan.raw_bytes,
            payload_bytes=plan.payload_bytes,
            chunks=len(seqs),
            blocking_s=job.blocking_s,
            encode_s=plan.encode_s,
            publish_s=time.perf_counter() - job.submitted,
        )

    async def _publish_payload(
        self, job: _Job, plan: VersionPlan, chunk_bytes: int, attempt: int
    ) -> tuple[list[Any], list[int]]:
        """Encode the tensors in a worker thread while the chunks they fill go out;
        returns the entries and the chunks' stream sequences, in payload order."""
        subject = self.bus.names.weights_data_subject(self.incarnation, job.version)
        entries: list[Any] = []
        seqs: list[int] = []
        buf = bytearray()

        async def send_chunk(data: bytes) -> None:
            ack = await self.bus.publish(
                subject,
                data,
                headers={
                    H_SCHEMA: WEIGHTS_SCHEMA,
                    H_ACTOR: self.bus.actor,
                    H_WEIGHTS_VERSION: str(job.version),
                    H_WEIGHTS_INCARNATION: str(self.incarnation),
                    H_WEIGHTS_CHUNK: str(len(seqs)),
                },
                msg_id=f"w:{self.incarnation}:{job.version}:{attempt}:{len(seqs)}",
            )
            seqs.append(ack.seq)

        if plan.raw_bytes <= SMALL_VERSION_BYTES:  # a millisecond of CPU: no thread hops
            for enc in self.encoder.tensors(plan, job.snapshot):
                entries.append(enc.entry)
                buf += memoryview(enc.data).cast("B")
            for start in range(0, max(len(buf), 1), chunk_bytes):
                await send_chunk(bytes(buf[start : start + chunk_bytes]))
            return entries, seqs
        send, receive = anyio.create_memory_object_stream[list[EncodedTensor]](2)
        tensors = self.encoder.tensors(plan, job.snapshot)
        failed: list[BaseException] = []

        async def encode() -> None:
            async with send:
                while True:  # a worker thread per batch of tensors, not per tensor
                    try:
                        batch = await anyio.to_thread.run_sync(_next_batch, tensors)
                    except WeightSyncError as exc:  # a tensor that cannot travel
                        failed.append(exc)
                        return
                    if not batch:
                        return
                    await send.send(batch)

        # a chunk's publish or an encoding that fails ends the task group; its error is
        # raised after it, as itself (not inside an exception group)
        async with anyio.create_task_group() as tg:
            tg.start_soon(encode)
            async with receive:
                async for batch in receive:
                    for enc in batch:
                        entries.append(enc.entry)
                        view = memoryview(enc.data).cast("B")
                        while len(view) and not failed:
                            take = chunk_bytes - len(buf)
                            buf += view[:take]
                            view = view[take:]
                            if len(buf) >= chunk_bytes:
                                try:
                                    await send_chunk(bytes(buf))
                                except BusError as exc:
                                    failed.append(exc)
                                    tg.cancel_scope.cancel()
                                buf = bytearray()
        if failed:
            raise failed[0]
        if buf or not seqs:
            await send_chunk(bytes(buf))
        return entries, seqs

    async def _keyframe_request(self) -> KeyframeRequest | None:
        """The newest keyframe request in KV. Read at the first version, then only after a
        write of the key was seen (a subscription on it, made at the first version and
        kept while the connection lasts): a round trip per version saved. A read that
        fails is tried again at the next version."""
        if self._request_writes is None:
            kv = await self.bus.kv()

            async def written() -> None:
                self._request_written = True

            self._request_writes = await kv.on_write((WEIGHTS_KEYFRAME.name,), written)
        if self._request_written:
            self._request_written = False
            try:
                self._request = await self.state.get(WEIGHTS_KEYFRAME)
            except BusError:
                self._request_written = True
        return self._request

    async def _keyframe_needed(self) -> str:
        """Why the next version must be a keyframe, or "" for a delta: an explorer asked for
        one (KV ``weights.keyframe_request``, newer than our last keyframe), or the chain
        is gone from the stream (a server restart of a ``storage: memory`` stream, a
        user's purge). The stream is asked at most every :data:`CHAIN_CHECK_S`."""
        request = await self._keyframe_request()
        if request is not None and request.ts > self._keyframe_ts:
            return f"{request.actor} asked for one ({request.reason})"
        now = time.monotonic()
        if now - self._chain_checked < CHAIN_CHECK_S:
            return ""
        self._chain_checked = now
        try:
            st = await self.bus.stream_state(self.bus.names.weights_stream)
        except BusError as exc:
            return f"the stream's state could not be read ({exc})"
        if 0 < st.first_seq <= self._keyframe_first_seq and st.last_seq >= self._last_manifest_seq:
            return ""
        return f"the delta chain is gone from {self.bus.names.weights_stream}"

    async def _purge_replaced(self) -> None:
        """Remove what came before a keyframe once it is :data:`KEEP_REPLACED_S` old and a
        later version is out (best effort): an explorer still reading the older chain
        had that long to finish."""
        now = time.monotonic()
        due = [seq for seq, at in self._purge_pending if now - at >= KEEP_REPLACED_S]
        if not due:
            return
        self._purge_pending = [(s, at) for s, at in self._purge_pending if s > max(due)]
        names = self.bus.names
        try:
            await self.bus.purge(names.weights_stream, names.weights_wildcard, max(due))
        except BusError as exc:
            log.warning("could not remove old weights from %s: %s", names.weights_stream, exc)
