"""Trinity-RFT 0.6 config keys: what each one becomes here, or why it has no meaning here.

:data:`TRINITY_KEYS` is the one table. Every key path of Trinity-RFT's
``Config`` (``trinity/common/config.py``) that rftstream's own schema does not
declare is either :class:`Mapped` (converted onto our key paths) or
:class:`Ignored` (dropped with one :class:`TrinityConfigWarning` naming the key
and why). Keys that both schemas declare pass through untouched, except the few
values in :data:`VALUE_RULES` (``synchronizer.sync_method: nccl`` without CUDA,
``engine_type: vllm`` without CUDA,
``monitor.monitor_type: swanlab`` ...).

:func:`translate_trinity` applies the table to a raw mapping (after overrides
and ``${oc.env:...}`` interpolation, before msgspec conversion), so that
:class:`~rftstream.config.schema.Config` stays rftstream's own. A key in
neither schema stays in the mapping, and the loader reports it as unknown with
a did-you-mean. Pure: no I/O (the CUDA probe is injectable).

Patterns: list items are written ``[*]``, names under ``auxiliary_buffers``
``*``; ``trainer.trainer_config`` (verl's own config) has its own sub-table,
:data:`VERL_KEYS`.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from rftstream.config.paths import PathPart, config_info, fmt_path, lookup, type_at
from rftstream.config.schema import MONITOR_TYPES
from rftstream.errors import ConfigError

__all__ = [
    "TRINITY_KEYS",
    "VALUE_RULES",
    "VERL_KEYS",
    "Ignored",
    "KeyNote",
    "Mapped",
    "TrinityConfigWarning",
    "Translation",
    "translate_trinity",
]


class TrinityConfigWarning(UserWarning):
    """A Trinity-RFT config key that has no meaning here, or a value that was replaced."""


Action = Literal["mapped", "ignored", "replaced", "overridden"]


@dataclass(frozen=True)
class KeyNote:
    """What became of one key of the file.

    ``action``: ``mapped`` (converted onto ``targets``), ``ignored`` (dropped,
    warned), ``replaced`` (our own key, value replaced, warned) or
    ``overridden`` (mapped, but every target is set explicitly elsewhere).
    ``targets``: ``(our key path, converted value)`` pairs.
    """

    path: str
    action: Action
    reason: str
    value: Any = None
    targets: tuple[tuple[str, Any], ...] = ()

    @property
    def warns(self) -> bool:
        """Whether this note is a warning (a key dropped or a value replaced)."""
        return self.action in ("ignored", "replaced")

    def message(self) -> str:
        """One line: the key path, what happened and why."""
        if self.action == "ignored":
            return f"config key `{self.path}` has no meaning in rftstream and is ignored: {self.reason}"
        if self.action == "replaced":
            new = ", ".join(f"{k}={v!r}" for k, v in self.targets)
            return f"config key `{self.path}`: {self.value!r} replaced by {new}: {self.reason}"
        if not self.targets:
            return f"`{self.path}` = {self.value!r}: {self.reason}"
        arrows = ", ".join(f"{k} = {v!r}" for k, v in self.targets)
        return f"`{self.path}` -> {arrows} ({self.reason})"


@dataclass
class Translation:
    """The result of :func:`translate_trinity`.

    ``data``: the mapping in rftstream's schema (keys in neither schema still
    in it, for the loader's unknown-key report); ``notes`` in file order;
    ``unknown``: ``(key path, report)`` for keys inside Trinity-only sections
    that Trinity does not declare either.
    """

    data: dict[str, Any]
    notes: list[KeyNote] = field(default_factory=list)
    unknown: list[tuple[str, str]] = field(default_factory=list)

    @property
    def warnings(self) -> list[KeyNote]:
        """The notes that are warnings (each key once)."""
        return [n for n in self.notes if n.warns]


# --------------------------------------------------------------------------- context

_EXPLICIT = 100  # a key of our own schema written in the file always wins


@dataclass
class _Assign:
    source: str
    target: tuple[PathPart, ...]
    value: Any
    priority: int


class _Ctx:
    """What a converter sees: the whole raw mapping, and where to put its results."""

    def __init__(
        self, raw: dict[str, Any], cuda_available: Callable[[], bool], source: str | None
    ) -> None:
        self.raw = raw
        self.source = source
        self.cuda_available = cuda_available
        self.assigns: list[_Assign] = []
        self.notes: list[KeyNote] = []
        self.reasons: dict[str, tuple[str, Any]] = {}

    def get(self, dotted: str, default: Any = None) -> Any:
        found, value = lookup(self.raw, _split(dotted))
        return value if found and value is not None else default

    def assign(self, source: str, target: str, value: Any, reason: str, priority: int = 50) -> None:
        """Propose ``target = value`` for ``source``; the highest priority wins, the file's own
        value of ``target`` always."""
        self.assigns.append(_Assign(source, tuple(_split(target)), value, priority))
        self.reasons.setdefault(source, (reason, None))

    def ignore(self, source: str, value: Any, reason: str) -> None:
        self.notes.append(KeyNote(source, "ignored", reason, value))

    def tasksets(self, *, eval_only: bool = False, train_only: bool = False) -> list[str]:
        """Dotted paths of the tasksets the file lists (never the built-in default one)."""
        inp = self.get("buffer.explorer_input", {})
        if not isinstance(inp, dict):
            return []
        out: list[str] = []
        base = "buffer.explorer_input"
        if not eval_only:
            if isinstance(inp.get("taskset"), dict):
                out.append(f"{base}.taskset")
            out += [f"{base}.tasksets[{i}]" for i, _ in enumerate(inp.get("tasksets") or [])]
        if not train_only:
            out += [
                f"{base}.eval_tasksets[{i}]" for i, _ in enumerate(inp.get("eval_tasksets") or [])
            ]
        return out


_SPLIT_RE = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _split(dotted: str) -> list[PathPart]:
    return [
        int(m.group(2)) if m.group(2) is not None else m.group(1)
        for m in _SPLIT_RE.finditer(dotted)
    ]


# --------------------------------------------------------------------------- rules

Convert = Callable[[str, Any, _Ctx], None]


@dataclass(frozen=True)
class Mapped:
    """A Trinity key converted onto ours. ``to``: the mapping in one line (for the table)."""

    to: str
    convert: Convert


@dataclass(frozen=True)
class Ignored:
    """A Trinity key without meaning here; ``reason`` says why (one line)."""

    reason: str


Rule = Mapped | Ignored


def _to(target: str, *, priority: int = 50, fn: Callable[[Any], Any] | None = None) -> Mapped:
    """Copy (or convert with ``fn``) the value onto ``target``."""

    def convert(source: str, value: Any, ctx: _Ctx) -> None:
        ctx.assign(
            source, target, fn(value) if fn else value, f"same meaning as {target}", priority
        )

    return Mapped(f"-> {target}", convert)


def _runner_per_model(source: str, value: Any, ctx: _Ctx) -> None:
    engines = ctx.get("explorer.rollout_model.engine_num", 1)
    if not isinstance(value, int) or not isinstance(engines, int):
        ctx.assign(source, "explorer.runner_num", value, "runner_per_model (not an int)")
        return
    ctx.assign(
        source,
        "explorer.runner_num",
        value * engines,
        f"runner_per_model {value} x engine_num {engines}: runners of the explorer in all",
    )


def _defaults_for_tasksets(target_key: str, *, eval_only: bool = False, train_only: bool = False):
    def convert(source: str, value: Any, ctx: _Ctx) -> None:
        paths = ctx.tasksets(eval_only=eval_only, train_only=train_only)
        for ts in paths:
            ctx.assign(source, f"{ts}.{target_key}", value, "the default of each taskset", 40)
        if not paths:
            ctx.ignore(source, value, "the file lists no taskset to give it to")

    which = "eval tasksets" if eval_only else "tasksets"
    return Mapped(f"-> <each of the {which}>.{target_key} that sets none", convert)


def _eval_workflow_default() -> Mapped:
    inner = _defaults_for_tasksets("default_workflow_type", eval_only=True)

    def convert(source: str, value: Any, ctx: _Ctx) -> None:
        # beats buffer.explorer_input.default_workflow_type on eval tasksets
        before = len(ctx.assigns)
        inner.convert(source, value, ctx)
        for a in ctx.assigns[before:]:
            a.priority = 45

    return Mapped(inner.to, convert)


def _taskset_storage(source: str, value: Any, ctx: _Ctx) -> None:
    if value == "file":
        ctx.notes.append(
            KeyNote(
                source,
                "mapped",
                "tasks are read from the file at `path` and published to the work-queue stream "
                "RFT_<RUN>_TASKS",
                value,
            )
        )
        return
    raise ConfigError(
        source,
        "only `file` tasksets exist here: tasks are read from `path` (a local jsonl/json/parquet "
        "file or directory) and published to the work-queue stream RFT_<RUN>_TASKS; a taskset fed "
        "by another process (`queue`, `sql`) has no counterpart",
        value=value,
        has_value=True,
        source=ctx.source,
    )


def _storage_type(source: str, value: Any, ctx: _Ctx) -> None:
    """``experience_buffer.storage_type``: ``queue`` is the experience stream here."""
    if value == "queue":
        reason = (
            "the explorer -> trainer queue is the JetStream stream RFT_<RUN>_EXP (subject "
            "rft.<run>.exp.train); a file is read only in mode: train"
        )
    else:
        reason = "a local data file or dataset directory the trainer reads in mode: train"
    ctx.notes.append(KeyNote(source, "mapped", reason, value))


def _data_selector(source: str, value: Any, ctx: _Ctx) -> None:
    parent = source.rsplit(".", 1)[0]
    if not isinstance(value, dict):
        ctx.ignore(source, value, "expected a mapping")
        return
    kind = value.get("selector_type", "sequential")
    if kind in ("sequential", None):
        ctx.assign(source, f"{parent}.shuffle", False, "sequential: tasks in file order", 40)
    elif kind in ("shuffle", "random"):
        ctx.assign(source, f"{parent}.shuffle", True, f"{kind}: tasks shuffled", 40)
    else:
        ctx.ignore(
            source,
            value,
            f"selector_type {kind!r} (difficulty-based selection) does not exist here",
        )
        return
    if "seed" in value:
        ctx.assign(source, f"{parent}.seed", value["seed"], "the shuffle seed", 40)


def _dynamic_bsz(source: str, value: Any, ctx: _Ctx) -> None:
    """``use_dynamic_bsz`` is ours too (micro-batches formed per step by the token budget);
    Trinity-RFT's default budget, ``2 x max_model_len``, becomes
    ``trainer.max_token_len_per_gpu`` when the file sets ``model.max_model_len`` and no
    budget (else ours applies: ``2 x (max_prompt_tokens + max_response_tokens)``)."""
    if not value:
        ctx.notes.append(
            KeyNote(
                source, "mapped", "false: micro-batches of ppo_micro_batch_size_per_gpu rows", value
            )
        )
        return
    how = (
        "micro-batches formed per step, as few as hold trainer.max_token_len_per_gpu padded "
        "tokens each"
    )
    budget_set = any(
        ctx.get(k) is not None
        for k in ("trainer.max_token_len_per_gpu", "trainer.ppo_max_token_len_per_gpu")
    )
    max_len = ctx.get("model.max_model_len")
    if budget_set or not (isinstance(max_len, int) and max_len > 0):
        if not budget_set:
            how += " (unset: 2 x (model.max_prompt_tokens + model.max_response_tokens))"
        ctx.notes.append(KeyNote(source, "mapped", how, value))
        return
    ctx.assign(
        source,
        "trainer.max_token_len_per_gpu",
        2 * max_len,
        f"{how}; Trinity-RFT's default budget 2 x model.max_model_len",
        40,
    )


def _total_steps(source: str, value: Any, ctx: _Ctx) -> None:
    """Trinity's trainer.total_steps bounds the run: here that is buffer.total_steps."""
    ctx.assign(source, "buffer.total_steps", value, "the run's trainer steps", 50)


