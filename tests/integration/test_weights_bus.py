"""Weights over JetStream (sync_method jetstream) on a real nats-server, into real
transformers engines: versions go out once and reach every explorer, late joiners
catch up from a keyframe, broken versions are refused by name and the engine keeps
its weights, LoRA adapters are merged on the explorer's side."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from rftstream.bus.client import Bus
from rftstream.bus.state import RunState
from rftstream.config.schema import NatsConfig
from rftstream.engines.transformers_engine import TransformersEngine
from rftstream.subjects import RunNames
from rftstream.weights.codec import LoraWire, decode_manifest, encode_manifest
from rftstream.weights.fetcher import WeightFetcher
from rftstream.weights.publisher import WeightPublisher
from rftstream.wire import WEIGHTS_KEYFRAME, KeyframeRequest

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


NAMES = RunNames("wbus")


@asynccontextmanager
async def _bus(url: str, actor: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(url, NAMES, NatsConfig(max_payload=256 * 1024), actor)
    try:
        await bus.provision()
        yield bus
    finally:
        await bus.close()


def _engine(path: str, **kw: Any) -> TransformersEngine:
    return TransformersEngine(path, max_batch_size=8, **kw)


def _trained(engine: TransformersEngine, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """The engine's weights moved a little, as one training step would (a new version)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in engine.model.state_dict().items():
        if name == "lm_head.weight" and engine.model.config.tie_word_embeddings:
            continue
        out[name] = (t + scale * torch.randn(t.shape, generator=g)).contiguous()
    return out


def _same(engine: TransformersEngine, state: dict[str, torch.Tensor]) -> bool:
    own = engine.model.state_dict()
    return all(torch.equal(own[k], v) for k, v in state.items())


async def _until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.02)


async def test_versions_reach_every_explorer_and_leave_the_trainer_once(
    nats_url: str, tiny_model_path: str
) -> None:
    engines = [_engine(tiny_model_path), _engine(tiny_model_path)]
    async with (
        _bus(nats_url, "trainer") as tbus,
        _bus(nats_url, "explorer-0") as b0,
        _bus(nats_url, "explorer-1") as b1,
    ):
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()))
        fetchers = [
            WeightFetcher(b, RunState(await b.kv()), e, name=f"explorer-{i}")
            for i, (b, e) in enumerate(zip((b0, b1), engines, strict=True))
        ]
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.run)
            for f in fetchers:
                tg.start_soon(f.run)
            versions = {}
            for v in (1, 2, 3):
                versions[v] = _trained(engines[0], v * 7)
                publisher.submit(v, v, versions[v])
                await publisher.flush()
                await _until(lambda v=v: all(f.held >= (0, v) for f in fetchers))
                for f, e in zip(fetchers, engines, strict=True):
                    before = e.model_version
                    pause = await f.swap(wait=True)
                    assert pause is not None and pause < 0.1  # a pointer swap, not a copy
                    assert e.model_version == v and before == v - 1
                    assert _same(e, versions[v])
            tg.cancel_scope.cancel()
        published = publisher.take_published()
        assert [r.version for r in published] == [1, 2, 3]
        assert published[0].keyframe and not published[1].keyframe  # deltas after the first
        # the stream holds each version once (one manifest each), whatever the readers
        state = await tbus.transport.stream_state(NAMES.weights_stream, subjects_filter=">")
        manifests = [s for s in state.subjects if s.endswith(".manifest")]
        assert sorted(manifests) == [NAMES.weights_manifest_subject(0, v) for v in (1, 2, 3)]
        # and every explorer read every version from the stream
        assert all(f.versions_total == 3 for f in fetchers)
        assert fetchers[0].bytes_total == fetchers[1].bytes_total == publisher.bytes_total


async def test_a_late_joiner_catches_up_from_the_keyframe(
    nats_url: str, tiny_model_path: str
) -> None:
    trainer_side = _engine(tiny_model_path)
    late = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "late") as lbus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), keyframe_ratio=100.0)
        newest = {}
        for v in (1, 2, 3, 4):
            newest = _trained(trainer_side, v)
            await trainer_side.load_weights(newest, v)
            await publisher.publish_now(v, v, newest)
        fetcher = WeightFetcher(lbus, RunState(await lbus.kv()), late, name="late")
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await _until(lambda: fetcher.held == (0, 4))
            tg.cancel_scope.cancel()
        record = fetcher.take_metrics()
        assert record["sync/fetched_from_keyframe"] == 1  # v1, then deltas 2, 3 and 4
        assert await fetcher.swap(wait=True) is not None
        assert late.model_version == 4 and _same(late, newest)


