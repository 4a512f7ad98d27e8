"""Paged attention: K/V live in fixed-size blocks; each sequence reads its context through its block table.

The KV pool is one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so a block of one
sequence is contiguous across all layers (one transfer descriptor / one swap copy per block). A layer's cache is
the strided view `kv[:, layer, 0|1]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine.kv_quant import is_quantized, quantize, raw


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence's tokens in the flat batch
    q_len: int  # tokens computed in this step
    context_len: int  # tokens of context after this step (cached + new)
    block_table: torch.Tensor  # [n_blocks] int64
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when plain causal with no cached prefix


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [D] rows of the flat batch that are single-token decodes
    block_tables: torch.Tensor  # [D, max_blocks] (padded with block 0)
    bias: torch.Tensor  # [D, 1, 1, max_blocks * block_size] float: 0 = attend, -inf = masked
    context_lens: torch.Tensor | None = None  # [D]: a layer with its own window builds its bias from them


@dataclass
class NativeDecode:
    """All single-token decodes of a step for the native kernel: no padding mask, no grouping needed."""
    rows: torch.Tensor  # [D] int64 rows of the flat batch
    block_tables: torch.Tensor  # [D, max_blocks] int64 (padding past a context is never read)
    context_lens: torch.Tensor  # [D] int64


@dataclass
class NativePrefill:
    """All prefill spans of a step for the native kernel (causal over the pool; no masks built)."""
    starts: torch.Tensor  # [S] int64 first row of each span
    q_lens: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, max_blocks] int64


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [T] offset inside that block
    prefills: list[PrefillSpan]
    decodes: list[DecodeGroup]  # single-token decodes, grouped by similar context length (torch path)
    native_decode: NativeDecode | None = None  # the same decodes for the native kernel (replaces `decodes`)
    native_prefill: NativePrefill | None = None  # the prefill spans for the native kernel (replaces `prefills`)
    # The kernels when `native_decode` or `native_prefill` is set: the compiled CPU module (kernels.py) or, on
    # CUDA, triton_attention.TritonAttention (the same two entry points).
    native_ops: object = None
    sliding_window: int | None = None
    # Masks of layers with their own window (gpt-oss), built by the first such layer of a step, reused by the rest
    layer_masks: dict = field(default_factory=dict)


def causal_mask(q_len: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Query i sits at absolute position context_len - q_len + i and sees keys at positions <= its own."""
    if q_len == context_len and sliding_window is None:
        return None
    q_pos = torch.arange(context_len - q_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def decode_bias(context_lens: torch.Tensor, width: int, sliding_window: int | None) -> torch.Tensor:
    """Additive mask for padded single-query attention: key j of row i is visible iff j < len_i (and within
    the sliding window)."""
    k_pos = torch.arange(width, device=context_lens.device).unsqueeze(0)
    visible = k_pos < context_lens.unsqueeze(1)
    if sliding_window is not None:
        visible &= k_pos >= (context_lens - sliding_window).unsqueeze(1)
    bias = torch.zeros(visible.shape, device=context_lens.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None, None, :]


def gather_blocks(kv: torch.Tensor, layer: int, tables: torch.Tensor, which: int) -> torch.Tensor:
    """K (which=0) or V (1) of `layer` for the blocks in `tables` (any shape) -> [*tables.shape, bs, KVH, D].

    The pool is viewed as rows of one (block, layer, K|V) each, so this is an `index_select` of whole
    contiguous rows: several times faster on CPU than advanced indexing of the strided per-layer view."""
    n, layers = kv.shape[0], kv.shape[1]
    rows = kv.view(n * layers * 2, -1)
    idx = tables * (layers * 2) + (layer * 2 + which)
    return rows.index_select(0, idx.reshape(-1)).view(*tables.shape, *kv.shape[3:])


def write_kv(kv: torch.Tensor, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, native_ops=None) -> None:
    """Store the step's new K/V rows ([T, KVH, D]) at their (block, offset) slots of `layer`.

    With the native kernels (CPU, k/v already in the pool's dtype) one call copies the rows (csrc/kv_write.cpp).
    Otherwise the pool is viewed as token rows `[(block, layer, K|V, offset), KVH * D]` and written with
    `index_copy_` of whole rows: advanced-index assignment into the strided per-layer view was ~1 ms per call
    here (16% of a mixed workload's time); this is a row memcpy."""
    native_write = getattr(native_ops, "write_kv", None)  # the CPU module has it; Triton's ops do not
    if native_write is not None and k.dtype == kv.dtype and kv.device.type == "cpu":
        native_write(kv, layer, slot_blocks, slot_offsets, k, v)
        return
    n, layers, _, bs = kv.shape[:4]
    rows = raw(kv).view(n * layers * 2 * bs, -1)
    k_rows = slot_blocks * (layers * 2 * bs) + (layer * 2 * bs) + slot_offsets
    rows.index_copy_(0, k_rows, raw(quantize(k.reshape(k.shape[0], -1), kv.dtype)))
    rows.index_copy_(0, k_rows + bs, raw(quantize(v.reshape(v.shape[0], -1), kv.dtype)))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    kv: torch.Tensor,  # the whole pool [num_blocks, num_layers, 2, block_size, KVH, D]
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # [H] a logit per query head in every softmax's denominator (gpt-oss)
    window: int | None | str = "model",  # this layer's own window (None: full); "model": meta.sliding_window
) -> torch.Tensor:
    """Sinks and per-layer windows reach the kernels only on the Triton path (the runner builds no native
    metadata for them on CPU: the compiled kernels take neither)."""
    # Write first: a token attends to its own key, and chunks attend to earlier chunks through the cache.
    write_kv(kv, layer, meta.slot_blocks, meta.slot_offsets, k, v, meta.native_ops)
    out = torch.empty_like(q)
    n_kv = k.shape[1]
    win = (meta.sliding_window if window == "model" else window) or 0
    extra = {} if sinks is None else {"sinks": sinks}  # the CPU module's signature has no sinks
    if meta.native_prefill is not None:
        npf = meta.native_prefill
        meta.native_ops.paged_prefill_attention(out, q, kv, layer, npf.starts, npf.q_lens, npf.context_lens,
                                                npf.block_tables, scale, win, **extra)
    for span in meta.prefills:
        qs = q[span.start:span.start + span.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if span.mask is None:  # whole prompt in this step: use the fresh K/V, no gather needed
            ks = k[span.start:span.start + span.q_len]
            vs = v[span.start:span.start + span.q_len]
        else:
            ks = gather_blocks(kv, layer, span.block_table, 0).flatten(0, 1)[:span.context_len]
            vs = gather_blocks(kv, layer, span.block_table, 1).flatten(0, 1)[:span.context_len]
        ks = ks.to(q.dtype).transpose(0, 1).unsqueeze(0)
        vs = vs.to(q.dtype).transpose(0, 1).unsqueeze(0)
        mask = span.mask if window == "model" else _span_mask(meta, span, window)
        if sinks is not None:
            o = sink_attention(qs, ks, vs, mask, sinks, scale)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=n_kv != q.shape[1])
        out[span.start:span.start + span.q_len] = o.squeeze(0).transpose(0, 1)
    if meta.native_decode is not None:
        nd = meta.native_decode
        meta.native_ops.paged_decode_attention(out, q, kv, layer, nd.rows, nd.block_tables, nd.context_lens,
                                               scale, win, **extra)
    _grouped_decode(out, q, kv, layer, meta, scale, sinks, window, n_kv)
    return out


