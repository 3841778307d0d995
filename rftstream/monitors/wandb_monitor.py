"""``monitor_type: wandb``: a Weights & Biases run, offline unless an API key is known.

``monitor.monitor_args`` (Trinity-RFT's keys and a few of wandb's own): ``base_url``,
``api_key``, ``mode`` (``online`` | ``offline`` | ``disabled``), ``entity``, ``tags``.
Without ``mode`` the run follows ``WANDB_MODE``; when that is unset too, it is online
when an API key is given (``api_key`` or ``WANDB_API_KEY``) and offline otherwise (the
run then lies under ``<run_dir>/wandb``; ``wandb sync`` uploads it later). The project,
group and run name are the config's ``project``, ``group`` (default ``name``) and
``<name>_<role>``; the resolved config (secrets masked) is the run's config.

wandb's own console output (banners, its terminal log, stdout capture) is switched
off; its debug logs stay in the run's ``wandb`` directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from rftstream.config.monitor_keys import MONITOR_ARGS
from rftstream.errors import ConfigError
from rftstream.monitors.base import Monitor, RunInfo

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")


def wandb_mode(monitor_args: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """The mode the run gets: ``monitor_args.mode``, else ``WANDB_MODE``, else online with
    an API key (``monitor_args.api_key`` / ``WANDB_API_KEY``) and offline without.
    Raises :class:`ConfigError` for a mode wandb does not have."""
    mode = monitor_args.get("mode") or environ.get("WANDB_MODE") or ""
    if not mode:
        has_key = bool(monitor_args.get("api_key") or environ.get("WANDB_API_KEY"))
        return "online" if has_key else "offline"
    key = "monitor.monitor_args.mode" if monitor_args.get("mode") else "WANDB_MODE"
    if mode == "dryrun":  # wandb's old name for offline
        return "offline"
    if mode not in WANDB_MODES:
        raise ConfigError(key, f"must be one of {', '.join(WANDB_MODES)}", value=mode)
    return str(mode)


class WandbMonitor(Monitor):
    """One wandb run per actor (``<name>_<role>``), tagged with the role."""

    name = "wandb"
    package = "wandb"
    extra = "wandb"
    args = MONITOR_ARGS["wandb"]

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        import wandb

        margs = run.monitor_args
        tags = margs.get("tags") or []
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise ConfigError("monitor.monitor_args.tags", "must be a list of strings", value=tags)
        self.mode = wandb_mode(margs, os.environ)
        settings: dict[str, Any] = {
            "silent": True,  # no banners, no "wandb:" lines on the terminal
            "console": "off",  # leave sys.stdout / sys.stderr alone
            "disable_git": True,
            "x_disable_stats": True,  # no system-metrics sampler threads
            "save_code": False,
        }
        if margs.get("base_url"):
            settings["base_url"] = str(margs["base_url"])
        if margs.get("api_key"):
            settings["api_key"] = str(margs["api_key"])
        run.run_dir.mkdir(parents=True, exist_ok=True)
        # wandb suggests its Weave tracer ("wandb: Detected [openai] in use ...") on the
        # terminal whenever an LLM client library is imported, silent setting or not
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        self._run: Any = wandb.init(
            project=run.project,
            entity=margs.get("entity") or None,
            group=run.group,
            name=run.display_name,
            tags=[run.role, *tags],
            config=run.config,
            dir=str(run.run_dir),
            mode=self.mode,
            reinit="create_new",
            settings=wandb.Settings(**settings),
        )
        self.run_path = os.path.dirname(str(self._run.dir))  # .../wandb/offline-run-...
        log.info("wandb run %s (%s) in %s", run.display_name, self.mode, self.run_path)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
