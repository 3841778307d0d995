"""Read back what each monitor backend wrote, with the backends' own readers (tests only)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf Records
_WANDB_HEADER = 7  # ":W&B", magic 0xBEE1, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in ``log_dir`` (tensorboard's EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    out: list[bytes] = []
    pos, pending = _WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            out.append(pending + body)
    return out


def wandb_offline_run(run_dir: Path) -> dict[str, Any]:
    """The one offline run under ``run_dir/wandb``: its ``run`` record (project, name,
    tags, config) and history rows (``{key: value}`` with ``_step``), parsed with wandb's
    own protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    run: Any = None
    history: list[dict[str, Any]] = []
    for body in _wandb_records(files[0]):
        record = pb.Record()
        record.ParseFromString(body)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    assert run is not None, "no run record"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    return {
        "project": run.project,
        "group": run.run_group,
        "name": run.display_name,
        "tags": list(run.tags),
        "config": config,
        "history": history,
    }


def mlflow_run(tracking_dir: Path, experiment: str) -> dict[str, Any]:
    """The one run of ``experiment`` in the file store at ``tracking_dir``: name, tags, its
    metric histories (``MlflowClient.get_metric_history``) and its config artifact."""
    import os

    import yaml
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=tracking_dir.resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {tracking_dir}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs
    run = runs[0]
    metrics = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    from urllib.parse import urlparse

    artifact = Path(urlparse(run.info.artifact_uri).path) / "config.yaml"  # a file store
    return {
        "name": run.info.run_name,
        "status": run.info.status,
        "tags": run.data.tags,
        "metrics": metrics,
        "config": yaml.safe_load(artifact.read_text()),
    }
