"""Typed config, Trinity-RFT key names where they exist.

Pure data: msgspec Structs with defaults, and the ``Literal`` types of the keys that
take one of a fixed set of values (``mode``, ``synchronizer.sync_style``, ...): msgspec
rejects any other value when a config is decoded, naming the key path, and editors
complete them. Each ``Literal`` has its tuple of values beside it (``MODES``,
``SYNC_STYLES``, ...), the one definition every check and form reads.

Loading (YAML, ``${oc.env:VAR,default}`` interpolation, key-path errors,
unknown-key reports) lives in :mod:`rftstream.config.loader`; cross-field checks in
:mod:`rftstream.config.validate`; values derived from other keys in
:mod:`rftstream.config.resolve`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

# ----------------------------------------------------------------- choices

Mode = Literal["both", "explore", "train", "bench"]
MODES: tuple[Mode, ...] = get_args(Mode)
TrainerMode = Literal["both", "train"]
TRAINER_MODES: tuple[TrainerMode, ...] = get_args(TrainerMode)  # modes that run a trainer

SyncStyle = Literal["fixed", "dynamic_by_explorer", "dynamic_by_trainer", "fully_async"]
SYNC_STYLES: tuple[SyncStyle, ...] = get_args(SyncStyle)
SyncStyleAlias = Literal["explorer_driven", "trainer_driven"]
SYNC_STYLE_ALIASES: dict[SyncStyleAlias, SyncStyle] = {
    "explorer_driven": "dynamic_by_explorer",
    "trainer_driven": "dynamic_by_trainer",
}
SyncStyleName = Literal[SyncStyle, SyncStyleAlias]  # what a config may say; resolved: SyncStyle

# the dtype weights travel in with sync_method jetstream; auto: the rollout engine's (model.dtype)
WeightsDtype = Literal["auto", "float32", "bfloat16", "float16"]
WEIGHTS_DTYPES: tuple[WeightsDtype, ...] = get_args(WeightsDtype)

StorageKind = Literal["file", "memory"]  # a stream's storage on the server

# jetstream: weights travel on the run's weights stream (nothing shared but NATS);
# checkpoint: safetensors files on a path every actor reads; memory: one process
SyncMethod = Literal["jetstream", "checkpoint", "memory", "nccl"]
SYNC_METHODS: tuple[SyncMethod, ...] = get_args(SyncMethod)

EngineType = Literal["transformers", "vllm", "openai"]
ENGINE_TYPES: tuple[EngineType, ...] = get_args(EngineType)
# an auxiliary model this process serves (one behind an external server: its base_url)
AuxiliaryEngineType = Literal["transformers", "vllm"]

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]  # vLLM's AsyncEngineArgs

# chatpair: Trinity-RFT's DPO rows of chat lists (read as any DPO row: see FormatConfig)
PromptType = Literal["", "messages", "plaintext", "chatpair"]

# queue: Trinity-RFT's experience queue, the experience stream here
StorageType = Literal["file", "queue"]

LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[LossAggMode, ...] = get_args(LossAggMode)

# which distribution the trainer's log-probs of a token sampled under a ban are of: the
# sampler's (the banned ids left out) or the model's over the whole vocabulary
LogprobsOf = Literal["sampler", "model"]
LOGPROBS_OF: tuple[LogprobsOf, ...] = get_args(LogprobsOf)

MixedPrecision = Literal["fp32", "bf16"]
MIXED_PRECISIONS: tuple[MixedPrecision, ...] = get_args(MixedPrecision)

ZeroStage = Literal[0, 1, 2, 3]
ZERO_STAGES: tuple[ZeroStage, ...] = get_args(ZeroStage)

WarmupStyle = Literal["constant", "cosine"]
WARMUP_STYLES: tuple[WarmupStyle, ...] = get_args(WarmupStyle)

# jsonl: the run's own files only; none: no eval.jsonl and no backend (see rftstream.monitors)
MonitorType = Literal["jsonl", "tensorboard", "wandb", "mlflow", "none"]
MONITOR_TYPES: tuple[MonitorType, ...] = get_args(MonitorType)

DiscardPolicy = Literal["new", "old"]
DISCARD_POLICIES: tuple[DiscardPolicy, ...] = get_args(DiscardPolicy)


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    pass


# ----------------------------------------------------------------- model


class LoRAConfig(_Base):
    """One entry of ``model.lora_configs``: a LoRA adapter trained through ``peft``.

    Trinity-RFT's key names. ``lora_rank`` is peft's ``r``; each adapted weight
    becomes ``W + (lora_alpha / lora_rank) * B @ A``. ``target_modules``: module
    names or a regex (a string), ``"all-linear"`` (every linear layer but the
    output head). ``path``: an adapter directory saved by peft to continue
    training from (none: a fresh adapter, ``B = 0``). ``lora_dropout`` (peft's, an
    rftstream extension) drops the adapter's input while training.
    ``save_adapter``: checkpoints also hold the adapter alone, in
    ``<checkpoint>/lora_adapter`` (peft format); the checkpoint itself and the
    weights sent to explorers are always the merged weights.
    """

    name: str | None = None
    path: str | None = None
    lora_rank: int = 32
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] | None = None
    save_adapter: bool = True


class ModelConfig(_Base):
    """``model``: the policy being trained.

    ``model_path`` empty (or ``"builtin:tiny"``) means the embedded tiny model,
    built and cached locally (no hub access); ``"builtin:qwen2.5-0.5b-shape"`` a
    model of Qwen2.5-0.5B's shape with random weights, built locally, for measuring
    at a realistic size (:mod:`rftstream.shaped_models`). ``lora_configs``: at most one
    :class:`LoRAConfig`; with one, the trainer trains that adapter only (the
    base weights stay frozen) and explorers get merged weights.
    """

    model_path: str = ""
    critic_model_path: str = ""
    max_prompt_tokens: int = 256
    max_response_tokens: int = 64
    max_model_len: int | None = None
    dtype: str = "float32"
    lora_configs: list[LoRAConfig] | None = None


# ----------------------------------------------------------------- buffer


class FormatConfig(_Base):
    """``...format``: how to read a raw task or a dataset row.

    ``prompt_type`` (datasets read by the trainer): ``messages`` (a chat list
    under ``messages_key``; the last assistant turn is the response),
    ``plaintext`` (``prompt_key`` / ``response_key``), or ``""``: ``messages``
    when the row has ``messages_key`` (default ``messages``), else plaintext.
    DPO rows carry ``chosen_key`` and ``rejected_key`` (strings or chat lists,
    whatever ``prompt_type`` says; Trinity-RFT's ``chatpair`` names the latter).
    """

    prompt_type: PromptType = ""
    prompt_key: str = "question"
    response_key: str = "answer"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    system_prompt: str | None = None
    reply_prefix: str | None = None
    messages_key: str | None = None
    chat_template: str | None = None
    tools_key: str | None = None  # a row's OpenAI tool schemas (tool-call workflows)
    workflow_key: str | None = None  # a row may name its own workflow
    reward_fn_key: str | None = None  # ... and its own reward fn


class GenerationConfig(_Base):
    """``...taskset.rollout_args``: sampling parameters for rollouts."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None  # None -> model.max_response_tokens
    min_tokens: int = 0  # no end-of-sequence token before this many new tokens (vLLM's key)
    logprobs: int = 0
    n: int = 1  # set from algorithm.repeat_times when a task is built


class TasksetConfig(_Base):
    """``buffer.explorer_input.taskset``.

    ``path`` empty (or ``"builtin:arithmetic"``) means the built-in arithmetic taskset.
    """

    name: str = "taskset"
    path: str = ""
    split: str = "train"
    subset_name: str | None = None
    format: FormatConfig = msgspec.field(default_factory=FormatConfig)
    rollout_args: GenerationConfig = msgspec.field(default_factory=GenerationConfig)
    default_workflow_type: str = "math_workflow"
    default_reward_fn_type: str | None = None
    workflow_args: dict[str, Any] = msgspec.field(default_factory=dict)
    reward_fn_args: dict[str, Any] = msgspec.field(default_factory=dict)
    repeat_times: int | None = None  # None -> algorithm.repeat_times
    shuffle: bool = True
    seed: int = 42
    total_epochs: int | None = None  # None -> buffer.total_epochs (eval tasksets: 1)
    is_eval: bool = False  # set for buffer.explorer_input.eval_tasksets


class StorageConfig(_Base):
    """A dataset read by the trainer (``buffer.trainer_input.experience_buffer`` or
    ``buffer.trainer_input.auxiliary_buffers.<name>``): a local data file (jsonl, json,
    parquet, csv, arrow) or a dataset directory, read as a taskset's ``path`` is (a
    folder of shards, a ``save_to_disk`` copy; ``split`` and ``subset_name`` pick
    within it).

    ``total_epochs``: passes over the file (``experience_buffer`` in ``mode:
    train``; an auxiliary buffer, e.g. MIX's expert data, is cycled for as long
    as the trainer runs). ``storage_type``/``schema_type`` are accepted as in
    Trinity-RFT (only ``file`` storage exists here).
    """

    name: str = ""
    storage_type: StorageType = "file"
    schema_type: str | None = None
    path: str = ""
    split: str = "train"
    subset_name: str | None = None
    total_epochs: int | None = None  # None: buffer.total_epochs (experience_buffer)
    shuffle: bool = False
    seed: int = 42
    format: FormatConfig = msgspec.field(default_factory=FormatConfig)


class ExplorerInput(_Base):
    """``buffer.explorer_input``.

    ``taskset`` is the training taskset; ``tasksets`` (optional) lists more,
    which are mixed in. ``eval_tasksets`` are run every
    ``explorer.eval_interval`` explorer steps (and never trained on).
    """

    taskset: TasksetConfig = msgspec.field(default_factory=TasksetConfig)
    tasksets: list[TasksetConfig] = msgspec.field(default_factory=list)
    eval_tasksets: list[TasksetConfig] = msgspec.field(default_factory=list)


class TrainerInput(_Base):
    """``buffer.trainer_input``.

    ``experience_buffer``: the dataset the trainer reads in ``mode: train``
    (SFT / DPO); in the other modes experiences come from ``exp.train``.
    """

    experience_buffer: StorageConfig | None = None
    auxiliary_buffers: dict[str, StorageConfig] = msgspec.field(default_factory=dict)


class BufferConfig(_Base):
    """``buffer``: batch sizes and budgets.

    ``batch_size`` tasks per explorer step; ``train_batch_size`` experiences per
    trainer step (0 means ``batch_size * repeat_times``).
    """

    batch_size: int = 8
    train_batch_size: int = 0
    total_epochs: int = 1
    total_steps: int | None = None
    explorer_input: ExplorerInput = msgspec.field(default_factory=ExplorerInput)
    trainer_input: TrainerInput = msgspec.field(default_factory=TrainerInput)
    pad_token_id: int | None = None  # set by the trainer from the tokenizer


# ----------------------------------------------------------------- explorer


class RolloutModelConfig(_Base):
    """``explorer.rollout_model``: the rollout engine.

    ``openai`` (an external OpenAI-compatible server at ``base_url``) cannot
    load trained weights: it serves ``mode: explore`` and ``bench`` only.
    """

    engine_type: EngineType = "transformers"
    engine_num: int = 1  # rollout engines: up starts one explorer process per engine
    tensor_parallel_size: int = 1
    enable_openai_api: bool = False
    enable_history: bool = False
    max_batch_size: int = 64  # requests batched into one forward pass
    batch_wait_ms: float = 5.0  # how long an idle batcher waits for more requests
    base_url: str = ""  # for engine_type: openai
    api_key: str = "EMPTY"
    # the sampler's seed; None: the run's top-level ``seed`` (42 by default), so that a run
    # started with another seed samples other rollouts, as TRL's and verl's ``seed`` do
    seed: int | None = None
    # engine_type: vllm (GPU)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    logprobs_mode: LogprobsMode = "processed_logprobs"
    engine_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)  # other vLLM engine args


