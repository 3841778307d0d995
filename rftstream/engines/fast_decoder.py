"""A lean, inference-only forward pass for Llama-family decoders, for the transformers engine.

``transformers`` spends several milliseconds of Python per forward pass on
decorators, mask builders, cache objects and output records; for the small
models a CPU runs (and for short decode steps anywhere) that overhead, not
arithmetic, is what sampling costs. :class:`FastDecoder` runs the same
computation as ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` /
``MistralForCausalLM`` with a few dozen tensor operations per step, on the HF
module's own parameters (nothing is copied except the fused projection
weights, rebuilt by :meth:`FastDecoder.refresh` after a weight load), with a
preallocated KV cache (vLLM does the same with its own model code).

What it computes, per layer: RMSNorm, fused q/k/v projection (with Qwen2's
biases), rotary embedding from the model's own ``inv_freq`` and
``attention_scaling``, attention through ``scaled_dot_product_attention``
(grouped-query heads), output projection, residual, RMSNorm, fused gate/up
projection, SiLU, down projection, residual; then the final norm and the LM
head on the last position only. Logits match the HF forward to floating-point
rounding (the tests check 1e-5 on float32).

:func:`fast_decoder_for` returns None (the caller keeps the HF path) for any
model it does not cover exactly: other architectures, sliding-window or
non-full attention layers, activations other than SiLU, RoPE variants whose
frequencies change with the sequence length, or a model in training mode.

Pure tensor code, no I/O; every call blocks (run it in a worker thread).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "DecodeSession",
    "FastDecoder",
    "apply_rope",
    "architecture_reason",
    "config_reason",
    "fast_decoder_for",
    "rms_norm",
    "rope_parameters",
    "rope_tables",
    "unsupported_reason",
]

SUPPORTED_TYPES = ("qwen2", "llama", "mistral")
STATIC_ROPE = ("default", "linear", "llama3")


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`FastDecoder` cannot run ``model`` exactly, or None if it can."""
    reason = architecture_reason(model)
    if reason is None and model.training:
        return "model in training mode"
    return reason


def architecture_reason(model: Any) -> str | None:
    """Why the lean forward passes (this module's, and the trainer's
    :mod:`rftstream.training.lean_forward`) cannot compute ``model``'s forward exactly, or
    None: the architecture and its configuration only, not the mode or the dtype."""
    reason = config_reason(getattr(model, "config", None))
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE:
        return f"rope_type {rotary.rope_type!r} (frequencies depend on the length)"
    return None


def config_reason(cfg: Any) -> str | None:
    """:func:`architecture_reason` from a model's config alone (the rotary embedding's
    type read from ``rope_parameters``, or ``rope_scaling`` before transformers 5)."""
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    if mtype == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "MLP bias / tensor-parallel pretraining layout"
    rope_type, _ = rope_parameters(cfg)
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} (frequencies depend on the length)"
    return None


def rope_parameters(cfg: Any) -> tuple[str, dict[str, Any]]:
    """``(rope_type, parameters)`` of a model config: its ``rope_parameters`` (transformers
    5), or its ``rope_scaling`` with ``rope_theta`` (before)."""
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict):
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return str(params.get("rope_type", params.get("type", "default"))), params


def fast_decoder_for(model: Any) -> FastDecoder | None:
    """A :class:`FastDecoder` for ``model``, or None when it is not covered exactly."""
    if unsupported_reason(model) is not None:
        return None
    return FastDecoder(model)