def _token_budget(source: str, value: Any, ctx: _Ctx) -> None:
    """``max_token_len_per_gpu`` (ours too) or its older name ``ppo_max_token_len_per_gpu``
    (onto ours, unless the file sets ours): the micro-batch token budget of
    ``use_dynamic_bsz``."""
    used = bool(ctx.get("trainer.use_dynamic_bsz", False))
    if source == "trainer.max_token_len_per_gpu":
        reason = (
            "the micro-batch token budget of trainer.use_dynamic_bsz"
            if used
            else "unused: only trainer.use_dynamic_bsz: true forms micro-batches by tokens"
        )
        ctx.notes.append(KeyNote(source, "mapped", reason, value))
    elif used:
        ctx.assign(
            source,
            "trainer.max_token_len_per_gpu",
            value,
            "older name of the micro-batch token budget of trainer.use_dynamic_bsz",
            50,
        )
    else:
        ctx.ignore(
            source, value, "only used with trainer.use_dynamic_bsz: true (as in Trinity-RFT)"
        )


def _trainer_type(source: str, value: Any, ctx: _Ctx) -> None:
    ctx.assign(
        source,
        "trainer.trainer_type",
        "deepspeed",
        f"{value!r}: the trainer here is DeepSpeed",
        _EXPLICIT,
    )


def _engine_type(source: str, value: Any, ctx: _Ctx) -> None:
    new = "vllm" if isinstance(value, str) and value.startswith("vllm") else value
    if new == "vllm" and not ctx.cuda_available():
        # refused here at once, not after the explorer processes started and failed
        ctx.notes.append(
            KeyNote(
                source,
                "replaced",
                "vLLM needs a CUDA device and this machine has none; the `transformers` engine "
                "(the same interface, on the CPU) runs instead",
                value,
                ((source, "transformers"),),
            )
        )
        new = "transformers"
    ctx.assign(source, source, new, "vLLM's async engine is the `vllm` engine here", _EXPLICIT)


_VERL_KL = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "k3",
}


# ------------------------------------------------------------------ reasons shared by many keys