class AuxiliaryModelConfig(_Base):
    """One entry of ``explorer.auxiliary_models``: a model workflows reach as an ``openai`` client.

    ``model_path`` (a local HF directory, served on loopback by a transformers
    engine) or ``base_url`` (an external OpenAI-compatible server).
    """

    name: str = ""
    model_path: str = ""
    base_url: str = ""
    api_key: str = "EMPTY"
    engine_type: AuxiliaryEngineType = "transformers"
    max_response_tokens: int = 256
    temperature: float = 1.0


class ExplorerConfig(_Base):
    """``explorer``."""

    name: str = "explorer"
    runner_num: int = 8
    max_timeout: float = 900.0
    max_retry_times: int = 2
    rollout_model: RolloutModelConfig = msgspec.field(default_factory=RolloutModelConfig)
    auxiliary_models: list[AuxiliaryModelConfig] = msgspec.field(default_factory=list)
    eval_interval: int = 100
    bench_on_latest_checkpoint: bool = False  # mode: bench: only the newest checkpoint


# ----------------------------------------------------------------- synchronizer


class SynchronizerConfig(_Base):
    """``synchronizer``: when and how weights travel from trainer to explorers.

    ``sync_method``: ``jetstream`` (the default) publishes each version on the run's
    weights stream, ``RFT_<RUN>_WEIGHTS``, in the background while the trainer goes
    on; explorers anywhere fetch it in the background while they generate and swap
    it in between requests (:mod:`rftstream.weights`): nothing is shared between
    machines but NATS. ``checkpoint``: safetensors files on a path every actor can
    read. ``memory``: all actors in one process.

    With ``jetstream``: ``weights_dtype`` is the dtype on the wire (``auto``: the
    rollout engine's, ``model.dtype``); ``weights_delta`` sends each version as a
    compressed byte delta against the previous one, and a whole version (a
    keyframe) again once the deltas since the last one add up to
    ``weights_keyframe_ratio`` of it; ``double_buffer`` lets the transformers engine
    copy a fetched version into a second copy of the model while it generates, so
    the swap pauses generation for microseconds (false: loaded in place at the swap,
    half the memory).
    """

    sync_method: SyncMethod = "jetstream"
    # explorer_driven / trainer_driven are read as dynamic_by_explorer / dynamic_by_trainer
    sync_style: SyncStyleName = "dynamic_by_explorer"
    sync_interval: int = 1
    sync_offset: int = 0
    sync_timeout: float = 3600.0
    max_staleness: int | None = None
    weights_dtype: WeightsDtype = "auto"
    weights_delta: bool = True
    weights_keyframe_ratio: float = 1.0
    double_buffer: bool = True