def _grouped_decode(out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, layer: int, meta: AttentionMetadata,
                    scale: float, sinks: torch.Tensor | None, window: int | None | str, n_kv: int) -> None:
    """The torch path's decodes, group by group (`meta.decodes`), written into `out`."""
    for g, grp in enumerate(meta.decodes):
        # Single-query attention as two batched matmuls in the cache dtype (scores and softmax in fp32): on CPU
        # this is ~2.5x faster than SDPA, whose kernels tile for long queries and want the K/V converted.
        b, h, d = grp.rows.numel(), q.shape[1], q.shape[2]
        kd = gather_blocks(kv, layer, grp.block_tables, 0).flatten(1, 2)  # [B, S, KVH, D]
        vd = gather_blocks(kv, layer, grp.block_tables, 1).flatten(1, 2)
        if is_quantized(kd.dtype):  # no matmul in fp8 on CPU: dequantize the gathered context
            kd, vd = kd.to(q.dtype), vd.to(q.dtype)
        qd = q[grp.rows].to(kd.dtype).view(b, n_kv, h // n_kv, d)  # query heads grouped by KV head
        bias = grp.bias if window == "model" else _group_bias(meta, g, grp, window)
        scores = torch.matmul(qd, kd.permute(0, 2, 3, 1)).float() * scale + bias  # [B, KVH, group, S]
        if sinks is None:
            probs = torch.softmax(scores, dim=-1).to(vd.dtype)
        else:  # the sink joins the denominator and is dropped: its "value" is zero
            sink = sinks.float().view(1, n_kv, h // n_kv, 1).expand(b, -1, -1, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(vd.dtype)
        out[grp.rows] = torch.matmul(probs, vd.transpose(1, 2)).reshape(b, h, d).to(q.dtype)


def _span_mask(meta: AttentionMetadata, span: PrefillSpan, window: int | None) -> torch.Tensor | None:
    """A prefill span's mask for a layer with its own window (the model-wide window is None then)."""
    if window is None:
        return span.mask
    key = ("prefill", span.start, window)
    if key not in meta.layer_masks:
        meta.layer_masks[key] = causal_mask(span.q_len, span.context_len, window, span.block_table.device)
    return meta.layer_masks[key]


def _group_bias(meta: AttentionMetadata, g: int, grp: DecodeGroup, window: int | None) -> torch.Tensor:
    if window is None:
        return grp.bias
    key = ("decode", g, window)
    if key not in meta.layer_masks:
        meta.layer_masks[key] = decode_bias(grp.context_lens, grp.bias.shape[-1], window)
    return meta.layer_masks[key]


SINK_QUERY_TILE = 256  # query rows per pass of sink_attention: its fp32 scores are [H, tile, context]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks[h]`, with no value (gpt-oss): q [1, H, q, D],
    k/v [1, KVH, c, D], mask [q, c] bool or None (plain causal, q == c). Scores and softmax in fp32; the scores
    are materialised, which SDPA avoids but cannot do with a sink, so queries go SINK_QUERY_TILE rows at a time
    (64 heads over an 8k context: 0.5 GB of scores per tile rather than 4 GB for a 2048-token chunk)."""
    h, n_kv, q_len, ctx = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if n_kv != h:
        k, v = k.repeat_interleave(h // n_kv, dim=1), v.repeat_interleave(h // n_kv, dim=1)
    if mask is None:
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril()
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    sink = sinks.float().view(1, h, 1, 1)
    for a in range(0, q_len, SINK_QUERY_TILE):
        b = min(q_len, a + SINK_QUERY_TILE)
        scores = torch.matmul(q[:, :, a:b], k.transpose(-1, -2)).float() * scale
        scores.masked_fill_(~mask[a:b], float("-inf"))
        probs = torch.softmax(torch.cat([scores, sink.expand(1, h, b - a, 1)], dim=-1), dim=-1)[..., :-1]
        out[:, :, a:b] = torch.matmul(probs.to(v.dtype), v)
    return out
