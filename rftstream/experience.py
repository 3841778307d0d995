"""The ``Experience`` record and its msgspec wire schema.

In memory an :class:`Experience` holds torch tensors (as in Trinity-RFT, so
``exp.advantages = score * exp.action_mask`` works). On the wire one message
carries one task's group of experiences as a :class:`ExperienceGroupMsg`
(msgpack); token and float arrays travel as raw little-endian bytes and are
decoded zero-copy: ``numpy.frombuffer`` over the message body, wrapped by
``torch.from_numpy``. No pickle anywhere.

Array shapes follow Trinity-RFT: ``tokens`` is the full sequence (prompt +
response); ``logprobs``, ``action_mask``, ``advantages``, ``returns`` and
``token_level_reward`` cover the response part only (``len(tokens) -
prompt_length``).

This module does no I/O.
"""

from __future__ import annotations

import math
import operator
import sys
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from rftstream.errors import PayloadTooLargeError, SchemaError
from rftstream.headers import (  # noqa: F401 - re-exported: users import them from here
    H_ACTOR,
    H_COUNT,
    H_MODEL_VERSION,
    H_MSG_ID,
    H_PART,
    H_REWARD_MEAN,
    H_SCHEMA,
    H_TASK,
    H_TOKENS,
    headers_size,
)

SCHEMA_NAME = "rft.experience.v1"


# ---------------------------------------------------------------------------
# In-memory record
# ---------------------------------------------------------------------------


@dataclass
class EID:
    """Experience id, as in Trinity-RFT.

    ``batch`` is the explorer step (or taskset batch) that produced the task,
    ``task`` the task's id inside it, ``run`` the rollout index inside the task's
    group, ``step`` the turn index for multi-step workflows and ``suffix`` a
    unique tail.
    """

    batch: int | str = ""
    task: int | str = ""
    run: int = 0
    step: int = 0
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def tid(self) -> str:
        """Task id ``batch/task``: every rollout of one task (a GRPO group) shares it."""
        return f"{self.batch}/{self.task}"

    @property
    def rid(self) -> str:
        """Run id ``batch/task/run``: one rollout of a task, all its steps."""
        return f"{self.batch}/{self.task}/{self.run}"

    @property
    def sid(self) -> str:
        """Step id ``batch/task/step``: one step of a task, shared by all its rollouts.

        As in Trinity-RFT, the run index is not part of it: the experiences that
        every run of a task produced at the same turn share one sid (so
        ``group_by(exps, "step")`` groups a multi-step task per turn).
        """
        return f"{self.batch}/{self.task}/{self.step}"

    @property
    def uid(self) -> str:
        """Globally unique id ``batch/task/run/step/suffix`` of this experience."""
        return f"{self.batch}/{self.task}/{self.run}/{self.step}/{self.suffix}"

    def __str__(self) -> str:
        return self.uid


TensorLike = torch.Tensor | np.ndarray | Sequence[float] | Sequence[int]