# ----------------------------------------------------------------- algorithm


class OptimizerConfig(_Base):
    """``algorithm.optimizer``."""

    lr: float = 1e-6
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    eps: float = 1e-8
    lr_warmup_steps: int = 0
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float | None = None
    warmup_style: WarmupStyle = "constant"


class AlgorithmConfig(_Base):
    """``algorithm``. ``None`` means: take the value from the preset's ``default_config()``."""

    algorithm_type: str = "grpo"
    repeat_times: int | None = None
    sample_strategy: str | None = None
    sample_strategy_args: dict[str, Any] | None = None
    advantage_fn: str | None = None
    advantage_fn_args: dict[str, Any] | None = None
    policy_loss_fn: str | None = None
    policy_loss_fn_args: dict[str, Any] | None = None
    kl_penalty_fn: str | None = None
    kl_penalty_fn_args: dict[str, Any] | None = None
    kl_loss_fn: str | None = None
    kl_loss_fn_args: dict[str, Any] | None = None
    entropy_loss_fn: str | None = None
    entropy_loss_fn_args: dict[str, Any] | None = None
    loss_agg_mode: LossAggMode | None = None  # None: the preset's, else token-mean
    # tokens sampled under a ban (min_tokens' end tokens): "sampler" trains the log-probs
    # of the distribution they were drawn from (the banned ids out of the softmax),
    # "model" the model's over the whole vocabulary (TRL's, verl's): see docs/algorithms.md
    logprobs_of: LogprobsOf = "sampler"
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)


