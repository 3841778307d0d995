"""The weights wire format (rftstream.weights.codec): keyframes, byte deltas, checks."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from rftstream.errors import WeightSyncError
from rftstream.weights import codec
from rftstream.weights.codec import (
    ChainLink,
    Decoder,
    Encoder,
    Manifest,
    chunk_spans,
    decode_manifest,
    encode_manifest,
    tensors_in,
    to_tensor,
    version_digest,
)


def _weights(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(64, 32, generator=g) * 0.02).to(dtype),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(96, 32, generator=g) * 0.02).to(dtype),
        "model.norm.weight": torch.ones(32, dtype=dtype),
    }


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """One small update of every tensor but the norm (which an RL step rarely moves)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if "norm" in name:
            out[name] = t.clone()
        else:
            out[name] = (t.float() - lr * torch.randn(t.shape, generator=g)).to(t.dtype)
    return out


def _encode(encoder: Encoder, version: int, state: dict[str, torch.Tensor], seq: int):
    plan = encoder.begin(version, state)
    encoded = list(encoder.tensors(plan, state))
    payload = b"".join(bytes(memoryview(e.data).cast("B")) for e in encoded)
    manifest = Manifest(
        run="r",
        version=version,
        incarnation=0,
        step=version,
        dtype=encoded[0].entry.dtype,
        base=plan.base,
        keyframe=plan.keyframe,
        chain=plan.chain,
        tensors=[e.entry for e in encoded],
        payload_bytes=plan.payload_bytes,
        raw_bytes=plan.raw_bytes,
        chunk_bytes=1000,
        chunks=[],
        digest=version_digest(plan.hashes),
    )
    encoder.commit(plan, state, seq)
    return manifest, payload


