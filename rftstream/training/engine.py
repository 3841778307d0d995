"""The DeepSpeed policy trainer: one RL step on a batch of experiences.

Everything here blocks (forward/backward passes): the trainer actor calls
:meth:`PolicyTrainer.train_step` through ``anyio.to_thread.run_sync``.

For a single-process run on CPU, DeepSpeed needs ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; they are set here
when absent (a multi-rank launch sets its own).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rftstream.bus.server import free_port
from rftstream.config.schema import Config
from rftstream.errors import ConfigError
from rftstream.experience import Experience
from rftstream.training.batch import TrainBatch, collate, response_logprobs

log = logging.getLogger(__name__)


def ensure_dist_env() -> None:
    """Set the torch.distributed env of a single-process group if it is not set."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


class PolicyTrainer:
    """Actor model (DeepSpeed engine), frozen reference model and the algorithm's losses."""

    def __init__(self, cfg: Config, model_path: str, algorithm: Any) -> None:
        ensure_dist_env()
        import deepspeed  # heavy import: only where training happens

        from algorithms import loss_inputs_for
        from rftstream.hf import HF_LOAD_LOCK, load_causal_lm, load_tokenizer

        self.cfg = cfg
        self.algorithm = algorithm
        self.temperature = float(cfg.buffer.explorer_input.taskset.rollout_args.temperature or 1.0)
        self.loss_agg_mode = algorithm.config.loss_agg_mode or "token-mean"
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        model = load_causal_lm(model_path, cfg.model.dtype)
        model.config.use_cache = False
        self.needs_ref = (
            bool(algorithm.use_reference) and (algorithm.config.kl_loss_fn or "none") != "none"
        )
        self.ref_model = None
        if self.needs_ref:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.loss_inputs = loss_inputs_for(algorithm.policy_loss_fn)
        available = {
            "logprob",
            "old_logprob",
            "ref_logprob",
            "action_mask",
            "advantages",
            "returns",
            "entropy",
            "expert_mask",
            "rollout_logprob",
        }
        missing = [n for n in self.loss_inputs if n not in available]
        if missing:
            raise ConfigError(
                "algorithm.policy_loss_fn",
                f"{type(algorithm.policy_loss_fn).__name__} needs {missing} which no experience field provides "
                f"(available: {sorted(available)})",
            )
        opt_cfg = cfg.algorithm.optimizer
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=opt_cfg.lr,
            betas=(opt_cfg.betas[0], opt_cfg.betas[1]),
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
        )
        self.micro = max(1, cfg.trainer.ppo_micro_batch_size_per_gpu)
        self.train_batch_size = max(1, cfg.buffer.train_batch_size)
        self.gas = max(1, math.ceil(self.train_batch_size / self.micro))
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": cfg.trainer.grad_clip,
            "zero_optimization": {"stage": cfg.trainer.zero_stage},
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        ds_config = _deep_merge(ds_config, cfg.trainer.deepspeed_config)
        warmup = opt_cfg.lr_warmup_steps
        scheduler = None
        if warmup > 0:
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: min(1.0, (s + 1) / warmup)
            )
        with HF_LOAD_LOCK:  # DeepSpeed moves the module; keep it apart from concurrent loads
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
            )
        if self.ref_model is not None:
            self.ref_model.to(self.engine.device)
        self.global_step = 0

    # ------------------------------------------------------------ forward
    def _forward(
        self, model: torch.nn.Module, mb: TrainBatch, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
        )
        return response_logprobs(
            out.logits, mb.input_ids, mb.prompt_width, self.temperature, with_entropy=with_entropy
        )

    @torch.no_grad()
    def _logprobs_no_grad(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        chunks = []
        for idx in _chunks(batch.size, self.micro):
            lp, _ = self._forward(model, batch.rows(idx), with_entropy=False)
            chunks.append(lp)
        return torch.cat(chunks, 0)

    def check_experience(self, exp: Experience) -> str | None:
        """Why ``exp`` cannot be trained on this model, or None. Cheap; no forward pass."""
        vocab = int(self.engine.module.get_input_embeddings().weight.shape[0])
        n = int(exp.tokens.numel())
        if not 0 < exp.prompt_length < n:
            return f"experience {exp.eid.uid}: prompt_length {exp.prompt_length} leaves no response in {n} tokens"
        if n and (int(exp.tokens.min()) < 0 or int(exp.tokens.max()) >= vocab):
            return f"experience {exp.eid.uid}: token ids outside the model's vocabulary (0..{vocab - 1})"
        return None

    # ------------------------------------------------------------ step
    def train_step(self, exps: list[Experience]) -> dict[str, float]:
        """One optimizer step on ``exps``; returns averaged metrics. Blocks."""
        t0 = time.perf_counter()
        mp = self.cfg.model
        batch = collate(
            exps,
            self.pad_token_id,
            max_prompt=mp.max_prompt_tokens,
            max_response=mp.max_response_tokens,
        )
        batch = batch.to(self.engine.device)
        self.engine.eval()  # the no-grad passes see no dropout
        old_logprob = self._logprobs_no_grad(self.engine.module, batch)
        ref_logprob = (
            self._logprobs_no_grad(self.ref_model, batch) if self.ref_model is not None else None
        )
        self.engine.train()
        metrics: dict[str, list[float]] = defaultdict(list)
        # exactly `gas` micro-batches per optimizer step (DeepSpeed's accumulation boundary)
        splits = torch.arange(batch.size).tensor_split(self.gas)
        for _epoch in range(max(1, self.cfg.trainer.ppo_epochs)):
            for rows in splits:
                if (
                    rows.numel() == 0
                ):  # fewer rows than micro-batches: a zero-gradient pass keeps DeepSpeed in step
                    zero = (
                        sum(p.sum() for p in self.engine.module.parameters() if p.requires_grad)
                        * 0.0
                    )
                    self.engine.backward(zero)
                    self.engine.step()
                    continue
                mb = batch.rows(rows)
                logprob, entropy = self._forward(self.engine, mb, with_entropy=True)
                tensors = {
                    "logprob": logprob,
                    "old_logprob": old_logprob[rows],
                    "ref_logprob": ref_logprob[rows]
                    if ref_logprob is not None
                    else torch.zeros_like(logprob),
                    "action_mask": mb.response_mask,
                    "advantages": mb.advantages,
                    "returns": mb.returns,
                    "entropy": entropy,
                    "rollout_logprob": mb.rollout_logprobs,
                    **mb.fields,
                }
                pg_loss, pg_metrics = self.algorithm.policy_loss_fn(
                    **{n: tensors[n] for n in self.loss_inputs}
                )
                loss = pg_loss
                for k, v in pg_metrics.items():
                    metrics[f"actor/{k}"].append(float(v))
                if ref_logprob is not None:
                    kl_loss, kl_metrics = self.algorithm.kl_loss_fn.calculate_kl_loss(
                        logprob,
                        tensors["ref_logprob"],
                        mb.response_mask,
                        self.loss_agg_mode,
                        old_logprob=tensors["old_logprob"],
                    )
                    loss = loss + kl_loss
                    for k, v in kl_metrics.items():
                        metrics[f"actor/{k}"].append(float(v))
                if entropy is not None and self.algorithm.entropy_loss_fn is not None:
                    ent_loss, ent_metrics = self.algorithm.entropy_loss_fn(
                        entropy=entropy,
                        action_mask=mb.response_mask,
                        loss_agg_mode=self.loss_agg_mode,
                    )
                    loss = loss + ent_loss
                    for k, v in ent_metrics.items():
                        metrics[f"actor/{k}"].append(float(v))
                    denom = mb.response_mask.sum().clamp(min=1)
                    metrics["actor/entropy"].append(
                        float((entropy.detach() * mb.response_mask).sum() / denom)
                    )
                # rows-weighted mean over micro-batches (DeepSpeed divides by gas)
                weight = rows.numel() * self.gas / batch.size
                self.engine.backward(loss * weight)
                self.engine.step()
                metrics["actor/loss"].append(float(loss.detach()))
        self.global_step += 1
        out = {k: sum(v) / len(v) for k, v in metrics.items() if v}
        gn = self.engine.get_global_grad_norm()
        if gn is not None:
            out["actor/grad_norm"] = float(gn)
        lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []
        if lrs:
            out["actor/lr"] = float(lrs[0])
        mask = batch.response_mask
        out["response_length/mean"] = float(mask.sum(1).mean())
        out["time/train_step"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current policy weights (CPU, detached copies)."""
        from rftstream.weights import snapshot

        return snapshot(self.engine.module.state_dict())

    def save_hf_checkpoint(self, path: str | Path) -> Path:
        """Write an HF-format (safetensors) checkpoint ``transformers`` can load. Blocks."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        self.engine.module.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
        return path


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
