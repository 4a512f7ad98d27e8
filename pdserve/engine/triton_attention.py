"""Paged attention for CUDA in Triton, reading the block-major KV pool in place through the block tables.

The pool keeps its layout `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (one block = one NIXL
descriptor across all layers, kv_cache.py). A layer's K (or V) is the strided view `kv[:, layer, 0|1]`; the
kernels take that view (no copy) and find key position `p` of a sequence at block `table[p // block_size]`, row
`p % block_size`, so the key tile width is independent of the block size and nothing is gathered or padded to the
longest sequence: each program stops at its own sequence's context length.

- decode: one program per (sequence, KV head, split of the context). The query heads of one GQA group are the
  rows of one `tl.dot` (padded to 16, the smallest MMA tile), so K/V of a group is read once. With more than one
  split ("flash decoding": batch 1 has too few programs to fill the GPU) each split writes a partial (max, sum,
  accumulator) and a second kernel merges them.
- prefill / chunked prefill with prefix hits: one program per (span, tile of its new queries, query head); the
  tile's queries sit at absolute positions `context_len - q_len + i` and attend causally to the cached blocks
  and the chunk, whose K/V the layer has already written into the pool.

Both have the signatures of the CPU kernels (kernels.py / csrc), so attention.py dispatches to either through
`AttentionMetadata.native_ops`; Triton's also take `sinks` (gpt-oss: a logit per query head in the softmax's
denominator, started from as a key of value zero) and every layer passes its own window.
- MLA decode (`mla_decode_attention`): the absorbed form over the latent pool (mla.py), one program per (sequence,
  16 query heads); every head reads the same cached entries. Under `TRITON_INTERPRET=1` (set before this module is imported) the same
kernels run on CPU tensors: that is how CI tests them (tests/engine/test_triton_attention.py).
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # CPU-only installs without Triton: the CUDA path reports why it is unavailable
    triton = None
    IMPORT_ERROR: str | None = f"triton is not importable ({e})"
else:
    IMPORT_ERROR = None

MMA_MIN = 16  # tl.dot needs every dimension >= 16
DECODE_BLOCK_N = 32  # keys per decode iteration
PREFILL_BLOCK_M = 32  # queries per prefill program
PREFILL_BLOCK_N = 32  # keys per prefill iteration
SPLIT_MIN_KEYS = 256  # a decode split covers at least this many keys (fewer: merge overhead dominates)


def _pow2(n: int, lo: int = MMA_MIN) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Context splits per (sequence, KV head): enough programs for ~2 per SM, each split >= SPLIT_MIN_KEYS keys.
    Computed from shapes only (the block-table width bounds the context), so it needs no device sync."""
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, -(-2 * num_sms // programs))
    return max(1, min(want, max_context // SPLIT_MIN_KEYS, 64))


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, Out, Rows, Tables, Lens, PartAcc, PartML, Sinks, scale, window,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
                       stride_tab, stride_pb, stride_ph, stride_ps,
                       GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_SINK: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(Rows + b)
        ctx = tl.load(Lens + b)
        hs = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + hs
        hmask = hs < GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # the query sits at ctx - 1 and, with a sliding window, sees keys at positions > ctx - 1 - window
        lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        per = tl.cdiv(tl.cdiv(ctx - lo, SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * per
        end = tl.minimum(start + per, ctx)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        if HAS_SINK:  # the sink is a key of value zero: split 0 starts from it (max = sink, sum = exp(0))
            sink = tl.load(Sinks + heads, mask=hmask, other=0.0).to(tl.float32)
            m = tl.where(split == 0, sink, m)
            l = tl.where(split == 0, 1.0, l)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            blk = tl.load(Tables + b * stride_tab + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            off = blk * stride_kb + (n % BLOCK_SIZE) * stride_kt + kvh * stride_kh
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(K + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if SPLITS == 1:
            o = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                     mask=hmask[:, None] & dmask[None, :])
        else:
            base = b * stride_pb + heads * stride_ph + split * stride_ps
            tl.store(PartAcc + base[:, None] * BLOCK_D + d[None, :], acc, mask=hmask[:, None])
            tl.store(PartML + base * 2, m, mask=hmask)
            tl.store(PartML + base * 2 + 1, l, mask=hmask)

    @triton.jit
    def _merge_kernel(Out, Rows, PartAcc, PartML, stride_ot, stride_oh, stride_pb, stride_ph, stride_ps,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(Rows + b)
        d = tl.arange(0, BLOCK_D)
        s = tl.arange(0, SPLITS)
        base = b * stride_pb + h * stride_ph + s * stride_ps
        m = tl.load(PartML + base * 2)
        l = tl.load(PartML + base * 2 + 1)
        acc = tl.load(PartAcc + base[:, None] * BLOCK_D + d[None, :])
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp(m - mx)  # empty splits have m = -inf: weight 0
        total = tl.sum(w * l, 0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(Out + row * stride_ot + h * stride_oh + d, o.to(Out.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _prefill_kernel(Q, K, V, Out, Starts, QLens, Lens, Tables, Sinks, scale, window,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_tab,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_SINK: tl.constexpr):
        span = tl.program_id(0)
        tile = tl.program_id(1)
        h = tl.program_id(2)
        kvh = h // GROUP
        start = tl.load(Starts + span)
        q_len = tl.load(QLens + span)
        ctx = tl.load(Lens + span)
        m0 = tile * BLOCK_M
        i = m0 + tl.arange(0, BLOCK_M)
        imask = i < q_len
        qpos = ctx - q_len + i  # absolute positions of this tile's queries
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(Q + (start + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=imask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # keys up to the tile's last query (causal); none at all when the tile lies past this span's queries
        hi = tl.where(m0 < q_len, tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M), 0)
        lo = tl.where(window > 0, tl.maximum(ctx - q_len + m0 - window + 1, 0), 0)
        if HAS_SINK:  # every query row starts from the sink, a key of value zero
            m = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + h).to(tl.float32)
            l = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            blk = tl.load(Tables + span * stride_tab + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            off = blk * stride_kb + (n % BLOCK_SIZE) * stride_kt + kvh * stride_kh
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(K + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = nmask[None, :] & (n[None, :] <= qpos[:, None]) & \
                ((window <= 0) | (n[None, :] > qpos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(Out + (start + i)[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                 mask=imask[:, None] & dmask[None, :])

    @triton.jit
    def _mla_decode_kernel(Q, K, V, Out, Tables, Lens, scale,
                           stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_kt, stride_tab,
                           HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr):
        """Absorbed latent attention, one program per (sequence, tile of query heads): every head attends to the
        same cached entry (latent + rope key, split in halves across the pool's K and V slots), scores are
        q . entry and the output is the probability-weighted entry, in latent space."""
        b = tl.program_id(0)
        hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = hs < HEADS
        ctx = tl.load(Lens + b)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        qmask = hmask[:, None] & dmask[None, :]
        q_base = Q + b * stride_qb + hs[:, None] * stride_qh + d[None, :]
        q1 = tl.load(q_base, mask=qmask, other=0.0)
        q2 = tl.load(q_base + HALF, mask=qmask, other=0.0)
        if UPCAST:
            q1, q2 = q1.to(tl.float32), q2.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        acc2 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(0, ctx, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < ctx
            blk = tl.load(Tables + b * stride_tab + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            off = blk * stride_kb + (n % BLOCK_SIZE) * stride_kt
            kvmask = nmask[:, None] & dmask[None, :]
            e1 = tl.load(K + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            e2 = tl.load(V + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if UPCAST:
                e1, e2 = e1.to(tl.float32), e2.to(tl.float32)
            s = (tl.dot(q1, tl.trans(e1), input_precision=PRECISION)
                 + tl.dot(q2, tl.trans(e2), input_precision=PRECISION)) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc1 = acc1 * alpha[:, None] + tl.dot(p.to(e1.dtype), e1, input_precision=PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(e2.dtype), e2, input_precision=PRECISION)
            m = m_new
        inv = 1.0 / tl.where(l > 0, l, 1.0)
        o_base = Out + b * stride_ob + hs[:, None] * stride_oh + d[None, :]
        tl.store(o_base, (acc1 * inv[:, None]).to(Out.dtype.element_ty), mask=qmask)
        tl.store(o_base + HALF, (acc2 * inv[:, None]).to(Out.dtype.element_ty), mask=qmask)


def _layer_views(kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `layer` as strided views of the pool (no copy): [num_blocks, block_size, KVH, D]."""
    assert kv.stride(-1) == 1, "the pool's head_dim must be contiguous"
    return kv[:, layer, 0], kv[:, layer, 1]


def _precision(dtype: torch.dtype) -> str:
    # fp32 models keep fp32 products (tf32 would not match the fp32 reference / transformers); bf16/fp16 ignore it.
    return "ieee"


def _upcast() -> bool:
    """Under the interpreter, bf16 tensors become garbage in tl.dot and bf16 arithmetic (Triton 3.9's numpy
    emulation), so q/k/v are converted to fp32 after loading there. On a GPU the dots take the pool's dtype
    (tensor cores, fp32 accumulation); only that operand dtype differs from what CI runs."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonAttention:
    """The CUDA attention backend: the CPU kernel module's two entry points, implemented with Triton."""

    def __init__(self, num_sms: int = 132, decode_splits_override: int | None = None):
        if triton is None:
            raise RuntimeError(IMPORT_ERROR)
        self.num_sms = num_sms
        self.decode_splits_override = decode_splits_override

    @classmethod
    def for_device(cls, device: torch.device) -> "TritonAttention":
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        return cls(num_sms=sms)

    def paged_decode_attention(self, out, q, kv, layer, rows, block_tables, context_lens, scale, window,
                               sinks=None):
        """`window` > 0: the query sees the last `window` keys only; `sinks` ([H] or None): a logit per query head
        in the softmax's denominator (gpt-oss)."""
        num = rows.shape[0]
        if num == 0:
            return
        k, v = _layer_views(kv, layer)
        n_heads, head_dim = q.shape[1], q.shape[2]
        n_kv = kv.shape[4]
        group = n_heads // n_kv
        block_size = kv.shape[3]
        max_ctx = block_tables.shape[1] * block_size
        splits = self.decode_splits_override or decode_splits(num, n_kv, max_ctx, self.num_sms)
        splits = _pow2(splits, 1)  # the merge kernel's tl.arange needs a power of two
        block_d = _pow2(head_dim)
        if splits > 1:
            part_acc = torch.empty((num, n_heads, splits, block_d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((num, n_heads, splits, 2), dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = torch.empty(0, dtype=torch.float32, device=q.device)
        _decode_kernel[(num, n_kv, splits)](
            q, k, v, out, rows, block_tables, context_lens, part_acc, part_ml, q if sinks is None else sinks,
            float(scale), int(window or 0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
            block_tables.stride(0), n_heads * splits, splits, 1,
            GROUP=group, BLOCK_H=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
            BLOCK_N=DECODE_BLOCK_N, SPLITS=splits, PRECISION=_precision(q.dtype), UPCAST=_upcast(),
            HAS_SINK=sinks is not None)
        if splits > 1:
            _merge_kernel[(num, n_heads)](out, rows, part_acc, part_ml, out.stride(0), out.stride(1),
                                          n_heads * splits, splits, 1, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                          SPLITS=splits)

    def paged_prefill_attention(self, out, q, kv, layer, starts, q_lens, context_lens, block_tables, scale, window,
                                sinks=None):
        spans = starts.shape[0]
        if spans == 0:
            return
        k, v = _layer_views(kv, layer)
        n_heads, head_dim = q.shape[1], q.shape[2]
        n_kv = kv.shape[4]
        block_size = kv.shape[3]
        # Tiles per span bounded from shapes (no device sync): a span has at most min(all tokens, its table's
        # capacity) queries; tiles past a span's own q_len exit without reading anything.
        bound = min(q.shape[0], block_tables.shape[1] * block_size)
        tiles = -(-bound // PREFILL_BLOCK_M)
        _prefill_kernel[(spans, tiles, n_heads)](
            q, k, v, out, starts, q_lens, context_lens, block_tables, q if sinks is None else sinks, float(scale),
            int(window or 0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
            block_tables.stride(0),
            GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_SIZE=block_size,
            BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, PRECISION=_precision(q.dtype), UPCAST=_upcast(),
            HAS_SINK=sinks is not None)

    def mla_decode_attention(self, q, kv, layer, block_tables, context_lens, scale) -> torch.Tensor:
        """Absorbed MLA decode over the latent pool (mla.py's layout: one KV "head", the entry's first half in the
        K slot, its second in the V slot). `q` [B, H, rank + rope]: the no-rope query projected into latent space
        beside the rotated rope query. Returns [B, H, rank + rope] fp32: the attention-weighted entries (the
        caller keeps the latent part and up-projects it)."""
        num, heads, width = q.shape
        k, v = _layer_views(kv, layer)
        half = kv.shape[-1]
        assert width == 2 * half and kv.shape[4] == 1, "q must match the latent entry of a one-head MLA pool"
        out = torch.empty((num, heads, width), dtype=torch.float32, device=q.device)
        if num == 0:
            return out
        q = q.contiguous()
        block_h = MMA_MIN  # two [heads, entry/2] fp32 accumulators: wider head tiles spill at DeepSeek's 576
        _mla_decode_kernel[(num, -(-heads // block_h))](
            q, k, v, out, block_tables, context_lens, float(scale),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), block_tables.stride(0),
            HEADS=heads, BLOCK_H=block_h, HALF=half, BLOCK_D=_pow2(half), BLOCK_SIZE=kv.shape[3],
            BLOCK_N=DECODE_BLOCK_N, PRECISION=_precision(q.dtype), UPCAST=_upcast())
        return out