async def _publish_broken(
    tbus: Bus, publisher: WeightPublisher, version: int, state: dict[str, torch.Tensor], how: str
) -> str:
    """Publish ``version`` normally, then break what is on the stream the way ``how``
    says and point the KV at the broken copy. Returns the tensor the break hits."""
    await publisher.publish_now(version, version, state)
    kv_state = RunState(await tbus.kv())
    ptr = await kv_state.latest_weights()
    assert ptr is not None
    stream = NAMES.weights_stream
    stored = await tbus.transport.get_msg(stream, ptr.manifest_seq, direct=True)
    manifest = decode_manifest(stored.data, "test")
    big = max(manifest.tensors, key=lambda e: e.length)
    chunk = big.offset // manifest.chunk_bytes
    if how == "missing chunk":  # the version's chunks up to that one: the first is named
        await tbus.transport.purge(
            stream, NAMES.weights_data_subject(0, version), manifest.chunks[chunk] + 1
        )
        first = min(manifest.tensors, key=lambda e: e.offset if e.length else 1 << 62)
        await kv_state.set_latest_weights(ptr)
        return first.name
    elif how in ("corrupt chunk", "wrong shape", "hash mismatch"):
        raw = await tbus.transport.get_msg(stream, manifest.chunks[chunk], direct=True)
        data = bytearray(raw.data)
        if how == "corrupt chunk":
            data[big.offset % manifest.chunk_bytes + big.length // 2] ^= 0x5A
        ack = await tbus.publish(NAMES.weights_data_subject(0, version), bytes(data))
        chunks = list(manifest.chunks)
        chunks[chunk] = ack.seq
        entries = list(manifest.tensors)
        if how == "wrong shape":  # the same bytes, declared as another shape
            i = entries.index(big)
            entries[i] = type(big)(**{**_fields(big), "shape": [big.shape[0] * big.shape[1]]})
        if how == "hash mismatch":
            i = entries.index(big)
            entries[i] = type(big)(**{**_fields(big), "xxh3": "0" * 32})
        fixed = type(manifest)(**{**_fields(manifest), "chunks": chunks, "tensors": entries})
        ack = await tbus.publish(NAMES.weights_manifest_subject(0, version), encode_manifest(fixed))
        ptr = type(ptr)(**{**_fields(ptr), "manifest_seq": ack.seq})
    await kv_state.set_latest_weights(ptr)
    return big.name


def _fields(struct: Any) -> dict[str, Any]:
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


@pytest.mark.parametrize("how", ["missing chunk", "corrupt chunk", "hash mismatch", "wrong shape"])
async def test_a_broken_version_is_refused_and_the_engine_keeps_its_weights(
    nats_url: str, tiny_model_path: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(tiny_model_path)
    good = _trained(engine, 1)
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "explorer") as ebus:
        # deltas off: each version stands alone, so the break hits exactly one version
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), delta=False)
        fetcher = WeightFetcher(ebus, RunState(await ebus.kv()), engine, name="explorer")
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await publisher.publish_now(1, 1, good)
            await _until(lambda: fetcher.held == (0, 1))
            await fetcher.swap(wait=True)
            tg.cancel_scope.cancel()  # the explorer looks away while v2 goes out and breaks
        tensor = await _publish_broken(tbus, publisher, 2, _trained(engine, 2), how)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await _until(lambda: fetcher.failures == 1)
            assert fetcher.held == (0, 1) and engine.model_version == 1
            assert await fetcher.swap(wait=True) is None  # nothing to swap in
            assert _same(engine, good)
            # nothing hangs: the next good version goes through
            fresh = _trained(engine, 3)
            await publisher.publish_now(3, 3, fresh)
            await _until(lambda: fetcher.held == (0, 3))
            await fetcher.swap(wait=True)
            tg.cancel_scope.cancel()
    assert engine.model_version == 3 and _same(engine, fresh)
    refused = [r.getMessage() for r in caplog.records if "keeping weights v1" in r.getMessage()]
    assert len(refused) == 1, refused
    assert "weights v2" in refused[0] and tensor in refused[0], refused[0]