# ----------------------------------------------------------------- data processor


class OperatorConfig(_Base):
    """One entry of ``data_processor.experience_pipeline.operators``."""

    name: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class ExperiencePipelineConfig(_Base):
    """``data_processor.experience_pipeline``: operators between ``exp.raw`` and ``exp.train``."""

    operators: list[OperatorConfig] = msgspec.field(default_factory=list)
    input_stage: str = "raw"
    output_stage: str = "train"
    batch_messages: int = 16  # messages fetched per pipeline call
    max_retries: int = 3  # more attempts for a message whose pipeline call raised, then dead-letter
    retry_backoff: float = 0.5  # seconds before the first retry; doubles (at most 10 s)
    process_timeout: float | None = None  # seconds one pipeline call may take (None: no limit)


class TaskPipelineConfig(_Base):
    """``data_processor.task_pipeline`` (Trinity-RFT's): Data-Juicer ops over the raw task
    files before exploring, written where the explorer reads its taskset.

    ``operators`` (``[{name: <dj op>, args: {...}}]``) or ``config_path`` (a Data-Juicer
    recipe) run in process over the rows of ``inputs`` (local data files), each row's
    ``target_fields`` kept (all its fields when empty); the kept rows go to
    ``output.path`` (default: the first training taskset's path; for SFT/DPO in mode
    train, the experience buffer's). ``num_process`` is accepted and unused;
    ``priority_weights``/``top_k`` (the ranking Trinity-RFT's Data-Juicer server does)
    are refused when set. See :mod:`rftstream.task_pipeline`.
    """

    operators: list[OperatorConfig] = msgspec.field(default_factory=list)
    num_process: int = 4
    config_path: str | None = None
    inputs: list[str] = msgspec.field(default_factory=list)
    output: TasksetConfig | None = None
    target_fields: list[str] = msgspec.field(default_factory=list)
    priority_weights: dict[str, float] = msgspec.field(default_factory=dict)
    top_k: int = -1


