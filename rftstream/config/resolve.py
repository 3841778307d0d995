"""The one place that derives config values from other keys. Pure: no I/O, no plugin import.

A loaded config leaves some keys to be derived (``buffer.train_batch_size: 0``, a
``sync_style`` alias, ``run_dir: ""``, ...); everything that fills them in is here,
each derivation once, and the rest of the code reads the resolved values.
:mod:`rftstream.config.validate` only checks. Three stages, in the order a run
meets them:

* :func:`resolve_config` (``load_config`` applies it after validating): the
  canonical ``synchronizer.sync_style`` (``explorer_driven`` ->
  ``dynamic_by_explorer``), ``is_eval`` on every eval taskset, and a one-name
  ``monitor.monitor_type`` list read as that name.
* :func:`resolve_run` (``rftstream.runtime.prepare_run``): the command line's
  ``--steps``, ``--run-dir`` and ``--nats-url`` and the default ``run_dir``
  (``runs/<name>``).
* Where a taskset or dataset is used: :func:`taskset_repeat_times`, :func:`eval_repeat_times` and
  :func:`dataset_epochs` (its own value, else the run's).
* Once the algorithm preset is known (the caller looks the preset up in the
  plugin registries and passes what it found): :func:`prefer_decoupled_ppo`
  (the off-policy correction of a stale run), :func:`fill_loss_batch_args`
  (the batch sizes a policy loss such as MIX's takes) and
  :func:`with_train_batch_size` (``buffer.train_batch_size``: 0 means
  ``batch_size * repeat_times``, :func:`train_batch_size`).

Every function returns a new :class:`~rftstream.config.schema.Config` (or the
same one when nothing changes); none modifies its argument. Errors are
:class:`~rftstream.errors.ConfigError` naming the key path.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from msgspec.structs import replace

from rftstream.config.schema import (
    SYNC_STYLE_ALIASES,
    SYNC_STYLES,
    WEIGHTS_DTYPES,
    BufferConfig,
    Config,
    ExplorerInput,
    MonitorConfig,
    StorageConfig,
    SyncStyle,
    TasksetConfig,
)
from rftstream.config.secrets import split_url_credentials
from rftstream.errors import ConfigError

__all__ = [
    "VerlBatchShape",
    "can_be_stale",
    "canonical_sync_style",
    "dataset_epochs",
    "default_run_dir",
    "fill_loss_batch_args",
    "loss_batch_args",
    "prefer_decoupled_ppo",
    "resolve_config",
    "resolve_run",
    "eval_repeat_times",
    "taskset_repeat_times",
    "train_batch_size",
    "with_train_batch_size",
]


# ----------------------------------------------------------------- stage 1: a loaded config


def canonical_sync_style(style: str) -> SyncStyle:
    """``style`` with its alias resolved (``explorer_driven`` -> ``dynamic_by_explorer``,
    ``trainer_driven`` -> ``dynamic_by_trainer``).

    Raises :class:`ConfigError` (key ``synchronizer.sync_style``) for a name that is
    neither a style nor an alias (a config built in Python; a decoded one cannot hold
    one)."""
    canonical = SYNC_STYLE_ALIASES.get(style, style)  # type: ignore[call-overload]
    if canonical not in SYNC_STYLES:
        raise ConfigError(
            "synchronizer.sync_style",
            f"must be one of {', '.join(SYNC_STYLES + tuple(SYNC_STYLE_ALIASES))}",
            value=style,
            has_value=True,
        )
    return canonical  # type: ignore[no-any-return]


def _marked_eval_tasksets(inp: ExplorerInput) -> ExplorerInput:
    """``inp`` with ``is_eval`` set on every entry of ``eval_tasksets``."""
    if all(ts.is_eval for ts in inp.eval_tasksets):
        return inp
    marked = [ts if ts.is_eval else replace(ts, is_eval=True) for ts in inp.eval_tasksets]
    return replace(inp, eval_tasksets=marked)


def _single_monitor_type(monitor: MonitorConfig) -> MonitorConfig:
    """A one-name ``monitor_type`` list read as that name (code comparing it with
    ``"none"`` keeps working)."""
    names = monitor.monitor_type
    if isinstance(names, list) and len(names) == 1:
        return replace(monitor, monitor_type=names[0])
    return monitor


def resolve_config(cfg: Config) -> Config:
    """The values a loaded config derives from its own keys; idempotent.

    ``synchronizer.sync_style`` canonical (:func:`canonical_sync_style`),
    ``buffer.explorer_input.eval_tasksets[*].is_eval`` true, and
    ``monitor.monitor_type: [name]`` read as ``name``. Expects a config that
    :func:`~rftstream.config.validate.validate_config` accepted.
    """
    sync = cfg.synchronizer
    style = canonical_sync_style(sync.sync_style)
    if style != sync.sync_style:
        cfg = replace(cfg, synchronizer=replace(sync, sync_style=style))
    inp = _marked_eval_tasksets(cfg.buffer.explorer_input)
    if inp is not cfg.buffer.explorer_input:
        cfg = replace(cfg, buffer=replace(cfg.buffer, explorer_input=inp))
    monitor = _single_monitor_type(cfg.monitor)
    if monitor is not cfg.monitor:
        cfg = replace(cfg, monitor=monitor)
    return cfg


# ----------------------------------------------------------------- stage 2: a run


def default_run_dir(cfg: Config) -> str:
    """``run_dir``, or ``runs/<name>`` when it is empty."""
    return cfg.run_dir or os.path.join("runs", cfg.name)


def resolve_run(
    cfg: Config,
    *,
    steps: int | None = None,
    run_dir: str | None = None,
    nats_url: str | None = None,
) -> Config:
    """:func:`resolve_config`, then the command line's choices for one run.

    ``steps`` replaces ``buffer.total_steps``; ``run_dir`` replaces ``run_dir``,
    which is otherwise :func:`default_run_dir` (either written as a path: ``runs/x/``
    and ``./runs/x`` are ``runs/x``); ``nats_url`` (``--nats-url``,
    several URLs may be comma-separated) replaces ``nats.url`` and empties
    ``nats.servers``. Credentials inside a URL move to ``nats.user``/``nats.password``
    (or ``nats.token``), where they are masked in every file and handed to child
    processes in their environment (:func:`~rftstream.config.secrets.split_url_credentials`);
    the URLs keep only the servers' addresses.
    """
    cfg = resolve_config(cfg)
    if steps is not None:
        cfg = replace(cfg, buffer=replace(cfg.buffer, total_steps=steps))
    if nats_url is not None:
        cfg = replace(cfg, nats=replace(cfg.nats, url=nats_url, servers=[]))
    cfg = _credentials_out_of_urls(cfg)
    return replace(cfg, run_dir=str(PurePath(run_dir or default_run_dir(cfg))))


def _credentials_out_of_urls(cfg: Config) -> Config:
    """``cfg`` with the credentials of ``nats.url`` / ``nats.servers`` moved to the
    ``nats`` keys (those already set win)."""
    nats = cfg.nats
    url, from_url = split_url_credentials(nats.url) if nats.url else ("", {})
    servers = []
    for server in nats.servers:
        clean, creds = split_url_credentials(server)
        servers.append(clean)
        from_url = from_url or creds
    if not from_url:
        return cfg
    keys = {k: v for k, v in from_url.items() if not (nats.user or nats.token or nats.creds)}
    return replace(cfg, nats=replace(nats, url=url, servers=servers, **keys))


# ----------------------------------------------------------------- per taskset and dataset
# Left unset in the config (a taskset that says nothing follows the run's keys, and
# training_tasksets compares tasksets with those defaults): worked out here, where used.


def taskset_repeat_times(ts: TasksetConfig, run_repeat_times: int) -> int:
    """Runs per task of the training taskset ``ts``: its own ``repeat_times``; unset,
    ``run_repeat_times`` (the run's ``algorithm.repeat_times``: ``ResolvedRun.repeat_times``)
    or, for a taskset marked ``is_eval``, 1, as in Trinity-RFT."""
    if ts.is_eval:
        return eval_repeat_times(ts)
    return int(ts.repeat_times) if ts.repeat_times else run_repeat_times


def eval_repeat_times(ts: TasksetConfig) -> int:
    """Runs per task of the eval taskset ``ts``: its own ``repeat_times``, else 1."""
    return int(ts.repeat_times) if ts.repeat_times else 1


def run_repeat_times(cfg: Config) -> int:
    """``algorithm.repeat_times`` of a resolved run (``prepare_run`` fills it from the
    algorithm preset). Raises :class:`ConfigError` naming the key when it is unset: the
    config was not resolved, and no default is guessed here."""
    if cfg.algorithm.repeat_times is None:
        raise ConfigError(
            "algorithm.repeat_times",
            "is unset: the run was not resolved (rftstream.runtime.prepare_run fills it "
            "from the algorithm preset)",
        )
    return int(cfg.algorithm.repeat_times)


def dataset_epochs(cfg: Config, source: TasksetConfig | StorageConfig) -> int:
    """Passes over a training taskset or a trainer's dataset: its own ``total_epochs``,
    else ``buffer.total_epochs`` (as in Trinity-RFT)."""
    return int(source.total_epochs or cfg.buffer.total_epochs)


def weights_wire_dtype(cfg: Config, *, source: str | None = None) -> str:
    """The dtype weights travel in with ``sync_method: jetstream``: ``synchronizer.weights_dtype``,
    or (``auto``) the rollout engine's ``model.dtype``.

    Raises :class:`ConfigError` (key ``synchronizer.weights_dtype``) when ``auto`` meets a
    ``model.dtype`` that cannot travel.
    """
    wanted = cfg.synchronizer.weights_dtype
    if wanted != "auto":
        return wanted
    dtype = str(cfg.model.dtype).removeprefix("torch.")
    if dtype not in WEIGHTS_DTYPES:
        raise ConfigError(
            "synchronizer.weights_dtype",
            f"is auto, which means model.dtype ({dtype!r}), and weights travel only as "
            f"{', '.join(d for d in WEIGHTS_DTYPES if d != 'auto')}: set one",
            value=wanted,
            source=source,
        )
    return dtype


# ----------------------------------------------------------------- stage 3: the algorithm


def train_batch_size(buffer: BufferConfig, repeat_times: int | None = None) -> int:
    """``buffer.train_batch_size``, or ``batch_size * repeat_times`` when it is 0.

    Raises :class:`ConfigError` (key ``buffer.train_batch_size``) when it is 0 and
    ``repeat_times`` is unknown.
    """
    if buffer.train_batch_size > 0:
        return buffer.train_batch_size
    if repeat_times:
        return buffer.batch_size * int(repeat_times)
    raise ConfigError(
        "buffer.train_batch_size",
        "is 0 (meaning batch_size * repeat_times) but the sample strategy was not given "
        "repeat_times; set it or pass sample_strategy_args.repeat_times",
    )


def with_train_batch_size(cfg: Config, repeat_times: int) -> Config:
    """``cfg`` with ``buffer.train_batch_size`` resolved by :func:`train_batch_size`
    (``repeat_times``: the resolved algorithm's)."""
    size = train_batch_size(cfg.buffer, repeat_times)
    if size == cfg.buffer.train_batch_size:
        return cfg
    return replace(cfg, buffer=replace(cfg.buffer, train_batch_size=size))


def can_be_stale(cfg: Config) -> bool:
    """Whether a run's trained experience can come from older weights than the trainer's:
    any asynchronous run (``mode: both``, or a trainer on the stream of a separate
    explorer), but ``sync_style: fixed`` at interval 1 and offset 0 (strictly on-policy)
    and ``max_staleness: 0``."""
    sync = cfg.synchronizer
    from_rollouts = cfg.mode == "both" or (cfg.mode == "train" and not cfg.trainer_reads_dataset)
    if not from_rollouts or sync.max_staleness == 0:
        return False
    on_policy = (
        canonical_sync_style(sync.sync_style) == "fixed"
        and sync.sync_interval <= 1
        and sync.sync_offset == 0
    )
    return not on_policy


def prefer_decoupled_ppo(cfg: Config, preset_policy_loss_fn: str | None) -> Config:
    """``algorithm.policy_loss_fn: decoupled_ppo`` where the preset's loss is ``ppo`` and
    experience can be stale (:func:`can_be_stale`); else ``cfg`` unchanged.

    The decoupled objective (AReaL; :mod:`algorithms.policy_loss_fn.decoupled_ppo_policy_loss`)
    weights each token by how much likelier the trainer's policy makes it than the
    weights that sampled it (the rollout log-probs every explorer records), so stale
    experience still gives an unbiased step; where experience is never stale it equals
    ``ppo``. Only when the user named no ``algorithm.policy_loss_fn``: naming ``ppo``
    keeps it. The preset's ``policy_loss_fn_args`` carry over (the loss takes all of
    ``ppo``'s). ``preset_policy_loss_fn``: the ``policy_loss_fn`` of the preset's
    ``default_config()`` (None: an unknown preset, reported where it is resolved).
    """
    if cfg.algorithm.policy_loss_fn is not None or preset_policy_loss_fn != "ppo":
        return cfg
    if not can_be_stale(cfg):
        return cfg
    return replace(cfg, algorithm=replace(cfg.algorithm, policy_loss_fn="decoupled_ppo"))


@dataclass(frozen=True)
class VerlBatchShape:
    """verl's batch arithmetic, for a policy loss that weights each micro-batch itself.

    Such a loss (its constructor takes ``ppo_mini_batch_size``; MIX, seed guide
    000) scales each micro-batch by its share of the step
    (``gradient_accumulation / train_batch_size_<kind>``, or
    ``experience_per_gpu / (rows * train_batch_size_<kind>)`` with
    ``use_dynamic_bsz``), counting on verl's trainer to divide each
    micro-batch loss by :attr:`gradient_accumulation` (or multiply it by
    ``rows /`` :attr:`mini_per_gpu` with ``use_dynamic_bsz``). Computed once,
    when the run is prepared (:func:`loss_batch_args`), from the arguments
    the loss is built with; the trainer applies it.
    """

    use_dynamic_bsz: bool
    mini_batch: int  # ppo_mini_batch_size
    micro_batch: int  # ppo_micro_batch_size_per_gpu
    ngpus: int  # ngpus_trainer

    @property
    def gradient_accumulation(self) -> int:
        """``ppo_mini_batch_size // ppo_micro_batch_size_per_gpu`` (at least 1)."""
        return max(1, self.mini_batch // max(1, self.micro_batch))

    @property
    def mini_per_gpu(self) -> int:
        """``ppo_mini_batch_size // ngpus_trainer`` (at least 1)."""
        return max(1, self.mini_batch // max(1, self.ngpus))


def loss_batch_args(
    loss_cls: type,
    args: dict[str, Any],
    *,
    train_batch_size: int,
    micro_batch: int,
    expert_ratio: float,
    use_dynamic_bsz: bool = False,
) -> tuple[dict[str, int], VerlBatchShape | None]:
    """The batch-shape arguments to fill in for a policy loss, and its verl arithmetic.

    ``args``: the loss's arguments so far (``policy_loss_fn_args``). Filled
    are those the constructor of ``loss_cls`` accepts and ``args`` does not
    set: ``ppo_mini_batch_size`` (the train batch),
    ``ppo_micro_batch_size_per_gpu`` (``micro_batch``, at most the mini
    batch), ``ngpus_trainer`` (1), ``train_batch_size_expert`` (``ceil(ratio
    * train batch)``), ``train_batch_size_usual`` (the rest) and, with
    ``use_dynamic_bsz`` (``trainer.use_dynamic_bsz``), ``use_dynamic_bsz``. The shape is
    None unless the constructor takes ``ppo_mini_batch_size``; its values
    come from ``args``, then the filled ones, then the constructor's
    defaults. Pure; inspects the constructor once.
    """
    params = inspect.signature(loss_cls.__init__).parameters
    total = train_batch_size
    micro = max(1, micro_batch)
    expert = math.ceil(expert_ratio * total)
    mini = int(args["ppo_mini_batch_size"]) if args.get("ppo_mini_batch_size") else total
    derived = {
        "ppo_mini_batch_size": total,
        "ppo_micro_batch_size_per_gpu": max(1, min(micro, mini)),
        "ngpus_trainer": 1,
        "train_batch_size_usual": max(1, total - expert),
        "train_batch_size_expert": max(1, expert),
    }
    if use_dynamic_bsz:
        derived["use_dynamic_bsz"] = True
    # Trinity-RFT 0.2.0's MIX names of the two batch sizes: given, the newer ones stay unfilled
    older = {
        "train_batch_size_usual": "read_batch_size_usual",
        "train_batch_size_expert": "read_batch_size_expert",
    }
    fill = {
        k: v
        for k, v in derived.items()
        if k in params and k not in args and args.get(older.get(k, "")) is None
    }
    if "ppo_mini_batch_size" not in params:
        return fill, None

    def value(name: str, default: Any) -> Any:
        if args.get(name) is not None:
            return args[name]
        if name in fill:
            return fill[name]
        p = params.get(name)
        if p is not None and p.default is not inspect.Parameter.empty and p.default is not None:
            return p.default
        return default

    shape = VerlBatchShape(
        use_dynamic_bsz=bool(value("use_dynamic_bsz", False)),
        mini_batch=int(value("ppo_mini_batch_size", 1)),
        micro_batch=int(value("ppo_micro_batch_size_per_gpu", 1)),
        ngpus=int(value("ngpus_trainer", 1)),
    )
    return fill, shape


def fill_loss_batch_args(
    cfg: Config, loss_cls: type, *, repeat_times: int, expert_ratio: float
) -> tuple[Config, VerlBatchShape | None]:
    """``cfg`` with the batch-shape arguments ``loss_cls`` takes filled into
    ``algorithm.policy_loss_fn_args`` (:func:`loss_batch_args`), and the loss's verl
    arithmetic.

    MIX (seed guide 000) weights each micro-batch by ``gradient_accumulation /
    train_batch_size_<kind>``; in Trinity-RFT the user copies those sizes into
    ``policy_loss_fn_args``. Here every one the loss accepts and nobody set is
    derived from the train batch (:func:`train_batch_size` with ``repeat_times``),
    ``trainer.ppo_micro_batch_size_per_gpu``, ``expert_ratio`` (the sample
    strategy's ``expert_data_ratio``) and ``trainer.use_dynamic_bsz``. ``cfg`` comes
    back unchanged when nothing is filled. Raises :class:`ConfigError` (key
    ``trainer.ppo_micro_batch_size_per_gpu``) when fixed-size micro-batches do not
    divide the train batch the loss weights them by.
    """
    total = train_batch_size(cfg.buffer, repeat_times)
    micro = max(1, cfg.trainer.ppo_micro_batch_size_per_gpu)
    fill, shape = loss_batch_args(
        loss_cls,
        dict(cfg.algorithm.policy_loss_fn_args or {}),
        train_batch_size=total,
        micro_batch=micro,
        expert_ratio=expert_ratio,
        use_dynamic_bsz=cfg.trainer.use_dynamic_bsz,
    )
    if not fill:
        return cfg, shape
    mb = fill.get("ppo_micro_batch_size_per_gpu", micro)
    fixed = not cfg.trainer.use_dynamic_bsz  # else micro-batches weigh by their rows
    if fixed and "ppo_mini_batch_size" in fill and total % mb:
        raise ConfigError(
            "trainer.ppo_micro_batch_size_per_gpu",
            f"{loss_cls.__name__} weights each micro-batch by "
            f"ppo_mini_batch_size // micro batch; the train batch {total} is not a multiple "
            f"of the micro batch {mb} (set buffer.train_batch_size or this key so it divides)",
            value=mb,
        )
    user = dict(cfg.algorithm.policy_loss_fn_args or {})
    algorithm = replace(cfg.algorithm, policy_loss_fn_args={**user, **fill})
    return replace(cfg, algorithm=algorithm), shape