async def test_lora_adapter_alone_travels_and_is_merged_on_the_explorer(
    nats_url: str, tiny_model_path: str
) -> None:
    engine = _engine(tiny_model_path)
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    layers = {"model.layers.0.self_attn.q_proj": 2.0, "model.layers.1.mlp.down_proj": 0.5}
    g = torch.Generator().manual_seed(0)
    adapter = {}
    for layer in layers:
        out_f, in_f = base[f"{layer}.weight"].shape
        adapter[f"{layer}.lora_A.weight"] = torch.randn(4, in_f, generator=g)
        adapter[f"{layer}.lora_B.weight"] = torch.randn(out_f, 4, generator=g) * 0.01
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "explorer") as ebus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), lora=LoraWire(layers=layers))
        record = await publisher.publish_now(1, 1, adapter)
        assert record.raw_bytes == sum(t.numel() * 4 for t in adapter.values())  # no base weights
        fetcher = WeightFetcher(
            ebus, RunState(await ebus.kv()), engine, name="explorer", model_path=tiny_model_path
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await _until(lambda: fetcher.held == (0, 1))
            await fetcher.swap(wait=True)
            tg.cancel_scope.cancel()
    own = engine.model.state_dict()
    for name, value in own.items():
        layer = name.removesuffix(".weight")
        if layer in layers:
            a, b = adapter[f"{layer}.lora_A.weight"], adapter[f"{layer}.lora_B.weight"]
            expected = base[name].float() + layers[layer] * (b @ a)
            assert torch.allclose(value, expected.to(value.dtype)), name
        else:
            assert torch.equal(value, base[name]), name  # untouched


async def test_a_chain_removed_from_the_stream_makes_the_next_version_a_keyframe(
    nats_url: str, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rftstream.weights.publisher as pub

    monkeypatch.setattr(pub, "CHAIN_CHECK_S", 0.0)
    engine = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()))
        await publisher.publish_now(1, 1, _trained(engine, 1))
        await publisher.publish_now(2, 2, _trained(engine, 2))
        state = await tbus.transport.stream_state(NAMES.weights_stream)
        await tbus.transport.purge(NAMES.weights_stream, NAMES.weights_wildcard, state.last_seq + 1)
        third = await publisher.publish_now(3, 3, _trained(engine, 3))
        assert [r.keyframe for r in publisher.take_published()] == [True, False, True]
        assert third.keyframe


async def test_the_stream_keeps_only_the_newest_chain(
    nats_url: str, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each keyframe replaces what came before it, at the first publish once it is
    KEEP_REPLACED_S old (0 here): a run that publishes many versions holds about two
    keyframes' bytes, never more."""
    import rftstream.weights.publisher as pub

    monkeypatch.setattr(pub, "KEEP_REPLACED_S", 0.0)
    engine = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), delta=False)
        sizes = []
        for v in range(1, 9):
            record = await publisher.publish_now(v, v, _trained(engine, v))
            sizes.append(record.payload_bytes)
            state = await tbus.transport.stream_state(NAMES.weights_stream, subjects_filter=">")
            versions = {int(s.split(".")[-2]) for s in state.subjects}
            assert versions == ({v} if v == 1 else {v - 1, v}), versions
            assert state.bytes < 2.1 * max(sizes)


async def test_replaced_versions_stay_a_while_for_slow_readers(
    nats_url: str, tiny_model_path: str
) -> None:
    """An explorer still reading the chain a new keyframe replaced finds it for
    KEEP_REPLACED_S (30 s) more."""
    engine = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), delta=False)
        for v in (1, 2, 3):
            await publisher.publish_now(v, v, _trained(engine, v))
        state = await tbus.transport.stream_state(NAMES.weights_stream, subjects_filter=">")
        assert {int(s.split(".")[-2]) for s in state.subjects} == {1, 2, 3}