class DataProcessorConfig(_Base):
    """``data_processor``."""

    experience_pipeline: ExperiencePipelineConfig = msgspec.field(
        default_factory=ExperiencePipelineConfig
    )
    task_pipeline: TaskPipelineConfig | None = None


# ----------------------------------------------------------------- trainer


class CriticConfig(_Base):
    """``trainer.critic``: the value model of algorithms with ``use_critic`` (PPO).

    A value head (``hidden -> 1``) on ``model.critic_model_path`` (default: the
    policy's ``model_path``), trained with verl's clipped value loss
    ``0.5 * max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2)``.
    """

    optim: OptimizerConfig = msgspec.field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"


class TrainerConfig(_Base):
    """``trainer``: the DeepSpeed trainer."""

    trainer_type: str = "deepspeed"
    # every N steps an HF-format checkpoint (global_step_<N>) and a resumable one; 0: the
    # step trigger is off (an HF checkpoint at the end only)
    save_interval: int = 0
    # a resumable checkpoint (what a restarted trainer continues from) after the first step
    # that ends this many seconds after the last one, or after the trainer's start; 0 turns
    # the time trigger off. With both triggers off no resumable checkpoint is written and a
    # crashed trainer starts over (see rftstream.actors.trainer)
    save_interval_seconds: float = 600.0
    zero_stage: ZeroStage = 0
    # verl's key: data-parallel trainer ranks on this node (GPUs on a GPU machine, processes
    # on CPU); rftstream up starts n - 1 rank processes beside the trainer (rank 0), which
    # alone reads the bus and feeds them (rftstream.training.ranks)
    n_gpus_per_node: int = 1
    # torchrun's --nnodes: machines the trainer's ranks span (Trinity's cluster.node_num of
    # a train-only run, cluster.trainer_node_num). More than 1 needs a launcher on every
    # node (torchrun, srun); rftstream up starts the ranks of one node only. Under a
    # launcher, nnodes x n_gpus_per_node must equal WORLD_SIZE unless both are 1
    nnodes: int = 1
    # verl's actor_rollout_ref.nccl_timeout: seconds a collective between trainer ranks
    # (NCCL or gloo) may wait before it fails the run, e.g. for a node that vanished from
    # the network. An idle trainer (waiting for experience) keeps its ranks' wait short
    # with a ping every min(60, this / 4) seconds, so waiting longer than this is fine
    nccl_timeout: float = 600.0
    ppo_micro_batch_size_per_gpu: int = 16
    # verl's dynamic batch size: each step's micro-batches are formed from the rows' token
    # counts, as few as fit max_token_len_per_gpu padded tokens each (rows x the longest
    # row of the micro-batch), instead of ppo_micro_batch_size_per_gpu rows each
    use_dynamic_bsz: bool = False
    # the token budget of one micro-batch with use_dynamic_bsz; None: Trinity-RFT's default,
    # 2 x (model.max_prompt_tokens + model.max_response_tokens)
    max_token_len_per_gpu: int | None = None
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    max_wait_for_batch: float = 0.0  # 0: wait until experience arrives or the explorer finishes
    balance_batch: bool = True  # length-balanced micro-batches where the algorithm allows it
    # rows with the same prompt (a GRPO group) share one forward pass of it: same result
    share_prompts: bool = True
    # float32 on the CPU: the forward in plain tensor operations on the model's own
    # parameters (rftstream.training.lean_forward), the same logits and gradients as the
    # HF forward for about a fifth less time on small models; other dtypes and devices,
    # architectures it does not cover, dropout, gradient checkpointing, ZeRO-3 and LoRA
    # keep the HF forward
    lean_forward: bool = True
    # recompute each decoder layer's activations in the backward pass instead of keeping them:
    # same loss and gradients, less memory, about one more forward pass of time
    gradient_checkpointing: bool = False
    # fp32 | bf16 (DeepSpeed bf16: bf16 weights and activations, fp32 master weights in the
    # optimizer); bf16 raises ConfigError where the accelerator has no bf16
    mixed_precision: MixedPrecision = "fp32"
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    deepspeed_config: dict[str, Any] = msgspec.field(
        default_factory=dict
    )  # merged over the generated one

    def token_budget(self, model: ModelConfig) -> int:
        """The padded tokens one micro-batch may hold with ``use_dynamic_bsz``:
        ``max_token_len_per_gpu``, or (None) ``2 x (max_prompt_tokens +
        max_response_tokens)`` of ``model``."""
        if self.max_token_len_per_gpu is not None:
            return int(self.max_token_len_per_gpu)
        return 2 * (model.max_prompt_tokens + model.max_response_tokens)


