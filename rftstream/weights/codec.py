"""The wire format of weights on the bus (``sync_method: jetstream``). Pure: no I/O.

A *version* is the policy's tensors in the wire dtype (the rollout engine's
``model.dtype``, or ``synchronizer.weights_dtype``), laid end to end in one
*payload* that travels as chunks of at most ``max_payload`` bytes, described by
a :class:`Manifest` (JSON, readable with ``nats stream view``) published after
its chunks. Each tensor is encoded on its own (:class:`TensorEntry`):

* ``full``: its bytes, or, in a keyframe where that saves at least 5% (see
  ``_FULL_PAYS``), its bytes split into byte planes (every element's first byte,
  then every second byte, ...) and compressed with zstd;
* ``delta``: the bytewise XOR against the same tensor of the *base* version (the
  previous one), byte planes, zstd. Between two RL steps most bf16 weights do
  not change at all and the others change in their low mantissa bits, so the
  XOR is mostly zero bytes and compresses to a few percent (a delta that does not
  at least halve, as float32 deltas do not, goes as plain ``full``, and that
  tensor's delta is tried again :data:`RETRY_COMPRESSION_AFTER` versions later);
* ``same``: no bytes: identical to the base's.

A version with a base is a delta version; one without is a *keyframe*. The
:class:`Encoder` (trainer side) sends deltas while the deltas since the last
keyframe add up to less than ``keyframe_ratio`` of that keyframe, then a
keyframe again, so an explorer that missed a version (joined late, restarted,
failed a check) catches up from the newest keyframe for at most about
``1 + keyframe_ratio`` keyframes' bytes. Every tensor carries the xxh3-128 hash
of its wire bytes; the :class:`Decoder` (explorer side) checks each
reconstructed tensor against it, and a version that fails (a missing or
corrupt chunk, a hash, a size) raises :class:`~rftstream.errors.WeightSyncError`
naming the version and the tensor, leaving the decoder's base as it was.

Everything here blocks on CPU work (XOR, zstd, hashing: numpy, zstandard and
xxhash release the GIL): run it in a worker thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
import torch
import xxhash
import zstandard

from rftstream.errors import WeightSyncError
from rftstream.wire import WEIGHTS_MANIFEST_SCHEMA as MANIFEST_SCHEMA
from rftstream.wire import WEIGHTS_SCHEMA

__all__ = [
    "MANIFEST_SCHEMA",
    "SMALL_VERSION_BYTES",
    "WEIGHTS_SCHEMA",
    "WIRE_DTYPES",
    "Assembly",
    "ChainLink",
    "Decoder",
    "Encoder",
    "LoraWire",
    "Manifest",
    "TensorEntry",
]

#: the dtypes weights may travel in (``synchronizer.weights_dtype``)
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: every dtype a tensor of a version may have (buffers of integers travel as they are)
TENSOR_DTYPES: dict[str, torch.dtype] = {
    **WIRE_DTYPES,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_TORCH_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}
MAX_CHAIN = 64  # deltas after a keyframe at most (the manifest lists the chain)
# a version this small (its tensors' bytes) is encoded and decoded on the event loop, a
# millisecond or two, rather than in worker threads; the trainer publishes it before it
# acks its step (the background would be no faster: the next step holds the GIL)
SMALL_VERSION_BYTES = 1 << 20

Encoding = Literal["full", "delta", "same"]
Codec = Literal["none", "zstd"]

#: a delta (a tensor XOR its previous version) is sent compressed only when that is at
#: most this share of its bytes. Deltas go with every version: zstd (level 1) compresses at
#: about 1 GB/s and decompresses at about 2.5 GB/s on one core, plus the XOR and byte
#: planes, so saving less than half the bytes costs the two ends more time than moving them
#: on a link of a few Gb/s. bf16 deltas between RL steps are a few percent of the weights
#: and always pay; float32 deltas (every weight's low two bytes change) are about 50-70%
#: and go plain. A tensor whose delta does not pay goes as it is: compressing the whole
#: tensor would do no better.
_DELTA_PAYS = 0.5
#: a keyframe's tensor (no base: the first version, or after ``keyframe_ratio``) is sent
#: compressed when that saves at least 5%: keyframes are rare and the largest messages of a
#: run (a random-weight bf16 model compresses to about 69%)
_FULL_PAYS = 0.95
#: a tensor whose compression did not pay is sent as it is for this many versions before
#: it is tried again (the attempt costs as much as a compression that pays)
RETRY_COMPRESSION_AFTER = 16


# ------------------------------------------------------------------ records


class TensorEntry(msgspec.Struct, kw_only=True):
    """One tensor of a version: where its encoded bytes lie in the payload and how to
    turn them back into the tensor's wire bytes (``xxh3``: their xxh3-128 hash)."""

    name: str
    dtype: str
    shape: list[int]
    encoding: Encoding
    codec: Codec
    offset: int
    length: int
    xxh3: str

    @property
    def nbytes(self) -> int:
        """The tensor's wire bytes (elements x item size)."""
        return math.prod(self.shape) * torch.empty((), dtype=_wire_dtype(self.dtype)).itemsize