async def test_an_explorer_that_lost_the_chain_gets_a_keyframe(
    nats_url: str, tiny_model_path: str
) -> None:
    """A refused delta makes the fetcher ask for a keyframe (KV weights.keyframe_request);
    the trainer's next version is one, and the explorer is back on the newest weights."""
    engine = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "explorer") as ebus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), keyframe_ratio=100.0)
        fetcher = WeightFetcher(ebus, RunState(await ebus.kv()), engine, name="explorer")
        await publisher.publish_now(1, 1, _trained(engine, 1))
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await _until(lambda: fetcher.held == (0, 1))
            tg.cancel_scope.cancel()
        await _publish_broken(tbus, publisher, 2, _trained(engine, 2), "corrupt chunk")
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await _until(lambda: fetcher.failures == 1)
            assert not fetcher.coming((0, 2)) and not fetcher.coming((0, 3))
            # the request's write reaches the trainer's subscription on its own connection
            await _until(lambda: publisher._request_written)
            third = await publisher.publish_now(3, 3, _trained(engine, 3))
            assert third.keyframe  # asked for: the deltas after v2 could not be rebuilt
            await _until(lambda: fetcher.held == (0, 3))
            tg.cancel_scope.cancel()
        assert fetcher.failures == 1


async def test_the_keyframe_request_is_read_only_after_it_was_written(
    nats_url: str, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer reads KV weights.keyframe_request at its first version and then only
    when a write of it arrives (no round trip per version), and still answers it."""
    engine = _engine(tiny_model_path)
    reads: list[str] = []
    real_get = RunState.get

    async def counted(self: RunState, key: Any) -> Any:
        reads.append(key.name)
        return await real_get(self, key)

    monkeypatch.setattr(RunState, "get", counted)
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "explorer") as ebus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), keyframe_ratio=100.0)
        for v in (1, 2, 3, 4):
            record = await publisher.publish_now(v, v, _trained(engine, v))
            assert record.keyframe == (v == 1)
        assert reads.count(WEIGHTS_KEYFRAME.name) == 1
        await RunState(await ebus.kv()).put(
            WEIGHTS_KEYFRAME,
            KeyframeRequest(
                actor="explorer", incarnation=0, version=4, reason="test", ts=time.time()
            ),
        )
        await _until(lambda: publisher._request_written)
        assert (await publisher.publish_now(5, 5, _trained(engine, 5))).keyframe
        assert (await publisher.publish_now(6, 6, _trained(engine, 6))).keyframe is False
        assert reads.count(WEIGHTS_KEYFRAME.name) == 2


async def test_a_read_that_fails_for_nats_reasons_is_tried_again(
    nats_url: str, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout reading a chunk is NATS trouble, not a broken version: no refusal, no
    keyframe request; the same version is fetched again and staged."""
    import rftstream.weights.fetcher as fetch_module
    from rftstream.errors import BusTimeout

    monkeypatch.setattr(fetch_module, "RETRY_S", 0.05)
    engine = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "explorer") as ebus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()))
        await publisher.publish_now(1, 1, _trained(engine, 1))
        real_get = ebus.transport.get_msg
        failures = [2]

        async def flaky(stream: str, seq: int, *, direct: bool = False) -> Any:
            if failures[0] > 0:
                failures[0] -= 1
                raise BusTimeout(f"message {seq} of stream {stream}: timed out")
            return await real_get(stream, seq, direct=direct)

        monkeypatch.setattr(ebus.transport, "get_msg", flaky)
        fetcher = WeightFetcher(ebus, RunState(await ebus.kv()), engine, name="explorer")
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await _until(lambda: fetcher.held == (0, 1))
            tg.cancel_scope.cancel()
        assert fetcher.failures == 0 and failures[0] == 0
        assert await RunState(await ebus.kv()).get(WEIGHTS_KEYFRAME) is None


async def test_waiting_for_a_refused_version_returns_at_once(
    nats_url: str, tiny_model_path: str
) -> None:
    engine = _engine(tiny_model_path)
    async with _bus(nats_url, "trainer") as tbus, _bus(nats_url, "explorer") as ebus:
        publisher = WeightPublisher(tbus, RunState(await tbus.kv()), delta=False)
        fetcher = WeightFetcher(ebus, RunState(await ebus.kv()), engine, name="explorer")
        await _publish_broken(tbus, publisher, 1, _trained(engine, 1), "hash mismatch")
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            with anyio.fail_after(10):  # not the 3600 s it may wait for a good version
                assert not await fetcher.wait_staged((0, 1), 3600)
            tg.cancel_scope.cancel()
