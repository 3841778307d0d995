"""The explorer's side of ``sync_method: jetstream``: versions in, in the background.

:meth:`WeightFetcher.run` runs in the explorer's task group beside exploration.
It follows the KV pointer ``weights.latest`` (woken by its writes, re-read at
least every 2 s), and for each newer version:

1. reads the version's :class:`~rftstream.weights.codec.Manifest` and, when the
   explorer does not hold its delta base, the chain from its keyframe (an
   explorer that joined late, restarted, or failed a version);
2. reads the chunks by stream sequence (direct gets, a few at a time), and
   rebuilds each version with the :class:`~rftstream.weights.codec.Decoder` in a
   worker thread, each tensor checked against the trainer's hash;
3. stages the result into the rollout engine (:meth:`RolloutEngine.stage_weights`:
   for the transformers engine, a copy into a second model while the first keeps
   generating). With a LoRA version it first merges the adapter onto the base
   weights of the adapted layers, read once from ``model_path``.

Generation never waits for any of it: the explorer calls :meth:`swap` at its sync
points (the sync policy decides when), which swaps the staged version in between
two batches.

A version that cannot be rebuilt (a chunk or manifest missing or corrupt, a hash
or digest mismatch) or staged (a tensor of the wrong shape) is refused with one
warning naming the version and the tensor (:class:`~rftstream.errors.WeightSyncError`):
the engine keeps its weights. When the delta chain cannot be rebuilt, the fetcher
asks the trainer for a keyframe (KV ``weights.keyframe_request``: the trainer's
next version is one) and skips the deltas built on the refused version meanwhile;
it never fetches the same broken version twice. A read that fails for NATS
reasons (a timeout, a lost connection) is not a broken version: the same one is
tried again a second later. :meth:`wait_staged` returns as soon as the version it
waits for is refused. Cancelling :meth:`run` drops a fetch in progress (nothing
staged from it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.errors import BusError, MessageNotFound, RftError, WeightSyncError
from rftstream.subjects import KV_WEIGHTS
from rftstream.weights.codec import (
    SMALL_VERSION_BYTES,
    TENSOR_DTYPES,
    ChainLink,
    Decoder,
    LoraWire,
    Manifest,
    decode_manifest,
    tensors_in,
    to_tensor,
)
from rftstream.wire import WEIGHTS_KEYFRAME, KeyframeRequest, WeightsPointer

log = logging.getLogger(__name__)

WINDOW = 3  # chunk reads in flight
REREAD_S = 2.0  # the pointer is re-read at least this often
RETRY_S = 1.0  # after a read failed for NATS reasons


class _Missing(WeightSyncError):
    """A manifest or chunk is not in the stream (removed after a newer keyframe, or lost)."""


class _Unreadable(WeightSyncError):
    """A read failed for NATS reasons (timeout, connection): worth trying again."""


@dataclass(frozen=True)
class FetchRecord:
    """One version fetched and staged: ``versions`` rebuilt on the way (1, or the
    chain from a keyframe), ``payload_bytes`` read, ``fetch_s`` from reading its
    pointer to rebuilt, ``stage_s`` copying it into the engine; ``from_keyframe``:
    it was a delta this explorer could not build on what it held, so it rebuilt the
    chain from its keyframe."""

    version: int
    incarnation: int
    versions: int
    payload_bytes: int
    fetch_s: float
    stage_s: float
    from_keyframe: bool


class WeightFetcher:
    """Fetches versions from the weights stream and stages them (module docstring).

    ``engine``: the explorer's rollout engine; ``model_path``: where a LoRA run's
    base weights are read from; ``name``: the explorer's, for messages.
    """

    def __init__(
        self,
        bus: Bus,
        state: RunState,
        engine: Any,
        *,
        name: str = "explorer",
        model_path: str | Path = "",
        initial: tuple[int, int] = (0, 0),
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``on_change``: called (in the event loop) whenever a version was staged or
        refused, e.g. to wake a staleness gate waiting for room."""
        self.bus = bus
        self.on_change = on_change
        self.state = state
        self.engine = engine
        self.name = name
        self.model_path = str(model_path)
        self.decoder = Decoder()
        self.active = initial  # (incarnation, version) the engine generates with
        self.staged: tuple[int, int] | None = None
        self._failed: set[tuple[int, int]] = set()
        self._poked = anyio.Event()
        self._staged_event = anyio.Event()
        self._lora_base: dict[str, torch.Tensor] | None = None
        self.fetched: list[FetchRecord] = []
        self.pauses: list[float] = []
        self.failures = 0
        self.bytes_total = 0
        self.versions_total = 0

    # ------------------------------------------------------------ explorer side
    @property
    def held(self) -> tuple[int, int]:
        """The newest (incarnation, version) the engine has or has staged."""
        return max(self.active, self.staged) if self.staged is not None else self.active

    async def swap(self, *, wait: bool = False) -> float | None:
        """Swap the staged version in (between two batches); returns how long generation
        paused, or None when nothing newer is staged (or, without ``wait``, still being
        copied). A failed load keeps the current weights (logged)."""
        staged = self.staged
        if staged is None or staged <= self.active:
            return None
        try:
            pause = await self.engine.swap_staged(wait=wait)
        except Exception as exc:  # noqa: BLE001 - whatever the engine raised: keep ours
            self.staged = None
            self._refuse(
                staged,
                f"weights v{staged[1]}: could not be swapped in: {type(exc).__name__}: {exc}",
            )
            return None
        if pause is None:
            return None
        self.active, self.staged = staged, None
        self.pauses.append(pause)
        return pause

    def coming(self, key: tuple[int, int]) -> bool:
        """Whether (incarnation, version) ``key`` will be held once fetched: newer than
        what is held, and neither it nor a version of its incarnation between ours and it
        was refused (``key`` builds on that one, until a keyframe)."""
        if key <= self.held or key in self._failed:
            return False
        return not any(f[0] == key[0] and self.held < f <= key for f in self._failed)

    async def wait_staged(self, want: tuple[int, int], timeout: float) -> bool:
        """Block until (incarnation, version) ``want`` or a newer one is held, at most
        ``timeout`` s; returns whether it is (False as soon as it cannot come: refused)."""
        with anyio.move_on_after(timeout):
            while self.held < want and self.coming(want):
                await self._staged_event.wait()
        return self.held >= want

    def take_metrics(self) -> dict[str, float]:
        """Explorer metrics of the syncs since the last call (``sync/*``: the longest
        fetch, from reading the pointer to staged, and the longest stage), and totals."""
        fetched, self.fetched = self.fetched, []
        pauses, self.pauses = self.pauses, []
        out: dict[str, float] = {
            "sync/fetched_versions_total": float(self.versions_total),
            "sync/fetch_bytes_total": float(self.bytes_total),
            "sync/failed_versions_total": float(self.failures),
            "sync/swaps": float(len(pauses)),
        }
        if pauses:
            out["sync/explorer_pause_seconds"] = max(pauses)
        if fetched:
            out["sync/fetch_seconds"] = max(f.fetch_s + f.stage_s for f in fetched)
            out["sync/stage_seconds"] = max(f.stage_s for f in fetched)
            out["sync/fetch_bytes"] = float(sum(f.payload_bytes for f in fetched))
            out["sync/fetched_from_keyframe"] = float(sum(f.from_keyframe for f in fetched))
        return out

    # ------------------------------------------------------------ background
    async def run(self) -> None:
        """Follow ``weights.latest`` and fetch each newer version until cancelled."""

        async def poked() -> None:
            self._poked.set()

        kv = await self.bus.kv()
        sub = await kv.on_write((KV_WEIGHTS,), poked)
        try:
            while True:
                try:
                    ptr = await self.state.latest_weights()
                except BusError as exc:
                    log.warning("%s: reading the weights pointer: %s", self.name, exc)
                    ptr = None
                if ptr is not None and self._wanted(ptr):
                    await self._fetch(ptr)
                with anyio.move_on_after(REREAD_S):
                    await self._poked.wait()
                self._poked = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection may be gone
                    pass

    def _changed(self) -> None:
        """Wake :meth:`wait_staged` (and ``on_change``): a version was staged or refused."""
        self._staged_event.set()
        self._staged_event = anyio.Event()
        if self.on_change is not None:
            self.on_change()

    def _wanted(self, ptr: WeightsPointer) -> bool:
        key = (ptr.incarnation, ptr.version)
        return ptr.method == "jetstream" and key > self.held and key not in self._failed

    def _refuse(self, key: tuple[int, int], message: str) -> None:
        self._failed.add(key)
        self.failures += 1
        self._changed()
        log.warning(
            "%s: %s; keeping weights v%d", self.name, message, self.engine.model_version or 0
        )

    async def _ask_keyframe(self, key: tuple[int, int], reason: str) -> None:
        """Ask the trainer for a keyframe (KV ``weights.keyframe_request``): the deltas after
        ``key`` cannot be rebuilt here. Best effort: the trainer's own keyframes come anyway."""
        try:
            await self.state.put(
                WEIGHTS_KEYFRAME,
                KeyframeRequest(
                    actor=self.name,
                    incarnation=key[0],
                    version=key[1],
                    reason=reason[:300],
                    ts=time.time(),
                ),
            )
        except BusError as exc:
            log.warning("%s: could not ask for a keyframe: %s", self.name, exc)

    async def _fetch(self, ptr: WeightsPointer) -> None:
        key = (ptr.incarnation, ptr.version)
        t0 = time.perf_counter()
        try:
            top = await self._manifest(ptr.manifest_seq, f"weights v{ptr.version}")
            if (top.incarnation, top.version) != key or top.run != self.bus.names.run:
                raise WeightSyncError(
                    f"weights v{ptr.version}: the pointer's manifest (stream sequence "
                    f"{ptr.manifest_seq}) is v{top.version} of incarnation {top.incarnation}, "
                    f"run {top.run!r}"
                )
            if ptr.digest and top.digest != ptr.digest:
                raise WeightSyncError(
                    f"weights v{ptr.version}: the manifest at stream sequence "
                    f"{ptr.manifest_seq} has digest {top.digest}, the pointer says {ptr.digest}"
                )
            links = [*top.chain, ChainLink(top.version, ptr.manifest_seq)]
            broken = [
                link.version for link in links if (top.incarnation, link.version) in self._failed
            ]
            if broken:  # built on a version refused before: a keyframe was asked for
                self._failed.add(key)
                self._changed()
                log.info(
                    "%s: weights v%d build on v%d, which was refused; waiting for a keyframe",
                    self.name,
                    top.version,
                    broken[-1],
                )
                return
            start = 0
            if self.decoder.incarnation == top.incarnation and self.decoder.version is not None:
                held = [i for i, link in enumerate(links) if link.version == self.decoder.version]
                if held:
                    start = held[0] + 1
            if start == 0:
                self.decoder.reset()
            payload = 0
            for i, link in enumerate(links[start:], start):
                manifest = (
                    top
                    if i == len(links) - 1
                    else await self._manifest(link.manifest_seq, f"weights v{link.version}")
                )
                payload += await self._rebuild(manifest)
            fetch_s = time.perf_counter() - t0
        except _Unreadable as exc:  # NATS trouble: the same version again, a little later
            log.warning("%s: %s; trying again", self.name, exc)
            await anyio.sleep(RETRY_S)
            return
        except WeightSyncError as exc:  # missing or corrupt: the chain cannot be rebuilt
            self.decoder.reset()
            if isinstance(exc, _Missing) and await self._newer_than(key):
                log.info("%s: %s; taking the newer version", self.name, exc)
                return  # replaced while we read it: not broken
            self._refuse(key, str(exc))
            await self._ask_keyframe(key, str(exc))
            return
        t1 = time.perf_counter()
        self.staged = None  # the engine's staged copy is being overwritten
        try:
            await self._stage(top)
        except WeightSyncError as exc:  # the bytes are the trainer's; the engine refused them
            self._refuse(key, str(exc))
            return
        stage_s = time.perf_counter() - t1
        self.staged = key
        self._changed()
        self.versions_total += 1
        self.bytes_total += payload
        self.fetched.append(
            FetchRecord(
                version=ptr.version,
                incarnation=ptr.incarnation,
                versions=len(links) - start,
                payload_bytes=payload,
                fetch_s=fetch_s,
                stage_s=stage_s,
                from_keyframe=start == 0 and len(links) > 1,
            )
        )
        log.debug(
            "%s: staged weights v%d (%d bytes in %.2fs, staged in %.2fs)",
            self.name,
            ptr.version,
            payload,
            fetch_s,
            stage_s,
        )

    async def _newer_than(self, key: tuple[int, int]) -> bool:
        try:
            ptr = await self.state.latest_weights()
        except BusError:
            return False
        return ptr is not None and (ptr.incarnation, ptr.version) > key

    async def _manifest(self, seq: int, where: str) -> Manifest:
        msg = await self._get(seq, f"{where}: manifest (stream sequence {seq})")
        return decode_manifest(msg.data, f"{where} (stream sequence {seq})")

    async def _get(self, seq: int, what: str) -> Any:
        stream = self.bus.names.weights_stream
        try:
            return await self.bus.get_msg(stream, seq, direct=True)
        except MessageNotFound as exc:
            raise _Missing(
                f"{what} is missing from {stream} (removed after a newer keyframe, or lost)"
            ) from exc
        except BusError as exc:
            raise _Unreadable(f"{what}: cannot be read: {exc}") from exc

    async def _rebuild(self, manifest: Manifest) -> int:
        """Read ``manifest``'s chunks and rebuild the version into the decoder; returns the
        payload bytes read."""
        where = f"weights v{manifest.version}"
        subject = self.bus.names.weights_data_subject(manifest.incarnation, manifest.version)
        assembly = self.decoder.assemble(manifest)
        n = len(manifest.chunks)
        read = 0
        for first in range(0, n, WINDOW):
            indices = range(first, min(first + WINDOW, n))
            got: dict[int, Any] = {}
            async with anyio.create_task_group() as tg:
                for i in indices:
                    tg.start_soon(self._chunk, manifest, i, got)
            for i in indices:
                msg = got[i]
                if isinstance(msg, WeightSyncError):
                    raise msg
                if msg.subject != subject:
                    raise WeightSyncError(
                        f"{where}: chunk {i + 1} of {n} (stream sequence "
                        f"{manifest.chunks[i]}) is a message on {msg.subject}, not {subject}"
                    )
                read += len(msg.data)
            last = indices[-1] == n - 1
            datas = [got[i].data for i in indices]
            if manifest.raw_bytes <= SMALL_VERSION_BYTES:  # a millisecond: no thread hop
                done = _feed(assembly, datas, last)
            else:  # one worker-thread call per window: decoding, at the end the checks
                done = await anyio.to_thread.run_sync(_feed, assembly, datas, last)
        tensors = done if n else await anyio.to_thread.run_sync(assembly.finish)
        self.decoder.commit(manifest, tensors)
        return read

    async def _chunk(self, manifest: Manifest, i: int, into: dict[int, Any]) -> None:
        """Read chunk ``i`` of ``manifest`` into ``into[i]``, or the
        :class:`WeightSyncError` naming the tensors it holds (kept, not raised: the caller
        raises the first in payload order, outside the task group)."""
        seq, n = manifest.chunks[i], len(manifest.chunks)
        lo = i * manifest.chunk_bytes
        names = tensors_in(manifest, lo, lo + manifest.chunk_bytes)
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        try:
            into[i] = await self._get(
                seq,
                f"weights v{manifest.version}: chunk {i + 1} of {n} (stream sequence {seq}; "
                f"tensors {shown})",
            )
        except WeightSyncError as exc:
            into[i] = exc

    async def _stage(self, manifest: Manifest) -> None:
        """Hand the decoder's newest version to the engine (merged onto the base weights
        when it is a LoRA adapter). Raises :class:`WeightSyncError` naming the version."""
        entries = {e.name: e for e in manifest.tensors}
        state = {
            name: to_tensor(raw, entries[name].dtype, entries[name].shape)
            for name, raw in self.decoder.base.items()
        }
        partial = manifest.lora is not None
        try:
            if manifest.lora is not None:
                state = await anyio.to_thread.run_sync(self._merge_lora, manifest.lora, state)
            await self.engine.stage_weights(state, manifest.version, partial=partial)
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's own errors: named, weights kept
            detail = str(exc) if isinstance(exc, RftError) else f"{type(exc).__name__}: {exc}"
            raise WeightSyncError(f"weights v{manifest.version}: {detail}") from exc

    def _merge_lora(
        self, lora: LoraWire, adapter: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if self._lora_base is None:
            names = [f"{layer}.weight" for layer in lora.layers]
            try:
                self._lora_base = read_base_weights(self.model_path, names)
            except WeightSyncError:
                model = getattr(self.engine, "model", None)  # no safetensors: the engine's own
                if model is None:
                    raise
                own = model.state_dict()
                self._lora_base = {k: own[k].detach().clone() for k in names if k in own}
        return merge_lora(self._lora_base, lora, adapter)


def _feed(assembly: Any, datas: list[bytes], last: bool) -> Any:
    """Worker thread: feed chunks to ``assembly``; the rebuilt tensors after the last."""
    for data in datas:
        assembly.feed(data)
    return assembly.finish() if last else None


# ------------------------------------------------------------------ LoRA (explorer side)


def read_base_weights(model_path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the Hugging Face checkpoint at ``model_path`` (its
    ``*.safetensors`` files). Raises :class:`WeightSyncError` naming what is missing."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise WeightSyncError(
            f"LoRA weights: no *.safetensors under model.model_path {model_path!r} to merge "
            "the adapter onto"
        )
    wanted = set(names)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in wanted.intersection(f.keys()):
                out[key] = f.get_tensor(key)
    missing = sorted(wanted - set(out))
    if missing:
        raise WeightSyncError(
            f"LoRA weights: the base model at {model_path!r} has no {missing[:3]} "
            f"({len(missing)} adapted layer weight(s) missing)"
        )
    return out


def merge_lora(
    base: dict[str, torch.Tensor], lora: LoraWire, adapter: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``<layer>.weight = W + scaling * B @ A`` for every adapted layer (``W`` in the
    trainer's ``base_dtype``; float32 product, cast to that dtype), as the trainer's
    merged checkpoints are. Raises
    :class:`WeightSyncError` naming a tensor that is missing or does not fit."""
    out: dict[str, torch.Tensor] = {}
    for layer, scaling in lora.layers.items():
        key = f"{layer}.weight"
        try:
            w = base[key]
            a = adapter[f"{layer}.lora_A.weight"].float()
            b = adapter[f"{layer}.lora_B.weight"].float()
        except KeyError as exc:
            raise WeightSyncError(f"LoRA weights: tensor {exc.args[0]} is missing") from None
        if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise WeightSyncError(
                f"LoRA weights: {layer}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit "
                f"W {tuple(w.shape)}"
            )
        w = w.to(TENSOR_DTYPES.get(lora.base_dtype, w.dtype))  # as the trainer holds it
        out[key] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return out