def _as_tensor(value: Any, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only views of message bodies
            t = torch.from_numpy(value)
        return t if t.dtype == dtype else t.to(dtype)
    try:
        return torch.tensor(list(value), dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"Experience.{name}: cannot convert {type(value).__name__} to a tensor"
        ) from exc


@dataclass(eq=False)
class Experience:
    """One trajectory (or one turn of one) with everything a trainer needs.

    Construct it like Trinity-RFT's: ``Experience(tokens=..., prompt_length=...,
    reward=..., logprobs=...)``. Lists and numpy arrays are converted to tensors;
    a missing ``action_mask`` means every response token is trained on.
    """

    tokens: torch.Tensor | Any = None
    prompt_length: int = 1
    logprobs: torch.Tensor | Any = None
    reward: float | None = None
    token_level_reward: torch.Tensor | Any = None
    advantages: torch.Tensor | Any = None
    returns: torch.Tensor | Any = None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    response_text: str | None = None
    prompt_text: str | None = None
    action_mask: torch.Tensor | Any = None
    messages: list[dict[str, Any]] | None = None
    chosen: torch.Tensor | Any = None
    rejected: torch.Tensor | Any = None
    chosen_text: str | None = None
    rejected_text: str | None = None
    model_version: int = 0
    eid: EID = field(default_factory=EID)
    # where the sampler banned tokens (min_tokens: end and stop tokens), per response
    # token the log of the probability mass it could still draw from, under the
    # distribution ``logprobs`` are of: log(1 - p(banned_ids)); 0 where nothing was banned
    allowed_logprobs: torch.Tensor | Any = None
    banned_ids: torch.Tensor | Any = None  # the token ids banned where allowed_logprobs < 0

    def __post_init__(self) -> None:
        self.tokens = _as_tensor(self.tokens, torch.int32, "tokens")
        if self.tokens is None:
            self.tokens = torch.zeros(0, dtype=torch.int32)
        self.prompt_length = int(self.prompt_length)
        for name in ("logprobs", "token_level_reward", "advantages", "returns"):
            setattr(self, name, _as_tensor(getattr(self, name), torch.float32, name))
        self.chosen = _as_tensor(self.chosen, torch.int32, "chosen")
        self.rejected = _as_tensor(self.rejected, torch.int32, "rejected")
        if self.allowed_logprobs is not None:
            self.allowed_logprobs = _as_tensor(
                self.allowed_logprobs, torch.float32, "allowed_logprobs"
            )
        if self.banned_ids is not None:
            self.banned_ids = _as_tensor(self.banned_ids, torch.int32, "banned_ids")
        mask = _as_tensor(self.action_mask, torch.bool, "action_mask")
        if mask is None:
            mask = torch.ones(self.response_length, dtype=torch.bool)
        self.action_mask = mask
        if self.reward is not None:
            self.reward = float(self.reward)
        if self.info is None:
            self.info = {}
        if self.metrics is None:
            self.metrics = {}

    def __getstate__(self) -> dict[str, Any]:
        """The fields, every lazy array materialised (for ``copy`` and ``deepcopy``)."""
        d = self.__dict__
        if "_wire" not in d:
            return dict(d)
        for name in _WIRE_ARRAYS:
            getattr(self, name)
        return {k: v for k, v in d.items() if k != "_wire"}

    @property
    def response_length(self) -> int:
        return max(_token_count(self) - self.prompt_length, 0)

    @property
    def response_tokens(self) -> torch.Tensor:
        return self.tokens[self.prompt_length :]

    @property
    def group_id(self) -> str:
        """The id of the group this experience belongs to (``eid.tid``)."""
        return self.eid.tid


def uid_digests(uids: Sequence[str]) -> np.ndarray:
    """The xxh3-64 digests of ``uids`` (experiences' ``eid.uid``) as uint64, in order: 8
    bytes that stand for an experience where every one ever trained is remembered."""
    import xxhash

    return np.fromiter(
        (xxhash.xxh3_64_intdigest(u.encode()) for u in uids), dtype=np.uint64, count=len(uids)
    )


def group_by(exps: Iterable[Experience], id_type: str = "task") -> dict[str, list[Experience]]:
    """Group experiences by ``eid`` part: ``task`` (tid), ``run`` (rid) or ``step`` (sid).

    Preserves first-seen order of groups and of experiences inside a group.
    """
    key = {"task": "tid", "run": "rid", "step": "sid"}.get(id_type)
    if key is None:
        raise ValueError(f"group_by: id_type must be 'task', 'run' or 'step', got {id_type!r}")
    groups: dict[str, list[Experience]] = defaultdict(list)
    for exp in exps:
        groups[getattr(exp.eid, key)].append(exp)
    return dict(groups)


# ---------------------------------------------------------------------------
# Wire schema (append-only: new fields go at the end, with defaults)
# ---------------------------------------------------------------------------


class WireEID(msgspec.Struct, array_like=True, frozen=True, gc=False):
    batch: int | str
    task: int | str
    run: int
    step: int
    suffix: str


class ExperienceRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """One experience on the wire. Arrays are raw little-endian bytes.

    :func:`to_record` builds it positionally: keep it in step with the field order.

    (``gc=False``: records never take part in reference cycles, so the garbage
    collector need not track the thousands a busy actor makes per second.)
    """

    eid: WireEID
    tokens: memoryview  # int32
    prompt_length: int
    logprobs: memoryview | None = None  # float32, response length
    reward: float | None = None
    token_level_reward: memoryview | None = None  # float32
    advantages: memoryview | None = None  # float32
    returns: memoryview | None = None  # float32
    info: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    response_text: str | None = None
    prompt_text: str | None = None
    action_mask: memoryview | None = None  # uint8 (0/1)
    messages: list[dict[str, Any]] | None = None
    chosen: memoryview | None = None  # int32
    rejected: memoryview | None = None  # int32
    chosen_text: str | None = None
    rejected_text: str | None = None
    model_version: int = 0
    allowed_logprobs: memoryview | None = None  # float32, response length
    banned_ids: memoryview | None = None  # int32


class ExperienceGroupMsg(msgspec.Struct, omit_defaults=True, gc=False):
    """One message: (part of) one task's group of experiences."""

    schema: str
    group_id: str
    experiences: list[ExperienceRecord]
    part: int = 0
    parts: int = 1
    producer: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ExperienceGroupMsg)

