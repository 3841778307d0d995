"""The DeepSpeed policy trainer: one RL step on a batch of experiences.

Everything here blocks (forward/backward passes): the trainer actor calls
:meth:`PolicyTrainer.train_step` through ``anyio.to_thread.run_sync``.

For a single-process run on CPU, DeepSpeed needs ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; they are set here
when absent (a multi-rank launch sets its own).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rftstream.config.resolved import ResolvedAlgorithmProtocol
from rftstream.config.schema import Config
from rftstream.engines.light_model import LightCausalLM, load_light_causal_lm
from rftstream.errors import ConfigError
from rftstream.experience import Experience, array_numpy
from rftstream.model_loading import (
    HF_LOAD_LOCK,
    forward_kwargs,
    load_causal_lm,
    load_tokenizer,
    output_cache,
    pad_token_id_from_files,
    quiet_progress_bars,
    torch_dtype,
)
from rftstream.nats_server.embedded import free_port
from rftstream.training.batch import (
    TokenBan,
    TokenStats,
    TrainBatch,
    balanced_partitions,
    collate,
    contiguous_partitions,
    response_logprobs,
    response_token_stats,
    token_budget_partitions,
    trainer_tensors,
)
from rftstream.training.critic import value_loss
from rftstream.training.eager_adamw import EagerAdamW
from rftstream.training.lean_forward import LeanForward, lean_forward_reason
from rftstream.training.loss_inputs import TRAINER_ADVANTAGE_INPUTS, loss_inputs_for
from rftstream.training.masked_reductions import whole_batch
from rftstream.training.memory import (
    check_bf16_supported,
    enable_gradient_checkpointing,
    mixed_precision_config,
)
from rftstream.training.schedule import lr_schedule
from rftstream.training.world import env_world_size, per_rank_batch_size
from rftstream.training.zero import embedding_rows, full_state_dict, tied_aliases

if TYPE_CHECKING:
    from rftstream.weights.codec import LoraWire

log = logging.getLogger(__name__)
_Part = TypeVar("_Part")  # what a no-grad pass computes per micro-batch (_no_grad_each)


@contextlib.contextmanager
def _no_shm_op() -> Any:
    """Within it, DeepSpeed's communication backend does not build its shared-memory
    all-reduce op, so nothing compiles at run time: that op only speeds up CPU collectives
    between ranks of one node (torch.distributed's gloo does the same work without it), and
    loading it compiles C++ with gcc the first time on a machine (36 s on two cores), then
    loads or rebuilds it on every start (9 s quiet, 50 s busy). Worse, the build holds a
    lock file in torch's extension cache: a rank killed while building (a crash, a kill -9,
    a timed-out test) leaves the lock behind, and every later multi-rank start on that
    machine waits on it for ever."""
    import importlib

    try:  # the module itself: the package's attribute `torch` is the torch package
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # another DeepSpeed layout: nothing to skip
        yield
        return
    original = getattr(ds_torch_comm, "build_shm_op", None)
    if original is None:
        yield
        return
    ds_torch_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch_comm.build_shm_op = original


@contextlib.contextmanager
def _deepspeed_without_mlflow() -> Any:
    """Within it, ``import mlflow`` fails unless mlflow is imported already: DeepSpeed's
    autotuner (imported by ``import deepspeed``, never used here) tries it at import time, and
    where mlflow is installed that import alone took 0.85 s of every trainer's start-up. Put
    back on the way out, so the ``mlflow`` monitor imports it as usual."""
    import sys

    if "mlflow" in sys.modules or "deepspeed" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # the import system: not found
    try:
        yield
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


def ensure_dist_env() -> None:
    """Set the torch.distributed env of a single-process group if it is not set; on a
    machine without CUDA, tell DeepSpeed it is the CPU (else it warns that it guessed)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


@dataclass
class _GradientClipping:
    """Gradient clipping done by the trainer instead of DeepSpeed (see
    :meth:`PolicyTrainer._clipping_outside_deepspeed`); ``last_norm``: the gradient norm
    before the last clip."""

    max_norm: float
    params: list[torch.nn.Parameter]
    last_norm: float | None = None