class LoraWire(msgspec.Struct, kw_only=True):
    """A version that carries a LoRA adapter only: ``layers`` maps each adapted layer
    (its state-dict prefix, ``model.layers.0.self_attn.q_proj``) to its ``scaling``
    (``lora_alpha / lora_rank``); its tensors are ``<layer>.lora_A.weight`` and
    ``<layer>.lora_B.weight``. The explorer merges ``W + scaling * B @ A`` onto the
    base model's ``<layer>.weight``."""

    layers: dict[str, float]
    # the dtype of the trainer's base weights: the explorer casts the ones it reads to it
    # before merging, so its merged weights are bitwise the trainer's
    base_dtype: str = "float32"


class ChainLink(msgspec.Struct, array_like=True):
    """An earlier version of a delta chain: its number and its manifest's stream sequence."""

    version: int
    manifest_seq: int


class Manifest(msgspec.Struct, kw_only=True):
    """What one version is (``rft.weights.manifest.v1``, JSON): published after its chunks.

    ``base``: the version this one is a delta against (None: a keyframe);
    ``chain``: the versions from the keyframe up to ``base``, in order, so a reader
    holding none of them fetches the whole chain. ``chunks``: the stream sequences of
    the payload's chunks, in payload order (each ``chunk_bytes`` long, the last one
    shorter). ``digest``: xxh3-128 over the tensors' names and hashes, the version's
    identity. ``raw_bytes``: the tensors' wire bytes (what a keyframe without
    compression would be).
    """

    run: str
    version: int
    incarnation: int
    step: int
    dtype: str
    base: int | None
    keyframe: int
    chain: list[ChainLink]
    tensors: list[TensorEntry]
    payload_bytes: int
    raw_bytes: int
    chunk_bytes: int
    chunks: list[int]
    digest: str
    lora: LoraWire | None = None
    ts: float = 0.0
    schema: str = MANIFEST_SCHEMA


_MANIFEST_ENCODER = msgspec.json.Encoder()


def encode_manifest(manifest: Manifest) -> bytes:
    return _MANIFEST_ENCODER.encode(manifest)


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Raises :class:`WeightSyncError` naming ``where`` when ``data`` is not a manifest."""
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as exc:
        raise WeightSyncError(f"{where}: not a weights manifest: {exc}") from exc
    if manifest.schema != MANIFEST_SCHEMA:
        raise WeightSyncError(
            f"{where}: manifest schema {manifest.schema!r}, expected {MANIFEST_SCHEMA!r}"
        )
    return manifest


def version_digest(hashes: dict[str, str]) -> str:
    """The identity of a version: xxh3-128 over ``name:hash`` lines, sorted by name."""
    h = xxhash.xxh3_128()
    for name in sorted(hashes):
        h.update(f"{name}:{hashes[name]}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------ bytes


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``. Raises :class:`WeightSyncError` for an unsupported one."""
    try:
        return _TORCH_NAMES[dtype]
    except KeyError:
        raise WeightSyncError(
            f"a tensor of dtype {dtype} cannot travel (dtypes: {', '.join(TENSOR_DTYPES)})"
        ) from None