# ------------------------------------------------------------ the pieces both lean passes use
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama-family RMSNorm: in float32 (fused), other dtypes upcast and back."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, 1, T, head_dim] for integer ``positions`` [B, T], from the
    rotary module's ``inv_freq`` and ``attention_scaling``, in ``dtype``."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(dtype)[:, None]
    sin = (emb.sin() * scaling).to(dtype)[:, None]
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, heads, T, head_dim] rotated by the tables of :func:`rope_tables`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer:
    __slots__ = ("attn_norm", "mlp_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w")

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn_norm = layer.input_layernorm
        self.mlp_norm = layer.post_attention_layernorm
        with torch.no_grad():
            self.qkv_w = torch.cat(
                [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0
            ).contiguous()
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            self.qkv_b = torch.cat(biases, 0).contiguous() if biases[0] is not None else None
            self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).contiguous()
        self.o_w = attn.o_proj.weight
        self.o_b = attn.o_proj.bias
        self.down_w = mlp.down_proj.weight

    def refill(self, layer: Any) -> None:
        """Copy ``layer``'s current q/k/v and gate/up weights into the fused tensors made
        from it (no new memory: a weight sync refills them every version)."""
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            torch.cat(
                [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0, out=self.qkv_w
            )
            if self.qkv_b is not None:
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], 0, out=self.qkv_b)
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0, out=self.gate_up_w)
        self.o_w = attn.o_proj.weight
        self.o_b = attn.o_proj.bias
        self.down_w = mlp.down_proj.weight