_RAY = "Ray placement setting; rftstream runs actors as processes (`rftstream up` on one machine, `rftstream explorer|operator|trainer` per machine against one NATS)"
_AUTO = 'Trinity-RFT sets it itself ("DO NOT SET"); nothing reads it here'
_SQL = "setting of SQL/queue storage; tasks and experience travel over JetStream here"
_VLLM_ONLY = "vLLM engine setting without a counterpart; pass vLLM engine arguments in explorer.rollout_model.engine_kwargs"
_MODEL_GEN = "sampling is set per taskset here (buffer.explorer_input.taskset.rollout_args)"
_NOT_HERE = "feature not implemented in rftstream"
_SERVE = "serve mode (`mode: serve`) does not exist here"
_LORA_VLLM = "vLLM's LoRA serving setting; explorers here get the merged weights (base + adapter), never the adapter alone"
_LORA_VERL = "Trinity-RFT fills it from model.lora_configs; set the adapter there"
_VERL_OTHER = "verl setting (trainer.trainer_config is verl's own config); the DeepSpeed trainer here has no counterpart"
_MONITOR = (
    f"swanlab is not a monitor here ({', '.join(t for t in MONITOR_TYPES if t != 'none')} are); "
    "metrics go to <run_dir>/metrics.jsonl and the metrics stream"
)


def _inference_model_rules(prefix: str, *, rollout: bool) -> dict[str, Rule]:
    """Keys of Trinity's InferenceModelConfig that ours lacks (rollout model or auxiliary model)."""
    rules: dict[str, Rule] = {
        f"{prefix}.{k}": Ignored(_VLLM_ONLY)
        for k in (
            "data_parallel_size",
            "pipeline_parallel_size",
            "enable_expert_parallel",
            "use_v1",
            "enable_chunked_prefill",
            "ignore_eos",
            "enable_log_requests",
            "enable_auto_tool_choice",
            "tool_call_parser",
            "reasoning_parser",
            "weight_sync_buffer_size",
            "enable_return_routed_experts",
        )
    }
    for k in (
        "gpu_per_engine",
        "bundle_indices",
        "engine_id",
        "ray_namespace",
        "ray_actor_name",
        "nnodes",
        "node_rank",
        "sync_method",
        "checkpoint_job_dir",
        "cuda_visible_devices",
        "enable_lora",
        "enable_runtime_lora_updating",
        "lora_modules",
        "lora_kwargs",
        "rope_scaling",
        "rope_theta",
        "temperature",
        "top_p",
        "top_k",
        "logprobs",
    ):
        rules[f"{prefix}.{k}"] = Ignored(_AUTO)
    for k in (
        "trust_remote_code",
        "min_response_tokens",
        "enable_prompt_truncation",
        "repetition_penalty",
        "enable_thinking",
        "enable_multimodal",
        "chat_template",
        "base_port",
    ):
        rules[f"{prefix}.{k}"] = Ignored(_NOT_HERE)
    rules[f"{prefix}.external_model_config"] = Ignored("use engine_type: openai with base_url here")
    rules[f"{prefix}.engine_type"] = Mapped("vllm_async -> vllm", _engine_type)
    if rollout:
        rules[f"{prefix}.model_path"] = Ignored("the rollout model is model.model_path here")
        rules[f"{prefix}.name"] = Ignored(_AUTO)
        rules[f"{prefix}.extra_engine_args"] = _to(f"{prefix}.engine_kwargs", priority=40)
        rules[f"{prefix}.dtype"] = Mapped(
            "-> model.dtype (one dtype for the rollout engine and the trainer here)",
            lambda s, v, c: c.assign(
                s, "model.dtype", v, "the rollout engine's dtype is model.dtype here", 40
            ),
        )
        for k in ("max_model_len", "max_prompt_tokens", "max_response_tokens"):
            rules[f"{prefix}.{k}"] = _to(f"model.{k}", priority=40)
    else:
        del rules[f"{prefix}.temperature"]  # an auxiliary model's own sampling temperature here
        for k in (
            "dtype",
            "seed",
            "engine_num",
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "enforce_eager",
            "enable_prefix_caching",
            "enable_history",
            "enable_openai_api",
            "extra_engine_args",
            "max_model_len",
            "max_prompt_tokens",
        ):
            rules[f"{prefix}.{k}"] = Ignored(
                "an auxiliary model is one engine with its own defaults here"
            )
    return rules


def _release(kept: str, note: str) -> str:
    """A reason for a key of older Trinity-RFT releases: which kept it, and what became of it."""
    return f"Trinity-RFT {kept} ({note})"


_STORAGE_ALGORITHM = _release(
    "0.1-0.2", "chose the storage's schema; 0.3 replaced it by schema_type"
)


def _storage_algorithm_type(source: str, value: Any, ctx: _Ctx) -> None:
    """A dataset's ``algorithm_type`` (0.1-0.2): ``sft``/``dpo`` data -> ``schema_type``."""
    storage = source.rsplit(".", 1)[0]
    if value in ("sft", "dpo"):
        ctx.assign(source, f"{storage}.schema_type", value, _STORAGE_ALGORITHM, priority=40)
    else:
        ctx.ignore(source, value, _STORAGE_ALGORITHM + "; the algorithm's own schema applies")


#: algorithms whose ``sft_warmup_dataset`` was their expert data (Trinity-RFT 0.2-0.3.0)
MIX_FAMILY = ("mix", "mix_chord")


def _sft_warmup_dataset(source: str, value: Any, ctx: _Ctx) -> None:
    """0.1-0.3.0's ``sft_warmup_dataset``: MIX/CHORD's expert data -> the auxiliary buffer
    ``sft_dataset`` (a warm-up of other algorithms became ``stages:`` when the file was
    read, :mod:`rftstream.config.legacy`; what is left here has 0 warm-up steps)."""
    algorithm = ctx.get("algorithm.algorithm_type")
    if algorithm in MIX_FAMILY and isinstance(value, dict):
        data = {k: v for k, v in value.items() if k not in ("algorithm_type", "name")}
        data.setdefault("schema_type", "sft")
        for key, item in data.items():
            ctx.assign(
                source,
                f"buffer.trainer_input.auxiliary_buffers.sft_dataset.{key}",
                item,
                _release("0.2-0.3.0", "MIX's expert data; 0.3.1 moved it to auxiliary_buffers"),
                priority=40,
            )
        return
    ctx.ignore(
        source,
        value,
        _release(
            "0.1-0.3.0",
            "SFT warm-up, moved to `stages:` in 0.3.1; with sft_warmup_steps > 0 it runs as a "
            "sft_warmup stage, here it has no steps",
        ),
    )


def _loss_agg_from_token_level(source: str, value: Any, ctx: _Ctx) -> None:
    mode = "token-mean" if value else "seq-mean-token-mean"
    ctx.assign(
        source,
        "algorithm.loss_agg_mode",
        mode,
        _release("0.2-0.3.0", "never read outside its UI; 0.4 has algorithm.loss_agg_mode"),
        priority=40,
    )


def _explore_batch_size(source: str, value: Any, ctx: _Ctx) -> None:
    ctx.assign(
        source,
        "buffer.batch_size",
        value,
        "a pre-release name of buffer.batch_size (Trinity-RFT's config manager writes its "
        "'Task Batch Size' there)",
        priority=30,
    )


# the keys of Trinity-RFT 0.2's pipelines, run by its data-processor server
_OLD_PIPELINE_KEYS = (
    "input_buffers",
    "output_buffer",
    "format",
    "dj_config_path",
    "dj_process_desc",
    "agent_model_name",
    "agent_model_config",
    "clean_strategy",
    "min_size_ratio",
    "min_priority_score",
    "data_dist",
    "db_url",
    "max_retry_times",
    "max_retry_interval",
)


