"""A lean training forward pass for Llama-family decoders in float32 on the CPU.

On the small models a CPU trains, ``transformers`` spends a fifth of a training
forward and backward in Python: decorators, output records, the mask builders,
per-layer wrappers. :class:`LeanForward` computes the same logits with a few
dozen tensor operations per layer, on the HF module's own parameters (nothing is
copied, so autograd gives the same gradients to the same tensors, and the
optimizer and DeepSpeed see nothing different), the way
:class:`~rftstream.engines.fast_decoder.FastDecoder` does for sampling.

Per layer: RMSNorm, q/k/v projections (with their biases), rotary embedding from
the model's own ``inv_freq`` and ``attention_scaling``, attention through
``scaled_dot_product_attention`` (grouped-query heads) under the causal mask and
the batch's ``attention_mask``, output projection, residual, RMSNorm, gate/up
projections, SiLU, down projection, residual; then the final norm and the LM head
on the kept positions only. A query at a left-padding position, which may see no
key at all, sees itself (HF unmasks such rows too): its output feeds nothing that
is kept. Logits match the HF forward to floating-point rounding and so do the
gradients (the tests check both, on Qwen2 and Llama shapes, padded both sides).

:func:`lean_forward_reason` says when the HF path stays: architectures the
sampler's lean pass does not cover, any dtype but float32 or any device but the
CPU (there the arithmetic, not Python, is the cost, and HF's own kernels and
mixed-precision casts are what users expect), active dropout, gradient
checkpointing, ZeRO-3 (parameters are partitioned and gathered by hooks on the
module's forward) and adapters (LoRA modules wrap the projections).

Pure tensor code, no I/O; every call blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rftstream.engines.fast_decoder import (
    apply_rope,
    architecture_reason,
    rms_norm,
    rope_tables,
)
from rftstream.training.batch import TokenBan, target_logprobs

__all__ = ["LeanForward", "Packing", "lean_forward_reason"]


def lean_forward_reason(
    model: Any, *, zero_stage: int, checkpointing: bool, adapters: bool, dropout: bool
) -> str | None:
    """Why :class:`LeanForward` must not train ``model`` (the HF path stays), or None."""
    reason = architecture_reason(model)
    if reason is not None:
        return reason
    first = next(iter(model.parameters()), None)
    if first is None or first.dtype != torch.float32 or first.device.type != "cpu":
        return "not float32 on the CPU"
    if dropout:
        return "dropout is active"
    if checkpointing:
        return "gradient checkpointing"
    if zero_stage >= 3:
        return "ZeRO-3 partitions the parameters"
    if adapters:
        return "adapters (LoRA) wrap the projections"
    return None


class Packing:
    """The real tokens of a [rows, width] layout, packed: ``index`` holds their flat
    positions (row-major), so a [rows, width, ...] tensor's real entries are
    ``t.reshape(rows * width, ...)[index]`` and back. Both directions keep autograd."""

    __slots__ = ("rows", "width", "index")

    def __init__(self, real: torch.Tensor) -> None:
        self.rows, self.width = int(real.shape[0]), int(real.shape[1])
        self.index = real.reshape(-1).nonzero().squeeze(1)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, width, ...] -> [N, ...]."""
        return t.reshape(self.rows * self.width, *t.shape[2:]).index_select(0, self.index)

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [rows, width, ...], zeros where padded."""
        flat = t.new_zeros(self.rows * self.width, *t.shape[1:])
        return flat.index_copy(0, self.index, t).view(self.rows, self.width, *t.shape[1:])


class LeanForward:
    """The training forward of a covered model (see :func:`lean_forward_reason`).

    Holds references to the model's parameters only; a weight update is seen at
    once. Inputs follow the trainer's batches: ``input_ids``, ``attention_mask`` and
    ``position_ids`` of shape [B, T].
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        cfg = model.config
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        inner = model.model
        self.inner = inner
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scaling = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))

    # ------------------------------------------------------------ pieces
    def _rms(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        return rms_norm(x, norm.weight, self.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.inv_freq, self.rope_scaling, torch.float32)

    def _layer(
        self,
        layer: Any,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        packing: Packing | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer; returns the hidden states and this call's keys and values.

        ``x`` is [B, T, hidden], or with ``packing`` the [N, hidden] real tokens of a
        [B, T] layout: everything but attention runs on those N tokens only, and
        attention on the [B, T] layout they are scattered into (zeros where padded,
        which ``mask`` hides from every real query)."""
        attn = layer.self_attn
        h = self._rms(x, layer.input_layernorm)
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias)
        if packing is None:
            B, T, _ = x.shape
        else:
            B, T = packing.rows, packing.width
            # the rotary embedding is per token: on the packed tokens, before the scatter
            cos, sin = rope
            q = apply_rope(q.view(-1, self.n_heads, self.head_dim), cos, sin)
            k = apply_rope(k.view(-1, self.n_kv, self.head_dim), cos, sin)
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if packing is None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = (
            (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        )
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads
        )
        o = o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if packing is not None:
            o = packing.pack(o)
        x = x + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
        mlp = layer.mlp
        h = self._rms(x, layer.post_attention_layernorm)
        gate = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
        return x + F.linear(gate, mlp.down_proj.weight), k, v

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(x, self.inner.norm), self.model.get_output_embeddings().weight)

    @staticmethod
    def _mask(keys_ok: torch.Tensor, queries: int) -> torch.Tensor:
        """[B, 1, queries, K] (True: attend): the last ``queries`` of the ``K`` positions
        attend causally to the keys ``keys_ok`` allows, and always to themselves."""
        K = keys_ok.shape[1]
        causal = torch.ones(queries, K, dtype=torch.bool, device=keys_ok.device).tril(K - queries)
        own = torch.zeros(queries, K, dtype=torch.bool, device=keys_ok.device)
        own[:, K - queries :] = torch.eye(queries, dtype=torch.bool, device=keys_ok.device)
        return ((causal & keys_ok[:, None, :]) | own)[:, None]

    # ------------------------------------------------------------ forwards
    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        keep: int,
    ) -> torch.Tensor:
        """The logits of the last ``keep`` positions, [B, keep, vocab] (HF's
        ``logits_to_keep``)."""
        mask = self._mask(attention_mask.bool(), input_ids.shape[1])
        rope = self._rope(position_ids)
        x = F.embedding(input_ids, self.inner.embed_tokens.weight)
        for layer in self.inner.layers:
            x, _, _ = self._layer(layer, x, rope, mask)
        return self._head(x[:, -keep:])

    def _prompts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_width: int,
        first: torch.Tensor,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The distinct prompts (rows ``first``, the first ``prompt_width`` columns) through
        every layer: their last hidden states [G, P, hidden] and each layer's keys and
        values, for the responses of the rows that share them."""
        P = prompt_width
        mask = self._mask(attention_mask[first, :P].bool(), P)
        rope = self._rope(position_ids[first, :P])
        x = F.embedding(input_ids[first, :P], self.inner.embed_tokens.weight)
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.inner.layers:
            x, k, v = self._layer(layer, x, rope, mask)
            past.append((k, v))
        return x, past

    def shared_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_width: int,
        first: torch.Tensor,
        inverse: torch.Tensor,
    ) -> torch.Tensor:
        """The logits that predict every row's response tokens, [B, R, vocab], with each
        distinct prompt run once (rows ``first``) and its keys and values repeated for
        the rows that have it (``inverse``), as the trainer's shared-prompt HF path."""
        P = prompt_width
        R = input_ids.shape[1] - P
        x, past = self._prompts(input_ids, attention_mask, position_ids, P, first)
        logits = self._head(x[:, -1:])[inverse]  # predicts response token 0 of every row
        if R <= 1:
            return logits
        mask = self._mask(attention_mask.bool(), R)
        rope = self._rope(position_ids[:, P:])
        x = F.embedding(input_ids[:, P:], self.inner.embed_tokens.weight)
        for layer, (k, v) in zip(self.inner.layers, past, strict=True):
            x, _, _ = self._layer(layer, x, rope, mask, (k[inverse], v[inverse]))
        return torch.cat([logits, self._head(x[:, : R - 1])], 1)

    def shared_token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_width: int,
        first: torch.Tensor,
        inverse: torch.Tensor,
        temperature: float,
        *,
        with_entropy: bool,
        ban: TokenBan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each response token's log-prob under ``logits / temperature`` (and the
        distribution's entropy there, and with ``ban``, per row as
        :meth:`~rftstream.training.batch.TrainBatch.token_ban` gives it, the mass outside
        the banned ids), [B, R], zeros where a row has no response token:
        :meth:`shared_logits` followed by
        :func:`~rftstream.training.batch.response_logprobs`, without the padding.

        The prompts run as in :meth:`shared_logits`; the response pass runs every layer
        but attention on the real response tokens only, and the LM head and softmax on
        those that predict a real token (not a row's last), where the padded pass runs
        them on ``B x R`` positions: with replies of uneven length a third of those can
        be padding. Real tokens after a gap in a row's mask keep every real key before
        them. Same values at every real token, to rounding, and the same gradients."""
        P = prompt_width
        R = input_ids.shape[1] - P
        x, past = self._prompts(input_ids, attention_mask, position_ids, P, first)
        # [B, vocab]: response token 0 of every row (each has one: the trainer's check)
        heads = [self._head(x[:, -1])[inverse]]
        targets = [input_ids[:, P]]
        places = [torch.arange(input_ids.shape[0], device=input_ids.device) * R]
        if R > 1:
            real = attention_mask[:, P : P + R - 1].bool()
            packing = Packing(real)
            mask = self._mask(attention_mask[:, : P + R - 1].bool(), R - 1)
            rope = self._rope(packing.pack(position_ids[:, P : P + R - 1]))
            x = F.embedding(
                packing.pack(input_ids[:, P : P + R - 1]), self.inner.embed_tokens.weight
            )
            for layer, (k, v) in zip(self.inner.layers, past, strict=True):
                x, _, _ = self._layer(layer, x, rope, mask, (k[inverse], v[inverse]), packing)
            # the LM head where the next token is real (not after a row's last token)
            predicts = packing.pack(attention_mask[:, P + 1 :]).bool()
            heads.append(self._head(x[predicts]))
            targets.append(packing.pack(input_ids[:, P + 1 :])[predicts])
            index = packing.index[predicts]
            places.append(index // (R - 1) * R + index % (R - 1) + 1)
        place, B = torch.cat(places), input_ids.shape[0]
        token_ban = None
        if ban is not None:  # the packed tokens' own rows' ids and places
            at = ban.at[:, :R].reshape(-1).index_select(0, place)
            token_ban = TokenBan(
                ban.ids.index_select(0, torch.div(place, R, rounding_mode="floor")),
                at,
                ban.exclude,
            )
        logp, entropy, allowed = target_logprobs(
            torch.cat(heads),
            torch.cat(targets),
            temperature,
            with_entropy=with_entropy,
            ban=token_ban,
        )

        def to_columns(t: torch.Tensor) -> torch.Tensor:  # [B, R], zeros where no token
            return t.new_zeros(B * R).index_copy(0, place, t).view(B, R)

        return (
            to_columns(logp),
            None if entropy is None else to_columns(entropy),
            None if allowed is None else to_columns(allowed),
        )
