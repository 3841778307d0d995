"""``monitor_type: mlflow``: an MLflow run, in a local file store under the run dir by default.

The tracking URI is ``monitor.monitor_args.uri`` (Trinity-RFT's key), else
``MLFLOW_TRACKING_URI``, else ``<run_dir>/mlruns`` (MLflow's file store; MLflow 3 refuses
it unless ``MLFLOW_ALLOW_FILE_STORE`` is true, which this monitor sets for that default
alone). ``username`` / ``password`` become ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``. The experiment is the config's ``project``; the run is
``<name>_<role>``, tagged with ``group`` and ``role``; the resolved config (secrets masked)
is the run's artifact ``config.yaml``. Metric names keep their slashes; ``@`` becomes
``_at_`` and any other character MLflow refuses becomes ``_``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rftstream.config.monitor_keys import MONITOR_ARGS
from rftstream.monitors.base import Monitor, RunInfo

log = logging.getLogger(__name__)

_NOT_ALLOWED = re.compile(r"[^\w\-. /:]")
BATCH = 1000  # MLflow's limit of metrics per log_batch call


def mlflow_metric_name(key: str) -> str:
    """``key`` as an MLflow metric name (``eval/x/accuracy/best@4`` -> ``..._at_4``)."""
    return _NOT_ALLOWED.sub("_", key.replace("@", "_at_"))


def tracking_uri(monitor_args: Mapping[str, Any], environ: Mapping[str, str], run_dir: Path) -> str:
    """``monitor_args.uri``, else ``MLFLOW_TRACKING_URI``, else ``<run_dir>/mlruns`` as a
    ``file:`` URI."""
    uri = monitor_args.get("uri") or environ.get("MLFLOW_TRACKING_URI")
    return str(uri) if uri else (Path(run_dir).resolve() / "mlruns").as_uri()


class MlflowMonitor(Monitor):
    """One MLflow run per actor, through ``MlflowClient`` (no global active run)."""

    name = "mlflow"
    package = "mlflow"
    extra = "mlflow"
    args = MONITOR_ARGS["mlflow"]

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        margs = run.monitor_args
        if margs.get("username"):
            os.environ["MLFLOW_TRACKING_USERNAME"] = str(margs["username"])
        if margs.get("password"):
            os.environ["MLFLOW_TRACKING_PASSWORD"] = str(margs["password"])
        self.uri = tracking_uri(margs, os.environ, run.run_dir)
        if self.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client: Any = MlflowClient(tracking_uri=self.uri)
        experiment = self._client.get_experiment_by_name(run.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(run.project)
        )
        created = self._client.create_run(
            experiment_id,
            run_name=run.display_name,
            tags={"group": run.group, "role": run.role, "rftstream.run_dir": str(run.run_dir)},
        )
        self.run_id: str = created.info.run_id
        self.experiment_id: str = experiment_id
        self._client.log_dict(self.run_id, run.config, "config.yaml")
        self._closed = False
        log.info("mlflow run %s (%s) at %s", run.display_name, self.run_id, self.uri)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(mlflow_metric_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(points), BATCH):
            self._client.log_batch(self.run_id, metrics=points[i : i + BATCH])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id)