def _old_pipeline_rules(
    prefix: str, since: str, more: tuple[str, ...], *, release: str = "0.2"
) -> dict[str, Rule]:
    """Trinity-RFT 0.1-0.2's keys of the pipeline at ``prefix``: named with their release."""
    reason = _release(release, f"the data-processor server's pipeline, replaced in 0.3 by {since}")
    return {f"{prefix}.{k}": Ignored(reason) for k in (*_OLD_PIPELINE_KEYS, *more)}


def _format_rules(prefix: str) -> dict[str, Rule]:
    return {
        f"{prefix}.system_prompt_key": Ignored(
            "set format.system_prompt (one prompt for the taskset)"
        ),
        f"{prefix}.image_key": Ignored("multi-modal data is not supported"),
        f"{prefix}.video_key": Ignored("multi-modal data is not supported"),
        f"{prefix}.enable_concatenated_multi_turn": Ignored(_NOT_HERE),
        f"{prefix}.enable_thinking": Ignored(_NOT_HERE),
    }


def _taskset_rules(prefix: str) -> dict[str, Rule]:
    rules: dict[str, Rule] = {
        f"{prefix}.storage_type": Mapped(
            "file -> read from path (queue/sql: error)", _taskset_storage
        ),
        f"{prefix}.data_selector": Mapped(
            "selector_type sequential|shuffle -> shuffle, seed -> seed", _data_selector
        ),
        f"{prefix}.task_selector": Mapped(
            "(deprecated data_selector) -> shuffle, seed", _data_selector
        ),
        f"{prefix}.max_retry_times": Ignored(_SQL),
        f"{prefix}.max_retry_interval": Ignored(_SQL),
        f"{prefix}.algorithm_type": Ignored(_STORAGE_ALGORITHM + "; tasks have none"),
        f"{prefix}.enable_progress_bar": Ignored("no progress bar for loading tasks here"),
        f"{prefix}.index": Ignored(_AUTO),
        f"{prefix}.batch_size": Ignored(_AUTO + " (buffer.batch_size)"),
        f"{prefix}.total_steps": Ignored(_AUTO + " (buffer.total_steps)"),
        f"{prefix}.ray_namespace": Ignored(_AUTO),
    }
    rules.update(_format_rules(f"{prefix}.format"))
    return rules


def _storage_rules(prefix: str) -> dict[str, Rule]:
    rules: dict[str, Rule] = {
        f"{prefix}.storage_type": Mapped(
            "queue -> the stream RFT_<RUN>_EXP; file -> a file", _storage_type
        ),
        f"{prefix}.capacity": Ignored(_SQL),
        f"{prefix}.max_read_timeout": Ignored(_SQL),
        f"{prefix}.replay_buffer": Ignored(
            "replay of stored experience is not supported; the stream keeps every stage"
        ),
        f"{prefix}.max_retry_times": Ignored(_SQL),
        f"{prefix}.max_retry_interval": Ignored(_SQL),
        f"{prefix}.algorithm_type": Mapped("sft|dpo -> schema_type", _storage_algorithm_type),
        **{
            f"{prefix}.{k}": Ignored(
                _release("0.2-0.3.1", "0.3.2 moved it to replay_buffer")
                + "; replay of stored experience is not supported"
            )
            for k in ("use_priority_queue", "reuse_cooldown_time", "replay_buffer_kwargs")
        },
        f"{prefix}.enable_progress_bar": Ignored("no progress bar for loading data here"),
        f"{prefix}.data_selector": Mapped(
            "selector_type sequential|shuffle -> shuffle, seed -> seed", _data_selector
        ),
        f"{prefix}.index": Ignored(_AUTO),
        f"{prefix}.batch_size": Ignored(_AUTO + " (buffer.train_batch_size)"),
        f"{prefix}.tokenizer_path": Ignored(_AUTO),
        f"{prefix}.total_steps": Ignored(_AUTO),
        f"{prefix}.ray_namespace": Ignored(_AUTO),
        f"{prefix}.repeat_times": Ignored(_AUTO),
    }
    rules.update(_format_rules(f"{prefix}.format"))
    return rules


def _trainer_nodes(ctx: _Ctx) -> int:
    """The trainer's nodes as a Trinity config gives them: ``cluster.trainer_node_num``, or
    ``cluster.node_num`` of a train-only run (every node trains), else 1."""
    nodes = ctx.get("cluster.trainer_node_num")
    if nodes is None and ctx.get("mode") == "train":
        nodes = ctx.get("cluster.node_num")
    try:
        return max(1, int(nodes or 1))
    except (TypeError, ValueError):
        return 1


def _node_num(source: str, value: Any, ctx: _Ctx) -> None:
    """``cluster.node_num``: every node trains in mode train (``trainer.nnodes``); in mode
    both Trinity splits the nodes between explorers and trainer, which is a placement here
    (``cluster.trainer_node_num`` or ``trainer.nnodes`` says the trainer's share)."""
    if ctx.get("mode") == "train":
        ctx.assign(source, "trainer.nnodes", value, "a train-only run trains on every node", 40)
    else:
        ctx.ignore(source, value, _RAY + "; the trainer's nodes: cluster.trainer_node_num")