class PolicyTrainer:
    """Actor model (DeepSpeed engine), optional frozen reference and critic, and the algorithm.

    One :meth:`train_step` per trainer step:

    1. collate the experiences (plus the sample strategy's custom fields);
    2. recompute ``old_logprob`` (and ``ref_logprob`` with a reference model,
       ``values`` with a critic) without gradient; ``old_logprob`` is instead
       the gradient pass's own log-probs, detached, when that is provably the
       same (:meth:`_old_logprob_is_redundant`: ``ppo_epochs`` 1, no dropout,
       no KL penalty on rewards); an advantage fn that declares
       ``trainer_inputs`` (``clipb``, ``clipv``) gets one no-grad pass computing
       each token's log-prob, entropy (and ``nec``), which also serves as the
       ``old_logprob`` pass, whether or not that one is skipped; without such
       an fn no extra pass runs;
    3. if the algorithm computes advantages in the trainer
       (``compute_advantage_in_trainer``): apply ``kl_penalty_fn`` to the
       token-level rewards, then call ``advantage_fn`` (with ``values=`` for
       a critic, and the declared token statistics); an fn that
       ``rewrites_action_mask`` narrows the mask the losses use;
    4. split into ``gradient_accumulation`` micro-batches (more when the batch has more
       rows than ``ppo_micro_batch_size_per_gpu`` allows them, see
       :meth:`_fixed_micro_batches`), balanced by
       token count when ``trainer.balance_batch`` and the algorithm's
       ``can_balance_batch`` allow it (DPO pairs stay together), and run
       ``ppo_epochs`` passes of policy loss + KL loss + entropy loss (and the
       critic's value loss). Each micro-batch counts by its rows (a
       rows-weighted mean), except for a loss that weights its micro-batches
       itself as verl expects (MIX): it gets verl's scaling
       (:class:`~rftstream.config.resolve.VerlBatchShape`, computed when the
       run is prepared and carried by ``algorithm.batch_shape``).
    """

    def __init__(self, cfg: Config, model_path: str, algorithm: ResolvedAlgorithmProtocol) -> None:
        ensure_dist_env()
        with _deepspeed_without_mlflow():
            import deepspeed  # heavy import: only where training happens

        if env_world_size() > 1 and not torch.distributed.is_initialized():
            # the ranks' collectives fail after trainer.nccl_timeout, not torch's 30 min
            with contextlib.redirect_stdout(io.StringIO()), _no_shm_op():
                deepspeed.init_distributed(
                    timeout=datetime.timedelta(seconds=cfg.trainer.nccl_timeout), verbose=False
                )

        self.cfg = cfg
        self.algorithm = algorithm
        self.temperature = float(cfg.buffer.explorer_input.taskset.rollout_args.temperature or 1.0)
        self.loss_agg_mode = algorithm.config.loss_agg_mode or "token-mean"
        # tokens sampled under a ban: log-probs of the sampler's distribution, not the model's
        self.sampler_logprobs = algorithm.config.logprobs_of == "sampler"
        algo_type = algorithm.algorithm_type
        self.schema = str(getattr(algo_type, "schema", "experience"))
        self.pair_unit = 2 if self.schema == "dpo" else 1
        self.balance = (
            bool(cfg.trainer.balance_batch)
            and bool(getattr(algo_type, "can_balance_batch", True))
            and self.pair_unit == 1
        )
        self.custom_fields = tuple(getattr(algorithm, "custom_fields", ()))
        self.advantage_in_trainer = bool(algorithm.compute_advantage_in_trainer) and (
            (algorithm.config.advantage_fn or "none") != "none"
        )
        self.advantage_inputs = _advantage_inputs(algorithm) if self.advantage_in_trainer else ()
        self.kl_penalty = (algorithm.config.kl_penalty_fn or "none") != "none"
        self.kl_loss = (algorithm.config.kl_loss_fn or "none") != "none"
        torch.manual_seed(cfg.seed)
        self.model_path = model_path
        self._tokenizer: Any = None
        # from the tokenizer's files where they settle it: loading the tokenizer imports
        # transformers, about 1.2 s of the start-up's critical path (see the tokenizer)
        pad = pad_token_id_from_files(model_path)
        if pad is None:
            pad = self.tokenizer.pad_token_id
            pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.pad_token_id = int(pad)
        self.bf16 = cfg.trainer.mixed_precision == "bf16"
        if self.bf16:
            check_bf16_supported()
        checkpointing = bool(cfg.trainer.gradient_checkpointing)
        # bf16: loaded in fp32, the optimizer's master weights; DeepSpeed casts the module
        model = self._light_policy(model_path, checkpointing) or load_causal_lm(
            model_path, "float32" if self.bf16 else cfg.model.dtype
        )
        model.config.use_cache = False
        if checkpointing:
            enable_gradient_checkpointing(model)
        self.cache_kwarg, self.keep_kwarg = forward_kwargs(model)
        # a shared prompt's KV cache: transformers runs checkpointed layers without a cache
        self.share_prompts = (
            bool(cfg.trainer.share_prompts) and self.keep_kwarg is not None and not checkpointing
        )
        # token ids must be below this: from the embedding module, not its weight (empty
        # under ZeRO-3)
        self.vocab_size = embedding_rows(model)
        self.loss_inputs = loss_inputs_for(algorithm.policy_loss_fn)
        self.needs_ref = bool(algorithm.use_reference) and (
            self.kl_loss or self.kl_penalty or "ref_logprob" in self.loss_inputs
        )
        self.lora = None
        if cfg.model.lora_configs:
            from rftstream.training.lora import wrap_with_lora

            self.lora = wrap_with_lora(model, cfg.model.lora_configs[0])
            model = self.lora.module
        self.ref_model: torch.nn.Module | None = None
        if self.needs_ref and self.lora is not None:
            self.ref_model = self.lora.reference()  # the policy, adapter disabled: no copy
        elif self.needs_ref:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
            if self.bf16:
                self.ref_model.to(torch.bfloat16)
        # raises ConfigError naming the loss and the first required field nothing provides
        self.loss_inputs = algorithm.check_loss_inputs(trainer_tensors(algorithm))
        self.entropy_inputs, self.entropy_var_kw = _entropy_extra_inputs(algorithm.entropy_loss_fn)
        coef = getattr(algorithm.entropy_loss_fn, "entropy_coef", 1.0)
        self.entropy_grad = (algorithm.config.entropy_loss_fn or "none") != "none" and coef != 0
        self.micro = max(1, cfg.trainer.ppo_micro_batch_size_per_gpu)
        # with several ranks each trains its shard (rftstream.training.ranks)
        self.world_size = env_world_size()
        # ZeRO-3 gathers the weights in every forward call, a collective: every rank must
        # make as many calls (a shared prompt's pass makes two, see _lockstep_extra)
        self.lockstep_forwards = cfg.trainer.zero_stage == 3 and self.world_size > 1
        if self.lockstep_forwards:
            self.share_prompts = False
        self.train_batch_size = per_rank_batch_size(cfg.buffer.train_batch_size, self.world_size)
        self.gas = max(1, math.ceil(self.train_batch_size / self.micro))
        self.verl_scaling = getattr(algorithm, "batch_shape", None)  # from prepare_run
        self.dynamic_bsz = bool(cfg.trainer.use_dynamic_bsz)
        self.token_budget = cfg.trainer.token_budget(cfg.model)
        # rows may be reordered into micro-batches where the algorithm allows it
        self.can_reorder = bool(getattr(algo_type, "can_balance_batch", True)) and (
            self.pair_unit == 1
        )
        # a loss that divides by the response width must see the whole batch's
        self.trim_responses = "seq-mean-token-sum-norm" not in {
            self.loss_agg_mode,
            getattr(algorithm.policy_loss_fn, "loss_agg_mode", None),
        }
        if self.dynamic_bsz:
            self._check_dynamic_bsz(cfg)
            self.gas = 1  # the caller owns the accumulation boundary (see _deepspeed)
        if self.verl_scaling is not None and self.world_size > 1:
            raise ConfigError(
                "algorithm.policy_loss_fn",
                f"{type(algorithm.policy_loss_fn).__name__} weights its micro-batches "
                f"verl-style, which is supported on one trainer rank only (WORLD_SIZE is "
                f"{self.world_size})",
            )
        opt_cfg = cfg.algorithm.optimizer
        self._own_clipping: dict[int, _GradientClipping] = {}  # by id(engine)
        with HF_LOAD_LOCK:  # DeepSpeed moves the module; keep it apart from concurrent loads
            self.engine, self.optimizer, self.scheduler = self._deepspeed(
                deepspeed, model, opt_cfg, "algorithm.optimizer"
            )
        if self.ref_model is not None:
            self.ref_model.to(self.engine.device)
        self.critic = None
        self.critic_scheduler: Any = None
        if algorithm.use_critic:
            from rftstream.training.critic import ValueModel

            critic_path = cfg.model.critic_model_path or model_path
            backbone = load_causal_lm(critic_path, cfg.model.dtype)
            backbone.config.use_cache = False
            with HF_LOAD_LOCK:
                self.critic, self.critic_optimizer, self.critic_scheduler = self._deepspeed(
                    deepspeed,
                    ValueModel(backbone),
                    cfg.trainer.critic.optim,
                    "trainer.critic.optim",
                )
        self.reuse_old_logprob = self._old_logprob_is_redundant()
        # the trainer's lean forward (rftstream.training.lean_forward) where it computes the
        # HF forward exactly: float32 on the CPU, by module (the policy, the reference)
        self._lean: dict[int, LeanForward] = {}
        if cfg.trainer.lean_forward:
            for module in (self.engine.module, self.ref_model):
                if module is None:
                    continue
                reason = lean_forward_reason(
                    module,
                    zero_stage=cfg.trainer.zero_stage,
                    checkpointing=checkpointing,
                    adapters=self.lora is not None,
                    dropout=_has_active_dropout(module),
                )
                if reason is None:
                    self._lean[id(module)] = LeanForward(module)
                elif isinstance(module, LightCausalLM):  # _light_policy admitted it: a bug
                    raise RuntimeError(f"trainer: the light policy cannot train: {reason}")
                else:
                    log.debug("trainer: the HF forward for %s (%s)", type(module).__name__, reason)
        self.global_step = 0

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (``AutoTokenizer``), loaded on first use: for datasets
        and checkpoints, not for training. Blocks for the load."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def _light_policy(self, model_path: str, checkpointing: bool) -> LightCausalLM | None:
        """The policy as a :class:`~rftstream.engines.light_model.LightCausalLM` (no
        transformers modeling code imported: about 1.5 s less CPU before the first step)
        where the lean forward will train it, else None (``from_pretrained``). Decided
        before loading, by what :func:`lean_forward_reason` checks after DeepSpeed: lean
        forward on, float32 (no bf16), the CPU accelerator, no dropout, no gradient
        checkpointing, no LoRA, ZeRO below 3, an architecture and checkpoint the light
        model covers. Blocks for the load."""
        cfg = self.cfg
        if (
            not cfg.trainer.lean_forward
            or checkpointing
            or cfg.model.lora_configs
            or cfg.trainer.zero_stage >= 3
            or self.bf16
            or torch_dtype(cfg.model.dtype) != torch.float32
            or _accelerator_name() != "cpu"
        ):
            return None
        with HF_LOAD_LOCK:  # transformers' lazy imports race with a load in another thread
            model = load_light_causal_lm(model_path, torch.float32, without_transformers=True)
        if model is None or _has_active_dropout(model):
            return None
        return model

    def _check_dynamic_bsz(self, cfg: Config) -> None:
        """Refuse what ``trainer.use_dynamic_bsz`` cannot train correctly; log a warning when
        the longest row (a DPO pair: two) does not fit the budget (it will train alone, over
        the budget).

        Raises:
            ConfigError: at ``algorithm.policy_loss_fn_args.use_dynamic_bsz`` for a loss
                that weights its micro-batches verl-style by a fixed accumulation count.
        """
        row = cfg.model.max_prompt_tokens + cfg.model.max_response_tokens
        if self.token_budget < self.pair_unit * row:
            what = "a DPO pair (2 rows)" if self.pair_unit > 1 else "the longest row"
            log.warning(
                "trainer.max_token_len_per_gpu: the micro-batch token budget %d cannot hold %s "
                "of model.max_prompt_tokens + model.max_response_tokens = %d tokens each; "
                "what is longer than the budget trains in a micro-batch of its own",
                self.token_budget,
                what,
                row,
            )
        shape = self.verl_scaling
        if shape is not None and not shape.use_dynamic_bsz:
            raise ConfigError(
                "algorithm.policy_loss_fn_args.use_dynamic_bsz",
                f"{type(self.algorithm.policy_loss_fn).__name__} weights its micro-batches "
                f"by a fixed gradient accumulation count, but trainer.use_dynamic_bsz forms "
                f"them by tokens: set this argument to true (or unset it)",
                value=False,
            )

    def _old_logprob_is_redundant(self) -> bool:
        """Whether the gradient pass's own log-probs (detached) equal a recomputed ``old_logprob``.

        They do when the weights cannot change between the two passes and the
        passes compute the same function: one optimizer step per batch
        (``ppo_epochs`` 1: every micro-batch accumulates into one step), no
        active dropout in the policy (a training-mode pass would sample it),
        and nothing needs ``old_logprob`` before the gradient pass (the KL
        penalty on rewards). TRL skips the pass on the same grounds
        (``num_iterations`` 1). Saves one no-grad forward pass per step.
        """
        if max(1, self.cfg.trainer.ppo_epochs) != 1 or self.kl_penalty:
            return False
        return not _has_active_dropout(self.engine.module)

    def _deepspeed(
        self, deepspeed: Any, model: torch.nn.Module, opt_cfg: Any, opt_key: str
    ) -> tuple[Any, Any, Any]:
        """A DeepSpeed engine for ``model`` with AdamW per ``opt_cfg`` (the algorithm's or the
        critic's, at config path ``opt_key``) and its lr schedule
        (:func:`~rftstream.training.schedule.lr_schedule`: constant or cosine, with warm-up).

        With ``trainer.use_dynamic_bsz`` the engine runs with
        ``managed_gradient_accumulation: false``: ``backward`` only accumulates and
        each ``step`` is the accumulation boundary, so a step may have any number of
        micro-batches, each weighted by its rows (``gradient_accumulation_steps`` 1:
        DeepSpeed divides by nothing). Chosen over a worst-case fixed count padded
        with zero-gradient passes, which would cost a pass over the parameters for
        every missing micro-batch; with several ranks the counts are made equal
        (:meth:`_partitions`), as ZeRO 2-3 reduce in every ``backward``.

        Raises:
            ConfigError: the schedule is invalid or needs ``buffer.total_steps``.
        """
        cfg = self.cfg
        params = [p for p in model.parameters() if p.requires_grad]
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.gas,
            # use_dynamic_bsz: a step's micro-batch count varies, DeepSpeed's is fixed
            **({"managed_gradient_accumulation": False} if self.dynamic_bsz else {}),
            "gradient_clipping": cfg.trainer.grad_clip,
            "zero_optimization": {"stage": cfg.trainer.zero_stage},
            **mixed_precision_config(cfg.trainer.mixed_precision),
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        ds_config = _deep_merge(ds_config, cfg.trainer.deepspeed_config)
        # where DeepSpeed steps the optimizer as given (ZeRO 0, float32), torch's AdamW
        # without its torch.compile guards: the same update, no torch._dynamo import (1.2 s
        # of the trainer's start-up)
        adamw = EagerAdamW if _steps_optimizer_as_given(ds_config) else torch.optim.AdamW
        optimizer = adamw(
            params,
            lr=opt_cfg.lr,
            betas=(opt_cfg.betas[0], opt_cfg.betas[1]),
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
            # torch picks the multi-tensor update on GPUs only; on the CPU it is the same
            # arithmetic in a few calls instead of a dozen per parameter
            foreach=True if params and params[0].device.type == "cpu" else None,
        )
        own_clipping = self._clipping_outside_deepspeed(ds_config, params)
        scheduler = None
        schedule = lr_schedule(opt_cfg, cfg.buffer.total_steps, key=opt_key)
        if schedule is not None:
            # on the torch optimizer DeepSpeed wraps; not handed to DeepSpeed, which would step
            # it once per optimizer step: train_step steps it once per trainer step, as verl
            # (whatever ppo_epochs), so the schedule spans buffer.total_steps trainer steps
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        # DeepSpeed prints (not logs) a line when it builds its CPU communication op
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), _no_shm_op():
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=ds_config
            )
        if cfg.trainer.zero_stage == 0 and getattr(engine, "dp_world_size", 0) == 1:
            # averaging the gradients over one rank is the identity; DeepSpeed would still
            # flatten, all-reduce and copy back every gradient each step
            engine.enable_backward_allreduce = False
        if own_clipping is not None:
            self._own_clipping[id(engine)] = own_clipping
        library_log = logging.getLogger("library.deepspeed")  # not rftstream's: the log file only
        for line in printed.getvalue().splitlines():
            library_log.info("%s", line)
        return engine, optimizer, scheduler

    # ------------------------------------------------------------ forward
    def _forward(
        self, model: torch.nn.Module, mb: TrainBatch, *, with_entropy: bool, banned: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (and entropy; with ``banned``, where ``mb`` has tokens sampled
        under a ban, the policy's ``log(1 - pi(banned))`` there, no gradient: see
        :meth:`TrainBatch.behaviour_logprobs`) of ``mb`` (see :meth:`_response_logits`),
        zeros where a row has no response token (every pass alike, so that a difference of
        two passes is zero there, never a difference of two paddings). Rows that
        share a prompt under the lean forward skip the response padding altogether
        (:meth:`LeanForward.shared_token_logprobs`). Under ``algorithm.logprobs_of:
        sampler`` every pass gives the log-probs of the sampler's distribution where
        tokens were sampled under a ban (:meth:`_token_ban`), ``banned`` or not."""
        lean = self._lean_for(model)
        shared = self._shares(mb)
        ban = self._token_ban(mb) if banned or self.sampler_logprobs else None
        if lean is not None and shared is not None:
            ids, mask, pos = mb.input_ids, mb.attention_mask, mb.position_ids
            return lean.shared_token_logprobs(
                ids,
                mask,
                pos,
                mb.prompt_width,
                *shared,
                self.temperature,
                with_entropy=with_entropy,
                ban=ban,
            )
        logits, start = self._response_logits(model, mb, shared)
        logp, entropy, allowed = response_logprobs(
            logits,
            mb.input_ids,
            mb.prompt_width,
            self.temperature,
            with_entropy=with_entropy,
            logits_start=start,
            ban=ban,
        )
        return (
            _zero_padding(logp, mb),
            None if entropy is None else _zero_padding(entropy, mb),
            None if allowed is None else _zero_padding(allowed, mb),
        )

    def _token_ban(self, mb: TrainBatch) -> TokenBan | None:
        """``mb``'s tokens sampled under a ban (:meth:`TrainBatch.token_ban`), to be left out
        of the softmax there under ``algorithm.logprobs_of: sampler``; None without any."""
        ban = mb.token_ban()
        return None if ban is None else replace(ban, exclude=self.sampler_logprobs)

    def _shares(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(first, inverse)`` of :func:`_shared_prompts` when ``trainer.share_prompts`` is
        on and rows of ``mb`` share prompts, else None: one pass's decision."""
        return _shared_prompts(mb) if self.share_prompts else None

    def _response_logits(
        self,
        model: torch.nn.Module,
        mb: TrainBatch,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, int]:
        """The logits that predict ``mb``'s response tokens, and the sequence position of
        their first column. The LM head runs on the positions that predict response
        tokens only, where the model's forward can be told so. Rows that share a prompt
        (``shared``: :meth:`_shares`) share its forward pass."""
        lean = self._lean_for(model)
        if shared is not None:
            if lean is not None:
                P = mb.prompt_width
                ids, mask, pos = mb.input_ids, mb.attention_mask, mb.position_ids
                return lean.shared_logits(ids, mask, pos, P, *shared), P - 1
            return self._forward_shared(model, mb, *shared)
        if lean is not None:
            response = mb.input_ids.shape[1] - mb.prompt_width
            logits = lean.logits(mb.input_ids, mb.attention_mask, mb.position_ids, response + 1)
            return logits, mb.prompt_width - 1
        kwargs: dict[str, Any] = {}
        start = 0
        if self.keep_kwarg is not None:
            response = mb.input_ids.shape[1] - mb.prompt_width
            kwargs[self.keep_kwarg] = response + 1
            start = mb.prompt_width - 1
        out = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
            **kwargs,
        )
        return out.logits, start

    def _lean_for(self, model: torch.nn.Module) -> LeanForward | None:
        """The lean forward of ``model`` (the DeepSpeed engine stands for its module), or
        None: the HF forward (see :func:`~rftstream.training.lean_forward.lean_forward_reason`)."""
        if not self._lean:
            return None
        module = self.engine.module if model is self.engine else model
        return self._lean.get(id(module))

    def _forward_shared(
        self,
        model: torch.nn.Module,
        mb: TrainBatch,
        first: torch.Tensor,
        inverse: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        """:meth:`_response_logits` with each distinct prompt run once (the rows ``first``),
        its KV cache repeated for every row that has it (``inverse``), then the responses
        on top.

        The same logits as the plain forward (attention sees the same keys; the
        gradient of a shared prompt sums over its rows through the repetition), for
        a fraction of the work when a group's ``repeat_times`` rows share one prompt.
        """
        P = mb.prompt_width
        R = mb.input_ids.shape[1] - P
        assert self.keep_kwarg is not None
        prompt = model(
            input_ids=mb.input_ids[first, :P],
            attention_mask=mb.attention_mask[first, :P],
            position_ids=mb.position_ids[first, :P],
            use_cache=True,
            **{self.keep_kwarg: 1},
        )
        logits = prompt.logits[inverse]  # predicts response token 0 of every row
        if R > 1:
            cache = output_cache(prompt)
            cache.batch_select_indices(inverse)
            rest = model(
                input_ids=mb.input_ids[:, P:],
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids[:, P:],
                use_cache=True,
                **{self.cache_kwarg: cache, self.keep_kwarg: R},
            )
            logits = torch.cat([logits, rest.logits[:, : R - 1]], 1)
        return logits, P - 1

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        assert self.critic is not None
        return self.critic(mb.input_ids, mb.attention_mask, mb.position_ids, mb.prompt_width)

    def _no_grad_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """``batch`` in consecutive micro-batches for a no-grad pass (whose outputs are
        concatenated in row order): ``ppo_micro_batch_size_per_gpu`` rows each, or with
        ``use_dynamic_bsz`` as few as fit the token budget, each trimmed to its own
        longest prompt and response."""
        if not self.dynamic_bsz:
            return [batch.rows(idx) for idx in _chunks(batch.size, self.micro)]
        parts = token_budget_partitions(
            batch.prompt_lengths(), batch.response_lengths(), self.token_budget, reorder=False
        )
        return [batch.rows(slice(p[0], p[-1] + 1)).trimmed() for p in parts]

    def _micro_batch(self, batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
        """The gradient pass's micro-batch of ``rows``; with ``use_dynamic_bsz`` trimmed to
        its own longest prompt (and response, unless the loss divides by the width)."""
        mb = batch.rows(rows)
        return mb.trimmed(responses=self.trim_responses) if self.dynamic_bsz else mb

    @torch.no_grad()
    def _no_grad_each(self, fn: Callable[[TrainBatch], _Part], batch: TrainBatch) -> list[_Part]:
        """``fn`` of each no-grad micro-batch of ``batch`` (:meth:`_no_grad_batches`), in
        order; then as many discarded calls as :meth:`_lockstep_extra` says. Blocks."""
        batches = self._no_grad_batches(batch)
        out = [fn(mb) for mb in batches]
        for _ in range(self._lockstep_extra(len(batches))):
            fn(batches[0])  # discarded: keeps this rank's forward calls in step
        return out

    def _no_grad(self, fn: Callable[[TrainBatch], torch.Tensor], batch: TrainBatch) -> torch.Tensor:
        width = batch.response_width
        return torch.cat([_pad_columns(t, width) for t in self._no_grad_each(fn, batch)], 0)

    def _lockstep_extra(self, calls: int) -> int:
        """How many discarded forward calls this rank adds to its ``calls`` so that every
        rank makes as many as the rank that makes most: under ZeRO-3 with several ranks
        (each call gathers the weights, a collective), else 0. Blocks; then a collective
        every rank reaches at the same point of its step."""
        if not self.lockstep_forwards:
            return 0
        most = torch.tensor([calls], device=self.engine.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most.item()) - calls

    @torch.no_grad()
    def _token_stats_no_grad(self, batch: TrainBatch, *, with_nec: bool) -> TokenStats:
        """Log-prob, entropy (and ``nec``) of every response token under the current policy:
        one no-grad pass over ``batch`` in micro-batch chunks. Blocks."""
        stats: TokenStats | None = None
        width = batch.response_width
        batches = self._no_grad_batches(batch)
        for _ in range(self._lockstep_extra(len(batches))):
            first = batches[0]  # see _lockstep_extra
            self._response_logits(self.engine.module, first, self._shares(first))
        for mb in batches:
            logits, start = self._response_logits(self.engine.module, mb, self._shares(mb))
            part = response_token_stats(
                logits,
                mb.input_ids,
                mb.prompt_width,
                self.temperature,
                with_nec=with_nec,
                logits_start=start,
                ban=self._token_ban(mb),
            )

            def columns(t: torch.Tensor | None, mb: TrainBatch = mb) -> torch.Tensor | None:
                return None if t is None else _pad_columns(_zero_padding(t, mb), width)

            part = TokenStats(
                _pad_columns(_zero_padding(part.logprob, mb), width),
                _pad_columns(_zero_padding(part.entropy, mb), width),
                columns(part.nec),
                columns(part.allowed),
            )
            stats = part if stats is None else stats.cat(part)
        assert stats is not None  # collate rejects an empty batch
        return stats

    def _logprobs_no_grad(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        return self._no_grad(lambda mb: self._forward(model, mb, with_entropy=False)[0], batch)

    def _old_logprobs_no_grad(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's log-probs of ``batch`` before the update and, where rows were sampled
        under a ban, its ``log(1 - pi(banned))`` (None without): one no-grad pass, in the
        micro-batches of :meth:`_no_grad_each`. Blocks."""
        if batch.token_ban() is None:
            return self._logprobs_no_grad(self.engine.module, batch), None
        width = batch.response_width
        parts = self._no_grad_each(
            lambda mb: self._forward(self.engine.module, mb, with_entropy=False, banned=True),
            batch,
        )
        logp = torch.cat([_pad_columns(lp, width) for lp, _, _ in parts], 0)
        allowed = torch.cat(
            [
                _pad_columns(a if a is not None else torch.zeros_like(lp), width)
                for lp, _, a in parts
            ],
            0,
        )
        return logp, allowed

    def check_experience(self, exp: Experience) -> str | None:
        """Why ``exp`` cannot be trained on this model, or None. Cheap; no forward pass."""
        vocab = self.vocab_size
        tokens = exp.tokens
        n = int(tokens.numel())
        if not 0 < exp.prompt_length < n:
            return f"experience {exp.eid.uid}: prompt_length {exp.prompt_length} leaves no response in {n} tokens"
        ids = tokens.numpy() if tokens.device.type == "cpu" else tokens.cpu().numpy()
        if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            return f"experience {exp.eid.uid}: token ids outside the model's vocabulary (0..{vocab - 1})"
        return _ban_problem(exp, ids, vocab)

    # ------------------------------------------------------------ step
    def _whole_batch_statistics(self, rank_scale: float) -> contextlib.AbstractContextManager[None]:
        """On several ranks: the advantage fn's whole-tensor statistics (REINFORCE++'s and
        PPO's whitening, :func:`rftstream.training.masked_reductions.whole_batch`) are all-reduced over every
        rank's shard, so they are the whole batch's, as on one rank; a rank training a
        padding copy (``rank_scale`` 0) adds nothing. One rank: no change. Each reduction
        is a collective: every rank makes the same ones (the fns branch on the reduced
        values only)."""
        if self.world_size <= 1:
            return contextlib.nullcontext()
        weight = 1.0 if rank_scale > 0 else 0.0
        device = self.engine.device

        def sum_over_ranks(local: torch.Tensor) -> torch.Tensor:
            total = local.to(device) * weight
            torch.distributed.all_reduce(total)
            return total.cpu()

        return whole_batch(sum_over_ranks)

    def _compute_advantages(
        self,
        exps: list[Experience],
        batch: TrainBatch,
        old_logprob: torch.Tensor | None,
        ref_logprob: torch.Tensor | None,
        values: torch.Tensor | None,
        stats: TokenStats | None = None,
    ) -> dict[str, float]:
        """KL penalty on rewards, then the advantage fn; writes advantages/returns into ``batch``.

        ``stats``: the current policy's per-token statistics, for an advantage fn
        that declares ``trainer_inputs``; each declared input goes to it as one
        tensor per experience over the tokens the batch trains on. An fn that
        ``rewrites_action_mask`` narrows ``batch.response_mask`` with the masks it
        returns.
        """
        metrics: dict[str, float] = {}
        algo = self.algorithm
        if self.kl_penalty:
            assert old_logprob is not None  # never reused with a KL penalty
            if ref_logprob is None:
                raise ConfigError(
                    "algorithm.kl_penalty_fn",
                    f"{algo.name} has no reference model (use_reference False)",
                )
            _, kl_metrics = algo.kl_penalty_fn.apply_kl_penalty_to_reward(
                exps, ref_logprobs=ref_logprob.cpu(), logprobs=old_logprob.cpu()
            )
            metrics.update({f"critic/{k}": float(v) for k, v in kl_metrics.items()})
        kwargs: dict[str, Any] = {}
        if values is not None:
            v = values.detach().cpu()
            kwargs["values"] = [_fit(v[i], e.response_length) for i, e in enumerate(exps)]
        if self.advantage_inputs:
            if stats is None:
                raise RuntimeError(
                    f"advantage_fn {type(algo.advantage_fn).__name__} needs "
                    f"{list(self.advantage_inputs)}, but no token statistics were computed"
                )
            kwargs.update(_advantage_kwargs(self.advantage_inputs, exps, batch, stats))
        exps_out, adv_metrics = algo.advantage_fn(exps, **kwargs)
        if len(exps_out) != len(exps):
            raise RuntimeError(
                f"advantage_fn {type(algo.advantage_fn).__name__} returned {len(exps_out)} of "
                f"{len(exps)} experiences; an advantage computed in the trainer must keep them all"
            )
        # group advantages return their experiences in group order: map back to batch rows
        rows = {id(e): i for i, e in enumerate(exps)}
        by_uid = {e.eid.uid: i for i, e in enumerate(exps)}
        width = batch.response_width
        for e in exps_out:
            i = rows.get(id(e), by_uid.get(e.eid.uid))
            if i is None:
                raise RuntimeError(
                    f"advantage_fn {type(algo.advantage_fn).__name__} returned experience "
                    f"{e.eid.uid}, which is not in the batch"
                )
            batch.advantages[i] = _fit(e.advantages, width).to(batch.advantages.device)
            batch.returns[i] = _fit(e.returns, width).to(batch.returns.device)
            if getattr(algo.advantage_fn, "rewrites_action_mask", False):
                narrowed = _fit(e.action_mask, width).to(batch.response_mask.device)
                batch.response_mask[i] = batch.response_mask[i] * narrowed
        metrics.update({f"advantage/{k}": float(v) for k, v in adv_metrics.items()})
        return metrics

    def _partitions(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The rows of each gradient micro-batch of ``batch``.

        Fixed: exactly ``gas`` micro-batches (some empty when the batch is small),
        balanced by tokens where allowed, else contiguous (DPO pairs together). With
        ``use_dynamic_bsz``: :func:`token_budget_partitions` (longest rows first where
        the algorithm allows reordering; DPO pairs together), then, with several ranks,
        empty ones appended up to the largest count of any rank (a collective), since
        ZeRO 2-3 reduce gradients in every ``backward``.
        """
        if self.dynamic_bsz:
            responses = (
                batch.response_lengths()
                if self.trim_responses
                else [batch.response_width] * batch.size
            )
            parts = token_budget_partitions(
                batch.prompt_lengths(),
                responses,
                self.token_budget,
                unit=self.pair_unit,
                reorder=self.can_reorder,
            )
            parts += [[] for _ in range(self._most_over_ranks(len(parts)) - len(parts))]
        else:
            count = self._fixed_micro_batches(batch.size)
            if self.balance:
                parts = balanced_partitions(batch.attention_mask.sum(1).tolist(), count)
            else:
                parts = contiguous_partitions(batch.size, count, self.pair_unit)
        return [torch.tensor(p, dtype=torch.long) for p in parts]

    def _fixed_micro_batches(self, rows: int) -> int:
        """Micro-batches of a step of ``rows`` rows outside ``use_dynamic_bsz``: ``gas``, or
        as many more as keep each at ``ppo_micro_batch_size_per_gpu`` rows (DPO: pairs) at
        most, a memory bound, when the batch is larger than ``train_batch_size`` (a rank
        whose shard of whole groups is larger than its even share). With several ranks,
        the most any rank needs (a collective: every rank makes as many passes, and so
        trains its rows in the micro-batches the one-rank run would)."""
        if self.verl_scaling is not None:
            return self.gas  # the loss weights its micro-batches by verl's own arithmetic
        per = max(self.pair_unit, self.micro - self.micro % self.pair_unit)
        return self._most_over_ranks(max(self.gas, math.ceil(rows / per)))

    def _most_over_ranks(self, count: int) -> int:
        """The largest ``count`` of any rank (a collective with several ranks; ``count``
        itself on one)."""
        if self.world_size == 1:
            return count
        most = torch.tensor([count], device=self.engine.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most.item())

    def _clipping_outside_deepspeed(
        self, ds_config: dict[str, Any], params: list[torch.nn.Parameter]
    ) -> _GradientClipping | None:
        """Take gradient clipping out of ``ds_config`` where DeepSpeed's own is a plain norm
        clip (one rank, ZeRO 0, fp32): there DeepSpeed computes the norm parameter by
        parameter in Python and all-reduces it over its one rank, about 0.7 ms a step on
        a small model, and does not report it; torch's multi-tensor
        ``clip_grad_norm_`` is the same arithmetic (``max_norm / (norm + 1e-6)`` when
        below 1) in a few calls, and its norm is logged as ``actor/grad_norm``. None
        (DeepSpeed clips) with several ranks, ZeRO 1-3, bf16/fp16 or no clipping."""
        max_norm = float(ds_config.get("gradient_clipping") or 0.0)
        if max_norm <= 0 or not _zero0_full_precision(ds_config) or self.world_size != 1:
            return None
        ds_config["gradient_clipping"] = 0.0
        return _GradientClipping(max_norm, params)

    def _optimizer_step(self, engine: Any) -> None:
        """``engine.step()``, first clipping the gradients at the accumulation boundary where
        clipping is done here (:meth:`_clipping_outside_deepspeed`). Blocks."""
        clipping = self._own_clipping.get(id(engine))
        if clipping is not None and (
            # unmanaged accumulation (use_dynamic_bsz): every step() is the boundary
            not engine.managed_gradient_accumulation() or engine.is_gradient_accumulation_boundary()
        ):
            norm = torch.nn.utils.clip_grad_norm_(clipping.params, clipping.max_norm, foreach=True)
            clipping.last_norm = float(norm)
        engine.step()

    def _mark_boundary(self, is_boundary: bool) -> None:
        """Tell the engines whether the next pass ends the optimizer step (fixed micro-batch
        counts: :meth:`_fixed_micro_batches` may exceed ``gas``, DeepSpeed's own count)."""
        for engine in (self.engine, self.critic):
            if engine is not None:
                engine.set_gradient_accumulation_boundary(is_boundary)

    def train_step(self, exps: list[Experience], *, rank_scale: float = 1.0) -> dict[str, float]:
        """One trainer step on ``exps`` (``ppo_epochs`` optimizer steps, then one step of the
        lr schedules); returns averaged metrics. Blocks; with several ranks a collective.

        ``rank_scale``: this rank's factor on its losses, ``world_size * len(exps) /
        global batch rows`` when ``exps`` is one rank's shard (see
        :mod:`rftstream.training.ranks`); 1 on a single rank."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        step_lr = float(groups[0]["lr"]) if groups else None
        mp = self.cfg.model
        # a Trinity-style strategy returns Experiences.gather_experiences(..., custom_fields=...)
        custom = list(self.custom_fields)
        known = {cf.destination_field for cf in custom}
        custom += [
            cf for cf in getattr(exps, "custom_fields", ()) if cf.destination_field not in known
        ]
        batch = collate(
            exps,
            self.pad_token_id,
            max_prompt=mp.max_prompt_tokens,
            max_response=mp.max_response_tokens,
            custom_fields=custom,
            temperature=self.temperature,
        )
        batch = batch.to(self.engine.device)
        self.engine.eval()  # the no-grad passes see no dropout
        stats = None
        if self.advantage_inputs:
            # the advantage fn needs the policy's entropies before the gradient pass: one
            # no-grad pass gives them, and the old log-probs with them
            stats = self._token_stats_no_grad(batch, with_nec="nec" in self.advantage_inputs)
        # None: the gradient pass's own detached log-probs serve (see _old_logprob_is_redundant)
        old_logprob = None
        # where rows were sampled under a ban: the policy's log(1 - pi(banned)) before the
        # update (see TrainBatch.behaviour_logprobs); the reused pass computes its own
        old_allowed = None
        if not self.reuse_old_logprob:
            if stats is not None:
                old_logprob, old_allowed = stats.logprob, stats.allowed
            else:
                old_logprob, old_allowed = self._old_logprobs_no_grad(batch)
        ref_logprob = (
            self._logprobs_no_grad(self.ref_model, batch) if self.ref_model is not None else None
        )
        values = None
        if self.critic is not None:
            self.critic.eval()
            values = self._no_grad(self._values, batch)
        out: dict[str, float] = {}
        if self.advantage_in_trainer:
            with self._whole_batch_statistics(rank_scale):
                out.update(
                    self._compute_advantages(exps, batch, old_logprob, ref_logprob, values, stats)
                )
        self.engine.train()
        if self.critic is not None:
            self.critic.train()
        metrics: dict[str, list[float]] = defaultdict(list)
        # fixed: exactly `gas` micro-batches per optimizer step (DeepSpeed's accumulation
        # boundary); use_dynamic_bsz: any number, then one step() (unmanaged accumulation)
        splits = self._partitions(batch)
        sizes = [self._micro_batch(batch, p).input_ids.numel() for p in splits if p.numel()]
        out["actor/micro_batches"] = float(len(sizes))
        out["actor/micro_batch_max_tokens"] = float(max(sizes, default=0))
        loss_sum, loss_rows = 0.0, 0
        if self.balance and not self.dynamic_bsz and len(splits) > 1:
            tokens = [float(batch.attention_mask[p].sum()) for p in splits]
            out["actor/micro_batch_token_spread"] = (max(tokens) - min(tokens)) / max(
                1.0, max(tokens)
            )
        for _epoch in range(max(1, self.cfg.trainer.ppo_epochs)):
            for index, rows in enumerate(splits):
                if not self.dynamic_bsz:
                    self._mark_boundary(index == len(splits) - 1)
                if rows.numel() == 0:
                    # fewer rows than micro-batches (or than another rank's): a pass that
                    # adds nothing keeps DeepSpeed (and the other ranks' reductions) in step
                    self._padding_micro_step(batch, old_logprob, ref_logprob, values)
                    continue
                rows = rows.to(batch.input_ids.device)
                # rows-weighted mean over the micro-batches (DeepSpeed divides by gas)
                weight = rows.numel() * self.gas / batch.size
                loss = self._actor_micro_step(
                    batch, rows, old_logprob, ref_logprob, values, metrics, old_allowed
                )
                self.engine.backward(loss * (self._actor_weight(rows.numel(), weight) * rank_scale))
                if not self.dynamic_bsz:
                    self._optimizer_step(self.engine)
                loss_sum += float(loss.detach()) * rows.numel()
                loss_rows += rows.numel()
                if self.critic is not None and values is not None:
                    vloss, vmetrics = self._critic_micro_step(batch, rows, values)
                    self.critic.backward(vloss * (weight * rank_scale))
                    if not self.dynamic_bsz:
                        self._optimizer_step(self.critic)
                    for k, v in vmetrics.items():
                        metrics[f"critic/{k}"].append(v)
            if self.dynamic_bsz:  # the epoch's one accumulation boundary
                for engine in (self.engine, self.critic):
                    if engine is not None:
                        self._optimizer_step(engine)
        self.global_step += 1
        for scheduler in (self.scheduler, self.critic_scheduler):
            if scheduler is not None:
                scheduler.step()  # the next trainer step's lr
        out.update({k: sum(v) / len(v) for k, v in metrics.items() if v})
        if loss_rows:
            out["actor/loss"] = loss_sum / loss_rows  # rows-weighted, as the gradient
        clipping = self._own_clipping.get(id(self.engine))
        gn = clipping.last_norm if clipping is not None else self.engine.get_global_grad_norm()
        if gn is not None:
            out["actor/grad_norm"] = float(gn)
        if step_lr is not None:
            out["actor/lr"] = step_lr  # the lr this step trained with (as verl logs it)
        if (
            self.kl_loss
            and self.ref_model is not None
            and hasattr(self.algorithm.kl_loss_fn, "kl_coef")
        ):
            out["actor/kl_coef"] = float(self.algorithm.kl_loss_fn.kl_coef)
        mask = batch.response_mask
        out["response_length/mean"] = float(mask.sum(1).mean())
        out["time/train_step"] = time.perf_counter() - t0
        out["time/train_step_cpu"] = time.thread_time() - cpu0  # this thread's CPU time
        return out

    def _critic_micro_step(
        self, batch: TrainBatch, rows: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's value loss on ``rows`` of ``batch`` (clipped around the no-grad
        ``values``) and its metrics; the caller scales and back-propagates it."""
        mb = self._micro_batch(batch, rows)
        critic = self.cfg.trainer.critic
        return value_loss(
            self._values(mb),
            mb.returns,
            values[rows][:, : mb.response_width],
            mb.response_mask,
            critic.cliprange_value,
            critic.loss_agg_mode,
        )

    def _padding_micro_step(
        self,
        batch: TrainBatch,
        old_logprob: torch.Tensor | None,
        ref_logprob: torch.Tensor | None,
        values: torch.Tensor | None,
    ) -> None:
        """A micro-step that adds exactly zero to the gradients: the real losses of the
        batch's first row (a DPO pair: its first pair), times 0, backpropagated (and
        stepped, outside ``use_dynamic_bsz``) through the actor and the critic. Its
        metrics are dropped. Blocks; with several ranks a collective.

        Why a real pass rather than ``sum(p) * 0``: under ZeRO-2 each ``backward`` reduces
        the gradients in one flat bucket in the order their hooks fire, and that order
        must be the same on every rank (DeepSpeed pairs the ranks' buckets by position);
        a sum over the parameters fires them in another order than the model's
        backward, so a rank padding its micro-batches while another trained mixed up
        the parameters' gradients. Under ZeRO-3 the parameters are partitions outside a
        forward pass, which such a sum cannot differentiate at all. A forward of the
        model gathers the parameters and fires the hooks as every other pass does.
        """
        rows = torch.arange(self.pair_unit, device=batch.input_ids.device)
        unused: dict[str, list[float]] = defaultdict(list)
        loss = self._actor_micro_step(batch, rows, old_logprob, ref_logprob, values, unused)
        self.engine.backward(loss * 0.0)
        if not self.dynamic_bsz:
            self._optimizer_step(self.engine)
        if self.critic is not None and values is not None:  # as a training micro-step
            vloss, _ = self._critic_micro_step(batch, rows, values)
            self.critic.backward(vloss * 0.0)
            if not self.dynamic_bsz:
                self._optimizer_step(self.critic)

    def _actor_weight(self, rows: int, rows_weight: float) -> float:
        """The factor on one micro-batch's actor loss before DeepSpeed divides it by ``gas``.

        A loss that weights its micro-batches itself, verl-style (see
        :class:`~rftstream.config.resolve.VerlBatchShape`), gets verl's scaling: ``1 /
        gradient_accumulation`` of its own batch arithmetic, or ``rows /
        ppo_mini_batch_size_per_gpu`` with ``use_dynamic_bsz``. Every other
        loss returns a per-micro-batch mean and gets ``rows_weight``
        (a rows-weighted mean over the step).
        """
        shape = self.verl_scaling
        if shape is None:
            return rows_weight
        if shape.use_dynamic_bsz:
            return self.gas * rows / shape.mini_per_gpu
        return self.gas / shape.gradient_accumulation

    def _actor_micro_step(
        self,
        batch: TrainBatch,
        rows: torch.Tensor,
        old_logprob: torch.Tensor | None,
        ref_logprob: torch.Tensor | None,
        values: torch.Tensor | None,
        metrics: dict[str, list[float]],
        old_allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Policy + KL + entropy loss of one micro-batch (not yet backpropagated).

        ``old_allowed``: with ``old_logprob``, the policy's ``log(1 - pi(banned))`` before
        the update where rows were sampled under a ban (None: none, or ``old_logprob`` is
        None and this pass measures it); the loss's ``rollout_logprob`` is
        :meth:`TrainBatch.behaviour_logprobs` of it."""
        algo = self.algorithm
        mb = self._micro_batch(batch, rows)
        width = mb.response_width  # trimmed with use_dynamic_bsz: the first columns

        def sub(t: torch.Tensor) -> torch.Tensor:
            return t[rows][:, :width]

        banned = old_logprob is None and mb.token_ban() is not None
        logprob, entropy, allowed = self._forward(self.engine, mb, with_entropy=True, banned=banned)
        if old_logprob is not None and old_allowed is not None:
            allowed = sub(old_allowed)
        if entropy is not None and not self.entropy_grad:
            entropy = entropy.detach()  # reported only: no B x R x V graph kept for it
        ref_mb = sub(ref_logprob) if ref_logprob is not None else None
        tensors: dict[str, torch.Tensor] = {
            "logprob": logprob,
            "old_logprob": logprob.detach() if old_logprob is None else sub(old_logprob),
            "ref_logprob": ref_mb if ref_mb is not None else torch.zeros_like(logprob),
            "action_mask": mb.response_mask,
            "advantages": mb.advantages,
            "returns": mb.returns,
            "rollout_logprob": mb.behaviour_logprobs(allowed),
            "rollout_logprob_mask": mb.rollout_logprob_mask,
            **mb.fields,
        }
        if entropy is not None:
            tensors["entropy"] = entropy
        if values is not None:
            tensors["values"] = sub(values)
        missing = [n for n in self.loss_inputs if n not in tensors]
        if missing:
            raise RuntimeError(
                f"{type(algo.policy_loss_fn).__name__} needs field {missing[0]!r}, which the "
                f"sample strategy declared but this batch lacks; batch fields: {sorted(tensors)}"
            )
        pg_loss, pg_metrics = algo.policy_loss_fn(**{n: tensors[n] for n in self.loss_inputs})
        loss = pg_loss
        for k, v in pg_metrics.items():
            metrics[f"actor/{k}"].append(float(v))
        if ref_mb is not None and self.kl_loss:
            kl_loss, kl_metrics = algo.kl_loss_fn.calculate_kl_loss(
                logprob,
                ref_mb,
                mb.response_mask,
                self.loss_agg_mode,
                old_logprob=tensors["old_logprob"],
            )
            loss = loss + kl_loss
            for k, v in kl_metrics.items():
                metrics[f"actor/{k}"].append(float(v))
        if entropy is not None and algo.entropy_loss_fn is not None:
            extra = {n: tensors[n] for n in self.entropy_inputs if n in tensors}
            if self.entropy_var_kw:
                extra.update(mb.fields)
            ent_loss, ent_metrics = algo.entropy_loss_fn(
                entropy=entropy,
                action_mask=mb.response_mask,
                loss_agg_mode=self.loss_agg_mode,
                **extra,
            )
            loss = loss - ent_loss  # Trinity-RFT's convention: the fn returns the bonus
            for k, v in ent_metrics.items():
                metrics[f"actor/{k}"].append(float(v))
            denom = mb.response_mask.sum().clamp(min=1)
            metrics["actor/entropy"].append(
                float((entropy.detach() * mb.response_mask).sum() / denom)
            )
        return loss

    # ------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current policy weights, whole (ZeRO-3 partitions gathered), as detached CPU
        copies; with LoRA the plain model's weights, adapter merged (explorers need no
        peft). Blocks; under ZeRO-3 a collective: every rank must call it."""
        state = full_state_dict(self.engine.module)
        return self.lora.merged(state) if self.lora is not None else state

    def wire_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """What ``sync_method: jetstream`` sends explorers: the policy's whole weights as
        ``dtype`` CPU copies (converted in the one copy), tied aliases left out (engines
        tie them again); with LoRA the adapter alone, in float32, named
        ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight`` (see :meth:`lora_wire`).
        Blocks; under ZeRO-3 a collective: every rank must call it."""
        if self.lora is not None:
            adapter = full_state_dict(self.engine.module, include=lambda k: ".lora_" in k)
            return self.lora.adapter_state(adapter)
        state = full_state_dict(self.engine.module, dtype=dtype)
        for key in tied_aliases(self.engine.module):
            state.pop(key, None)
        return state

    def lora_wire(self) -> LoraWire | None:
        """With LoRA, the adapted layers and their scalings explorers merge with; else None."""
        if self.lora is None:
            return None
        from rftstream.weights.codec import LoraWire

        base = next(p for p in self.engine.module.parameters() if not p.requires_grad)
        return LoraWire(
            layers=dict(self.lora.layers), base_dtype=str(base.dtype).removeprefix("torch.")
        )

    def critic_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The critic's weights (backbone and ``value_head``), whole, as detached CPU copies;
        None without a critic. Blocks; under ZeRO-3 a collective: every rank must call it."""
        return None if self.critic is None else full_state_dict(self.critic.module)

    def save_hf_checkpoint(self, path: str | Path) -> Path:
        """Write an HF-format (safetensors) checkpoint ``transformers`` can load: the whole
        policy weights of :meth:`state_dict` (gathered under ZeRO-3; with LoRA merged, and
        the adapter alone in ``lora_adapter/``). Blocks; under ZeRO-3 a collective (every
        rank gathers; rank 0 alone writes). Returns ``path``."""
        path = Path(path)
        raw = full_state_dict(self.engine.module)  # peft's names with LoRA
        if _rank() != 0:
            return path
        tmp = path.with_name(path.name + ".tmp")
        with quiet_progress_bars():
            if self.lora is not None:
                self.lora.save(tmp, raw)
            else:
                # tied weights once, as save_pretrained writes them (copies hide the tie)
                for key in tied_aliases(self.engine.module):
                    raw.pop(key, None)
                self.engine.module.save_pretrained(tmp, state_dict=raw, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
        return path


def _accelerator_name() -> str:
    """The device name of DeepSpeed's accelerator (``cpu``, ``cuda``, ...); DeepSpeed is
    imported already (by :class:`PolicyTrainer`)."""
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().device_name())


def _rank() -> int:
    """This process's rank in the default process group (0 when there is none)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _advantage_inputs(algorithm: ResolvedAlgorithmProtocol) -> tuple[str, ...]:
    """The token statistics the algorithm's advantage fn declares (``trainer_inputs``), sorted.

    Raises:
        ConfigError: at ``algorithm.advantage_fn`` for a name the trainer cannot compute.
    """
    declared = set(getattr(algorithm.advantage_fn, "trainer_inputs", ()) or ())
    unknown = sorted(declared - TRAINER_ADVANTAGE_INPUTS)
    if unknown:
        raise ConfigError(
            "algorithm.advantage_fn",
            f"{type(algorithm.advantage_fn).__name__} declares trainer_inputs {unknown}, which "
            f"the trainer does not compute (it computes {sorted(TRAINER_ADVANTAGE_INPUTS)})",
            value=algorithm.config.advantage_fn,
        )
    return tuple(sorted(declared))


def _ban_problem(exp: Experience, ids: Any, vocab: int) -> str | None:
    """Why ``exp``'s ban (``banned_ids`` where ``allowed_logprobs`` < 0) cannot be trained,
    or None: ids outside the vocabulary or repeated, or a response token drawn where its
    own id was banned (its banned-distribution log-prob would be -inf)."""
    allowed = array_numpy(exp, "allowed_logprobs")  # no tensor made off the wire
    banned = array_numpy(exp, "banned_ids")
    if allowed is None or banned is None or banned.size == 0:
        return None
    uid = exp.eid.uid
    if int(banned.min()) < 0 or int(banned.max()) >= vocab:
        return f"experience {uid}: banned_ids outside the model's vocabulary (0..{vocab - 1})"
    banned_set = set(banned.tolist())
    if len(banned_set) != banned.size:
        return f"experience {uid}: banned_ids repeats an id ({banned.tolist()})"
    response = ids[exp.prompt_length :]
    at = allowed[: response.shape[0]] < 0
    drawn = set(response[: at.shape[0]][at].tolist()) & banned_set
    if drawn:
        return (
            f"experience {uid}: response tokens {sorted(drawn)} were drawn where "
            "allowed_logprobs says they were banned"
        )
    return None


def _advantage_kwargs(
    names: tuple[str, ...], exps: list[Experience], batch: TrainBatch, stats: TokenStats
) -> dict[str, list[torch.Tensor]]:
    """One CPU float32 tensor per experience for each of ``names``, over the tokens the
    batch holds of its response (``min(response length, batch response width)``)."""
    rollout = None
    if "rollout_logprob" in names:
        have = batch.rollout_logprob_mask > 0
        rollout = torch.where(have, batch.behaviour_logprobs(stats.allowed), stats.logprob)
    full = {
        "old_logprob": stats.logprob,
        "entropy": stats.entropy,
        "nec": stats.nec,
        "rollout_logprob": rollout,
    }
    width = batch.response_width
    out: dict[str, list[torch.Tensor]] = {}
    for name in names:
        t = full[name]
        assert t is not None, name  # nec is computed whenever it is declared
        t = t.detach().to(device="cpu", dtype=torch.float32)
        out[name] = [t[i, : min(e.response_length, width)].clone() for i, e in enumerate(exps)]
    return out


def _fit(t: torch.Tensor | None, n: int) -> torch.Tensor:
    """``t`` as float32 of length ``n``: cut, or zero-padded (None: zeros)."""
    out = torch.zeros(n, dtype=torch.float32)
    if t is not None:
        m = min(n, int(t.numel()))
        out[:m] = t.reshape(-1)[:m].to(torch.float32).cpu()
    return out


def _zero_padding(t: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """``t`` [B, R] (one value per response column of ``mb``) with zeros where a row has
    no response token, as :meth:`LeanForward.shared_token_logprobs` leaves them."""
    return t.masked_fill(mb.attention_mask[:, mb.prompt_width :] == 0, 0.0)


def _shared_prompts(mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, inverse)`` when rows of ``mb`` share prompts: ``first[k]`` is a row with the
    k-th distinct (left-padded) prompt, ``inverse[i]`` the prompt of row ``i``; None when
    every prompt is distinct (nothing to share)."""
    prompts = mb.input_ids[:, : mb.prompt_width]
    distinct, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    if distinct.shape[0] == prompts.shape[0]:
        return None
    rows = torch.arange(prompts.shape[0], device=prompts.device)
    first = torch.empty(distinct.shape[0], dtype=torch.long, device=prompts.device)
    first.scatter_(0, inverse, rows)
    return first, inverse


def _has_active_dropout(module: torch.nn.Module) -> bool:
    """Whether a training-mode forward pass of ``module`` would drop anything: a
    ``Dropout`` module with ``p > 0``, or a ``*dropout*`` / ``*pdrop*`` probability
    above 0 in its ``config`` (transformers' attention dropout is functional)."""
    if any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()
    ):
        return True
    config = getattr(module, "config", None)
    for key, value in (vars(config) if config is not None else {}).items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
            return True
    return False


def _entropy_extra_inputs(fn: Any) -> tuple[set[str], bool]:
    """(batch tensors an entropy fn names besides ``entropy``/``action_mask``, takes ``**kwargs``).

    The trainer passes the named ones, and every custom field (``expert_mask``,
    ...) to a fn that takes ``**kwargs``.
    """
    import inspect

    if fn is None:
        return set(), False
    params = inspect.signature(type(fn).__call__).parameters
    fixed = {"self", "entropy", "action_mask", "loss_agg_mode"}
    named = {
        n
        for n, p in params.items()
        if n not in fixed and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return named | set(getattr(fn, "required_fields", ()) or ()), var_kw


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (``[B, w]``, ``w <= width``) right-padded with zeros to ``width`` columns."""
    missing = width - t.shape[1]
    return t if missing <= 0 else torch.nn.functional.pad(t, (0, missing))


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _enabled(ds_config: dict[str, Any], section: str) -> bool:
    """Whether ``ds_config[section]`` (``{"enabled": ...}``, or a bare flag) is on."""
    value = ds_config.get(section) or {}
    return bool(value.get("enabled", False)) if isinstance(value, dict) else bool(value)


def _zero0_full_precision(ds_config: dict[str, Any]) -> bool:
    """Whether DeepSpeed, with ``ds_config``, runs ZeRO stage 0 with neither bf16 nor fp16:
    it then steps the client optimizer as given (stages 1-3 wrap it and accept only the
    optimizer classes they know; the half-precision wrappers were not tried with
    :class:`EagerAdamW`), and its gradient clipping is a plain norm clip."""
    zero = ds_config.get("zero_optimization") or {}
    stage = int((zero.get("stage", 0) if isinstance(zero, dict) else 0) or 0)
    return stage == 0 and not _enabled(ds_config, "bf16") and not _enabled(ds_config, "fp16")


def _steps_optimizer_as_given(ds_config: dict[str, Any]) -> bool:
    """Whether DeepSpeed, with ``ds_config``, steps the client optimizer itself, where
    :class:`EagerAdamW` serves: ZeRO 0 in full precision (:func:`_zero0_full_precision`),
    no ``amp``."""
    return _zero0_full_precision(ds_config) and not _enabled(ds_config, "amp")


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
