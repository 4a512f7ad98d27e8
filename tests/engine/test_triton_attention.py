"""The CUDA path's Triton paged attention, run on CPU under Triton's interpreter, against attention written out per
sequence and position in float64 (K/V looked up block by block through the table, independently of the kernels).

Every pool block the tables do not name, and every row of a named block past a sequence's context, holds NaN: a
kernel that read outside its sequence's context (or gathered/padded to the longest) would return NaN."""
from __future__ import annotations

import os

# tests/conftest.py sets TRITON_INTERPRET=1 on hosts without a GPU, before anything imports triton.
import pytest  # noqa: E402
import torch  # noqa: E402

triton_attention = pytest.importorskip("pdserve.engine.triton_attention")
if triton_attention.IMPORT_ERROR:
    pytest.skip(f"Triton kernels not testable: {triton_attention.IMPORT_ERROR}", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs TRITON_INTERPRET=1 (set by tests/conftest.py before triton is imported) or a GPU",
                allow_module_level=True)

if os.environ.get("TRITON_INTERPRET") == "1":
    import numpy  # noqa: E402
    import triton  # noqa: E402
    from packaging.version import Version  # noqa: E402
    # Triton < 3.8's interpreter turns a loaded scalar into a loop bound with int() of a 1-element array, which
    # NumPy >= 2.4 refuses (3.8 squeezes it first). Only the interpreter is affected, not the compiled kernels.
    if Version(triton.__version__) < Version("3.8") and Version(numpy.__version__) >= Version("2.4"):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run with NumPy {numpy.__version__} "
                    "(needs NumPy < 2.4 or Triton >= 3.8)", allow_module_level=True)

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
N_BLOCKS, LAYERS = 24, 2