_LE_I32 = np.dtype("<i4")
_LE_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_LITTLE = sys.byteorder == "little"  # the wire is little-endian: native arrays need no swap

# The array fields of an experience and their wire dtypes (the mask: one byte, 0 or 1).
_WIRE_ARRAYS: dict[str, np.dtype] = {
    "tokens": _LE_I32,
    "logprobs": _LE_F32,
    "token_level_reward": _LE_F32,
    "advantages": _LE_F32,
    "returns": _LE_F32,
    "action_mask": _U8,
    "chosen": _LE_I32,
    "rejected": _LE_I32,
    "allowed_logprobs": _LE_F32,
    "banned_ids": _LE_I32,
}


class _WireArray:
    """Materialises an array field of a decoded experience on first access.

    A non-data descriptor (``__get__`` only), installed on :class:`Experience` in place of
    the field's dataclass default: the instance dict wins over it, so it runs only while
    the field is missing from the instance, that is for a decoded experience
    (:func:`from_record`) whose wire arrays stay bytes until a field is read. An actor that
    only reads rewards and writes advantages converts nothing and re-publishes the
    untouched arrays as they came (:func:`to_record`). Unlike ``__getattr__``, which runs
    after a failed lookup has raised, this costs one call per first read.
    """

    __slots__ = ("dtype", "get", "name", "read")

    def __init__(self, name: str, read: Callable[[ExperienceRecord], torch.Tensor | None]) -> None:
        self.name = name
        self.get = operator.attrgetter(name)
        # numpy dtype of a field read as a zero-copy view (None: the action mask, a copy)
        self.dtype = None if name == "action_mask" else _WIRE_ARRAYS[name]
        self.read = read  # the general reader (big-endian hosts, the action mask)

    def __get__(self, exp: Experience | None, owner: type | None = None) -> Any:
        if exp is None:
            return self
        d = exp.__dict__
        try:
            wire = d["_wire"]
        except KeyError:
            raise AttributeError(f"'Experience' object has no attribute {self.name!r}") from None
        dtype = self.dtype
        if dtype is not None and _LITTLE:  # the common case inline: one view, one wrapper
            buf = self.get(wire)
            value = None if buf is None else _from_numpy(_frombuffer(buf, dtype))
        else:
            value = self.read(wire)
        d[self.name] = value
        return value