def _trainer_gpu_num(source: str, value: Any, ctx: _Ctx) -> None:
    """``cluster.trainer_gpu_num`` counts the trainer's GPUs on all its nodes: per node,
    that over the trainer's nodes."""
    try:
        per_node = max(1, int(value) // _trainer_nodes(ctx))
    except (TypeError, ValueError):
        per_node = value  # validation names the bad value
    ctx.assign(source, "trainer.n_gpus_per_node", per_node, "the trainer's GPUs over its nodes", 40)


def _build_table() -> dict[str, Rule]:
    t: dict[str, Rule] = {
        # root
        "checkpoint_job_dir": Ignored(_AUTO),
        "ray_namespace": Ignored(_RAY),
        "ignore_validator_suggestions": Ignored("there is no GPU-memory validator here"),
        "service": Ignored(
            "no service is started or contacted: the Data-Juicer ops of "
            "data_processor.task_pipeline and of the data_juicer operator run in process"
        ),
        "log": Ignored(
            "logging is set with --log-level; the run log is <run_dir>/logs/rftstream.log"
        ),
        "cod": Ignored(_NOT_HERE),
        # cluster
        **{
            f"cluster.{k}": Ignored(_RAY)
            for k in (
                "ray_address",
                "gpu_per_node",
                "total_gpu_num",
                "rollout_gpu_num",
                "auxiliary_model_gpu_num",
                "explorer_gpu_num",
            )
        },
        "cluster.node_num": Mapped("-> trainer.nnodes (mode train)", _node_num),
        "cluster.trainer_node_num": _to("trainer.nnodes", priority=50),
        "cluster.trainer_gpu_num": Mapped("-> trainer.n_gpus_per_node", _trainer_gpu_num),
        "cluster.trainer_gpu_num_per_node": _to("trainer.n_gpus_per_node", priority=45),
        # algorithm
        "algorithm.optimizer.lr_scheduler_type": _to(
            "algorithm.optimizer.warmup_style", priority=40
        ),
        "algorithm.optimizer.optimizer_type": Ignored(
            "the optimizer is DeepSpeed's AdamW (betas, eps, weight_decay)"
        ),
        "algorithm.optimizer.clip_grad": _to("trainer.grad_clip", priority=40),
        "algorithm.enable_router_replay": Ignored("MoE router replay is not supported"),
        "algorithm.bypass_old_logprobs": Ignored(
            "old logprobs are the rollout logprobs here unless the algorithm recomputes them"
        ),
        "algorithm.rollout_correction": Ignored(
            "the off-policy correction is chosen from synchronizer settings here (decoupled_ppo when experience can be stale)"
        ),
        # model
        "model.trust_remote_code": Ignored(_NOT_HERE),
        "model.custom_chat_template": Ignored("set format.chat_template on the taskset/dataset"),
        "model.chat_template_path": Ignored("set format.chat_template on the taskset/dataset"),
        **{
            f"model.{k}": Ignored(_MODEL_GEN) for k in ("temperature", "top_p", "top_k", "logprobs")
        },
        **{
            f"model.{k}": Ignored(_NOT_HERE)
            for k in (
                "min_response_tokens",
                "enable_prompt_truncation",
                "repetition_penalty",
                "enable_thinking",
                "rope_scaling",
                "rope_theta",
            )
        },
        **{f"model.{k}": Ignored(_LORA_VLLM) for k in ("fully_sharded_loras", "max_cpu_loras")},
        "model.lora_configs[*].base_model_name": Ignored(_LORA_VLLM),
        "model.lora_configs[*].lora_dtype": Ignored(
            "the dtype vLLM serves the adapter in; here the adapter trains in "
            "trainer.mixed_precision and explorers get merged weights in model.dtype"
        ),
        "model.lora_configs[*].is_dummy": Ignored(_AUTO),
        "model.tinker": Ignored("Tinker training service is not supported"),
        "model.external_model": Ignored(
            "use explorer.rollout_model.engine_type: openai with base_url"
        ),
        # buffer
        "buffer.explorer_output": Ignored(_AUTO),
        **{
            f"buffer.{k}": Ignored(
                _release("0.1-0.2", "SQL sessions' retries; 0.3 moved it onto each storage")
                + "; "
                + _SQL
            )
            for k in ("max_retry_times", "max_retry_interval")
        },
        "buffer.explore_batch_size": Mapped("-> buffer.batch_size", _explore_batch_size),
        "buffer.trainer_input.sft_warmup_dataset": Mapped(
            "MIX/CHORD: -> auxiliary_buffers.sft_dataset; others: stages", _sft_warmup_dataset
        ),
        "buffer.trainer_input.sft_warmup_steps": Ignored(
            _release("0.1-0.3.0", "SFT warm-up steps, moved to `stages:` in 0.3.1")
            + "; with a warm-up dataset and steps > 0 the file runs a sft_warmup stage first"
        ),
        "model.max_token_len": Ignored(
            "not a key of any Trinity-RFT release: the context length is model.max_model_len, "
            "a trainer GPU's token budget trainer.max_token_len_per_gpu"
        ),
        "data_processor.data_processor_url": Ignored(
            _release("0.2", "a data-processor server; removed in 0.3")
            + "; operators run in the operator host (data_processor.experience_pipeline)"
        ),
        "data_processor.data_workflow_url": Ignored(
            _release("0.1", "a data-processor server; removed in 0.3")
            + "; operators run in the operator host (data_processor.experience_pipeline)"
        ),
        # Trinity-RFT 0.1's trainer and data-processor keys
        "trainer.actor_use_kl_loss": Mapped(
            "false -> algorithm.kl_loss_fn: none (0.1; verl's use_kl_loss)",
            lambda s, v, c: _use_kl_loss(s, v, c),
        ),
        "trainer.actor_kl_loss_coef": _to("algorithm.kl_loss_fn_args.kl_coef", priority=40),
        **_old_pipeline_rules(
            "data_processor",
            "data_processor.task_pipeline / experience_pipeline",
            ("source_data_path", "priority_weights", "reward_shaping"),
            release="0.1",
        ),
        "algorithm.use_token_level_loss": Mapped(
            "true -> loss_agg_mode token-mean, false -> seq-mean-token-mean",
            _loss_agg_from_token_level,
        ),
        "algorithm.add_strategy": Ignored(
            _release("0.2", "removed in 0.3: algorithm.advantage_fn: step_wise_grpo")
            + "; set advantage_fn"
        ),
        "algorithm.add_strategy_args": Ignored(
            _release("0.2", "removed in 0.3: algorithm.advantage_fn_args")
            + "; set advantage_fn_args"
        ),
        "buffer.tokenizer_path": Ignored(_AUTO),
        "buffer.cache_dir": Ignored(_AUTO),
        "buffer.explorer_input.default_workflow_type": _defaults_for_tasksets(
            "default_workflow_type"
        ),
        "buffer.explorer_input.default_eval_workflow_type": _eval_workflow_default(),
        "buffer.explorer_input.default_reward_fn_type": _defaults_for_tasksets(
            "default_reward_fn_type"
        ),
        # explorer
        "explorer.mode": Ignored(_AUTO + " (copied from mode)"),
        "explorer.runner_per_model": Mapped(
            "-> explorer.runner_num = runner_per_model x rollout_model.engine_num",
            _runner_per_model,
        ),
        "explorer.runner_prepare_concurrency": Ignored(_NOT_HERE),
        "explorer.runner_prepare_max_retries": Ignored(_NOT_HERE),
        "explorer.env_vars": Ignored(
            "workflows run in the explorer's process; set variables in its environment"
        ),
        "explorer.concurrent_mode": Ignored("workflow runs are concurrent anyio tasks here"),
        "explorer.max_repeat_times_per_runner": Ignored(
            "a task's repeat_times rollouts always run as one group here"
        ),
        "explorer.eval_on_startup": Ignored(
            "evaluation runs every eval_interval explorer steps and at the end"
        ),
        **{
            f"explorer.{k}": Ignored(_SERVE)
            for k in (
                "proxy_port",
                "listen_address",
                "service_status_check_interval",
                "min_running_model_num",
                "db_url",
            )
        },
        "explorer.over_rollout": Ignored(
            "explorers never wait for a batch here (sync_style dynamic_by_explorer)"
        ),
        "explorer.dynamic_timeout": Ignored("a task's timeout is explorer.max_timeout"),
        "explorer.runner_state_report_interval": Ignored(
            "runner state is in the heartbeats (`rftstream status`)"
        ),
        "explorer.max_inflight_batches": Ignored(
            "in-flight experience is bounded by synchronizer.max_staleness here"
        ),
        # data processor
        **_old_pipeline_rules(
            "data_processor.task_pipeline", "operators, inputs and target_fields", ()
        ),
        **_old_pipeline_rules(
            "data_processor.experience_pipeline",
            "operators: [{name, args}] (reward_shaping_mapper, Data-Juicer ops)",
            ("priority_weights", "reward_shaping"),
        ),
        "data_processor.experience_pipeline.save_input": Ignored(
            "every stage is kept in the stream RFT_<RUN>_EXP (`rftstream tail raw`)"
        ),
        "data_processor.experience_pipeline.input_save_path": Ignored(
            "every stage is kept in the stream RFT_<RUN>_EXP (`rftstream tail raw`)"
        ),
        "data_processor.experience_pipeline.inputs": Ignored(
            "an operator pipeline reads one stage here"
        ),
        "data_processor.experience_pipeline.output": Ignored(
            "the pipeline writes output_stage (exp.train) here"
        ),
        # trainer
        "trainer.name": Ignored(_AUTO),
        "trainer.trainer_type": Mapped("verl -> deepspeed", _trainer_type),
        "trainer.trainer_strategy": Ignored("the trainer is DeepSpeed (trainer.zero_stage)"),
        "trainer.enable_preview": Ignored(_MONITOR),
        "trainer.total_steps": Mapped(
            "-> buffer.total_steps (unless the file sets buffer.total_steps)", _total_steps
        ),
        "trainer.ppo_max_token_len_per_gpu": Mapped(
            "-> trainer.max_token_len_per_gpu (its older name) with trainer.use_dynamic_bsz",
            _token_budget,
        ),
        "trainer.save_hf_checkpoint": Ignored(
            "checkpoints are always Hugging Face safetensors directories here"
        ),
        "trainer.use_dynamic_bsz": Mapped(
            "ours: micro-batches formed per step by the token budget "
            "(trainer.max_token_len_per_gpu; Trinity's default 2 x model.max_model_len)",
            _dynamic_bsz,
        ),
        "trainer.max_token_len_per_gpu": Mapped(
            "ours: the micro-batch token budget of trainer.use_dynamic_bsz", _token_budget
        ),
        "trainer.use_remove_padding": Ignored("micro-batches are padded to their longest row here"),
        "trainer.critic_warmup": Ignored(_NOT_HERE),
        "trainer.ulysses_sequence_parallel_size": Ignored(
            "sequence parallelism (Ulysses) is not supported: each GPU holds whole sequences"
        ),
        "trainer.fix_actor_microbatch_loss_scale": Ignored(_NOT_HERE),
        **{
            f"trainer.{k}": Ignored(
                "offloading is DeepSpeed's here: trainer.deepspeed_config.zero_optimization.offload_*"
            )
            for k in ("param_offload", "optimizer_offload", "grad_offload", "offload_policy")
        },
        "trainer.save_strategy": Ignored(_NOT_HERE),
        "trainer.max_checkpoints_to_keep": Ignored(_NOT_HERE),
        "trainer.megatron": Ignored("the trainer is DeepSpeed, not Megatron"),
        "trainer.trust_remote_code": Ignored(_AUTO),
        "trainer.trainer_config_path": Ignored(
            "the verl config file is not read; put its keys under trainer.trainer_config"
        ),
        "trainer.trainer_config": Mapped(
            "verl keys with a counterpart (see VERL_KEYS); the rest ignored",
            lambda s, v, c: _verl(s, v, c),
        ),
        # monitor
        "monitor.detailed_stats": Ignored(_NOT_HERE),
        "monitor.enable_ray_timeline": Ignored(_RAY),
        "monitor.cache_dir": Ignored(_AUTO),
        # synchronizer
        "synchronizer.explorer_sync_interval": Ignored("one sync_interval here"),
        "synchronizer.trainer_sync_interval": Ignored("one sync_interval here"),
        "synchronizer.group_name": Ignored(_AUTO),
        "synchronizer.wait_for_checkpoint": Ignored(_NOT_HERE),
        "synchronizer.explorer_world_size": Ignored(_AUTO),
        "synchronizer.ray_namespace": Ignored(_RAY),
    }
    t.update(_inference_model_rules("explorer.rollout_model", rollout=True))
    t.update(_inference_model_rules("explorer.auxiliary_models[*]", rollout=False))
    for prefix in (
        "buffer.explorer_input.taskset",
        "buffer.explorer_input.tasksets[*]",
        "buffer.explorer_input.eval_tasksets[*]",
    ):
        t.update(_taskset_rules(prefix))
    for prefix in (
        "buffer.trainer_input.experience_buffer",
        "buffer.trainer_input.auxiliary_buffers.*",
    ):
        t.update(_storage_rules(prefix))
    return t


# ------------------------------------------------------------------ verl (trainer.trainer_config)

_A = "actor_rollout_ref.actor"


def _loss_arg(arg: str) -> Convert:
    """``policy_loss_fn_args.<arg>`` when the run's policy loss takes ``arg``, else ignored."""

    def convert(source: str, value: Any, ctx: _Ctx) -> None:
        params = _policy_loss_params(ctx)
        if params is not None and arg not in params:
            ctx.ignore(source, value, f"the policy loss of this algorithm takes no `{arg}`")
            return
        ctx.assign(
            source, f"algorithm.policy_loss_fn_args.{arg}", value, f"the policy loss's {arg}", 30
        )

    return convert


def _policy_loss_params(ctx: _Ctx) -> set[str] | None:
    """The constructor arguments of the run's policy loss, None when it cannot be told."""
    try:
        import inspect

        from rftstream.plugins.registries import ALGORITHM_TYPE, POLICY_LOSS_FN

        name = ctx.get("algorithm.policy_loss_fn")
        if name is None:
            preset = ALGORITHM_TYPE.get(ctx.get("algorithm.algorithm_type", "grpo"))
            name = preset.default_config().get("policy_loss_fn")
        cls = POLICY_LOSS_FN.get(name)
        return set(inspect.signature(cls.__init__).parameters)
    except Exception:  # noqa: BLE001 - an unknown algorithm is reported later, by key
        return None


def _use_kl_loss(source: str, value: Any, ctx: _Ctx) -> None:
    if value:
        ctx.notes.append(
            KeyNote(source, "mapped", "KL loss on: algorithm.kl_loss_fn from kl_loss_type", value)
        )
    else:
        ctx.assign(source, "algorithm.kl_loss_fn", "none", "use_kl_loss: false", 30)


def _kl_type(source: str, value: Any, ctx: _Ctx) -> None:
    if ctx.get(f"trainer.trainer_config.{_A}.use_kl_loss", True) is False:
        ctx.ignore(source, value, "use_kl_loss is false")
        return
    name = _VERL_KL.get(str(value))
    if name is None:
        ctx.ignore(
            source,
            value,
            f"verl KL type {value!r} has no counterpart (k1, k2, k3, low_var_kl, abs)",
        )
        return
    ctx.assign(source, "algorithm.kl_loss_fn", name, f"verl {value!r} is {name!r} here", 30)


_PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


def _mixed_precision(source: str, value: Any, ctx: _Ctx) -> None:
    """verl's ``fsdp_config.mixed_precision`` (``param_dtype``, ``reduce_dtype``,
    ``buffer_dtype``): its ``param_dtype`` is the precision DeepSpeed computes in here."""
    param = value.get("param_dtype") if isinstance(value, dict) else None
    mode = _PRECISIONS.get(str(param)) if param is not None else None
    if mode is None:
        ctx.ignore(
            source,
            value,
            "only param_dtype bf16 (DeepSpeed bf16 with fp32 master weights) or fp32 has a "
            "counterpart here (trainer.mixed_precision)",
        )
        return
    ctx.assign(
        source,
        "trainer.mixed_precision",
        mode,
        f"param_dtype {param}: DeepSpeed computes in {mode} (master weights fp32); "
        "reduce_dtype and buffer_dtype have no counterpart",
        30,
    )


def _verl_to(target: str) -> Mapped:
    return Mapped(
        f"-> {target}", lambda s, v, c: c.assign(s, target, v, f"same meaning as {target}", 30)
    )


VERL_KEYS: dict[str, Rule] = {
    f"{_A}.optim.lr": _verl_to("algorithm.optimizer.lr"),
    f"{_A}.optim.weight_decay": _verl_to("algorithm.optimizer.weight_decay"),
    f"{_A}.optim.betas": _verl_to("algorithm.optimizer.betas"),
    f"{_A}.optim.lr_warmup_steps": _verl_to("algorithm.optimizer.lr_warmup_steps"),
    f"{_A}.optim.lr_warmup_steps_ratio": _verl_to("algorithm.optimizer.lr_warmup_steps_ratio"),
    f"{_A}.optim.min_lr_ratio": _verl_to("algorithm.optimizer.min_lr_ratio"),
    f"{_A}.optim.warmup_style": _verl_to("algorithm.optimizer.warmup_style"),
    f"{_A}.optim.lr_scheduler_type": _verl_to("algorithm.optimizer.warmup_style"),
    f"{_A}.optim.total_training_steps": Ignored(_AUTO),
    f"{_A}.ppo_micro_batch_size_per_gpu": _verl_to("trainer.ppo_micro_batch_size_per_gpu"),
    f"{_A}.ppo_epochs": _verl_to("trainer.ppo_epochs"),
    f"{_A}.grad_clip": _verl_to("trainer.grad_clip"),
    f"{_A}.loss_agg_mode": _verl_to("algorithm.loss_agg_mode"),
    f"{_A}.clip_ratio": Mapped(
        "-> algorithm.policy_loss_fn_args.clip_range (if the loss takes it)",
        _loss_arg("clip_range"),
    ),
    f"{_A}.clip_ratio_low": Mapped(
        "-> algorithm.policy_loss_fn_args.clip_range_low", _loss_arg("clip_range_low")
    ),
    f"{_A}.clip_ratio_high": Mapped(
        "-> algorithm.policy_loss_fn_args.clip_range_high", _loss_arg("clip_range_high")
    ),
    f"{_A}.clip_ratio_c": Mapped(
        "-> algorithm.policy_loss_fn_args.clip_ratio_c", _loss_arg("clip_ratio_c")
    ),
    f"{_A}.entropy_coeff": _verl_to("algorithm.entropy_loss_fn_args.entropy_coef"),
    f"{_A}.use_kl_loss": Mapped("false -> algorithm.kl_loss_fn: none", _use_kl_loss),
    f"{_A}.kl_loss_coef": _verl_to("algorithm.kl_loss_fn_args.kl_coef"),
    f"{_A}.kl_loss_type": Mapped(
        "-> algorithm.kl_loss_fn (kl=k1, mse=k2, low_var_kl, abs)", _kl_type
    ),
    f"{_A}.log_prob_fn": Ignored(
        "the trainer computes the per-token statistics an advantage fn asks for (clipb, "
        "clipv: entropy and nec) by itself"
    ),
    "actor_rollout_ref.nccl_timeout": _verl_to("trainer.nccl_timeout"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": _verl_to(
        "trainer.gradient_checkpointing"
    ),
    f"{_A}.fsdp_config.mixed_precision": Mapped(
        "param_dtype bf16 -> trainer.mixed_precision: bf16 (fp32: fp32)", _mixed_precision
    ),
    **{
        f"actor_rollout_ref.model.{k}": Ignored(_LORA_VERL)
        for k in (
            "lora_rank",
            "lora_alpha",
            "target_modules",
            "exclude_modules",
            "lora_adapter_path",
        )
    },
    "critic.optim.lr": _verl_to("trainer.critic.optim.lr"),
    "critic.optim.weight_decay": _verl_to("trainer.critic.optim.weight_decay"),
    "critic.cliprange_value": _verl_to("trainer.critic.cliprange_value"),
    "critic.loss_agg_mode": _verl_to("trainer.critic.loss_agg_mode"),
}


def _verl(source: str, value: Any, ctx: _Ctx) -> None:
    """Walk verl's config: keys of :data:`VERL_KEYS` are converted, every other leaf ignored."""

    def walk(node: Any, rel: tuple[str, ...]) -> None:
        dotted = ".".join(rel)
        rule = VERL_KEYS.get(dotted)
        path = f"{source}.{dotted}" if dotted else source
        if rule is not None:
            _apply(rule, path, node, ctx)
            return
        if (
            isinstance(node, dict)
            and node
            and any(k.startswith(dotted + ".") or not dotted for k in VERL_KEYS)
        ):
            for k, v in node.items():
                walk(v, (*rel, str(k)))
            return
        ctx.ignore(path, node, _VERL_OTHER)

    if not isinstance(value, dict):
        ctx.ignore(source, value, "expected verl's config as a mapping")
        return
    walk(value, ())


# ------------------------------------------------------------------ values of our own keys


def _sync_method(source: str, value: Any, ctx: _Ctx) -> Any:
    if value == "nccl" and not ctx.cuda_available():
        ctx.notes.append(
            KeyNote(
                source,
                "replaced",
                "`nccl` broadcasts weights between GPUs and this machine has no CUDA device; "
                "`jetstream` (weights over NATS, nothing shared between machines) is the best method "
                "available",
                value,
                ((source, "jetstream"),),
            )
        )
        return "jetstream"
    return value


def _monitor_type(source: str, value: Any, ctx: _Ctx) -> Any:
    if value == "swanlab":
        ctx.notes.append(KeyNote(source, "replaced", _MONITOR, value, ((source, "jsonl"),)))
        return "jsonl"
    if isinstance(value, list) and "swanlab" in value:
        kept = [v for v in value if v != "swanlab"] or ["jsonl"]
        ctx.notes.append(KeyNote(source, "replaced", _MONITOR, value, ((source, kept),)))
        return kept
    return value


def _checkpoint_root(source: str, value: Any, ctx: _Ctx) -> Any:
    """An example's placeholder (``/PATH/TO/CHECKPOINT/``, which would make directories at
    the filesystem root) -> unset: checkpoints go under the run directory."""
    from rftstream.config.validate import placeholder_hint

    if isinstance(value, str) and placeholder_hint(value):
        ctx.notes.append(
            KeyNote(
                source,
                "replaced",
                "an example's placeholder, not a directory: checkpoints go under "
                "<run_dir>/checkpoints (set a directory of yours to put them elsewhere)",
                value,
                ((source, ""),),
            )
        )
        return ""
    return value


ValueRule = Callable[[str, Any, _Ctx], Any]

VALUE_RULES: dict[str, ValueRule] = {
    "synchronizer.sync_method": _sync_method,
    "monitor.monitor_type": _monitor_type,
    "checkpoint_root_dir": _checkpoint_root,
}

TRINITY_KEYS: dict[str, Rule] = _build_table()

# Trinity sections that ours lacks entirely, or whose keys ours lacks: walked for the table
_TRINITY_SECTIONS = {
    ".".join(p.split(".")[:i]) for p in TRINITY_KEYS for i in range(1, p.count(".") + 1)
}


# --------------------------------------------------------------------------- walk


def _pattern(parts: tuple[PathPart, ...]) -> str:
    """The table pattern of a concrete path: ``[i]`` -> ``[*]``, an auxiliary buffer's name -> ``*``."""
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += "[*]"
        elif i and parts[i - 1] == "auxiliary_buffers":
            out += ".*"
        else:
            out += f".{p}" if out else p
    return out


def _apply(rule: Rule, path: str, value: Any, ctx: _Ctx) -> None:
    if isinstance(rule, Ignored):
        ctx.ignore(path, value, rule.reason)
    else:
        rule.convert(path, value, ctx)


def _is_struct(parts: tuple[PathPart, ...]) -> bool:
    return isinstance(type_at(config_info(), parts), msgspec.inspect.StructType) or _struct_union(
        parts
    )


def _struct_union(parts: tuple[PathPart, ...]) -> bool:
    info = type_at(config_info(), parts)
    return isinstance(info, msgspec.inspect.UnionType) and any(
        isinstance(t, msgspec.inspect.StructType) for t in info.types
    )


def _is_list_of_structs(parts: tuple[PathPart, ...]) -> bool:
    info = type_at(config_info(), parts)
    options = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return any(
        isinstance(t, msgspec.inspect.ListType)
        and isinstance(t.item_type, msgspec.inspect.StructType)
        for t in options
    )


def _is_dict_of_structs(parts: tuple[PathPart, ...]) -> bool:
    info = type_at(config_info(), parts)
    return isinstance(info, msgspec.inspect.DictType) and isinstance(
        info.value_type, msgspec.inspect.StructType
    )


def _trinity_keys_under(pattern: str) -> list[str]:
    depth = pattern.count(".") + 1 if pattern else 0
    names = {
        k.split(".")[depth].split("[")[0]
        for k in TRINITY_KEYS
        if (k.startswith(pattern + ".") if pattern else True) and k.count(".") >= depth
    }
    return sorted(names)


def translate_trinity(
    data: dict[str, Any],
    *,
    source: str | None = None,
    cuda_available: Callable[[], bool] | None = None,
) -> Translation:
    """Map a raw config mapping written for Trinity-RFT 0.6 onto rftstream's schema.

    Returns a :class:`Translation`: the new mapping (``data`` is not modified),
    a :class:`KeyNote` for every Trinity key met, and the keys of Trinity-only
    sections that neither schema declares. Issues no warning itself (see
    :func:`rftstream.config.loader.load_config`). Raises
    :class:`~rftstream.errors.ConfigError` for a Trinity value that cannot run
    here (a ``queue`` taskset), naming ``source``. ``cuda_available`` (default: ask torch, only
    when ``sync_method`` is ``nccl`` or an engine is vLLM) decides the ``nccl`` and
    vLLM fallbacks.
    """
    ctx = _Ctx(data, cuda_available or _torch_cuda_available, source)
    out = copy.deepcopy(data)
    unknown: list[tuple[str, str]] = []
    removed: list[tuple[PathPart, ...]] = []

    def walk(node: dict[str, Any], parts: tuple[PathPart, ...]) -> None:
        for key, value in node.items():
            here = (*parts, str(key))
            pat = _pattern(here)
            path = fmt_path(here)
            rule = TRINITY_KEYS.get(pat)
            ours = type_at(config_info(), here) is not None
            if rule is not None:
                _apply(rule, path, value, ctx)
                if not ours:
                    removed.append(here)
                continue
            if ours:
                vr = VALUE_RULES.get(pat)
                if vr is not None:
                    new = vr(path, value, ctx)
                    if new is not value:
                        ctx.assign(path, path, new, "replaced", _EXPLICIT + 1)
                descend(value, here)
                continue
            if pat in _TRINITY_SECTIONS:
                removed.append(here)
                descend(value, here, trinity_only=True)
                continue
            parent_pat = _pattern(parts)
            if parts and parent_pat in _TRINITY_SECTIONS and type_at(config_info(), parts) is None:
                choices = _trinity_keys_under(parent_pat)
                close = difflib.get_close_matches(str(key), choices, n=1, cutoff=0.6)
                hint = (
                    f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(choices)}"
                )
                unknown.append((path, f"unknown key `{path}` ({hint})"))

    def descend(value: Any, here: tuple[PathPart, ...], trinity_only: bool = False) -> None:
        if isinstance(value, dict) and (
            trinity_only or _is_struct(here) or _is_dict_of_structs(here)
        ):
            walk(value, here)
        elif isinstance(value, list) and (trinity_only or _is_list_of_structs(here)):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    walk(item, (*here, i))

    walk(data, ())
    for parts in sorted(removed, key=len, reverse=True):
        _delete(out, parts)
    notes = _resolve(ctx, out)
    return Translation(out, notes, unknown)