# ----------------------------------------------------------------- monitor / nats


class MonitorConfig(_Base):
    """``monitor``: where metrics go besides the metrics stream."""

    # a MonitorType or a list of them ([jsonl, tensorboard]); <run_dir>/metrics.jsonl is
    # written whatever it says (see rftstream.monitors)
    monitor_type: MonitorType | list[MonitorType] = "jsonl"
    plot: bool = True  # write metrics.png at the end of a run
    # the run fails when at least max_dead_letter_share of the last dead_letter_window groups
    # (tasks, or groups of experiences) were dead-lettered, at any stage; 0 turns it off
    dead_letter_window: int = 64
    max_dead_letter_share: float = 1.0  # 1.0: every group of the window
    # the backends' arguments (Trinity-RFT's keys): wandb base_url, api_key, mode, entity,
    # tags; mlflow uri, username, password
    monitor_args: dict[str, Any] = msgspec.field(default_factory=dict)


class StreamLimitsConfig(_Base):
    """``nats.streams.<stream>``: the limits of one of the run's streams (NATS's own names).

    ``max_bytes`` / ``max_msgs``: -1 is unlimited; ``max_age``: seconds, 0 is
    unlimited. ``discard``: what the server does when a limit is reached: ``new``
    refuses the publish (the producer waits and retries: back-pressure), ``old``
    removes the oldest messages (read or not).
    """

    max_bytes: int = -1
    max_msgs: int = -1
    max_age: float = 0.0
    discard: DiscardPolicy = "new"


