"""Resumable trainer checkpoints: DeepSpeed's own model + optimizer state, plus what the
trainer needs to go on where it stopped (step, weights version, lr schedules, RNG states,
the experience already trained from messages not yet acked).

Layout under the trainer's checkpoint directory (:func:`rftstream.weights.checkpoint_dir`)::

    resume/global_step_<N>/            DeepSpeed ``save_checkpoint`` of the actor (tag dir)
    resume/global_step_<N>/critic/     the critic's, when the algorithm has one
    resume/global_step_<N>/rftstream_state.json   :class:`ResumeState`, written last
    resume/latest                      the newest complete tag (temp file + rename)

A checkpoint is complete once ``rftstream_state.json`` is in its directory (it is
written after DeepSpeed returns, through a temp file and a rename). The run's commit
point is the trainer's KV record ``trainer.checkpoint`` (written by the trainer after
this module returns, and before it acks the experience the checkpoint contains): a
restarted trainer resumes from the checkpoint that record names, so a kill at any
moment of a save leaves the previous checkpoint in force and its experience unacked.

Everything here blocks (disk I/O, DeepSpeed collectives): call it through
``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from rftstream.errors import RftError
from rftstream.fault_points import fault_point

RESUME_DIR = "resume"
STATE_FILE = "rftstream_state.json"
#: every experience trained up to the checkpoint: the sorted, distinct xxh3-64 digests of
#: their ``eid.uid`` (:func:`rftstream.experience.uid_digests`), little-endian uint64, 8 bytes each
TRAINED_FILE = "trained_digests.u64"
LATEST_FILE = "latest"
CRITIC_DIR = "critic"


class CheckpointError(RftError):
    """A resumable checkpoint could not be written or read."""


class RngStates(msgspec.Struct, kw_only=True):
    """The random generators' states: python ``random``, numpy's global one, torch CPU
    (base64 of its byte tensor) and torch CUDA (one per device, base64; empty without CUDA)."""

    python: list[Any]
    numpy: list[Any]
    torch: str
    cuda: list[str] = msgspec.field(default_factory=list)


class ResumeState(msgspec.Struct, kw_only=True):
    """What a checkpoint holds besides DeepSpeed's state (``rftstream_state.json``).

    ``trained_uids``: experiences trained before the checkpoint whose messages the
    trainer had not acked (confirmed) when it was written; a resumed trainer skips
    them when their messages are redelivered, so each is trained once.
    ``lr_schedulers``: the state of the actor's and the critic's lr schedule (None
    where there is none).
    """

    step: int
    version: int
    incarnation: int
    trained: int  # experiences trained in total up to this step
    rng: RngStates
    trained_uids: list[str] = msgspec.field(default_factory=list)
    # stream sequences (``raw``: exp.raw, ``metrics``) the trainer's upstream monitor had
    # reported through at this step; a resumed trainer's monitor reads on after them
    monitor_through: dict[str, int] = msgspec.field(default_factory=dict)
    lr_schedulers: list[dict[str, Any] | None] = msgspec.field(default_factory=list)
    ts: float = 0.0


def tag_for(step: int) -> str:
    """The checkpoint's tag (directory name under ``resume/``) for trainer step ``step``."""
    return f"global_step_{step}"


def capture_rng() -> RngStates:
    """The current states of python's, numpy's and torch's global generators."""
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = []
    if torch.cuda.is_available():
        cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return RngStates(
        python=[py[0], list(py[1]), py[2]],
        numpy=[kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        torch=_b64(torch.get_rng_state()),
        cuda=cuda,
    )


def restore_rng(rng: RngStates) -> None:
    """Set python's, numpy's and torch's global generators to ``rng``."""
    version, internal, gauss = rng.python
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    kind, keys, pos, has_gauss, cached = rng.numpy
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(rng.torch))
    if rng.cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in rng.cuda])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_trained_digests(directory: Path, step: int) -> np.ndarray:
    """The checkpoint's :data:`TRAINED_FILE` (sorted uint64 digests); empty for a checkpoint
    written without one (an older release).

    Raises :class:`CheckpointError` naming the file when it cannot be read or is cut short.
    """
    path = Path(directory) / RESUME_DIR / tag_for(step) / TRAINED_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return np.empty(0, dtype=np.uint64)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    if len(data) % 8:
        raise CheckpointError(f"{path}: {len(data)} bytes, not whole 8-byte digests")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64)


