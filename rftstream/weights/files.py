"""Weights as files (``checkpoint``) or in one process's memory (``memory``).

``checkpoint``: the trainer writes ``<dir>/v<N>.safetensors`` (atomically:
temp file + rename), and puts a :class:`WeightsPointer` (uri, sha256, version)
in KV. Explorers read the file and verify the digest. Any filesystem all actors
can read works.

``memory``: for actors in one process (``rftstream up``): the tensors stay in a
process-wide store and only the pointer travels through KV.

Saving and loading block (disk I/O, hashing): call them through
``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rftstream.config import Config
from rftstream.errors import WeightSyncError
from rftstream.wire import WeightsPointer


class _MemoryStore:
    """Process-wide store of the latest few weight versions per run, by (trainer
    incarnation, version): a restarted trainer's versions replace its predecessor's."""

    def __init__(self, keep: int = 2) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, dict[tuple[int, int], dict[str, torch.Tensor]]] = {}
        self.keep = keep

    def put(
        self, run: str, version: int, state: dict[str, torch.Tensor], incarnation: int = 0
    ) -> None:
        with self._lock:
            versions = self._data.setdefault(run, {})
            versions[(incarnation, version)] = state
            for old in sorted(versions)[: -self.keep]:
                del versions[old]

    def get(self, run: str, version: int, incarnation: int = 0) -> dict[str, torch.Tensor] | None:
        with self._lock:
            return self._data.get(run, {}).get((incarnation, version))


MEMORY_STORE = _MemoryStore()


def snapshot(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy (no shared storage between keys, as safetensors requires)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_weights(
    method: str,
    run: str,
    version: int,
    state: dict[str, torch.Tensor],
    directory: Path,
    *,
    step: int,
    incarnation: int = 0,
) -> WeightsPointer:
    """Make version ``version`` available by ``method``; returns the pointer to put in KV.

    ``incarnation``: which start of the trainer publishes it (see
    :class:`WeightsPointer`). Checkpoint files are ``v<N>.safetensors`` for the first
    one, ``v<N>.r<incarnation>.safetensors`` after a restart (a resumed trainer publishes
    versions its predecessor published already, with other weights); the two newest
    files of this incarnation are kept, older ones and those of earlier incarnations
    are deleted.

    Raises:
        WeightSyncError: a tensor of ``state`` is empty (a ZeRO-3 partition that was not
            gathered: see :func:`rftstream.training.zero.full_state_dict`), or ``method``
            is not ``memory`` or ``checkpoint``.
    """
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise WeightSyncError(
            f"weights v{version}: {len(empty)} empty tensors ({', '.join(empty[:3])}...): "
            "ZeRO-3 partitions, not whole weights; publish the gathered state dict"
        )
    if method == "memory":
        MEMORY_STORE.put(run, version, state, incarnation)
        return WeightsPointer(
            version=version,
            method="memory",
            uri=f"memory://{run}/{version}",
            step=step,
            ts=time.time(),
            incarnation=incarnation,
        )
    if method == "checkpoint":
        directory.mkdir(parents=True, exist_ok=True)
        name = weights_file_name(version, incarnation)
        final = directory / name
        tmp = directory / f".{name}.tmp"
        save_file(state, str(tmp), metadata={"version": str(version), "run": run})
        os.replace(tmp, final)
        digest = _sha256(final)
        # keep the two newest files: explorers may still be reading the previous one
        for old in directory.glob("v*.safetensors"):
            parsed = _parse_weights_file_name(old.name)
            if parsed is None:
                continue
            old_version, old_incarnation = parsed
            if old_incarnation < incarnation or (
                old_incarnation == incarnation and old_version < version - 1
            ):
                old.unlink(missing_ok=True)
        return WeightsPointer(
            version=version,
            method="checkpoint",
            uri=str(final.resolve()),
            sha256=digest,
            step=step,
            ts=time.time(),
            incarnation=incarnation,
        )
    raise WeightSyncError(
        f"synchronizer.sync_method {method!r} is not supported here (use checkpoint or memory)"
    )


def weights_file_name(version: int, incarnation: int = 0) -> str:
    """The file name of weights ``version`` published by trainer ``incarnation``."""
    return (
        f"v{version}.safetensors" if not incarnation else f"v{version}.r{incarnation}.safetensors"
    )


def _parse_weights_file_name(name: str) -> tuple[int, int] | None:
    """(version, incarnation) of a :func:`weights_file_name`; None for another name."""
    if not name.startswith("v") or not name.endswith(".safetensors"):
        return None
    parts = name[1 : -len(".safetensors")].split(".r")
    try:
        if len(parts) == 1:
            return int(parts[0]), 0
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return None


def load_weights(ptr: WeightsPointer, run: str) -> dict[str, torch.Tensor]:
    """Fetch the tensors a pointer names; verifies the sha256 of checkpoint files."""
    if ptr.method == "memory":
        state = MEMORY_STORE.get(run, ptr.version, ptr.incarnation)
        if state is None:
            raise WeightSyncError(
                f"weights v{ptr.version} are in another process's memory; "
                "synchronizer.sync_method: memory needs all actors in one process (use checkpoint)"
            )
        return state
    if ptr.method == "checkpoint":
        path = Path(ptr.uri)
        if not path.is_file():
            raise WeightSyncError(
                f"weights v{ptr.version}: file {path} not found (is checkpoint_root_dir shared?)"
            )
        if ptr.sha256 and _sha256(path) != ptr.sha256:
            raise WeightSyncError(f"weights v{ptr.version}: sha256 mismatch for {path}")
        return load_file(str(path))
    raise WeightSyncError(f"unknown weights method {ptr.method!r}")


def checkpoint_dir(cfg: Config, run_dir: str | Path | None = None) -> Path:
    """Where the trainer of ``cfg`` saves its ``global_step_<N>`` checkpoints.

    ``<checkpoint_root_dir>/<project>/<name>`` when ``checkpoint_root_dir`` is set,
    else ``<run_dir>/checkpoints`` (``run_dir`` defaults to the config's, then
    ``runs/<name>``).
    """
    if cfg.checkpoint_root_dir:
        return Path(cfg.checkpoint_root_dir) / cfg.project / cfg.name
    return Path(run_dir or cfg.run_dir or Path("runs") / cfg.name) / "checkpoints"