class ExperienceStreamConfig(StreamLimitsConfig):
    """``nats.streams.experience``: limits of ``RFT_<RUN>_EXP`` and what happens to
    experience every durable consumer has acked.

    ``purge_acked`` true: explorers purge messages that every durable consumer of
    the stream has acked (trained or filtered), keeping the newest
    ``keep_acked_msgs`` of them for ``rftstream tail`` / ``nats stream view``, and,
    while the stream is below 40% of its limits, every message younger than
    ``keep_acked_s`` seconds and everything stored after an operator's first unacked
    message (so that a group published again after a killed server lost an ack still
    finds its first copy, and the server deduplicates it);
    false: everything is kept (replay, inspection) until ``max_bytes``.
    """

    max_bytes: int = 2 * 1024**3
    purge_acked: bool = True
    keep_acked_msgs: int = 1000
    keep_acked_s: float = 10.0


class TasksStreamConfig(StreamLimitsConfig):
    """``nats.streams.tasks``: limits of ``RFT_<RUN>_TASKS`` (a work queue: explored tasks go)."""

    max_bytes: int = 1024**3


class DeadLetterStreamConfig(StreamLimitsConfig):
    """``nats.streams.dead_letter``: limits of ``RFT_<RUN>_DLQ`` (the oldest roll over)."""

    max_bytes: int = 256 * 1024**2
    discard: DiscardPolicy = "old"


class MetricsStreamConfig(StreamLimitsConfig):
    """``nats.streams.metrics``: limits of ``RFT_<RUN>_METRICS`` (the oldest roll over)."""

    max_bytes: int = 256 * 1024**2
    discard: DiscardPolicy = "old"


class WeightsStreamConfig(StreamLimitsConfig):
    """``nats.streams.weights``: ``RFT_<RUN>_WEIGHTS``, the policy's versions with
    ``synchronizer.sync_method: jetstream``. The trainer removes what a keyframe
    replaced 30 s after it (a run keeps about two keyframes and their deltas, at most
    ``2 + weights_keyframe_ratio`` keyframes' bytes), so no limit is set by default;
    ``storage: memory`` keeps them in the server's memory instead of its store
    (faster on slow disks; lost when the server restarts, after which the trainer
    sends a keyframe again within seconds).
    """

    storage: StorageKind = "file"


class StreamsConfig(_Base):
    """``nats.streams``: limits of the run's streams (``rftstream`` defaults bound
    a long run's disk: acked tasks and experience are removed, dead letters and
    metrics roll over, old weights are removed). A table given in part keeps that
    stream's other defaults."""

    tasks: TasksStreamConfig = msgspec.field(default_factory=TasksStreamConfig)
    experience: ExperienceStreamConfig = msgspec.field(default_factory=ExperienceStreamConfig)
    dead_letter: DeadLetterStreamConfig = msgspec.field(default_factory=DeadLetterStreamConfig)
    metrics: MetricsStreamConfig = msgspec.field(default_factory=MetricsStreamConfig)
    weights: WeightsStreamConfig = msgspec.field(default_factory=WeightsStreamConfig)