def _wire_dtype(name: str) -> torch.dtype:
    try:
        return TENSOR_DTYPES[name]
    except KeyError:
        raise WeightSyncError(
            f"unknown tensor dtype {name!r} (expected one of {', '.join(TENSOR_DTYPES)})"
        ) from None


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (a view, no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise WeightSyncError("tensor_bytes needs a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy()


def to_tensor(raw: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over the bytes ``raw`` (shared, no copy)."""
    return torch.from_numpy(raw).view(_wire_dtype(dtype)).reshape(shape)


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bytewise XOR of two equal-length uint8 arrays (8 bytes at a time where it can)."""
    if a.nbytes % 8 == 0:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(a, b)


def _xor_into(out: np.ndarray, other: np.ndarray) -> None:
    """``out ^= other`` bytewise (equal lengths; 8 bytes at a time where it can)."""
    if out.nbytes % 8 == 0:
        np.bitwise_xor(out.view(np.uint64), other.view(np.uint64), out=out.view(np.uint64))
    else:
        np.bitwise_xor(out, other, out=out)


def _planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes: every element's byte 0, then every byte 1, ... (a copy)."""
    if itemsize == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _unplanes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """The inverse of :func:`_planes` (a new, writable array): each plane widened and
    shifted into place, whole words at a time (a byte-strided transpose is 4x slower)."""
    if itemsize == 1:
        return planes.copy()
    p = planes.reshape(itemsize, -1)
    words = np.empty(p.shape[1], _WORDS[itemsize])
    np.copyto(words, p[0], casting="unsafe")
    shifted = np.empty_like(words)
    for k in range(1, itemsize):
        np.copyto(shifted, p[k], casting="unsafe")
        np.left_shift(shifted, 8 * k, out=shifted)
        np.bitwise_or(words, shifted, out=words)
    return words.view(np.uint8)


# ------------------------------------------------------------------ encoder


@dataclass
class EncodedTensor:
    """One tensor's entry and its encoded bytes (``data``, empty for ``same``)."""

    entry: TensorEntry
    data: bytes | memoryview


@dataclass
class VersionPlan:
    """What :meth:`Encoder.begin` decided for a version: keyframe or delta (``base``)."""

    version: int
    base: int | None
    keyframe: int
    chain: list[ChainLink]
    raw_bytes: int
    hashes: dict[str, str] = field(default_factory=dict)
    payload_bytes: int = 0
    encode_s: float = 0.0


class Encoder:
    """Turns the trainer's successive snapshots into versions (see the module docstring).

    Holds the wire bytes of the last version it encoded (the next delta's base),
    and the chain since the last keyframe. Not thread-safe: one thread encodes at a
    time. ``delta`` False: every version is a keyframe. ``level``: zstd's level.
    """

    def __init__(
        self,
        *,
        delta: bool = True,
        keyframe_ratio: float = 1.0,
        level: int = 1,
        max_chain: int = MAX_CHAIN,
    ) -> None:
        self.delta = delta
        self.keyframe_ratio = keyframe_ratio
        self.max_chain = max_chain
        self._zstd = zstandard.ZstdCompressor(level=level)
        self._base: dict[str, np.ndarray] = {}
        self._base_hashes: dict[str, str] = {}
        self._base_version: int | None = None
        self._keyframe: int | None = None
        self._keyframe_bytes = 0
        self._since_keyframe = 0
        self._chain: list[ChainLink] = []
        # (tensor, encoding) -> the first version at which compressing it so is tried again
        self._plain_until: dict[tuple[str, Encoding], int] = {}

    def forget(self) -> None:
        """Drop the base: the next version is a keyframe (after a version failed to go out,
        a reader could not reconstruct a delta against it)."""
        self._base, self._base_hashes, self._base_version = {}, {}, None
        self._keyframe, self._chain = None, []

    def begin(self, version: int, snapshot: dict[str, torch.Tensor]) -> VersionPlan:
        """Decide whether ``version`` is a keyframe or a delta against the previous one."""
        raw_bytes = sum(t.numel() * t.element_size() for t in snapshot.values())
        keyframe = (
            not self.delta
            or self._base_version is None
            or self._keyframe is None
            or set(snapshot) != set(self._base)
            or self._since_keyframe > self.keyframe_ratio * self._keyframe_bytes
            or len(self._chain) > self.max_chain
        )
        if keyframe:
            return VersionPlan(version, None, version, [], raw_bytes)
        assert self._keyframe is not None and self._base_version is not None
        return VersionPlan(
            version, self._base_version, self._keyframe, list(self._chain), raw_bytes
        )

    def tensors(
        self, plan: VersionPlan, snapshot: dict[str, torch.Tensor]
    ) -> Iterator[EncodedTensor]:
        """Encode ``snapshot``'s tensors one by one (offsets from 0, in name order).

        Each step blocks for one tensor's XOR, compression and hash. ``plan`` gets the
        hashes, the payload size and the encoding time.
        """
        offset = 0
        for name in sorted(snapshot):
            t0 = time.perf_counter()
            enc = self._encode_one(plan, name, snapshot[name], offset)
            plan.encode_s += time.perf_counter() - t0
            plan.hashes[name] = enc.entry.xxh3
            offset += enc.entry.length
            plan.payload_bytes = offset
            yield enc

    def _encode_one(
        self, plan: VersionPlan, name: str, t: torch.Tensor, offset: int
    ) -> EncodedTensor:
        dtype = wire_dtype_name(t.dtype)
        raw = tensor_bytes(t.contiguous())
        digest = xxhash.xxh3_128_hexdigest(raw)
        shape = list(t.shape)
        base = self._base.get(name) if plan.base is not None else None

        def entry(encoding: Encoding, codec: Codec, length: int) -> TensorEntry:
            return TensorEntry(
                name=name,
                dtype=dtype,
                shape=shape,
                encoding=encoding,
                codec=codec,
                offset=offset,
                length=length,
                xxh3=digest,
            )

        if base is not None and base.nbytes == raw.nbytes:
            if self._base_hashes.get(name) == digest:
                return EncodedTensor(entry("same", "none", 0), b"")
            if self._worth_compressing(name, "delta", plan.version):
                packed = self._zstd.compress(_planes(_xor(raw, base), t.element_size()))
                if len(packed) <= _DELTA_PAYS * raw.nbytes:
                    return EncodedTensor(entry("delta", "zstd", len(packed)), packed)
                self._plain_until[name, "delta"] = plan.version + RETRY_COMPRESSION_AFTER
            # a delta that does not pay: the whole tensor would compress no better
            return EncodedTensor(entry("full", "none", raw.nbytes), memoryview(raw))
        if self._worth_compressing(name, "full", plan.version):
            packed = self._zstd.compress(_planes(raw, t.element_size()))
            if len(packed) <= _FULL_PAYS * raw.nbytes:
                return EncodedTensor(entry("full", "zstd", len(packed)), packed)
            self._plain_until[name, "full"] = plan.version + RETRY_COMPRESSION_AFTER
        return EncodedTensor(entry("full", "none", raw.nbytes), memoryview(raw))

    def _worth_compressing(self, name: str, encoding: Encoding, version: int) -> bool:
        """False while compressing ``name`` as ``encoding`` did not pay lately (it failed less
        than :data:`RETRY_COMPRESSION_AFTER` versions before ``version``)."""
        return version >= self._plain_until.get((name, encoding), 0)

    def commit(
        self, plan: VersionPlan, snapshot: dict[str, torch.Tensor], manifest_seq: int
    ) -> None:
        """``plan``'s version is out (its manifest stored at ``manifest_seq``): it becomes the
        base of the next delta. ``snapshot`` must not change afterwards (it is kept as is)."""
        self._base = {name: tensor_bytes(t.contiguous()) for name, t in snapshot.items()}
        self._base_hashes = dict(plan.hashes)
        self._base_version = plan.version
        if plan.base is None:
            self._keyframe = plan.version
            self._keyframe_bytes = max(1, plan.payload_bytes)
            self._since_keyframe = 0
            self._chain = []
        else:
            self._since_keyframe += plan.payload_bytes
        self._chain.append(ChainLink(plan.version, manifest_seq))


def chunk_spans(payload_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of a payload of ``payload_bytes`` (at least one)."""
    if payload_bytes <= 0:
        return [(0, 0)]
    return [(s, min(s + chunk_bytes, payload_bytes)) for s in range(0, payload_bytes, chunk_bytes)]


def tensors_in(manifest: Manifest, start: int, end: int) -> list[str]:
    """Names of the tensors whose bytes lie (in part) in ``[start, end)`` of the payload."""
    return [
        e.name
        for e in manifest.tensors
        if e.length and e.offset < end and e.offset + e.length > start
    ]


# ------------------------------------------------------------------ decoder


class Decoder:
    """Rebuilds versions from manifests and payload bytes, keeping the last one as the
    base of the next delta (explorer side).

    :meth:`assemble` starts a version; feed it the payload in order, then
    :meth:`Assembly.finish`, then :meth:`commit` makes it the base. A failed version
    (any :class:`WeightSyncError`) leaves the base as it was; :meth:`reset` drops the
    base (the next version must be a keyframe).
    """

    def __init__(self) -> None:
        self.base: dict[str, np.ndarray] = {}
        self.incarnation: int | None = None
        self.version: int | None = None

    def reset(self) -> None:
        self.base, self.incarnation, self.version = {}, None, None

    def can_apply(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` is a keyframe or a delta against exactly our base."""
        if manifest.base is None:
            return True
        return (self.incarnation, self.version) == (manifest.incarnation, manifest.base)

    def assemble(self, manifest: Manifest) -> Assembly:
        """Start rebuilding ``manifest``'s version. Raises :class:`WeightSyncError` when it is
        a delta against another base than ours."""
        if not self.can_apply(manifest):
            raise WeightSyncError(
                f"weights v{manifest.version}: a delta against v{manifest.base} "
                f"(incarnation {manifest.incarnation}); this reader holds v{self.version} "
                f"(incarnation {self.incarnation})"
            )
        return Assembly(manifest, self.base if manifest.base is not None else {})

    def commit(self, manifest: Manifest, tensors: dict[str, np.ndarray]) -> None:
        self.base = tensors
        self.incarnation, self.version = manifest.incarnation, manifest.version


class Assembly:
    """One version being rebuilt: :meth:`feed` the payload in order, then :meth:`finish`.

    Each tensor is decoded and checked against its hash as soon as its bytes are
    in (so memory holds about one chunk besides the tensors), then its bytes are
    dropped.
    """

    def __init__(self, manifest: Manifest, base: dict[str, np.ndarray]) -> None:
        self.manifest = manifest
        self._base = base
        self._entries = sorted(manifest.tensors, key=lambda e: e.offset)
        self._next = 0
        self._buf = bytearray()
        self._buf_start = 0  # payload offset of _buf[0]
        self._received = 0
        self._zstd = zstandard.ZstdDecompressor()
        self.tensors: dict[str, np.ndarray] = {}
        self._where = f"weights v{manifest.version}"
        self._decode_ready()  # `same` tensors and empty payloads need no bytes

    def feed(self, data: bytes | memoryview) -> None:
        """Append the next payload bytes; decodes every tensor they complete.

        Raises :class:`WeightSyncError` (naming the tensor) when one fails its checks.
        """
        self._received += len(data)
        if self._received > self.manifest.payload_bytes:
            raise WeightSyncError(
                f"{self._where}: {self._received} payload bytes received, the manifest "
                f"says {self.manifest.payload_bytes}"
            )
        self._buf += data
        self._decode_ready()

    def _decode_ready(self) -> None:
        end = self._buf_start + len(self._buf)
        while self._next < len(self._entries):
            e = self._entries[self._next]
            if e.offset + e.length > end:
                break
            lo = e.offset - self._buf_start
            self.tensors[e.name] = self._decode(e, memoryview(self._buf)[lo : lo + e.length])
            self._next += 1
        if self._next < len(self._entries):
            keep_from = self._entries[self._next].offset - self._buf_start
        else:
            keep_from = len(self._buf)
        if keep_from > 0:
            del self._buf[:keep_from]
            self._buf_start += keep_from

    def _decode(self, e: TensorEntry, data: memoryview) -> np.ndarray:
        where = f"{self._where}: tensor {e.name}"
        itemsize = torch.empty((), dtype=_wire_dtype(e.dtype)).itemsize
        nbytes = math.prod(e.shape) * itemsize
        base = self._base.get(e.name)
        if e.encoding in ("same", "delta"):
            if self.manifest.base is None:
                raise WeightSyncError(f"{where}: encoded as {e.encoding} in a keyframe")
            if base is None or base.nbytes != nbytes:
                raise WeightSyncError(
                    f"{where}: {e.encoding} against v{self.manifest.base}, whose tensor has "
                    f"{'no such name' if base is None else f'{base.nbytes} bytes'} "
                    f"(this one has {nbytes})"
                )
        if e.encoding == "same":
            raw = base
        else:
            raw = self._unpack(e, data, itemsize, nbytes, where)
            if e.encoding == "delta":
                if raw.nbytes != nbytes:
                    raise WeightSyncError(
                        f"{where}: a delta of {raw.nbytes} bytes for a tensor of {nbytes}"
                    )
                _xor_into(raw, base)  # raw is ours: no third array
        assert raw is not None
        if raw.nbytes != nbytes:
            raise WeightSyncError(
                f"{where}: {raw.nbytes} bytes, but shape {tuple(e.shape)} of {e.dtype} "
                f"needs {nbytes}"
            )
        if xxhash.xxh3_128_hexdigest(raw) != e.xxh3:
            raise WeightSyncError(
                f"{where}: hash mismatch (the rebuilt bytes are not the trainer's: "
                "a corrupt chunk, or a delta against other weights)"
            )
        return raw

    def _unpack(
        self, e: TensorEntry, data: memoryview, itemsize: int, nbytes: int, where: str
    ) -> np.ndarray:
        if e.codec == "none":
            return np.frombuffer(data, dtype=np.uint8).copy()
        if e.codec != "zstd":
            raise WeightSyncError(f"{where}: unknown codec {e.codec!r}")
        try:
            planes = self._zstd.decompress(data, max_output_size=nbytes)
        except zstandard.ZstdError as exc:
            raise WeightSyncError(f"{where}: corrupt compressed bytes: {exc}") from exc
        if len(planes) != nbytes:
            raise WeightSyncError(
                f"{where}: decompressed to {len(planes)} bytes, shape {tuple(e.shape)} "
                f"of {e.dtype} needs {nbytes}"
            )
        return _unplanes(np.frombuffer(planes, dtype=np.uint8), itemsize)

    def finish(self) -> dict[str, np.ndarray]:
        """Every tensor of the version, checked. Raises :class:`WeightSyncError` when bytes
        are missing (naming the first tensor left incomplete) or the digest differs."""
        if self._next < len(self._entries):
            e = self._entries[self._next]
            raise WeightSyncError(
                f"{self._where}: payload ends at byte {self._received} of "
                f"{self.manifest.payload_bytes}; tensor {e.name} is incomplete"
            )
        hashes = {e.name: e.xxh3 for e in self.manifest.tensors}
        if version_digest(hashes) != self.manifest.digest:
            raise WeightSyncError(f"{self._where}: digest mismatch over the tensor hashes")
        return self.tensors
