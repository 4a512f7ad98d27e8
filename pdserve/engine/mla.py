"""DeepSeek-V3's multi-head latent attention (MLA) over the paged pool, computed as transformers computes it.

Per token the layer caches one compressed latent: `kv_lora_rank` values (kv_a_proj's first part, RMS-normalised)
and the `qk_rope_head_dim` shared key after RoPE, the same for every head. The pool keeps its shape (config.py,
`kv_layout` "mla": one KV "head" of half that width), the latent's first half in the K slot and its second half in
the V slot, so a block still moves, swaps and is prefix-cached as one unit and the P/D transfer moves latents:
`layers * (kv_lora_rank + qk_rope_head_dim)` elements per token, against `layers * heads * (qk_nope + qk_rope +
v_head_dim)` for the same model caching per-head K and V.

Each step expands the latents of a sequence's whole context through kv_b_proj into per-head keys (no-rope part)
and values, then attends with the queries. That is the plain form, correct and simple; it costs a
[context, kv_lora_rank] x [kv_lora_rank, heads * (nope + v)] GEMM per layer per step. On the CUDA path
(Triton) decodes take the absorbed form instead (`_absorbed_decode`: kv_b folded into the query and the output,
attention over the latents, triton_attention.mla_decode_attention); prefill keeps the plain form.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, gather_blocks, write_kv
from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import take

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default: q_a_layernorm and kv_a_layernorm do not take rms_norm_eps


def mla_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope says so."""
    from pdserve.engine.model import yarn_factor
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling or {}
    all_dim = float(rope.get("mscale_all_dim") or 0)
    if rope and all_dim:
        factor = yarn_factor(rope, cfg.max_position_embeddings)
        m = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (x0, x1), (x2, x3)... -> halves (x0, x2, ...| x1, x3, ...), so the model's
    rotate-halves RoPE applies (transformers' apply_rotary_pos_emb_interleave gives the same numbers)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: type[nn.Linear], norm: type[nn.Module]):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.heads, self.nope, self.rope, self.v_dim = heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a = linear(h, cfg.q_lora_rank, bias=cfg.o_bias)
            self.q_a_norm = norm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = linear(cfg.q_lora_rank, heads * qk, bias=False)
            self.q = None
        else:
            self.q = linear(h, heads * qk, bias=False)
        self.kv_a = linear(h, self.rank + self.rope, bias=cfg.o_bias)
        self.kv_a_norm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b = linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o = linear(heads * self.v_dim, h, bias=cfg.o_bias)
        self.scale = mla_scale(cfg)

    def forward(self, x, cos, sin, kv: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        from pdserve.engine.model import apply_rope
        t = x.shape[0]
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q_nope, q_rot = q.view(t, self.heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent.contiguous())
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin)], dim=-1)
        entry = torch.cat([latent, apply_rope(k_rot.unsqueeze(1), cos, sin).squeeze(1)], dim=-1)  # [T, rank+rope]
        half = entry.shape[-1] // 2
        write_kv(kv, layer, meta.slot_blocks, meta.slot_offsets, entry[:, None, :half], entry[:, None, half:])
        out = q.new_empty(t, self.heads, self.v_dim)
        for span in meta.prefills:
            k, v = self._expand(self._latents(kv, layer, span.block_table)[:span.context_len], q.dtype)
            qs = q[span.start:span.start + span.q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               attn_mask=span.mask, is_causal=span.mask is None, scale=self.scale)
            out[span.start:span.start + span.q_len] = o.squeeze(0).transpose(0, 1)
        if meta.native_decode is not None:  # the CUDA path: absorbed attention over the latents (Triton)
            nd = meta.native_decode
            out[nd.rows] = self._absorbed_decode(q[nd.rows], kv, layer, nd, meta.native_ops).to(out.dtype)
        for grp in meta.decodes:
            k, v = self._expand(self._latents(kv, layer, grp.block_tables), q.dtype)  # [B, S, H, *]
            scores = torch.einsum("bhd,bshd->bhs", q[grp.rows], k).float() * self.scale + grp.bias[:, 0]
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            out[grp.rows] = torch.einsum("bhs,bshd->bhd", probs, v).to(out.dtype)
        return self.o(out.reshape(t, self.heads * self.v_dim))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b split per head into its key part W_uk [H, nope, rank] and value part W_uv [H, v, rank]."""
        w = self.kv_b.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def _absorbed_decode(self, q: torch.Tensor, kv: torch.Tensor, layer: int, nd, ops) -> torch.Tensor:
        """q [B, H, nope + rope] -> [B, H, v_dim]. q_nope . (W_uk c) = (W_uk^T q_nope) . c, so the query moves into
        latent space and every head scores the cached entries [c | k_rot] directly; the weighted sum of latents
        goes up through W_uv once per head, instead of every cached latent through kv_b every step."""
        w_uk, w_uv = self.absorbed_weights()
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk.to(q.dtype))
        entry_q = torch.cat([q_lat, q_rot], dim=-1).to(kv.dtype)
        o = ops.mla_decode_attention(entry_q, kv, layer, nd.block_tables, nd.context_lens, self.scale)
        return torch.einsum("bhr,hvr->bhv", o[..., :self.rank].to(w_uv.dtype), w_uv)

    @staticmethod
    def _latents(kv: torch.Tensor, layer: int, tables: torch.Tensor) -> torch.Tensor:
        """The cached latents of the blocks in `tables` ([n] or [B, n]) -> [n * bs, rank+rope] or [B, n * bs, ...]."""
        both = torch.cat([gather_blocks(kv, layer, tables, 0), gather_blocks(kv, layer, tables, 1)], dim=-1)
        return both.flatten(-4, -2) if tables.dim() == 1 else both.flatten(1, 3)

    def _expand(self, latents: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [..., S, rank+rope] -> keys [..., S, H, nope+rope] and values [..., S, H, v_dim]."""
        latents = latents.to(dtype)
        lat, k_rot = latents.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b(lat.contiguous()).unflatten(-1, (self.heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope)], dim=-1)
        return k, v

    def load(self, tensors: dict[str, torch.Tensor], p: str, put) -> None:
        """`p`: "model.layers.{i}.self_attn."."""
        def weight(m: nn.Linear, name: str) -> None:
            put(m.weight, take(tensors, f"{p}{name}.weight", (m.out_features, m.in_features)))
            if m.bias is not None:
                put(m.bias, take(tensors, f"{p}{name}.bias", (m.out_features,)))

        if self.q is not None:
            weight(self.q, "q_proj")
        else:
            weight(self.q_a, "q_a_proj")
            weight(self.q_b, "q_b_proj")
            put(self.q_a_norm.weight, take(tensors, f"{p}q_a_layernorm.weight", (self.q_a.out_features,)))
        weight(self.kv_a, "kv_a_proj_with_mqa")
        put(self.kv_a_norm.weight, take(tensors, f"{p}kv_a_layernorm.weight", (self.rank,)))
        weight(self.kv_b, "kv_b_proj")
        weight(self.o, "o_proj")