# The codec is on every actor's hot path (about 1 us per array each way is the
# floor: one numpy view and one copy out, one numpy view and one torch wrapper in),
# so it avoids anything more: no torch calls beyond `numpy()` / `from_numpy`, no
# `catch_warnings` blocks, no `Experience.__init__` on decode.
_frombuffer = np.frombuffer
_from_numpy = torch.from_numpy
_Tensor = torch.Tensor
_I32, _F32, _BOOL = torch.int32, torch.float32, torch.bool


def _prime_torch_warnings() -> None:
    """Let torch emit its once-per-process "not writable" warning now, silenced.

    ``torch.from_numpy`` over a read-only message body warns once per process
    (the views are never written to); emitting that warning here, under
    ``catch_warnings``, spares every later array a ``catch_warnings`` block
    (2.5 us each).
    """
    global _torch_warned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=_LE_I32))
    _torch_warned = True


_torch_warned = False


def _to_bytes(t: Any, np_dtype: np.dtype) -> bytes | None:
    """The raw little-endian bytes of array field ``t`` (``np_dtype``: ``<i4`` or ``<f4``).

    Fast path (a plain CPU tensor of the wire dtype, as ``Experience`` makes
    them): one ``numpy()`` view, one ``tobytes()`` copy. Anything else (numpy
    arrays, lists, bf16, GPU or grad-tracking tensors, assigned after
    construction) is converted first.
    """
    if t is None:
        return None
    want = _I32 if np_dtype is _LE_I32 else _F32
    if type(t) is _Tensor and t.dtype is want and _LITTLE:
        try:
            return t.numpy().tobytes()  # C order, whatever the strides
        except (RuntimeError, TypeError):  # requires grad, not on the CPU, ...
            pass
    t = _as_tensor(t, want, "array")
    assert t is not None
    arr = t.detach().cpu().resolve_neg().contiguous().numpy()
    if arr.dtype != np_dtype:
        arr = arr.astype(np_dtype)
    return arr.tobytes()


def _mask_bytes(mask: Any) -> bytes | None:
    """The action mask as one byte (0 or 1) per response token."""
    if mask is None:
        return None
    if type(mask) is _Tensor and mask.dtype is _BOOL:
        try:
            return mask.numpy().tobytes()  # torch.bool is one byte, 0 or 1
        except (RuntimeError, TypeError):
            pass
    mask = _as_tensor(mask, _BOOL, "action_mask")
    assert mask is not None
    return mask.detach().cpu().numpy().tobytes()


def _view(buf: memoryview, np_dtype: np.dtype) -> torch.Tensor:
    """A tensor over ``buf`` without copying: ``numpy.frombuffer`` wrapped by ``torch.from_numpy``.

    Raises ``ValueError`` if ``buf`` is not a whole number of elements.
    """
    if _LITTLE:
        return _from_numpy(_frombuffer(buf, np_dtype))
    return _from_numpy(_frombuffer(buf, np_dtype).astype(np_dtype.newbyteorder("=")))


def _array_bytes(d: dict[str, Any], wire: ExperienceRecord | None, name: str) -> Any:
    """The wire bytes of array field ``name``: its wire record's as they came if never read."""
    if name in d:
        if name == "action_mask":
            return _mask_bytes(d[name])
        return _to_bytes(d[name], _WIRE_ARRAYS[name])
    if wire is not None:
        return getattr(wire, name)
    return None