def _resolve(ctx: _Ctx, out: dict[str, Any]) -> list[KeyNote]:
    """Apply the winning assignment of each target; one note per source key, in file order."""
    best: dict[tuple[PathPart, ...], _Assign] = {}
    for a in ctx.assigns:
        explicit = lookup(ctx.raw, list(a.target))[0] and a.target != tuple(_split(a.source))
        if explicit and a.priority <= _EXPLICIT:
            continue
        cur = best.get(a.target)
        if cur is None or a.priority > cur.priority:
            best[a.target] = a
    for target, a in best.items():
        _set(out, target, a.value)
    winners: dict[str, list[tuple[str, Any]]] = {}
    for target, a in best.items():
        winners.setdefault(a.source, []).append((fmt_path(target), a.value))
    notes = list(ctx.notes)
    seen = {n.path for n in notes}
    for a in ctx.assigns:
        if a.source in seen:
            continue
        seen.add(a.source)
        reason, _ = ctx.reasons[a.source]
        found, value = lookup(ctx.raw, _split(a.source))
        won = tuple(winners.get(a.source, ()))
        if won:
            notes.append(KeyNote(a.source, "mapped", reason, value, won))
        else:
            targets = ", ".join(
                sorted({fmt_path(x.target) for x in ctx.assigns if x.source == a.source})
            )
            notes.append(
                KeyNote(a.source, "overridden", f"{targets} is set in the file (it wins)", value)
            )
    order = {p: i for i, p in enumerate(_leaf_order(ctx.raw))}
    notes.sort(key=lambda n: order.get(n.path, len(order)))
    return notes


def _leaf_order(data: Any, prefix: tuple[PathPart, ...] = ()) -> list[str]:
    out = [fmt_path(prefix)] if prefix else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _leaf_order(v, (*prefix, str(k)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _leaf_order(v, (*prefix, i))
    return out


def _delete(data: dict[str, Any], parts: tuple[PathPart, ...]) -> None:
    found, parent = lookup(data, list(parts[:-1]))
    if found and isinstance(parent, dict):
        parent.pop(parts[-1], None)


def _set(data: dict[str, Any], parts: tuple[PathPart, ...], value: Any) -> None:
    node: Any = data
    for p in parts[:-1]:
        if isinstance(p, int):
            node = node[p]
            continue
        if not isinstance(node.get(p), dict | list):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = copy.deepcopy(value)


def _torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
