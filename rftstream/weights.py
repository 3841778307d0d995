"""Moving policy weights from the trainer to explorers.

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
from rftstream.errors import RftError
from rftstream.messages import WeightsPointer


class WeightSyncError(RftError):
    """Weights could not be published or loaded."""


class _MemoryStore:
    """Process-wide store of the latest few weight versions per run."""

    def __init__(self, keep: int = 2) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.keep = keep

    def put(self, run: str, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            versions = self._data.setdefault(run, {})
            versions[version] = state
            for old in sorted(versions)[: -self.keep]:
                del versions[old]

    def get(self, run: str, version: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            return self._data.get(run, {}).get(version)


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
) -> WeightsPointer:
    """Make version ``version`` available by ``method``; returns the pointer to put in KV.

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
        MEMORY_STORE.put(run, version, state)
        return WeightsPointer(
            version=version,
            method="memory",
            uri=f"memory://{run}/{version}",
            step=step,
            ts=time.time(),
        )
    if method == "checkpoint":
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"v{version}.safetensors"
        tmp = directory / f".v{version}.safetensors.tmp"
        save_file(state, str(tmp), metadata={"version": str(version), "run": run})
        os.replace(tmp, final)
        digest = _sha256(final)
        # keep the two newest files: explorers may still be reading the previous one
        for old in directory.glob("v*.safetensors"):
            try:
                n = int(old.stem[1:])
            except ValueError:
                continue
            if n < version - 1:
                old.unlink(missing_ok=True)
        return WeightsPointer(
            version=version,
            method="checkpoint",
            uri=str(final.resolve()),
            sha256=digest,
            step=step,
            ts=time.time(),
        )
    raise WeightSyncError(
        f"synchronizer.sync_method {method!r} is not supported here (use checkpoint or memory)"
    )


def load_weights(ptr: WeightsPointer, run: str) -> dict[str, torch.Tensor]:
    """Fetch the tensors a pointer names; verifies the sha256 of checkpoint files."""
    if ptr.method == "memory":
        state = MEMORY_STORE.get(run, ptr.version)
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