def save_resumable(
    directory: Path,
    step: int,
    engines: list[Any],
    state: ResumeState,
    trained_digests: np.ndarray | None = None,
) -> Path:
    """Write a complete resumable checkpoint of trainer step ``step``; returns its directory.

    ``engines``: the DeepSpeed engines, actor first, then the critic (if any), saved
    with ``engine.save_checkpoint``. ``trained_digests``: every experience trained so far
    (sorted distinct digests, see :data:`TRAINED_FILE`), written before the state file.
    A directory of the same tag left by an earlier (killed) attempt is replaced.
    ``resume/latest`` names the new tag once it is complete. Raises
    :class:`CheckpointError` when DeepSpeed or the disk fails.
    """
    root = Path(directory) / RESUME_DIR
    tag = tag_for(step)
    target = root / tag
    try:
        if target.exists():
            shutil.rmtree(target)
        root.mkdir(parents=True, exist_ok=True)
        for i, engine in enumerate(engines):
            save_dir = root if i == 0 else target / CRITIC_DIR
            engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False)
        fault_point("checkpoint")  # chaos tests kill the run here: no state file yet
        if trained_digests is not None:
            _write_atomic(target / TRAINED_FILE, trained_digests.astype("<u8").tobytes())
        _write_atomic(target / STATE_FILE, msgspec.json.encode(state))
        _write_atomic(root / LATEST_FILE, tag.encode())
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"could not write the resumable checkpoint {target}: {exc}") from exc
    return target


def read_state(directory: Path, step: int) -> ResumeState:
    """The :class:`ResumeState` of the checkpoint of step ``step`` under ``directory``.

    Raises :class:`CheckpointError` naming the file when it is missing (an
    incomplete checkpoint) or does not decode.
    """
    path = Path(directory) / RESUME_DIR / tag_for(step) / STATE_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=ResumeState)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path}: missing: the checkpoint of step {step} is incomplete"
        ) from exc
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc


def load_resumable(directory: Path, step: int, engines: list[Any]) -> ResumeState:
    """Load the checkpoint of step ``step`` into ``engines`` (model and optimizer states,
    actor first, then the critic) and return its :class:`ResumeState`; the caller restores
    the lr schedules and the RNG (:func:`restore_rng`) from it.

    Raises :class:`CheckpointError` when the checkpoint is incomplete or DeepSpeed
    cannot load it.
    """
    state = read_state(directory, step)
    root = Path(directory) / RESUME_DIR
    tag = tag_for(step)
    for i, engine in enumerate(engines):
        load_dir = root if i == 0 else root / tag / CRITIC_DIR
        try:
            path, _ = engine.load_checkpoint(str(load_dir), tag=tag)
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"could not load {load_dir / tag}: {exc}") from exc
        if path is None:
            raise CheckpointError(f"{load_dir / tag}: DeepSpeed found no checkpoint there")
    return state


def prune(directory: Path, keep: set[int]) -> list[int]:
    """Delete the resumable checkpoints whose step is not in ``keep``; returns their steps.

    Only directories named ``global_step_<N>`` under ``resume/`` are touched.
    """
    root = Path(directory) / RESUME_DIR
    removed = []
    for child in root.glob("global_step_*") if root.is_dir() else []:
        try:
            step = int(child.name.rsplit("_", 1)[1])
        except ValueError:
            continue
        if step not in keep:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(step)
    return sorted(removed)


def drop_records_after(path: Path, step: int, discarded: Path) -> int:
    """Keep the JSON lines of ``path`` whose ``step`` is at most ``step``; move the others
    (steps a killed trainer ran after its last checkpoint, trained again after a resume)
    to the end of ``discarded``. Returns how many were moved. A missing file is left alone;
    a line that does not decode is kept.
    """
    if not path.is_file():
        return 0
    kept: list[str] = []
    moved: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record_step = int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            kept.append(line)
            continue
        (moved if record_step > step else kept).append(line)
    if moved:
        with open(discarded, "a") as f:
            f.write("".join(x + "\n" for x in moved))
        _write_atomic(path, "".join(x + "\n" for x in kept).encode())
    return len(moved)
