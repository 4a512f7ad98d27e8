"""The native CPU kernels against independent references: attention written out per sequence in float64, and
silu(gate) * up in float64."""
from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.kernels import native_ops, native_unavailable_reason

pytestmark = pytest.mark.skipif(os.environ.get("PDSERVE_NATIVE_KERNELS") == "0", reason="native kernels disabled")


@pytest.fixture(scope="module")
def ops():
    mod = native_ops()
    assert mod is not None, f"native kernels failed to build: {native_unavailable_reason()}"
    return mod


def scattered_tables(lens: torch.Tensor, bs: int, n_blocks: int, g: torch.Generator, width: int = 0) -> torch.Tensor:
    """Distinct random blocks per sequence, each table padded with block 0 past its context."""
    perm = torch.randperm(n_blocks, generator=g).tolist()
    width = max(width, max(-(-n // bs) for n in lens.tolist()))
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens.tolist()):
        need = -(-n // bs)
        tables[i, :need] = torch.tensor(perm[used:used + need])
        used += need
    return tables


def reference(q, kv, layer, rows, tables, lens, scale, window):
    """softmax(q k^T * scale) v per sequence and head, K/V gathered position by position, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, n_kv = kv.shape[3], kv.shape[4]
    group = q.shape[1] // n_kv
    for r, table, n in zip(rows.tolist(), tables.tolist(), lens.tolist()):
        first = max(0, n - window) if window else 0
        pos = range(first, n)
        k = torch.stack([kv[table[p // bs], layer, 0, p % bs] for p in pos]).double()  # [S, KVH, D]
        v = torch.stack([kv[table[p // bs], layer, 1, p % bs] for p in pos]).double()
        for h in range(q.shape[1]):
            s = (k[:, h // group] @ q[r, h].double()) * scale
            out[r, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n_heads,n_kv,window", [(8, 2, 0), (4, 4, 0), (6, 3, 7)])
def test_decode_attention_matches_reference(ops, dtype, tol, n_heads, n_kv, window):
    g = torch.Generator().manual_seed(n_heads * 10 + n_kv + window)
    n_blocks, layers, bs, d = 40, 3, 4, 16
    kv = torch.randn(n_blocks, layers, 2, bs, n_kv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 4, 5, 13, 30], dtype=torch.long)
    tables = scattered_tables(lens, bs, n_blocks, g, width=9)
    rows = torch.tensor([6, 0, 3, 2, 5], dtype=torch.long)  # scattered rows of a flat batch of 7 tokens
    q = torch.randn(7, n_heads, d, generator=g).to(dtype)
    out = torch.full_like(q, 7.0)
    ops.paged_decode_attention(out, q, kv, 1, rows, tables, lens, d ** -0.5, window)
    ref = reference(q, kv, 1, rows, tables, lens, d ** -0.5, window)
    assert (out[rows].double() - ref[rows]).abs().max().item() <= tol
    untouched = [i for i in range(7) if i not in rows.tolist()]
    assert (out[untouched] == 7.0).all()  # rows that are not decodes are left alone


def test_decode_attention_rejects_out_of_range_indices(ops):
    kv = torch.zeros(4, 1, 2, 4, 1, 8)
    q = torch.zeros(2, 1, 8)
    out = torch.empty_like(q)
    ok = dict(rows=torch.tensor([0]), tables=torch.tensor([[3]]), lens=torch.tensor([4]))
    ops.paged_decode_attention(out, q, kv, 0, ok["rows"], ok["tables"], ok["lens"], 1.0, 0)
    bad = [
        dict(ok, tables=torch.tensor([[4]])),  # block id past the pool
        dict(ok, rows=torch.tensor([2])),  # row past the batch
        dict(ok, lens=torch.tensor([5])),  # context longer than its table
        dict(ok, lens=torch.tensor([0])),  # empty context
    ]
    for b in bad:
        with pytest.raises(RuntimeError, match="out of range"):
            ops.paged_decode_attention(out, q, kv, 0, b["rows"], b["tables"], b["lens"], 1.0, 0)
    with pytest.raises(RuntimeError, match="layer out of range"):
        ops.paged_decode_attention(out, q, kv, 1, ok["rows"], ok["tables"], ok["lens"], 1.0, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.paged_decode_attention(out, q.double(), kv, 0, ok["rows"], ok["tables"], ok["lens"], 1.0, 0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
@pytest.mark.parametrize("width", [48, 37])  # 37: a tail shorter than one vector
def test_silu_and_mul_matches_torch(ops, dtype, tol, width):
    g = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(33, 2 * width, generator=g) * 6).to(dtype)  # wide range: exp saturates at both ends
    out = torch.empty(33, width, dtype=dtype)
    ops.silu_and_mul(out, gate_up)
    x = gate_up.double()
    ref = x[:, :width] * torch.sigmoid(x[:, :width]) * x[:, width:]
    rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert rel <= tol


def test_silu_and_mul_rejects_bad_shapes(ops):
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.silu_and_mul(torch.empty(2, 3), torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.silu_and_mul(torch.empty(2, 4), torch.empty(2, 6))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_rms_norm_matches_float64(ops, dtype, tol):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 5, 80, generator=g) * 3).to(dtype)
    w = torch.randn(80, generator=g).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert ((out.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item() <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_rope_in_place_on_a_strided_view_matches_float64(ops, dtype, tol):
    """q as a view into a fused qkv row (what the model passes): rotated in place, neighbours untouched."""
    g = torch.Generator().manual_seed(2)
    t, heads, d = 11, 3, 16
    qkv = torch.randn(t, heads * d + 8, generator=g).to(dtype)
    before = qkv.clone()
    q = qkv[:, :heads * d].view(t, heads, d)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * (0.5 ** torch.arange(d // 2, dtype=torch.float64))
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ops.rope_(q, cos, sin)
    x = before[:, :heads * d].view(t, heads, d).double()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    assert (q.double() - ref).abs().max().item() <= tol
    assert torch.equal(qkv[:, heads * d:], before[:, heads * d:])


def test_argmax_logsumexp_matches_torch(ops):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1003, generator=g) * 8  # 1003: a tail shorter than one vector
    x[1, 500] = x[1, 20] = x[1, 999] = 1e3  # ties: the lowest index wins, as torch.argmax
    x[2] = float("-inf")
    x[2, 1000] = -5.0  # the only finite logit sits in the scalar tail
    x[3, :] = 0.0  # all equal
    arg, lse = ops.argmax_logsumexp(x)
    assert arg.tolist() == x.argmax(-1).tolist() and arg[1].item() == 20 and arg[3].item() == 0
    ref = torch.logsumexp(x.double(), -1)
    assert (lse.double() - ref).abs().max().item() <= 1e-4
    tiny = torch.tensor([[1.0, 3.0, 2.0]])  # shorter than a vector
    a, lse1 = ops.argmax_logsumexp(tiny)
    assert a.item() == 1 and abs(lse1.item() - torch.logsumexp(tiny, -1).item()) <= 1e-6
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_logsumexp(x.double())


def prefill_reference(q, kv, layer, starts, q_lens, ctx_lens, tables, scale, window):
    """Causal attention of each span's queries over its context, position by position, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, n_kv = kv.shape[3], kv.shape[4]
    group = q.shape[1] // n_kv
    for s0, n, ctx, table in zip(starts.tolist(), q_lens.tolist(), ctx_lens.tolist(), tables.tolist()):
        k = torch.stack([kv[table[p // bs], layer, 0, p % bs] for p in range(ctx)]).double()  # [ctx, KVH, D]
        v = torch.stack([kv[table[p // bs], layer, 1, p % bs] for p in range(ctx)]).double()
        for i in range(n):
            pos = ctx - n + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                sc = (k[lo:pos + 1, h // group] @ q[s0 + i, h].double()) * scale
                out[s0 + i, h] = torch.softmax(sc, 0) @ v[lo:pos + 1, h // group]
    return out


@pytest.mark.parametrize("n_heads,n_kv,d,window", [(6, 2, 16, 0), (4, 4, 32, 0), (8, 1, 16, 0), (6, 3, 16, 9)])
def test_prefill_attention_matches_float64(ops, n_heads, n_kv, d, window):
    """Spans in one flat batch: a whole prompt, a chunk after cached context (q_len < context_len), a one-token
    span and a span longer than the kernel's 32-query chunks; blocks scattered through the pool."""
    kv0 = torch.zeros(1, 1, 2, 4, n_kv, 16 * (d // 16), dtype=torch.bfloat16)
    if not ops.prefill_attention_supported(kv0, n_heads):
        pytest.skip("prefill kernel needs AVX-512 (SDPA is the path here)")
    g = torch.Generator().manual_seed(n_heads + n_kv + d + window)
    n_blocks, layers, bs = 64, 2, 4
    kv = torch.randn(n_blocks, layers, 2, bs, n_kv, d, generator=g).to(torch.bfloat16)
    q_lens = torch.tensor([13, 7, 1, 45], dtype=torch.long)
    ctx_lens = torch.tensor([13, 30, 9, 45], dtype=torch.long)
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), q_lens[:-1]]), 0)
    tables = scattered_tables(ctx_lens, bs, n_blocks, g)
    t = int(q_lens.sum())
    q = torch.randn(t, n_heads, d, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    ops.paged_prefill_attention(out, q, kv, 1, starts, q_lens, ctx_lens, tables, d ** -0.5, window)
    ref = prefill_reference(q, kv, 1, starts, q_lens, ctx_lens, tables, d ** -0.5, window)
    assert (out.double() - ref).abs().max().item() <= 2e-2  # bf16 output rounding of values |x| < 4


def test_prefill_attention_rejects_bad_spans(ops):
    kv = torch.zeros(4, 1, 2, 4, 1, 16, dtype=torch.bfloat16)
    if not ops.prefill_attention_supported(kv, 2):
        pytest.skip("prefill kernel needs AVX-512")
    q = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    one = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    table = lambda *v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    ops.paged_prefill_attention(out, q, kv, 0, one(0), one(3), one(5), table(0, 1), 1.0, 0)
    for args in [(one(1), one(3), one(5), table(0, 1)),  # rows past the batch
                 (one(0), one(3), one(9), table(0, 1)),  # context longer than the table
                 (one(0), one(3), one(2), table(0, 1)),  # fewer context tokens than queries
                 (one(0), one(3), one(5), table(0, 4))]:  # block past the pool
        with pytest.raises(RuntimeError, match="out of range"):
            ops.paged_prefill_attention(out, q, kv, 0, *args, 1.0, 0)
    assert not ops.prefill_attention_supported(kv.float(), 2)  # bf16 only: SDPA serves other dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_each_row_at_its_slot(ops, dtype):
    """Rows of strided k/v views (as the fused qkv output gives them) land at (block, layer, K|V, offset), written
    position by position as the reference; every other slot of the pool keeps its value."""
    g = torch.Generator().manual_seed(3)
    n, layers, bs, n_kv, d, t = 6, 3, 4, 2, 8, 5
    kv = torch.randn(n, layers, 2, bs, n_kv, d, generator=g).to(dtype)
    qkv = torch.randn(t, 4 * d + 2 * n_kv * d, generator=g).to(dtype)  # q of 4 heads, then k, then v
    k = qkv[:, 4 * d:4 * d + n_kv * d].view(t, n_kv, d)
    v = qkv[:, 4 * d + n_kv * d:].view(t, n_kv, d)
    slots = torch.randperm(n * bs, generator=g)[:t]
    blocks, offsets = slots // bs, slots % bs
    want = kv.clone()
    for i in range(t):
        want[blocks[i], 1, 0, offsets[i]] = k[i]
        want[blocks[i], 1, 1, offsets[i]] = v[i]
    ops.write_kv(kv, 1, blocks, offsets, k, v)
    assert torch.equal(kv, want)
    with pytest.raises(ValueError, match="slot out of range"):
        ops.write_kv(kv, 1, blocks + n, offsets, k, v)
    with pytest.raises(ValueError, match="layer out of range"):
        ops.write_kv(kv, layers, blocks, offsets, k, v)
    with pytest.raises(ValueError, match="pool's dtype"):
        ops.write_kv(kv, 1, blocks, offsets, k.double(), v.double())


def test_build_targets_the_detected_isa(ops):
    """The module is compiled for the CPU's level, lowered by PDSERVE_CPU_ISA (run this file with
    PDSERVE_CPU_ISA=avx2 on an AVX-512 machine to test the AVX2 paths against the same references)."""
    from pdserve.engine.cpu_isa import detected_level
    assert ops.compiled_isa() == detected_level()