def to_record(exp: Experience) -> ExperienceRecord:
    """Convert an :class:`Experience` to its wire record.

    Arrays of a decoded experience that were never read (nor assigned) are
    passed through as their wire bytes, without a conversion.
    """
    eid = exp.eid
    d = exp.__dict__
    wire = d.get("_wire")
    if wire is None:  # made in this process: every array is an attribute
        # the common case inline (CPU tensors of the wire dtypes: one view and one copy
        # each); anything else goes through the general conversion
        tk, lp, adv, am = d["tokens"], d["logprobs"], d["advantages"], d["action_mask"]
        try:
            if not _LITTLE:
                raise TypeError("big-endian host: the general conversion swaps bytes")
            tokens = (
                tk.numpy().tobytes()
                if type(tk) is _Tensor and tk.dtype is _I32
                else _to_bytes(tk, _LE_I32)
            )
            logprobs = (
                lp.numpy().tobytes()
                if type(lp) is _Tensor and lp.dtype is _F32
                else _to_bytes(lp, _LE_F32)
            )
            advantages = (
                adv.numpy().tobytes()
                if type(adv) is _Tensor and adv.dtype is _F32
                else _to_bytes(adv, _LE_F32)
            )
            mask = (  # torch.bool is one byte, 0 or 1
                am.numpy().tobytes()
                if type(am) is _Tensor and am.dtype is _BOOL
                else _mask_bytes(am)
            )
        except (RuntimeError, TypeError):  # requires grad, not on the CPU, a negative view, ...
            tokens = _to_bytes(tk, _LE_I32)
            logprobs = _to_bytes(lp, _LE_F32)
            advantages = _to_bytes(adv, _LE_F32)
            mask = _mask_bytes(am)
        tlr = None if (t := d["token_level_reward"]) is None else _to_bytes(t, _LE_F32)
        returns = None if (t := d["returns"]) is None else _to_bytes(t, _LE_F32)
        chosen = None if (t := d["chosen"]) is None else _to_bytes(t, _LE_I32)
        rejected = None if (t := d["rejected"]) is None else _to_bytes(t, _LE_I32)
        allowed = None if (t := d.get("allowed_logprobs")) is None else _to_bytes(t, _LE_F32)
        banned = None if (t := d.get("banned_ids")) is None else _to_bytes(t, _LE_I32)
    else:
        tokens = _array_bytes(d, wire, "tokens")
        logprobs = _array_bytes(d, wire, "logprobs")
        tlr = _array_bytes(d, wire, "token_level_reward")
        advantages = _array_bytes(d, wire, "advantages")
        returns = _array_bytes(d, wire, "returns")
        mask = _array_bytes(d, wire, "action_mask")
        chosen = _array_bytes(d, wire, "chosen")
        rejected = _array_bytes(d, wire, "rejected")
        allowed = _array_bytes(d, wire, "allowed_logprobs")
        banned = _array_bytes(d, wire, "banned_ids")
    # positional, in the order of ExperienceRecord's fields (five times cheaper than keywords)
    return ExperienceRecord(
        WireEID(eid.batch, eid.task, eid.run, eid.step, eid.suffix),
        tokens,
        exp.prompt_length,
        logprobs,
        exp.reward,
        tlr,
        advantages,
        returns,
        exp.info or {},
        exp.metrics or {},
        exp.response_text,
        exp.prompt_text,
        mask,
        exp.messages,
        chosen,
        rejected,
        exp.chosen_text,
        exp.rejected_text,
        exp.model_version,
        allowed,
        banned,
    )