class FastDecoder:
    """The inference forward of a covered model (see :func:`unsupported_reason`).

    Holds references to the model's parameters; fused q/k/v and gate/up weights
    are copies, so call :meth:`refresh` after the model's weights change.
    """

    def __init__(self, model: Any) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastDecoder cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm
        self.lm_head = model.get_output_embeddings().weight
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scaling = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.dtype = self.embed.dtype
        self.layers: list[_Layer] = []
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.dtype)
        self.refresh()

    def refresh(self) -> None:
        """Bring the fused weights up to the model's current parameters (copied into the
        ones made before, when there are)."""
        blocks = list(self.model.model.layers)
        if len(self.layers) == len(blocks):
            for fused, layer in zip(self.layers, blocks, strict=True):
                fused.refill(layer)
        else:
            self.layers = [_Layer(layer) for layer in blocks]

    # ------------------------------------------------------------ pieces
    def _rms(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        return rms_norm(x, norm.weight, self.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, T, 1, head_dim] for integer ``positions`` [B, T] (every
        head of a token turns by the same angles), looked up in tables made once for
        every position up to the longest session so far (:meth:`_rope_room`): a decode
        step indexes them instead of computing the angles again."""
        return self._cos[positions][:, :, None], self._sin[positions][:, :, None]

    def _rope_room(self, width: int, device: torch.device) -> None:
        """Make the rotary tables cover positions ``0 .. width - 1`` (on ``device``)."""
        if self._cos.shape[0] >= width and self._cos.device == device:
            return
        n = max(width, 2 * int(self._cos.shape[0]))
        positions = torch.arange(n, device=device)[None]
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scaling, self.dtype)
        self._cos, self._sin = cos[0, 0], sin[0, 0]  # [n, head_dim]

    def _forward(
        self,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        session: DecodeSession,
        start: int,
        mask: torch.Tensor,
        keep: int = 1,
    ) -> torch.Tensor:
        """Run ``ids`` [B, T] at cache columns ``start .. start+T-1``; the logits of the last
        ``keep`` columns, [B, keep, vocab]."""
        B, T = ids.shape
        x = F.embedding(ids, self.embed)
        end = start + T
        heads = self.n_heads
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.attn_norm)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
            # the query and key heads of a token are rotated together, in one pass
            qk = qkv[..., : self.q_size + self.kv_size].view(B, T, heads + self.n_kv, -1)
            qk = apply_rope(qk, cos, sin)
            q = qk[:, :, :heads].transpose(1, 2)
            k = qk[:, :, heads:].transpose(1, 2)
            v = qkv[..., self.q_size + self.kv_size :].view(B, T, self.n_kv, -1).transpose(1, 2)
            kc, vc = session.k[i], session.v[i]
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v
            keys, values = kc[:, :, :end], vc[:, :, :end]
            if T == 1 and mask.dtype != torch.bool:
                # a decode step: two batched matmuls with the session's additive mask
                # (SDPA's CPU kernel costs about a third more for one query row); the
                # query heads that share a kv head are that head's query rows
                rep = self.n_heads // self.n_kv
                q = q.reshape(B, self.n_kv, rep, self.head_dim)
                scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale).add_(mask)
                a = torch.matmul(scores.softmax(dim=-1), values)
                a = a.reshape(B, self.n_heads, 1, self.head_dim)
            elif self.n_kv == self.n_heads:
                a = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self.scale
                )
            elif T == 1:
                # one new token: the query heads that share a kv head become that head's
                # query rows (head h reads kv head h // rep), so nothing is repeated
                q = q.reshape(B, self.n_kv, self.n_heads // self.n_kv, self.head_dim)
                a = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self.scale
                )
                a = a.reshape(B, self.n_heads, 1, self.head_dim)
            else:
                rep = self.n_heads // self.n_kv
                keys = keys.repeat_interleave(rep, dim=1)
                values = values.repeat_interleave(rep, dim=1)
                a = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self.scale
                )
            a = a.transpose(1, 2).reshape(B, T, self.q_size)
            x = x + F.linear(a, layer.o_w, layer.o_b)
            h = self._rms(x, layer.mlp_norm)
            gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_w)
        last = self._rms(x[:, -keep:], self.norm)
        return F.linear(last, self.lm_head)

    # ------------------------------------------------------------ API
    @torch.inference_mode()
    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
    ) -> tuple[DecodeSession, torch.Tensor]:
        """Prefill left-padded prompts ``input_ids`` [B, P] (``attention_mask`` 1 on real tokens).

        Returns the session (KV cache for ``P + max_new_tokens`` columns) and the
        logits [B, vocab] of the next token. Position ids count real tokens only,
        as in the engine's HF path.
        """
        session, logits = self._prefill(input_ids, attention_mask, max(1, max_new_tokens), 1)
        return session, logits[:, -1]

    @torch.inference_mode()
    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int
    ) -> torch.Tensor:
        """The float logits [B, keep, vocab] of the last ``keep`` positions of left-padded
        ``input_ids`` (HF's forward with ``logits_to_keep``; no cache is kept)."""
        return self._prefill(input_ids, attention_mask, 0, keep)[1]

    def _prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, room: int, keep: int
    ) -> tuple[DecodeSession, torch.Tensor]:
        """The session of :meth:`start` with ``room`` free columns, and the float logits of
        the prompts' last ``keep`` positions."""
        B, P = input_ids.shape
        device = input_ids.device
        session = DecodeSession(self, B, P + room, device)
        self._rope_room(P + room + 1, device)
        positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        cos, sin = self._rope(positions)
        real = attention_mask.bool()
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        # a padding query row sees itself, so it never attends to nothing (no NaN)
        mask = (causal[None] & real[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)
        session.keys_bias[:, :P].masked_fill_(~real, -math.inf)
        session.next_pos = positions[:, -1] + 1
        session.length = P
        logits = self._forward(input_ids, cos, sin, session, 0, mask[:, None], keep)
        return session, logits.float()


class DecodeSession:
    """The KV cache and positions of one batch being sampled by a :class:`FastDecoder`."""

    def __init__(self, decoder: FastDecoder, batch: int, width: int, device: torch.device) -> None:
        self.decoder = decoder
        shape = (batch, decoder.n_kv, width, decoder.head_dim)
        n = len(decoder.layers)
        self.k = [torch.empty(shape, dtype=decoder.dtype, device=device) for _ in range(n)]
        self.v = [torch.empty(shape, dtype=decoder.dtype, device=device) for _ in range(n)]
        # which cached keys a decode step attends to, as the additive mask its attention
        # takes: 0 for a real token, -inf for padding and finished rows' tokens
        self.keys_bias = torch.zeros(batch, width, dtype=decoder.dtype, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``tokens`` [B]; rows with ``active`` False are finished:
        their token is masked out for every later step) and return the next logits [B, vocab]."""
        d = self.decoder
        col = self.length
        self.keys_bias[:, col] = torch.where(active, 0.0, -math.inf)
        self.length = col + 1
        cos, sin = d._rope(self.next_pos[:, None])
        mask = self.keys_bias[:, None, None, : col + 1]
        logits = d._forward(tokens[:, None], cos, sin, self, col, mask)
        self.next_pos = self.next_pos + 1
        return logits[:, -1].float()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (a LongTensor of row indices) of the batch."""
        self.k = [t[rows] for t in self.k]
        self.v = [t[rows] for t in self.v]
        self.keys_bias = self.keys_bias[rows]
        self.next_pos = self.next_pos[rows]