def _decode(decoder: Decoder, manifest: Manifest, payload: bytes, piece: int = 777):
    assembly = decoder.assemble(manifest)
    for i in range(0, len(payload), piece):
        assembly.feed(payload[i : i + piece])
    tensors = assembly.finish()
    decoder.commit(manifest, tensors)
    return {
        name: to_tensor(raw, e.dtype, e.shape)
        for e in manifest.tensors
        for name, raw in [(e.name, tensors[e.name])]
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_chain_of_deltas_rebuilds_every_version_exactly(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float32 deltas save under half the bytes and would go plain: compress every one here
    monkeypatch.setattr(codec, "_DELTA_PAYS", 0.95)
    encoder, decoder = Encoder(keyframe_ratio=10.0), Decoder()
    state = _weights(dtype=dtype)
    for version in range(1, 6):
        state = _step(state, 1e-4, version)
        manifest, payload = _encode(encoder, version, state, seq=version * 10)
        assert (manifest.base is None) == (version == 1)
        got = _decode(decoder, manifest, payload)
        assert _equal(got, state)
        if version > 1:
            kinds = {e.name: e.encoding for e in manifest.tensors}
            assert kinds["model.norm.weight"] == "same"
            assert kinds["model.embed_tokens.weight"] == "delta"
            assert manifest.chain == [ChainLink(v, v * 10) for v in range(1, version)]


def test_bf16_deltas_of_small_updates_are_a_small_share_of_the_weights() -> None:
    encoder = Encoder()
    state = _weights()
    manifest, _ = _encode(encoder, 1, state, 1)
    state = _step(state, 1e-6, 2)
    manifest, payload = _encode(encoder, 2, state, 2)
    assert manifest.base == 1
    assert len(payload) < 0.2 * manifest.raw_bytes  # most bf16 values did not change


def test_a_keyframe_follows_once_the_deltas_outweigh_the_ratio() -> None:
    encoder = Encoder(keyframe_ratio=0.5)
    state = _weights(dtype=torch.float32)
    kinds = []
    for version in range(1, 8):
        state = _step(state, 1e-2, version)  # large updates: each delta is most of a version
        manifest, _ = _encode(encoder, version, state, version)
        kinds.append(manifest.base is None)
    assert kinds[0] and any(kinds[1:]) and not all(kinds)


class _CountingCompressor:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def compress(self, data: Any) -> bytes:
        self.calls += 1
        return bytes(self.inner.compress(data))


def test_tensors_whose_compression_does_not_pay_go_plain_and_are_tried_again_later() -> None:
    encoder, decoder = Encoder(keyframe_ratio=100.0), Decoder()
    state = _weights(dtype=torch.float32)  # float32 deltas: about half the bytes
    zstd = _CountingCompressor(encoder._zstd)
    encoder._zstd = zstd
    compressed: list[int] = []  # versions that ran zstd
    for version in range(1, 3 + codec.RETRY_COMPRESSION_AFTER):
        state = _step(state, 1e-4, version)
        before = zstd.calls
        manifest, payload = _encode(encoder, version, state, version)
        if zstd.calls > before:
            compressed.append(version)
        entry = {e.name: e for e in manifest.tensors}["model.embed_tokens.weight"]
        if version > 1:  # a delta that does not halve goes plain, never as compressed full
            assert (entry.encoding, entry.codec) == ("full", "none")
        assert _equal(_decode(decoder, manifest, payload), state)
    # tried at the keyframe (full) and the first delta, then not until the delta's retry
    assert compressed == [1, 2, 2 + codec.RETRY_COMPRESSION_AFTER]


def test_a_keyframe_is_compressed_when_that_saves_a_little() -> None:
    """A keyframe goes compressed when zstd saves 5% (bf16 weights of a random model: about
    70%), though a delta must halve: keyframes are rare and the largest messages."""
    encoder = Encoder()
    manifest, payload = _encode(encoder, 1, _weights(dtype=torch.bfloat16), 1)
    codecs = {e.name: e.codec for e in manifest.tensors if e.length > 4096}
    assert codecs and set(codecs.values()) == {"zstd"}, codecs
    assert len(payload) < 0.95 * manifest.raw_bytes


def test_without_deltas_every_version_is_a_keyframe() -> None:
    encoder = Encoder(delta=False)
    state = _weights()
    for version in (1, 2, 3):
        manifest, _ = _encode(encoder, version, _step(state, 1e-4, version), version)
        assert manifest.base is None and all(e.encoding == "full" for e in manifest.tensors)


def test_a_corrupt_byte_is_refused_naming_the_version_and_tensor() -> None:
    encoder, decoder = Encoder(), Decoder()
    state = _weights(dtype=torch.float32)
    manifest, payload = _encode(encoder, 1, state, 1)
    _decode(decoder, manifest, payload)
    entry = next(e for e in manifest.tensors if e.name == "model.layers.0.mlp.up_proj.weight")
    bad = bytearray(payload)
    bad[entry.offset + entry.length // 2] ^= 0xFF
    keep = dict(decoder.base)
    with pytest.raises(WeightSyncError, match=r"weights v1: tensor model\.layers\.0\.mlp\.up_proj"):
        _decode(decoder, manifest, bytes(bad))
    assert decoder.base.keys() == keep.keys()  # the base is the last good version


def test_a_truncated_payload_names_the_tensor_left_incomplete() -> None:
    encoder, decoder = Encoder(), Decoder()
    manifest, payload = _encode(encoder, 1, _weights(), 1)
    assembly = decoder.assemble(manifest)
    assembly.feed(payload[: len(payload) - 10])
    with pytest.raises(
        WeightSyncError, match=r"weights v1: payload ends .* tensor .* is incomplete"
    ):
        assembly.finish()


def test_a_wrong_shape_in_the_manifest_is_refused() -> None:
    encoder, decoder = Encoder(delta=False), Decoder()
    manifest, payload = _encode(encoder, 1, _weights(dtype=torch.float32), 1)
    entries = [
        msgspec.structs.replace(e, shape=[e.shape[0] * 2, *e.shape[1:]])
        if e.name == "model.embed_tokens.weight"
        else e
        for e in manifest.tensors
    ]
    bad = msgspec.structs.replace(manifest, tensors=entries)
    with pytest.raises(WeightSyncError, match=r"tensor model\.embed_tokens\.weight.*shape"):
        _decode(decoder, bad, payload)


def test_a_delta_needs_its_own_base() -> None:
    encoder = Encoder()
    state = _weights()
    m1, p1 = _encode(encoder, 1, state, 1)
    m2, p2 = _encode(encoder, 2, _step(state, 1e-4, 2), 2)
    late = Decoder()  # joined after v1: holds nothing
    assert not late.can_apply(m2)
    with pytest.raises(WeightSyncError, match=r"weights v2: a delta against v1"):
        late.assemble(m2)
    _decode(late, m1, p1)  # the keyframe first, then the delta
    _decode(late, m2, p2)
    assert late.version == 2


def test_a_tampered_hash_list_fails_the_digest() -> None:
    encoder, decoder = Encoder(), Decoder()
    manifest, payload = _encode(encoder, 1, _weights(), 1)
    bad = msgspec.structs.replace(manifest, digest="0" * 32)
    with pytest.raises(WeightSyncError, match="digest mismatch"):
        _decode(decoder, bad, payload)


def test_manifest_round_trips_as_json_and_rejects_other_messages() -> None:
    encoder = Encoder()
    manifest, _ = _encode(encoder, 1, _weights(), 1)
    data = encode_manifest(manifest)
    assert data.startswith(b"{")  # readable with `nats stream view`
    assert decode_manifest(data, "here") == manifest
    with pytest.raises(WeightSyncError, match=r"here: not a weights manifest"):
        decode_manifest(b'{"version": "x"}', "here")


def test_chunk_spans_and_the_tensors_in_a_chunk() -> None:
    assert chunk_spans(0, 10) == [(0, 0)]
    assert chunk_spans(25, 10) == [(0, 10), (10, 20), (20, 25)]
    encoder = Encoder(delta=False)
    manifest, _ = _encode(encoder, 1, _weights(dtype=torch.float32), 1)
    first = manifest.tensors[0]
    assert tensors_in(manifest, first.offset, first.offset + 1) == [first.name]


def test_encoder_forget_starts_a_new_chain() -> None:
    encoder = Encoder()
    state = _weights()
    _encode(encoder, 1, state, 1)
    encoder.forget()
    manifest, _ = _encode(encoder, 2, _step(state, 1e-4, 2), 2)
    assert manifest.base is None and manifest.keyframe == 2 and manifest.chain == []


def test_decoded_tensors_own_their_bytes() -> None:
    encoder, decoder = Encoder(delta=False), Decoder()
    state = _weights(dtype=torch.float32)
    manifest, payload = _encode(encoder, 1, state, 1)
    got = _decode(decoder, manifest, bytearray(payload))
    for raw in decoder.base.values():
        assert isinstance(raw, np.ndarray) and raw.flags.writeable
    assert _equal(got, state)
