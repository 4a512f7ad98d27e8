"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, gpt-oss) over a flat batch of tokens with
paged attention."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import env_knobs
from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_isa import FP32_PACK_ENV, cpu_vendor, pack_fp32
from pdserve.engine.decoder_stack import DecoderStacks
from pdserve.engine.errors import CheckpointError
from pdserve.engine.loader import take
from pdserve.engine.mla import LatentAttention
from pdserve.engine.moe import SparseMoE
from pdserve.engine.quant import GEMV_COPY_MAX_ROWS
from pdserve.engine.tp.shard import TPShard, shard_for


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.rope_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths scaled by `factor`, short kept, smooth between.
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    if kind == "yarn":
        if "original_max_position_embeddings" not in scaling:
            raise CheckpointError("yarn rope scaling needs original_max_position_embeddings")
        return yarn_inv_freq(inv_freq, dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
    raise CheckpointError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def yarn_factor(scaling: dict, max_pos: int) -> float:
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_pos / float(scaling["original_max_position_embeddings"])


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict, max_pos: int) -> torch.Tensor:
    """YaRN (gpt-oss): low frequencies interpolated by `factor`, high ones kept, a linear ramp between the
    dimensions that turn `beta_fast` and `beta_slow` times over the original context (transformers' formula)."""
    factor = yarn_factor(scaling, max_pos)
    old_len = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(scaling.get("beta_fast") or 32)), correction_dim(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return (inv_freq / factor * (1 - keep) + inv_freq * keep).float()


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The scale YaRN puts on cos and sin (1 for every other rope type)."""
    scaling = cfg.rope_scaling or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = yarn_factor(scaling, cfg.max_position_embeddings)
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
    return mscale(factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF convention (rotate the two halves), with cos/sin of half width already in x's dtype, as HF casts them.
    Working on halves avoids materialising the rotated copy: ~10x faster on CPU than the textbook form."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    native_ops = None  # the compiled CPU kernels, set by LlamaModel.use_native_ops
    # Deterministic mode (batch_invariant.py): strided inputs (Qwen3's q/k heads, a view into the fused qkv) are
    # copied to take the native kernel too. Otherwise they take torch's, except at one row, where the view is
    # contiguous: a decode alone and in a batch would be normalised by different kernels.
    contiguous_first = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ops is not None and self.contiguous_first:
            x = x.contiguous()
        if self.native_ops is not None and x.is_contiguous():  # one pass instead of ~8 small ops
            out = torch.empty_like(x)
            self.native_ops.rms_norm(out, x, self.weight, self.eps)
            return out
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # accumulates in fp32


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked linear: for bf16 on CPUs with AVX512-BF16/AMX, and for fp32 where MKL's sgemm is not the
    faster one (cpu_isa.pack_fp32: non-Intel CPUs)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32 and pack_fp32(cpu_vendor(), env_knobs.get(FP32_PACK_ENV) or None)


class Linear(nn.Linear):
    """nn.Linear whose weight can be reordered once into oneDNN's blocked layout.

    Plain `F.linear` on a bf16 CPU tensor re-packs the weight inside every call: a batch-1 decode GEMV then reads
    weights at ~15 GB/s. The prepacked form reads them at cache/DRAM speed, 2-3x faster at M=1 and ~1.5x at
    M=32, with bit-identical results (bench/engine_throughput.py). The plain weight is dropped after packing so
    the model is held once."""

    packed: torch.Tensor | None = None
    # The plain bf16 weight kept beside the packed one for steps of up to GEMV_COPY_MAX_ROWS rows
    # (quant.keep_batch1_gemv): the native GEMV (vdpbf16ps) reads it 1.2-1.9x faster than oneDNN's small-M linear
    # on an AMD Zen 4.
    gemv_weight: torch.Tensor | None = None
    native_ops = None  # the compiled CPU kernels, set by LlamaModel.use_native_ops

    def pack(self, keep_gemv: bool = False) -> None:
        w = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.gemv_weight = w.contiguous() if keep_gemv else None
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.gemv_weight is not None and self.native_ops is not None and x.dim() == 2 \
                and x.shape[0] <= GEMV_COPY_MAX_ROWS and x.dtype == self.gemv_weight.dtype and x.is_contiguous():
            out = x.new_empty(x.shape[0], self.gemv_weight.shape[0])
            self.native_ops.weight_gemv(out, x, self.gemv_weight, None)
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, self.bias, "none", [], "")


def swiglu(gate_up: torch.Tensor, native_ops=None) -> torch.Tensor:
    """silu(gate) * up of the fused [gate | up] projection: one native pass on CPU (kernels.py), else torch."""
    if native_ops is not None and gate_up.device.type == "cpu" and gate_up.dim() == 2 and gate_up.is_contiguous():
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        native_ops.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """With tensor parallelism (`shard` of N > 1 ranks, `comm` its group): qkv and gate/up are column-parallel
    (this rank's heads and intermediate slice), o and down row-parallel, each followed by one all-reduce.
    `sparse`: the MLP is a mixture of experts (moe.py) instead of gate_up/down. `index`: this layer's place in
    the stack, which picks its window where the model gives each layer its own (gpt-oss)."""
    native_ops = None  # the compiled CPU kernels, set by LlamaModel.use_native_ops

    def __init__(self, cfg: ModelConfig, shard: TPShard, comm=None, sparse: bool = False, index: int = 0,
                 all_to_all: bool = False):
        """`all_to_all`: with expert parallelism, a sparse layer dispatches its tokens to the experts' owners
        (tp/dispatch.py) instead of summing every rank's partial output over every token."""
        super().__init__()
        self.cfg = cfg
        self.comm = comm
        self.replicated = shard.replicated  # expert parallelism without TP: only the experts' outputs are summed
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        inter = len(shard.inter)
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        # DeepSeek's latent attention (mla.py) in place of the fused qkv and o
        self.mla = LatentAttention(cfg, Linear, RMSNorm) if cfg.kv_layout == "mla" else None
        mha = self.mla is None
        self.qkv = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias) if mha else None  # one GEMM
        self.o = Linear(self.q_size, h, bias=cfg.o_bias) if mha else None
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        # q/k norms have one weight over head_dim, the same on every rank: tensor parallelism needs no slicing.
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        # gpt-oss: a learned per-head logit in every softmax's denominator; MoE refuses TP, so all heads are here
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None
        self.window = cfg.layer_windows[index] if cfg.layer_windows else "model"
        dispatch = None
        if sparse and all_to_all and comm is not None and len(shard.experts) < cfg.num_experts:
            from pdserve.engine.tp.dispatch import ExpertDispatch
            dispatch = ExpertDispatch(comm, cfg.num_experts, shard.experts)
        self.moe = SparseMoE(cfg, Linear, shard.experts, shard.rank, dispatch) if sparse else None
        self.gate_up = None if sparse else Linear(h, 2 * inter, bias=cfg.mlp_bias)
        self.down = None if sparse else Linear(inter, h, bias=cfg.mlp_bias)

    @property
    def stackable(self) -> bool:
        """Whether the native decoder stack (csrc/decoder_stack.cpp) can compute this layer: Qwen3's q/k norms and
        the softmax top-k routers' experts on the native MoE kernel (`SparseMoE.stack_native`, checked per step
        size), not attention sinks, latent attention, DeepSeek's router or gpt-oss's experts."""
        moe = self.moe
        return self.sinks is None and self.mla is None and (
            moe is None or (moe.stacked is not None and not moe.deepseek and not moe.gpt_oss
                            and moe.shared_gate_up is None and moe.dispatch is None))

    def _reduce(self, x: torch.Tensor, experts: bool = False) -> torch.Tensor:
        """Sum a row-parallel output over the ranks; `experts`: the split experts' shares, summed even where the
        rest of the model is whole on every rank."""
        return x if self.comm is None or (self.replicated and not experts) else self.comm.all_reduce(x)

    def forward(self, x, cos, sin, kv, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        if self.moe is not None and self.moe.dispatch is not None:
            return self._dispatched(x, cos, sin, kv, layer, meta)
        if self.mla is not None:
            x = x + self.mla(self.input_norm(x), cos, sin, kv, layer, meta)
        else:
            x = x + self._attention(x, cos, sin, kv, layer, meta)
        if self.moe is not None:  # with tensor parallelism: expert parallel, this rank's experts' share summed
            return x + self._reduce(self.moe(self.post_norm(x)), experts=True)
        return x + self._reduce(self.down(swiglu(self.gate_up(self.post_norm(x)), self.native_ops)))

    def _dispatched(self, x, cos, sin, kv, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """The layer with its experts reached by all-to-all: rank r carries the residual of its slice of the tokens
        (tp/dispatch.token_slice) from the attention output to the MoE output, then every slice is all-gathered.
        Tensor-parallel attention is summed by a reduce-scatter into the slices (each rank receives only the rows
        it carries); replicated attention (DeepSeek's latent attention, any attention at TP 1) is sliced as it is."""
        from pdserve.engine.tp.dispatch import token_slice
        t, n = x.shape[0], self.comm.size
        lo, hi, per = token_slice(t, self.comm.rank, n)
        if self.mla is not None:
            h = x[lo:hi] + self.mla(self.input_norm(x), cos, sin, kv, layer, meta)[lo:hi]
        elif self.replicated:
            h = x[lo:hi] + self._attention(x, cos, sin, kv, layer, meta)[lo:hi]
        else:
            partial = self._attention(x, cos, sin, kv, layer, meta, reduce=False)
            if per * n != t:
                partial = torch.cat([partial, partial.new_zeros(per * n - t, partial.shape[1])])
            h = x[lo:hi] + self.comm.reduce_scatter(partial)[:hi - lo]
        h = h + self.moe.dispatched(self.post_norm(h))
        if hi - lo != per:
            h = torch.cat([h, h.new_zeros(per - (hi - lo), h.shape[1])])
        return self.comm.all_gather(h)[:t]

    def _attention(self, x, cos, sin, kv, layer: int, meta: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv(self.input_norm(x))
        if self.q_norm is not None:  # before RoPE, in place in the fused output so the rotation below still applies
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, cfg.head_dim)
            qk[:, :self.num_heads] = self.q_norm(qk[:, :self.num_heads])
            qk[:, self.num_heads:] = self.k_norm(qk[:, self.num_heads:])
        if self.native_ops is not None:  # q's and k's heads (adjacent in the fused output) rotated in place, one call
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, cfg.head_dim)
            self.native_ops.rope_(qk, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, cfg.head_dim), k.view(t, self.num_kv_heads, cfg.head_dim)
        if self.native_ops is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(t, self.num_kv_heads, cfg.head_dim)
        attn = paged_attention(q, k, v, kv, layer, meta, scale=cfg.head_dim ** -0.5, sinks=self.sinks,
                               window=self.window)
        out = self.o(attn.reshape(t, self.q_size))
        return self._reduce(out) if reduce else out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, comm=None, all_to_all: bool = False):
        """`shard`/`comm`: this rank's slice and the TP group (engine/tp/); None: the whole model, one process.
        The embedding and LM head are vocab-parallel: each rank holds `shard.vocab` rows. `all_to_all`: split
        experts are reached by all-to-all dispatch (DecoderLayer)."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard or shard_for(cfg)
        self.comm = comm
        self.embed = nn.Embedding(len(self.shard.vocab), cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.shard, comm, i in cfg.moe_layers, i, all_to_all)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, len(self.shard.vocab), bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_scale = rope_attention_factor(cfg)
        self.weight_bytes = 0  # weight bytes held (set on load and by quantize; packing adds only kept GEMV copies)
        self.packed = False  # projections prepacked for oneDNN (pack_weights)
        self.dual_bytes = (0, 0)  # the bf16 and the fp32 copies' bytes of DualLinear projections (quant.py)
        self.gemv_bytes = 0  # bytes of the plain copies packed projections keep for small-batch GEMVs (Linear)
        self.weight_storage = "same"  # projections held as: same (the compute dtype) | int8 | bfloat16 (quant.py)
        self.stacks: DecoderStacks | None = None  # the layers as one native call for small decode steps

    def _apply(self, fn, recurse=True):
        # `.to(bf16)` would round the RoPE frequencies too (0.5623 -> 0.5625), turning distant positions by a
        # visibly different angle than transformers, which keeps them in fp32 whatever the weights' dtype.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.cfg).to(self.inv_freq.device)
        return self

    def use_native_ops(self, ops) -> None:
        """Route norms, rope and the MLP's silu(gate) * up through the compiled kernels (None: torch ops)."""
        from pdserve.engine.quant import WeightOnlyLinear
        for m in self.modules():
            if isinstance(m, (DecoderLayer, RMSNorm, WeightOnlyLinear, Linear, SparseMoE)):
                m.native_ops = ops
        self.stacks = DecoderStacks(self, ops) if ops is not None else None

    def expert_tokens(self) -> list[list[int]] | None:
        """Tokens routed to each expert of each MoE layer since start (or the last reset), one row per MoE layer;
        None for a dense model."""
        rows = [layer.moe.routed for layer in self.layers if layer.moe is not None]
        return torch.stack(rows).tolist() if rows else None

    def reset_expert_tokens(self) -> None:
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.routed.zero_()

    def _forget_stacks(self) -> None:
        """The projections changed form: plans built over the old tensors would still compute with them."""
        if self.stacks is not None:
            self.stacks = DecoderStacks(self, self.stacks.native_ops)

    def store_weights(self, kind: str, native_ops=None) -> None:
        """Hold the projections and lm_head as int8 or bf16 (quant.py); the embedding keeps the compute dtype."""
        from pdserve.engine.quant import DualLinear, convert_linears
        convert_linears(self, kind, native_ops)
        self.weight_storage = kind
        self._forget_stacks()
        self.weight_bytes = sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()]
                                if t is not self.inv_freq)
        duals = [m for m in self.modules() if isinstance(m, DualLinear)]
        self.dual_bytes = (sum(m.gemv.weight.nbytes for m in duals), sum(m.gemm.weight.nbytes for m in duals))

    def weight_bytes_read(self, rows: int) -> int:
        """Weight bytes held that a step of `rows` rows reads: all, except one copy of each DualLinear's two, and
        one of each packed projection's two where it kept a plain copy (the two are the same size)."""
        from pdserve.engine.quant import DUAL_GEMV_MAX_ROWS
        bf16, fp32 = self.dual_bytes
        return self.weight_bytes - (fp32 if rows <= DUAL_GEMV_MAX_ROWS else bf16) - self.gemv_bytes

    def stack_experts(self) -> int:
        """Stack each sparse layer's experts for the native MoE kernel (moe.py); return how many layers took it.
        Before pack_weights, which then leaves those experts plain."""
        n = sum(layer.moe.stack_experts() for layer in self.layers if layer.moe is not None)
        if n:
            self._forget_stacks()
        return n

    def pack_weights(self, keep_gemv: bool = False) -> bool:
        """Prepack every projection for oneDNN where that path exists (can_pack); return whether it did. keep_gemv:
        each also keeps its plain weight for small-batch steps (quant.keep_batch1_gemv)."""
        # experts stacked for the native MoE kernel stay plain: packed, their weights would be held twice
        plain = {id(m) for layer in self.layers if layer.moe is not None and layer.moe.stacked is not None
                 for m in [*layer.moe.gate_up, *layer.moe.down]}
        # latent attention's kv_b stays plain too: its absorbed decode splits the weight per head (mla.py), which a
        # oneDNN-blocked weight cannot give back
        plain |= {id(layer.mla.kv_b) for layer in self.layers if getattr(layer, "mla", None) is not None}
        linears = [m for m in self.modules() if isinstance(m, Linear) and id(m) not in plain]
        if not linears or not can_pack(linears[0].weight):
            return False
        for m in linears:
            m.pack(keep_gemv)
        self.packed = True
        self._forget_stacks()
        if keep_gemv:
            self.gemv_bytes = sum(m.gemv_weight.nbytes for m in linears)
            self.weight_bytes += self.gemv_bytes
        return True

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None or self.shard.replicated:
            return self.embed(input_ids)
        # vocab-parallel: rows outside this rank's slice are zero here and come from their owner's all-reduce
        local = input_ids - self.shard.vocab.start
        inside = (local >= 0) & (local < len(self.shard.vocab))
        x = self.embed(local.clamp(0, len(self.shard.vocab) - 1)).masked_fill_(~inside.unsqueeze(1), 0)
        return self.comm.all_reduce(x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor | None:
        """Run the decoder over the flat batch; return float32 logits only for `logits_rows` (with tensor
        parallelism: gathered on rank 0, None on the other ranks)."""
        freqs = (positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)).unsqueeze(1)  # [T, 1, D/2]
        x = self._embed(input_ids)
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_scale != 1.0:  # YaRN: scaled in fp32 before the cast, as transformers does
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        t = input_ids.shape[0]
        stack = self.stacks.get(t, x.dtype) if self.stacks and self.stacks.applies(meta, t, kv, x) else None
        if stack is not None:
            nd = meta.native_decode
            x = stack.forward(x, cos, sin, kv, meta.slot_blocks, meta.slot_offsets, nd.rows, nd.block_tables,
                              nd.context_lens, self.cfg.head_dim ** -0.5, meta.sliding_window or 0)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv, i, meta)
        if self.comm is not None and self.shard.replicated and self.comm.rank != 0:
            return None  # rank 0 holds the whole LM head and samples
        x = self.norm(x[logits_rows])
        logits = self.lm_head(x).float()
        if self.comm is None or self.shard.replicated:
            return logits
        full = self.comm.gather0(logits)
        return None if full is None else full[:, :self.cfg.vocab_size]

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every expected tensor must be present. Each rank
        takes its slice (`self.shard`); a row-parallel bias is added once, so only rank 0 holds it."""
        cfg, sh = self.cfg, self.shard
        h, inter = cfg.hidden_size, cfg.intermediate_size
        dt = self.embed.weight.dtype
        if cfg.architecture == "Phi3ForCausalLM":
            tensors = split_fused(cfg, tensors)
        cols = slice(sh.inter.start, sh.inter.stop)

        def put(param: torch.Tensor, value: torch.Tensor) -> None:
            param.data.copy_(value.to(dt))

        def put_vocab(param: torch.Tensor, full: torch.Tensor) -> None:  # the last rank's padding rows stay 0
            rows = full[sh.vocab.start:min(sh.vocab.stop, cfg.vocab_size)]
            param.data.zero_()
            param.data[:rows.shape[0]].copy_(rows.to(dt))

        def row_bias(param: torch.Tensor, value: torch.Tensor) -> None:
            put(param, value if sh.rank == 0 or sh.replicated else torch.zeros_like(value))

        put_vocab(self.embed.weight, take(tensors, "model.embed_tokens.weight", (cfg.vocab_size, h)))
        put(self.norm.weight, take(tensors, "model.norm.weight", (h,)))
        if cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
            put_vocab(self.lm_head.weight, tensors["model.embed_tokens.weight"])
        else:
            put_vocab(self.lm_head.weight, take(tensors, "lm_head.weight", (cfg.vocab_size, h)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm.weight, take(tensors, p + "input_layernorm.weight", (h,)))
            put(layer.post_norm.weight, take(tensors, p + "post_attention_layernorm.weight", (h,)))
            if layer.mla is not None:
                layer.mla.load(tensors, p + "self_attn.", put)
            else:
                self._load_attention(tensors, layer, p, put, row_bias)
            if layer.moe is not None:
                layer.moe.load(tensors, p, cfg.architecture, put)
                continue
            gw = take(tensors, p + "mlp.gate_proj.weight", (inter, h))
            uw = take(tensors, p + "mlp.up_proj.weight", (inter, h))
            put(layer.gate_up.weight, torch.cat([gw[cols], uw[cols]]))
            put(layer.down.weight, take(tensors, p + "mlp.down_proj.weight", (h, inter))[:, cols])
            if cfg.mlp_bias:
                put(layer.gate_up.bias, torch.cat([take(tensors, p + "mlp.gate_proj.bias")[cols],
                                                   take(tensors, p + "mlp.up_proj.bias")[cols]]))
                row_bias(layer.down.bias, take(tensors, p + "mlp.down_proj.bias"))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())

    def _load_attention(self, tensors: dict[str, torch.Tensor], layer: DecoderLayer, p: str, put, row_bias) -> None:
        """q/k/v fused into qkv (this rank's heads), o, and what each architecture adds (biases, sinks, q/k norms)."""
        cfg, sh = self.cfg, self.shard
        h, hd = cfg.hidden_size, cfg.head_dim
        heads = slice(sh.heads.start * hd, sh.heads.stop * hd)
        kv_heads = slice(sh.kv_heads.start * hd, sh.kv_heads.stop * hd)
        qw = take(tensors, p + "self_attn.q_proj.weight", (cfg.num_heads * hd, h))
        kw = take(tensors, p + "self_attn.k_proj.weight", (cfg.num_kv_heads * hd, h))
        vw = take(tensors, p + "self_attn.v_proj.weight", (cfg.num_kv_heads * hd, h))
        put(layer.qkv.weight, torch.cat([qw[heads], kw[kv_heads], vw[kv_heads]]))
        if cfg.qkv_bias:
            qb, kb, vb = (take(tensors, p + f"self_attn.{n}_proj.bias") for n in "qkv")
            put(layer.qkv.bias, torch.cat([qb[heads], kb[kv_heads], vb[kv_heads]]))
        put(layer.o.weight, take(tensors, p + "self_attn.o_proj.weight", (h, cfg.num_heads * hd))[:, heads])
        if cfg.o_bias:
            row_bias(layer.o.bias, take(tensors, p + "self_attn.o_proj.bias"))
        if layer.sinks is not None:
            put(layer.sinks, take(tensors, p + "self_attn.sinks", (cfg.num_heads,))[sh.heads.start:sh.heads.stop])
        if cfg.qk_norm:
            put(layer.q_norm.weight, take(tensors, p + "self_attn.q_norm.weight", (hd,)))
            put(layer.k_norm.weight, take(tensors, p + "self_attn.k_norm.weight", (hd,)))


def split_fused(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3 stores each layer's q/k/v as one `qkv_proj` ([q | k | v] rows) and gate/up as one `gate_up_proj`
    ([gate | up] rows): split into Llama's names so each rank slices its heads and columns as for Llama."""
    out = dict(tensors)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = take(tensors, p + "self_attn.qkv_proj.weight", (q + 2 * kv, cfg.hidden_size))
        for name, part in zip(("q", "k", "v"), qkv.split([q, kv, kv])):
            out[f"{p}self_attn.{name}_proj.weight"] = part
        gate_up = take(tensors, p + "mlp.gate_up_proj.weight", (2 * inter, cfg.hidden_size))
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate_up.split([inter, inter])
    return out