def make_pool(bs, n_kv, d, dtype, lens, g, width_extra=1):
    """A pool of NaN with random K/V written only at each sequence's context positions; scattered tables padded
    with a block id whose contents are NaN too."""
    kv = torch.full((N_BLOCKS, LAYERS, 2, bs, n_kv, d), float("nan"), dtype=dtype)
    perm = torch.randperm(N_BLOCKS, generator=g).tolist()
    width = max(-(-n // bs) for n in lens) + width_extra
    tables = torch.full((len(lens), width), perm[-1], dtype=torch.long)  # perm[-1] is never used: NaN
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = torch.tensor(perm[used:used + need])
        used += need
        for p in range(n):
            kv[tables[i, p // bs], :, :, p % bs] = torch.randn(LAYERS, 2, n_kv, d, generator=g).to(dtype)
    return kv, tables


def reference(q, kv, layer, table, context_len, q_rows, scale, window, sinks=None):
    """Queries at rows q_rows are the last len(q_rows) positions of a context of context_len tokens. `sinks`: one
    more logit per head in the softmax, whose value is zero (gpt-oss)."""
    bs, n_kv = kv.shape[3], kv.shape[4]
    group = q.shape[1] // n_kv
    keys = torch.stack([kv[table[p // bs], layer, 0, p % bs] for p in range(context_len)]).double()
    vals = torch.stack([kv[table[p // bs], layer, 1, p % bs] for p in range(context_len)]).double()
    out = {}
    for j, r in enumerate(q_rows):
        qp = context_len - len(q_rows) + j
        lo = max(0, qp - window + 1) if window else 0
        for h in range(q.shape[1]):
            s = keys[lo:qp + 1, h // group] @ q[r, h].double() * scale
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1].double()])
            p = torch.softmax(s, 0)[:qp + 1 - lo]
            out[(r, h)] = p @ vals[lo:qp + 1, h // group]
    return out


def check(out, ref, tol):
    assert not torch.isnan(out).any(), "read outside a sequence's context (NaN)"
    for (r, h), want in ref.items():
        torch.testing.assert_close(out[r, h].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bs,n_heads,n_kv,d,window,splits", [
    (4, 4, 2, 16, 0, 1),   # GQA, one pass
    (3, 2, 2, 24, 0, 4),   # block size not a power of two, head_dim padded, split context merged
    (4, 6, 2, 16, 5, 2),   # sliding window, split
])
def test_decode_matches_reference(dtype, tol, bs, n_heads, n_kv, d, window, splits):
    g = torch.Generator().manual_seed(bs * 100 + n_heads * 10 + splits)
    lens = [1, 7, 13, 33]
    kv, tables = make_pool(bs, n_kv, d, dtype, lens, g)
    rows = torch.tensor([5, 0, 3, 2])  # scattered rows of a flat batch of 6 tokens
    q = torch.randn(6, n_heads, d, generator=g).to(dtype)
    out = torch.zeros_like(q).to(DEVICE)
    ops = triton_attention.TritonAttention(decode_splits_override=splits)
    scale = d ** -0.5
    ops.paged_decode_attention(out, q.to(DEVICE), kv.to(DEVICE), 1, rows.to(DEVICE), tables.to(DEVICE),
                               torch.tensor(lens).to(DEVICE), scale, window)
    out = out.cpu()
    for r, t, n in zip(rows.tolist(), tables, lens):
        check(out, reference(q, kv, 1, t.tolist(), n, [r], scale, window), tol)
    untouched = [1, 4]
    assert (out[untouched] == 0).all(), "wrote rows that are not decodes"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bs,n_heads,n_kv,d,window", [(4, 4, 2, 16, 0), (5, 2, 1, 16, 6)])
def test_prefill_with_prefix_hits_matches_reference(dtype, tol, bs, n_heads, n_kv, d, window):
    """Spans of a mixed flat batch: a chunk after a cached prefix (q 37 of ctx 45: two query tiles), a whole
    prompt, and a one-token chunk; rows not in any span are left alone."""
    g = torch.Generator().manual_seed(bs * 10 + window)
    spans = [(0, 37, 45), (38, 3, 3), (41, 1, 9)]  # (start row, q_len, context_len); row 37 is a decode
    kv, tables = make_pool(bs, n_kv, d, dtype, [c for _, _, c in spans], g)
    q = torch.randn(42, n_heads, d, generator=g).to(dtype)
    out = torch.zeros_like(q).to(DEVICE)
    scale = d ** -0.5
    ops = triton_attention.TritonAttention()
    ops.paged_prefill_attention(out, q.to(DEVICE), kv.to(DEVICE), 0, torch.tensor([s[0] for s in spans]).to(DEVICE),
                                torch.tensor([s[1] for s in spans]).to(DEVICE),
                                torch.tensor([s[2] for s in spans]).to(DEVICE), tables.to(DEVICE), scale, window)
    out = out.cpu()
    for (start, q_len, ctx), t in zip(spans, tables):
        check(out, reference(q, kv, 0, t.tolist(), ctx, list(range(start, start + q_len)), scale, window), tol)
    assert (out[37] == 0).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window,splits", [(0, 1), (5, 2), (0, 4)])
def test_decode_with_sinks_matches_reference(dtype, tol, window, splits):
    """gpt-oss's sinks: split 0 carries the sink into the merge; splits past a window's start hold nothing."""
    g = torch.Generator().manual_seed(7 + window + splits)
    bs, n_heads, n_kv, d = 4, 4, 2, 16
    lens = [1, 7, 13, 33]
    kv, tables = make_pool(bs, n_kv, d, dtype, lens, g)
    rows = torch.tensor([3, 0, 2, 1])
    q = torch.randn(4, n_heads, d, generator=g).to(dtype)
    sinks = (torch.randn(n_heads, generator=g) * 2).to(dtype)  # some above the scores, some below
    out = torch.zeros_like(q).to(DEVICE)
    ops = triton_attention.TritonAttention(decode_splits_override=splits)
    scale = d ** -0.5
    ops.paged_decode_attention(out, q.to(DEVICE), kv.to(DEVICE), 0, rows.to(DEVICE), tables.to(DEVICE),
                               torch.tensor(lens).to(DEVICE), scale, window, sinks=sinks.to(DEVICE))
    out = out.cpu()
    for r, t, n in zip(rows.tolist(), tables, lens):
        check(out, reference(q, kv, 0, t.tolist(), n, [r], scale, window, sinks), tol)


@pytest.mark.parametrize("window", [0, 6])
def test_prefill_with_sinks_matches_reference(window):
    g = torch.Generator().manual_seed(11 + window)
    bs, n_heads, n_kv, d = 4, 4, 2, 16
    spans = [(0, 37, 45), (37, 3, 3)]
    kv, tables = make_pool(bs, n_kv, d, torch.float32, [c for _, _, c in spans], g)
    q = torch.randn(40, n_heads, d, generator=g)
    sinks = torch.randn(n_heads, generator=g) * 2
    out = torch.zeros_like(q).to(DEVICE)
    scale = d ** -0.5
    triton_attention.TritonAttention().paged_prefill_attention(
        out, q.to(DEVICE), kv.to(DEVICE), 1, torch.tensor([s[0] for s in spans]).to(DEVICE),
        torch.tensor([s[1] for s in spans]).to(DEVICE), torch.tensor([s[2] for s in spans]).to(DEVICE),
        tables.to(DEVICE), scale, window, sinks=sinks.to(DEVICE))
    out = out.cpu()
    for (start, q_len, ctx), t in zip(spans, tables):
        check(out, reference(q, kv, 1, t.tolist(), ctx, list(range(start, start + q_len)), scale, window, sinks),
              1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_mla_absorbed_decode_matches_plain_float64(dtype, tol):
    """The CUDA path's MLA decode (query absorbed into latent space, Triton over the latent pool, output
    up-projected) against the plain form in float64: every latent expanded through kv_b into per-head keys and
    values. 20 heads: two head tiles, the second partly padding."""
    from types import SimpleNamespace

    from pdserve.engine.attention import NativeDecode
    from pdserve.engine.mla import LatentAttention
    from pdserve.engine.model import RMSNorm

    heads, rank, rope, nope, v_dim, bs = 20, 32, 16, 16, 24, 4
    cfg = SimpleNamespace(hidden_size=32, num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                          v_head_dim=v_dim, kv_lora_rank=rank, rope_interleave=False, q_lora_rank=0, o_bias=False,
                          rope_scaling=None, max_position_embeddings=64)
    g = torch.Generator().manual_seed(3)
    attn = LatentAttention(cfg, torch.nn.Linear, RMSNorm)
    with torch.no_grad():
        attn.kv_b.weight.copy_(torch.randn(attn.kv_b.weight.shape, generator=g) * rank ** -0.5)
    attn = attn.to(dtype)
    lens = [1, 9, 38]
    kv, tables = make_pool(bs, 1, (rank + rope) // 2, dtype, lens, g)
    q = torch.randn(len(lens), heads, nope + rope, generator=g).to(dtype)
    nd = NativeDecode(torch.arange(len(lens)), tables, torch.tensor(lens))
    out = attn._absorbed_decode(q, kv, 1, nd, triton_attention.TritonAttention()).float()
    w = attn.kv_b.weight.double().view(heads, nope + v_dim, rank)
    for b, (t, n) in enumerate(zip(tables.tolist(), lens)):
        entries = torch.stack([torch.cat([kv[t[p // bs], 1, 0, p % bs, 0], kv[t[p // bs], 1, 1, p % bs, 0]])
                               for p in range(n)]).double()  # [n, rank + rope]
        lat, k_rot = entries[:, :rank], entries[:, rank:]
        for h in range(heads):
            keys = torch.cat([lat @ w[h, :nope].T, k_rot], dim=-1)  # [n, nope + rope]
            vals = lat @ w[h, nope:].T  # [n, v]
            want = torch.softmax(keys @ q[b, h].double() * attn.scale, 0) @ vals
            torch.testing.assert_close(out[b, h].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_seqs,max_ctx,want", [(1, 4096, 16), (64, 4096, 1), (1, 200, 1), (2, 1 << 20, 17)])
def test_decode_splits(num_seqs, max_ctx, want):
    """~2 programs per SM (132 SMs, 8 KV heads), each split at least 256 keys, at most 64 splits."""
    assert triton_attention.decode_splits(num_seqs, 8, max_ctx, 132) == want


@pytest.mark.parametrize("variant", [dict(arch="llama"), dict(arch="mistral", sliding_window=8),
                                     dict(arch="gpt_oss"), dict(arch="deepseek_v3")],
                         ids=["llama-gqa", "mistral-window-8", "gpt-oss-sinks-window-6", "deepseek-v3-mla"])
def test_engine_greedy_through_triton_matches_transformers(tmp_path, variant):
    """The whole engine with attention="triton" (the CUDA path's kernels, here interpreted): chunked prefill
    (max_num_batched_tokens 16 cuts the 41-token prompt, so later chunks attend to cached blocks), then batched
    decodes; greedy tokens equal transformers'. gpt-oss: sinks on both layers, layer 0 windowed to 6 keys, layer 1
    full; DeepSeek-V3: the absorbed latent decode."""
    import transformers as tf

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from tests.conftest import make_checkpoint

    ckpt = make_checkpoint(tmp_path, **variant)
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=64, block_size=4, attention="triton",
                                                       max_num_batched_tokens=16, device=DEVICE))
    mla = variant["arch"] == "deepseek_v3"  # MLA prefills in torch (the plain form), decodes absorbed in Triton
    assert type(engine.runner.attention_ops).__name__ == "TritonAttention" and engine.runner.native_prefill != mla
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [3]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
