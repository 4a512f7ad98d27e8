"""Roofline numbers equal hand-computed values (from the published config.json numbers and vendor specs)."""
from __future__ import annotations

import pytest

from pdserve.sim.costmodel import StepShape
from pdserve.sim.roofline import RooflineCostModel, get_gpu, get_model, min_tp


def test_kv_bytes_per_token():
    # 2 (K,V) * layers * kv_heads * head_dim * 2 bytes (bf16)
    assert get_model("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert get_model("llama-3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680
    assert get_model("qwen2.5-7b").kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344


def test_params_llama3_8b():
    m = get_model("llama-3-8b")
    # per layer: q 4096*4096, k/v 4096*1024 each, o 4096*4096, mlp 3*4096*14336
    assert m.layer_params == 16777216 + 2 * 4194304 + 16777216 + 176160768 == 218103808
    assert m.linear_params == 32 * 218103808 == 6979321856
    assert m.total_params == 6979321856 + 2 * 128256 * 4096 == 8029995008  # ~8.03B (norms excluded)


def test_decode_step_bound_h100_llama3_8b():
    cm = RooflineCostModel(get_model("llama-3-8b"), get_gpu("H100"))
    # one sequence decoding its token at context 1024 (1023 cached + 1 new)
    s = StepShape(decode_seqs=1, sum_context=1024, attn_pairs=1024, samples=1)
    weight_bytes = (6979321856 + 525336576) * 2           # layers + LM head, bf16
    kv_bytes = 131072 * 1024                               # 1023 read + 1 written
    flops = 2 * 6979321856 * 1 + 2 * 4096 * 128256 * 1 + 4 * 32 * 32 * 128 * 1024
    assert cm.bytes(s) == weight_bytes + kv_bytes == 15143534592
    assert cm.flops(s) == flops
    assert cm.step_time(s) == pytest.approx(15143534592 / 3.35e12)   # memory-bound: ~4.52 ms
    assert cm.step_time(s) == cm.memory_s(s) > cm.compute_s(s)


def test_prefill_bound_is_compute_bound_and_ridge():
    cm = RooflineCostModel(get_model("llama-3-8b"), get_gpu("H100"))
    n = 4096
    s = StepShape(prefill_tokens=n, prefill_seqs=1, sum_context=n, attn_pairs=n * (n + 1) // 2, samples=1)
    flops = 2 * 6979321856 * n + 2 * 4096 * 128256 + 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    assert cm.step_time(s) == pytest.approx(flops / 989e12)
    assert cm.step_time(s) == cm.compute_s(s) > cm.memory_s(s)
    assert cm.ridge_point() == pytest.approx(989e12 / 3.35e12)


def test_transfer_capacity_and_tp():
    m, h100 = get_model("llama-3-8b"), get_gpu("H100")
    cm = RooflineCostModel(m, h100, link="ib")
    assert cm.transfer_time(1000) == pytest.approx(1000 * 131072 / 50e9)
    assert RooflineCostModel(m, h100, link="nvlink").transfer_time(1000) == pytest.approx(1000 * 131072 / 450e9)
    assert cm.kv_blocks(16) == int((0.9 * 80e9 - 8029995008 * 2) // (131072 * 16))
    assert min_tp(m, h100) == 1
    assert min_tp(get_model("llama-3-70b"), h100) == 4   # 141 GB of bf16 weights: 2 x 80 GB is not enough room
    assert min_tp(get_model("llama-3-70b"), get_gpu("H200")) == 2
    # H200 has H100's compute and more bandwidth: decode bound shrinks by 3.35/4.8
    s = StepShape(decode_seqs=8, sum_context=8 * 512, attn_pairs=8 * 512, samples=8)
    h200 = RooflineCostModel(m, get_gpu("H200"))
    assert h200.step_time(s) == pytest.approx(cm.step_time(s) * 3.35 / 4.8)


def test_fp8_kv_halves_kv_bytes_not_weight_bytes():
    """Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) = 65536 values per token: 131072 bytes in bf16, 65536 in
    fp8; the weight term is the same; the KV term of a decode step halves, its blocks double."""
    m = get_model("llama-3-8b")
    q = m.with_kv_cache_dtype("fp8_e4m3")
    assert (m.kv_bytes_per_token, q.kv_bytes_per_token) == (131072, 65536)
    assert q.weight_bytes == m.weight_bytes and q.weight_bytes_read_per_step == m.weight_bytes_read_per_step
    g = get_gpu("H100")
    a, b = RooflineCostModel(m, g, 1), RooflineCostModel(q, g, 1)
    s = StepShape.decode(64, 64 * 4096)
    assert b.kv_bytes(s) * 2 == a.kv_bytes(s) == 131072 * 64 * 4096
    assert a.bytes(s) - a.kv_bytes(s) == b.bytes(s) - b.kv_bytes(s) == m.weight_bytes_read_per_step
    assert b.transfer_time(1000) * 2 == pytest.approx(a.transfer_time(1000))
    assert b.kv_blocks(16) in (2 * a.kv_blocks(16), 2 * a.kv_blocks(16) + 1)
    with pytest.raises(ValueError, match="kv cache dtype"):
        m.with_kv_cache_dtype("int3")