class NatsTlsConfig(_Base):
    """``nats.tls``: TLS to the server. ``ca`` verifies the server's certificate (the
    system's roots when empty); ``cert`` + ``key`` are a client certificate, for servers
    that verify clients. Any of them set (or a ``tls://`` URL) turns TLS on."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)


class NatsConfig(_Base):
    """``nats``: the bus. ``url`` empty (and no ``servers``) means: start an embedded
    nats-server. Credentials (``creds``, ``nkey_seed``, ``token``, ``user``/``password``,
    ``tls``) and the reconnect window are for a server of your own; secrets are best
    given as ``${oc.env:VAR}`` and are never written out (see :mod:`rftstream.bus.jetstream.connect`).
    """

    url: str = ""
    max_payload: int = 8 * 1024 * 1024
    num_replicas: int = 1
    max_inflight_bytes: int = 16 * 1024 * 1024
    ack_wait: float = 60.0
    max_deliver: int = 5
    dedup_window: float = 600.0
    connect_timeout: float = 10.0
    streams: StreamsConfig = msgspec.field(default_factory=StreamsConfig)
    # secured and shared servers (rftstream.bus.jetstream.connect builds nats-py's options from these)
    servers: list[str] = msgspec.field(default_factory=list)  # several URLs of one cluster
    creds: str = ""  # a .creds file (user JWT + nkey seed), for operator-mode servers
    nkey_seed: str = ""  # a file holding a user nkey seed (SU...)
    token: str = ""
    user: str = ""
    password: str = ""
    tls: NatsTlsConfig = msgspec.field(default_factory=NatsTlsConfig)
    # seconds a lost connection may stay lost: the client reconnects meanwhile (a server
    # restart), then gives up and the actor exits with an error naming the server
    reconnect_window: float = 120.0
    # seconds a JetStream request or publish that times out (or is answered 503) is
    # retried: a cluster electing leaders after a node died, a reconnect in progress
    retry_window: float = 60.0


# ----------------------------------------------------------------- root


class Config(_Base):
    """The root config of one run."""

    mode: Mode = "both"
    project: str = "rftstream"
    group: str = ""  # monitors group runs by it (wandb group, mlflow tag); "" -> name
    name: str = "default"
    checkpoint_root_dir: str = ""  # "" -> <run_dir>/checkpoints
    run_dir: str = ""  # "" -> runs/<name>
    # a trainer started again in a run that has a committed resumable checkpoint (KV
    # trainer.checkpoint; written every trainer.save_interval_seconds / save_interval
    # steps, at the end and on SIGINT/SIGTERM) continues from it, and `rftstream up` on a
    # run dir whose run did not finish continues the run; false: from model.model_path
    # at step 1 (Trinity-RFT's key and default)
    continue_from_checkpoint: bool = True
    seed: int = 42
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    explorer: ExplorerConfig = msgspec.field(default_factory=ExplorerConfig)
    synchronizer: SynchronizerConfig = msgspec.field(default_factory=SynchronizerConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    data_processor: DataProcessorConfig = msgspec.field(default_factory=DataProcessorConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    monitor: MonitorConfig = msgspec.field(default_factory=MonitorConfig)
    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)

    @property
    def trainer_reads_dataset(self) -> bool:
        """Whether the trainer reads a dataset file: ``mode: train`` with a file
        experience buffer. ``mode: train`` with ``storage_type: queue`` (Trinity-RFT's
        trainer half of an explorer/trainer pair) trains on the run's experience
        stream instead, fed by another process's ``mode: explore``."""
        eb = self.buffer.trainer_input.experience_buffer
        return self.mode == "train" and not (eb is not None and eb.storage_type == "queue")