def _array_reader(name: str) -> Callable[[ExperienceRecord], torch.Tensor | None]:
    """The function that makes array field ``name`` of a wire record a tensor.

    Arrays are zero-copy views of the message body; the action mask is a copy
    (any non-zero byte is True), and a missing one means every response token
    of the wire's tokens.
    """
    get = operator.attrgetter(name)
    if name == "action_mask":

        def read_mask(rec: ExperienceRecord) -> torch.Tensor:
            buf = rec.action_mask
            if buf is None:
                return torch.ones(max(len(rec.tokens) // 4 - rec.prompt_length, 0), dtype=_BOOL)
            return _from_numpy(_frombuffer(buf, _U8).astype(np.bool_))

        return read_mask
    dtype = _WIRE_ARRAYS[name]

    def read(rec: ExperienceRecord) -> torch.Tensor | None:
        buf = get(rec)
        return None if buf is None else _view(buf, dtype)

    return read


# Their dataclass defaults live in ``Experience.__init__`` only: the class attributes are
# the descriptors that read a decoded experience's arrays off the wire
for _name in _WIRE_ARRAYS:
    setattr(Experience, _name, _WireArray(_name, _array_reader(_name)))
del _name


def array_numpy(exp: Experience, name: str) -> np.ndarray | None:
    """Array field ``name`` of ``exp`` as a 1-D numpy array (bool as uint8 0/1; None where
    absent, an absent wire action mask meaning every response token), without
    making a tensor where the array is still on the wire: a read-only view of the
    message body (the action mask: a 0/1 copy). A tensor already read or assigned is
    viewed as numpy (a copy only off the CPU). For a trainer's collate: it pads numpy
    rows, so a tensor per array would only be made to be taken apart again."""
    d = exp.__dict__
    if name not in d and _LITTLE and "_wire" in d:
        buf = getattr(d["_wire"], name)
        if buf is None:  # absent (an absent action mask: every response token)
            return None
        if name == "action_mask":
            return (_frombuffer(buf, _U8) != 0).view(_U8)
        return _frombuffer(buf, _WIRE_ARRAYS[name])
    t = getattr(exp, name)
    if t is None:
        return None
    if not isinstance(t, _Tensor):
        return np.asarray(t).reshape(-1)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == _BOOL:
        t = t.to(torch.uint8)
    return t.reshape(-1).numpy()


def _token_count(exp: Experience) -> int:
    """``exp.tokens.numel()``, read from the wire record while the tokens are not materialised."""
    d = exp.__dict__
    tokens = d.get("tokens")
    if tokens is not None:
        return int(tokens.numel())
    if "_wire" in d:
        return len(d["_wire"].tokens) // 4
    return int(exp.tokens.numel())


def _raise_ragged(rec: ExperienceRecord) -> None:
    """Raise ``ValueError`` naming the first array field of ``rec`` that is not whole elements."""
    for name, dtype in _WIRE_ARRAYS.items():
        buf = getattr(rec, name)
        if buf is not None and len(buf) % dtype.itemsize:
            raise ValueError(
                f"{name}: {len(buf)} bytes is not a whole number of {dtype.itemsize}-byte elements"
            )


def from_record(rec: ExperienceRecord) -> Experience:
    """Convert a wire record to an :class:`Experience` whose arrays stay on the wire until read.

    Every field but the arrays is set as ``Experience.__post_init__`` would set
    it (msgspec checked the record); each array becomes a tensor of its wire
    dtype on first access (:meth:`Experience.__getattr__`: a zero-copy view of
    the message body, the action mask a normalised copy), and one never read
    is re-encoded from its wire bytes. Raises ``ValueError`` for an array that
    is not a whole number of elements.
    """
    lp, adv, tlr, ret = rec.logprobs, rec.advantages, rec.token_level_reward, rec.returns
    if (
        len(rec.tokens) & 3
        or (lp is not None and len(lp) & 3)
        or (adv is not None and len(adv) & 3)
        or (tlr is not None and len(tlr) & 3)
        or (ret is not None and len(ret) & 3)
        or (rec.chosen is not None and len(rec.chosen) & 3)
        or (rec.rejected is not None and len(rec.rejected) & 3)
        or (rec.allowed_logprobs is not None and len(rec.allowed_logprobs) & 3)
        or (rec.banned_ids is not None and len(rec.banned_ids) & 3)
    ):
        _raise_ragged(rec)
    if not _torch_warned:
        _prime_torch_warnings()
    e = rec.eid
    exp = Experience.__new__(Experience)
    exp.__dict__ = {  # every dataclass field but the arrays (a unit test checks none is missed)
        "prompt_length": rec.prompt_length,
        "reward": rec.reward,
        "info": rec.info,
        "metrics": rec.metrics,
        "response_text": rec.response_text,
        "prompt_text": rec.prompt_text,
        "messages": rec.messages,
        "chosen_text": rec.chosen_text,
        "rejected_text": rec.rejected_text,
        "model_version": rec.model_version,
        "eid": EID(e.batch, e.task, e.run, e.step, e.suffix),
        "_wire": rec,
    }
    return exp


def encode_group(
    exps: Sequence[Experience],
    *,
    group_id: str | None = None,
    producer: str = "",
    part: int = 0,
    parts: int = 1,
) -> bytes:
    """Encode experiences as one :class:`ExperienceGroupMsg` body.

    Raises :class:`SchemaError` naming the experience and field that cannot be
    encoded (e.g. a tensor left in ``info``).
    """
    gid = group_id if group_id is not None else (exps[0].group_id if exps else "")
    records = []
    for exp in exps:
        rec = to_record(exp)
        records.append(rec)
    msg = ExperienceGroupMsg(
        schema=SCHEMA_NAME,
        group_id=gid,
        experiences=records,
        part=part,
        parts=parts,
        producer=producer,
    )
    try:
        return _ENCODER.encode(msg)
    except (TypeError, msgspec.EncodeError) as exc:
        for exp, rec in zip(exps, records, strict=True):
            for name in ("info", "metrics", "messages"):
                try:
                    _ENCODER.encode(getattr(rec, name))
                except (TypeError, msgspec.EncodeError) as inner:
                    raise SchemaError(
                        f"experience {exp.eid.uid}: field `{name}` is not encodable: {inner}"
                    ) from exc
        raise SchemaError(f"cannot encode experience group {gid!r}: {exc}") from exc


def decode_group_msg(data: bytes | memoryview) -> ExperienceGroupMsg:
    """Decode a message body into its :class:`ExperienceGroupMsg` (no tensor conversion)."""
    try:
        msg = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not a {SCHEMA_NAME} message: {exc}") from exc
    if msg.schema != SCHEMA_NAME:
        raise SchemaError(f"unsupported schema {msg.schema!r}; expected {SCHEMA_NAME!r}")
    return msg


def decode_group(data: bytes | memoryview) -> list[Experience]:
    """Decode a message body into experiences; arrays are zero-copy views of ``data``.

    Raises :class:`SchemaError` if the body is not an experience group.
    """
    msg = decode_group_msg(data)
    try:
        return [from_record(rec) for rec in msg.experiences]
    except (ValueError, TypeError) as exc:
        raise SchemaError(f"group {msg.group_id!r}: malformed array field: {exc}") from exc


def experience_problem(exp: Experience) -> str | None:
    """Why a decoded experience is unfit for any stage, or None. Cheap; pure.

    Checks what a well-formed wire record can still get wrong: a reward that is
    NaN or infinite (it would turn a whole group's advantages into NaN), a
    ``prompt_length`` outside the tokens, negative token ids.
    """
    if exp.reward is not None and not math.isfinite(float(exp.reward)):
        return f"experience {exp.eid.uid}: reward is not finite ({exp.reward})"
    n = _token_count(exp)
    if not 0 <= exp.prompt_length <= n:
        return f"experience {exp.eid.uid}: prompt_length {exp.prompt_length} outside its {n} tokens"
    return None


def summary_headers(
    exps: Sequence[Experience],
    *,
    actor: str,
    msg_id: str,
    group_id: str | None = None,
    part: int = 0,
    parts: int = 1,
) -> dict[str, str]:
    """Headers that summarise a group, readable in ``nats stream view``."""
    reward_sum, rewarded, tokens, version = 0.0, 0, 0, None
    for e in exps:  # one pass (this runs once per published group)
        r = e.reward
        if r is not None and r == r:  # not NaN
            reward_sum += r
            rewarded += 1
        v = e.model_version
        if version is None or v < version:
            version = v
        t = e.__dict__.get("tokens")  # absent: a decoded experience's tokens still on the wire
        tokens += t.numel() if t is not None else _token_count(e)
    headers = {
        H_SCHEMA: SCHEMA_NAME,
        H_TASK: group_id if group_id is not None else (exps[0].group_id if exps else ""),
        H_MODEL_VERSION: str(version if version is not None else 0),
        H_COUNT: str(len(exps)),
        H_REWARD_MEAN: f"{(reward_sum / rewarded):.4f}" if rewarded else "nan",
        H_TOKENS: str(tokens),
        H_ACTOR: actor,
        H_MSG_ID: msg_id,
    }
    if parts > 1:
        headers[H_PART] = f"{part + 1}/{parts}"
    return headers


@dataclass
class EncodedMessage:
    """One ready-to-publish message: body, headers and dedup id."""

    data: bytes
    headers: dict[str, str]
    msg_id: str
    count: int
    size: int = -1  # payload + headers as the server counts them (-1: not computed)


def pack_group(
    exps: Sequence[Experience],
    *,
    actor: str,
    msg_id_prefix: str,
    max_payload: int,
    group_id: str | None = None,
) -> list[EncodedMessage]:
    """Encode one group as one message, split into parts if it exceeds ``max_payload``.

    ``max_payload`` bounds payload + headers together (the server counts both).
    Part ``i`` gets ``Nats-Msg-Id = f"{msg_id_prefix}#{i}"`` when split, else
    ``msg_id_prefix``; deterministic, so a retried publish is deduplicated.
    Raises :class:`PayloadTooLargeError` if one experience alone does not fit.
    """
    gid = group_id if group_id is not None else (exps[0].group_id if exps else "")
    chunks: list[list[Experience]] = [list(exps)]
    while True:
        out: list[EncodedMessage] = []
        too_big = False
        for i, chunk in enumerate(chunks):
            mid = msg_id_prefix if len(chunks) == 1 else f"{msg_id_prefix}#{i}"
            headers = summary_headers(
                chunk, actor=actor, msg_id=mid, group_id=gid, part=i, parts=len(chunks)
            )
            data = encode_group(chunk, group_id=gid, producer=actor, part=i, parts=len(chunks))
            size = len(data) + headers_size(headers)
            if size > max_payload:
                too_big = True
                break
            out.append(EncodedMessage(data, headers, mid, len(chunk), size))
        if not too_big:
            return out
        if all(len(c) <= 1 for c in chunks):
            raise PayloadTooLargeError(
                f"group {gid!r}: a single experience exceeds max_payload={max_payload} bytes"
            )
        # split every chunk in two and retry
        new_chunks: list[list[Experience]] = []
        for c in chunks:
            if len(c) > 1:
                mid_i = len(c) // 2
                new_chunks.extend([c[:mid_i], c[mid_i:]])
            else:
                new_chunks.append(c)
        chunks = new_chunks


class Experiences(list):  # type: ignore[type-arg]
    """A step's batch as Trinity-RFT's ``Experiences``: a list of :class:`Experience`
    plus the custom fields the trainer collates from ``exp.info``.

    :meth:`gather_experiences` is the constructor sample strategies call (as in
    Trinity-RFT); padding happens later, in the trainer, so ``pad_token_id`` is
    accepted and recorded only. Pure data, no I/O.
    """

    custom_fields: list[Any]
    pad_token_id: int | None

    def __init__(
        self,
        experiences: Iterable[Experience] = (),
        custom_fields: Iterable[Any] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__(experiences)
        self.custom_fields = list(custom_fields or [])
        self.pad_token_id = pad_token_id

    @classmethod
    def gather_experiences(
        cls,
        experiences: Iterable[Experience],
        pad_token_id: int | None = 0,
        custom_fields: Iterable[Any] | None = None,
    ) -> Experiences:
        """The batch ``experiences`` with ``custom_fields`` (``CustomField(source_field,
        destination_field, data_type)``) to collate from each ``exp.info``."""
        return cls(experiences, custom_fields=custom_fields, pad_token_id=pad_token_id)
