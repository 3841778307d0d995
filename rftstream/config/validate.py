"""Value checks on a converted :class:`~rftstream.config.schema.Config`. Checks only.

:func:`validate_config` checks the numeric ranges and cross-field rules that the
types alone cannot express (a decoded config already holds only the values its
``Literal`` keys allow; a config built in Python is checked against them here too)
and raises :class:`~rftstream.errors.ConfigError` naming the key path and the
offending value. Values derived from other keys (aliases, defaults) are filled in
by :mod:`rftstream.config.resolve`. :func:`run_id_from_name` turns ``name`` (any
length) into the run id that scopes every stream, subject and bucket.

:func:`check_model_context` and :func:`check_output_dirs` look at files (the model's
context, where checkpoints go); :func:`rftstream.run_inputs.check_run_inputs` runs them
with the data-path checks, which need the taskset readers, before anything of the run is
written. Everything else here does no I/O.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

from rftstream.config.monitor_keys import check_monitor_config
from rftstream.config.paths import choice_message
from rftstream.config.resolve import weights_wire_dtype
from rftstream.config.schema import (
    DISCARD_POLICIES,
    ENGINE_TYPES,
    LOGPROBS_OF,
    LOSS_AGG_MODES,
    MIXED_PRECISIONS,
    MODES,
    SYNC_METHODS,
    SYNC_STYLE_ALIASES,
    SYNC_STYLES,
    TRAINER_MODES,
    ZERO_STAGES,
    Config,
    ExplorerInput,
    LoRAConfig,
    NatsConfig,
    TasksetConfig,
)
from rftstream.config.stream_limits import STREAM_KEYS, StreamLimitWarning, limit_warnings
from rftstream.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "TASKSET_NAME_RE",
    "ConfigWarning",
    "check_model_context",
    "check_output_dirs",
    "check_run_name",
    "eval_tasksets",
    "run_id_from_name",
    "training_tasksets",
    "validate_config",
]

KIB = 1024
MIB = 1024 * KIB
RUN_ID_MAX_LEN = 16
RUN_ID_HASH_LEN = 6
RUN_ID_PREFIX_LEN = RUN_ID_MAX_LEN - RUN_ID_HASH_LEN - 1
_RUN_ID_RE = re.compile(rf"[a-z0-9_]{{1,{RUN_ID_MAX_LEN}}}")
TASKSET_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_INPUT = "buffer.explorer_input"


class ConfigWarning(UserWarning):
    """A config that loads but probably does not do what was meant (an empty file, a token
    budget longer than the model's context). Shown as one ``warning:`` line by the CLI."""


def training_tasksets(inp: ExplorerInput) -> list[tuple[str, TasksetConfig]]:
    """The training tasksets with their config key paths, in order.

    ``taskset`` first, then ``tasksets[i]``; when ``tasksets`` is given and
    ``taskset`` was left entirely at its defaults, ``taskset`` (the built-in
    arithmetic set) is not one of them.
    """
    out = [(f"{_INPUT}.tasksets[{i}]", ts) for i, ts in enumerate(inp.tasksets)]
    if not out or inp.taskset != TasksetConfig():
        out.insert(0, (f"{_INPUT}.taskset", inp.taskset))
    return out


def eval_tasksets(inp: ExplorerInput) -> list[tuple[str, TasksetConfig]]:
    """The eval tasksets with their config key paths (``eval_tasksets[i]``)."""
    return [(f"{_INPUT}.eval_tasksets[{i}]", ts) for i, ts in enumerate(inp.eval_tasksets)]


def run_id_from_name(name: str, *, source: str | None = None) -> str:
    """The run id for ``name``: what scopes every stream, subject and bucket of the run.

    A name that gives ``[a-z0-9_]{1,16}`` after lower-casing and replacing
    ``-`` and ``.`` by ``_`` keeps that id (``GSM8K-GRPO`` -> ``gsm8k_grpo``).
    Any other name (longer, or with spaces, ``/``, other characters) gets a
    readable prefix of at most 9 characters and 6 hex digits of the SHA-256 of
    the full name (``qwen2.5-1.5B-gsm8k`` -> ``qwen2_5_1_`` + hash), so stream
    names ``RFT_<RUN>_METRICS`` stay under 32 characters and different names
    get different ids. The full name is kept in the streams' metadata
    (``rft.run_name``). Raises :class:`ConfigError` for key ``name`` when it is
    not a string or is empty.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            "name",
            "must be a non-empty string (it names the run, its streams and its run_dir)",
            value=name,
            has_value=True,
            source=source,
        )
    run_id = name.lower().replace("-", "_").replace(".", "_")
    if _RUN_ID_RE.fullmatch(run_id):
        return run_id
    prefix = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:RUN_ID_PREFIX_LEN]
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:RUN_ID_HASH_LEN]
    return f"{prefix.rstrip('_') or 'run'}_{digest}"


def check_run_name(name: Any, *, source: str | None = None) -> None:
    """``name`` must stay inside the directories it names: the run directory is
    ``runs/<name>`` and the checkpoints ``<checkpoint_root_dir>/<project>/<name>``.

    So ``name`` holds no ``\\`` and no NUL, does not start with ``/``, and each of its
    ``/``-separated parts is a plain directory name: not empty, not ``.``, not ``..``
    (``../../etc/evil`` and ``/tmp/x`` are refused). One part is the usual name; two
    are what a staged config makes (``<name>/<stage_name>``). Every other non-empty
    string stays legal (spaces, dots, any length, non-ASCII: :func:`run_id_from_name`
    makes the run id). Raises :class:`ConfigError` for key ``name``.
    """
    run_id_from_name(name, source=source)  # a non-empty string
    problem = ""
    if "\0" in name or "\\" in name:
        problem = "it holds a NUL byte" if "\0" in name else "it holds `\\`"
    elif name.startswith("/"):
        problem = "it starts with `/` (an absolute path)"
    elif any(part.strip() in ("", ".", "..") for part in name.split("/")):
        problem = "a `/`-separated part of it is empty, `.` or `..`"
    if problem:
        raise ConfigError(
            "name",
            f"must not lead out of the run directory runs/<name> and the checkpoint "
            f"directory it names; {problem}: use letters, digits, `-`, `_`, `.` and spaces "
            "(set run_dir to put the run elsewhere)",
            value=name,
            has_value=True,
            source=source,
        )


class Checker:
    def __init__(self, source: str | None) -> None:
        self.source = source

    def fail(self, key: str, message: str, value: Any) -> None:
        raise ConfigError(key, message, value=value, has_value=True, source=self.source)

    def choice(self, key: str, value: Any, choices: tuple[Any, ...]) -> None:
        if value not in choices:
            self.fail(key, choice_message(value, choices), value)

    def at_least(self, key: str, value: Any, low: int | float, *, optional: bool = False) -> None:
        if value is None and optional:
            return
        if value is None or not value >= low:  # NaN too
            none = " or null" if optional else ""
            self.fail(key, f"must be >= {low}{none}", value)

    def positive(self, key: str, value: Any) -> None:
        if value is None or not value > 0:
            self.fail(key, "must be > 0", value)

    def between(self, key: str, value: Any, low: int, high: int, unit: str = "") -> None:
        if value is None or not low <= value <= high:
            self.fail(key, f"must be between {low} and {high}{unit}", value)


def validate_config(cfg: Config, source: str | None = None) -> None:
    """Check ``cfg``; returns nothing and changes nothing (see
    :func:`rftstream.config.resolve.resolve_config` for the derived values).

    Raises :class:`ConfigError` naming the first invalid key path and its value;
    ``source`` (the config file) is included in the message. Warns
    (:class:`~rftstream.config.stream_limits.StreamLimitWarning`) for stream limits that can
    lose unprocessed messages.
    """
    c = Checker(source)
    c.choice("mode", cfg.mode, MODES)
    check_run_name(cfg.name, source=source)

    sync = cfg.synchronizer
    c.choice("synchronizer.sync_style", sync.sync_style, SYNC_STYLES + tuple(SYNC_STYLE_ALIASES))
    c.choice("synchronizer.sync_method", sync.sync_method, SYNC_METHODS)
    c.at_least("synchronizer.sync_interval", sync.sync_interval, 1)
    c.positive("synchronizer.weights_keyframe_ratio", sync.weights_keyframe_ratio)
    if sync.sync_method == "jetstream":
        weights_wire_dtype(cfg, source=source)
    c.at_least("synchronizer.sync_offset", sync.sync_offset, 0)
    c.at_least("synchronizer.max_staleness", sync.max_staleness, 0, optional=True)

    rm = cfg.explorer.rollout_model
    c.choice("explorer.rollout_model.engine_type", rm.engine_type, ENGINE_TYPES)
    # N rollout engines = N explorers (explorer, explorer-2, ...) sharing the task queue
    c.at_least("explorer.rollout_model.engine_num", rm.engine_num, 1)
    if rm.engine_type == "openai" and cfg.mode in TRAINER_MODES:
        c.fail(
            "explorer.rollout_model.engine_type",
            f"`openai` is an external server whose weights rftstream cannot update, and "
            f"mode: {cfg.mode} runs a trainer; use it with mode: explore or bench, or train "
            "with engine_type transformers or vllm",
            rm.engine_type,
        )
    c.at_least("explorer.runner_num", cfg.explorer.runner_num, 1)
    c.at_least("explorer.max_retry_times", cfg.explorer.max_retry_times, 0)
    c.positive("explorer.max_timeout", cfg.explorer.max_timeout)

    if cfg.algorithm.loss_agg_mode is not None:
        c.choice("algorithm.loss_agg_mode", cfg.algorithm.loss_agg_mode, LOSS_AGG_MODES)
    c.choice("algorithm.logprobs_of", cfg.algorithm.logprobs_of, LOGPROBS_OF)
    c.at_least("algorithm.repeat_times", cfg.algorithm.repeat_times, 1, optional=True)

    check_monitor_config(cfg.monitor, source=source)
    c.at_least("monitor.dead_letter_window", cfg.monitor.dead_letter_window, 0)
    share = cfg.monitor.max_dead_letter_share
    if not 0 < share <= 1:
        c.fail(
            "monitor.max_dead_letter_share",
            "must be above 0 and at most 1 (1.0: every group of monitor.dead_letter_window)",
            share,
        )

    buf = cfg.buffer
    c.at_least("buffer.batch_size", buf.batch_size, 1)
    c.at_least("buffer.train_batch_size", buf.train_batch_size, 0)
    c.at_least("buffer.total_epochs", buf.total_epochs, 1)
    c.at_least("buffer.total_steps", buf.total_steps, 1, optional=True)
    c.at_least("explorer.eval_interval", cfg.explorer.eval_interval, 1)
    _check_tasksets(c, buf.explorer_input)
    if cfg.mode == "bench" and not buf.explorer_input.eval_tasksets:
        c.fail(
            "buffer.explorer_input.eval_tasksets",
            "mode: bench evaluates the eval tasksets; list at least one",
            [],
        )

    c.at_least("trainer.save_interval", cfg.trainer.save_interval, 0)
    c.at_least("trainer.save_interval_seconds", cfg.trainer.save_interval_seconds, 0)
    c.choice("trainer.zero_stage", cfg.trainer.zero_stage, ZERO_STAGES)
    c.at_least("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node, 1)
    c.at_least("trainer.nnodes", cfg.trainer.nnodes, 1)
    c.at_least("trainer.nccl_timeout", cfg.trainer.nccl_timeout, 10)
    many = cfg.trainer.n_gpus_per_node > 1
    if many and cfg.mode == "both" and cfg.synchronizer.sync_method == "memory":
        c.fail(
            "trainer.n_gpus_per_node",
            "several trainer ranks run in separate processes, so the weights must leave the "
            "trainer: set synchronizer.sync_method to jetstream (or checkpoint)",
            cfg.trainer.n_gpus_per_node,
        )
    c.choice("trainer.mixed_precision", cfg.trainer.mixed_precision, MIXED_PRECISIONS)
    c.at_least("model.max_prompt_tokens", cfg.model.max_prompt_tokens, 1)
    c.at_least("model.max_response_tokens", cfg.model.max_response_tokens, 1)
    c.at_least("model.max_model_len", cfg.model.max_model_len, 1, optional=True)
    _check_token_budget(c, cfg)
    _check_lora(c, cfg.model.lora_configs)

    c.between("nats.max_payload", cfg.nats.max_payload, KIB, 64 * MIB, " bytes (1 KiB to 64 MiB)")
    _check_stream_limits(c, cfg)
    _check_nats_security(c, cfg.nats)


def _check_stream_limits(c: Checker, cfg: Config) -> None:
    """``nats.streams.<stream>``: limits NATS accepts, and a warning for each that can lose
    messages nobody processed yet (see :mod:`rftstream.retention.limits`)."""

    for name in STREAM_KEYS:
        limits = getattr(cfg.nats.streams, name)
        key = f"nats.streams.{name}"
        c.choice(f"{key}.discard", limits.discard, DISCARD_POLICIES)
        for field in ("max_bytes", "max_msgs"):
            value = getattr(limits, field)
            if value == 0 or value < -1:
                c.fail(f"{key}.{field}", "must be -1 (unlimited) or > 0", value)
        c.at_least(f"{key}.max_age", limits.max_age, 0)
    exp = cfg.nats.streams.experience
    c.at_least("nats.streams.experience.keep_acked_msgs", exp.keep_acked_msgs, 0)
    c.at_least("nats.streams.experience.keep_acked_s", exp.keep_acked_s, 0)
    if 0 < exp.max_bytes < 2 * cfg.nats.max_payload:
        c.fail(
            "nats.streams.experience.max_bytes",
            f"must hold at least two messages of nats.max_payload ({cfg.nats.max_payload} bytes)",
            exp.max_bytes,
        )
    for line in limit_warnings(cfg.nats.streams):
        warnings.warn(line, StreamLimitWarning, stacklevel=3)


def _check_token_budget(c: Checker, cfg: Config) -> None:
    """``trainer.max_token_len_per_gpu`` is at least 1, and a warning when it cannot hold the
    longest row the trainer can see (``max_prompt_tokens + max_response_tokens``: collate
    cuts rows to them): such a row trains in a micro-batch of its own, over the budget
    (Trinity-RFT's examples set budgets below their maxima). ``use_dynamic_bsz`` only."""
    t = cfg.trainer
    c.at_least("trainer.max_token_len_per_gpu", t.max_token_len_per_gpu, 1, optional=True)
    if not t.use_dynamic_bsz or t.max_token_len_per_gpu is None:
        return
    row = cfg.model.max_prompt_tokens + cfg.model.max_response_tokens
    if t.max_token_len_per_gpu < row:
        warnings.warn(
            f"{c.source + ': ' if c.source else ''}config key `trainer.max_token_len_per_gpu` "
            f"({t.max_token_len_per_gpu}) is smaller than the longest row the trainer can see, "
            f"model.max_prompt_tokens + model.max_response_tokens = {row}: a row longer than "
            f"the budget trains in a micro-batch of its own, over it (raise it to {row}, or "
            f"leave it unset: 2 x {row})",
            ConfigWarning,
            stacklevel=2,
        )


def _check_tasksets(c: Checker, inp: ExplorerInput) -> None:
    """Check every taskset's values and name uniqueness."""
    for group, entries in (
        ("training", training_tasksets(inp)),
        ("eval", eval_tasksets(inp)),
    ):
        seen: dict[str, str] = {}
        for key, ts in entries:
            if not TASKSET_NAME_RE.fullmatch(ts.name or ""):
                c.fail(
                    f"{key}.name",
                    "must be 1 to 64 characters from [A-Za-z0-9_.-] (it names the taskset's "
                    "task ids and metrics)",
                    ts.name,
                )
            if ts.name in seen:
                c.fail(
                    f"{key}.name",
                    f"{group} taskset names must be unique; {seen[ts.name]} has it too "
                    "(give each taskset its own `name`)",
                    ts.name,
                )
            seen[ts.name] = key
            c.at_least(f"{key}.repeat_times", ts.repeat_times, 1, optional=True)
            c.at_least(f"{key}.total_epochs", ts.total_epochs, 1, optional=True)
            max_tokens = ts.rollout_args.max_tokens
            c.at_least(f"{key}.rollout_args.max_tokens", max_tokens, 1, optional=True)
            c.at_least(f"{key}.rollout_args.min_tokens", ts.rollout_args.min_tokens, 0)
            if group == "training" and ts.is_eval:
                c.fail(
                    f"{key}.is_eval",
                    "a training taskset cannot be is_eval; list it in "
                    "buffer.explorer_input.eval_tasksets",
                    ts.is_eval,
                )


#: ``/PATH/TO/...``, ``path/to/...``: what Trinity-RFT's examples and most READMEs write
#: where a path of the user's own goes
_PLACEHOLDER_RE = re.compile(r"(^|/)path/to(/|$)", re.IGNORECASE)


def placeholder_hint(path: str) -> str:
    """A sentence for an error about ``path`` when it is an example's placeholder, else ""."""
    if _PLACEHOLDER_RE.search(path.strip()):
        return " (`/PATH/TO/...` is an example's placeholder: put a path of yours there)"
    return ""


def check_output_dirs(cfg: Config, *, source: str | None = None) -> None:
    """``checkpoint_root_dir``, when set, is a directory this process can create and write:
    its nearest existing ancestor a writable directory (an example's placeholder,
    ``/PATH/TO/CHECKPOINT/``, was unset at load: :mod:`rftstream.config.trinity`). Blocks
    for a few ``stat`` calls; creates nothing. Raises :class:`ConfigError` at
    ``checkpoint_root_dir``."""
    root = cfg.checkpoint_root_dir
    if not root:
        return
    c = Checker(source)
    unset = "or remove the key: checkpoints then go under <run_dir>/checkpoints"
    existing = Path(root).expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        c.fail("checkpoint_root_dir", f"{existing} is a file, not a directory; {unset}", root)
    if not os.access(existing, os.W_OK | os.X_OK):
        c.fail(
            "checkpoint_root_dir",
            f"cannot be created or written: {existing} is not writable by this user; {unset}",
            root,
        )


def check_model_context(cfg: Config, model_path: str, *, source: str | None = None) -> None:
    """The token budget against the context of the model at ``model_path`` (a local
    directory: what :func:`rftstream.runtime.resolve_model_path` returns).

    The context is ``max_position_embeddings`` in ``<model_path>/config.json`` (or its
    ``text_config``), lowered to ``model.max_model_len`` when that is set; without
    either there is nothing to check. Raises :class:`ConfigError` when
    ``model.max_response_tokens`` (or a taskset's ``rollout_args.max_tokens``) leaves no
    room for a prompt (it must be below the context). Logs a note (INFO, the run's log)
    when ``model.max_prompt_tokens + model.max_response_tokens`` exceeds the context:
    the engines then give a long prompt a shorter response than asked for. Blocks
    (reads one small file).
    """
    context, where = _model_context(model_path)
    if cfg.model.max_model_len is not None and (
        context is None or cfg.model.max_model_len < context
    ):
        context, where = cfg.model.max_model_len, "model.max_model_len"
    if context is None:
        return
    c = Checker(source)
    budgets = [("model.max_response_tokens", cfg.model.max_response_tokens)]
    inp = cfg.buffer.explorer_input
    budgets += [
        (f"{key}.rollout_args.max_tokens", ts.rollout_args.max_tokens)
        for key, ts in training_tasksets(inp) + eval_tasksets(inp)
        if ts.rollout_args.max_tokens is not None
    ]
    for key, tokens in budgets:
        if tokens >= context:
            c.fail(
                key,
                f"must be below the model's context of {context} tokens ({where}): a response "
                "this long leaves no room for the prompt",
                tokens,
            )
    row = cfg.model.max_prompt_tokens + cfg.model.max_response_tokens
    if row > context:  # a note in the run's log: common (short prompts) and harmless
        shown = f"{source}: " if source else ""
        log.info(
            "%smodel.max_prompt_tokens + model.max_response_tokens = %d exceeds the model's "
            "context of %d tokens (%s): a prompt longer than %d tokens gets a shorter response",
            shown,
            row,
            context,
            where,
            context - cfg.model.max_response_tokens,
        )


def _model_context(model_path: str) -> tuple[int | None, str]:
    """``max_position_embeddings`` of the model directory's ``config.json`` (None when the
    file, or the key, is not there or does not parse) and where it was read."""
    path = Path(model_path) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None, str(path)
    if not isinstance(data, dict):
        return None, str(path)
    for section, prefix in ((data, ""), (data.get("text_config"), "text_config.")):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{prefix}max_position_embeddings in {path}"
    return None, str(path)


def _check_lora(c: Checker, configs: list[LoRAConfig] | None) -> None:
    """At most one adapter (as in Trinity-RFT), with a rank, alpha and dropout peft accepts."""
    if not configs:
        return
    if len(configs) > 1:
        c.fail(
            "model.lora_configs",
            "only one LoRA adapter can be trained (as in Trinity-RFT); list one entry",
            [lc.name for lc in configs],
        )
    key = "model.lora_configs[0]"
    lora = configs[0]
    c.at_least(f"{key}.lora_rank", lora.lora_rank, 1)
    c.positive(f"{key}.lora_alpha", lora.lora_alpha)
    if not 0.0 <= lora.lora_dropout < 1.0:
        c.fail(f"{key}.lora_dropout", "must be in [0, 1)", lora.lora_dropout)
    if not lora.target_modules:
        c.fail(f"{key}.target_modules", "names no module to adapt", lora.target_modules)


_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _check_nats_security(c: Checker, nats: NatsConfig) -> None:
    """``nats.servers`` / ``nats.url`` (one or the other), the credential files (they must
    exist), ``user`` with ``password``, ``tls.cert`` with ``tls.key``, ``reconnect_window``.
    Secret values (``token``, ``password``) are never put in an error."""
    if nats.url and nats.servers:
        c.fail(
            "nats.servers",
            "give either nats.url (one server) or nats.servers (a list), not both; "
            "put every URL in nats.servers",
            nats.servers,
        )
    for i, url in enumerate(nats.servers):
        if not isinstance(url, str) or not url.strip():
            c.fail(f"nats.servers[{i}]", "must be a non-empty URL such as nats://host:4222", url)
    for i, url in enumerate([nats.url] if nats.url else nats.servers):
        key = "nats.url" if nats.url else f"nats.servers[{i}]"
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme and scheme not in _NATS_SCHEMES:
            c.fail(key, f"unknown scheme {scheme!r}; use one of {', '.join(_NATS_SCHEMES)}", url)
    for key, path in (
        ("nats.creds", nats.creds),
        ("nats.nkey_seed", nats.nkey_seed),
        ("nats.tls.ca", nats.tls.ca),
        ("nats.tls.cert", nats.tls.cert),
        ("nats.tls.key", nats.tls.key),
    ):
        if path and not os.path.isfile(path):
            c.fail(key, "file not found", path)
    if nats.creds and nats.nkey_seed:
        c.fail(
            "nats.nkey_seed",
            "a .creds file (nats.creds) already holds the user's nkey seed; give one of them",
            nats.nkey_seed,
        )
    if nats.password and not nats.user:
        raise ConfigError("nats.password", "is set without nats.user", source=c.source)
    if bool(nats.tls.cert) != bool(nats.tls.key):
        key = "nats.tls.key" if nats.tls.cert else "nats.tls.cert"
        raise ConfigError(
            key,
            "a TLS client certificate needs both nats.tls.cert and nats.tls.key",
            source=c.source,
        )
    c.positive("nats.reconnect_window", nats.reconnect_window)
    c.at_least("nats.retry_window", nats.retry_window, 0)
