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


# ---- MoE and MLA (DeepSeek-V3, gpt-oss-120b presets from their published config.json) --------------------------
def _experts_hit_by_enumeration(e: int, k: int, b: int) -> float:
    """E[distinct experts] over every equally likely choice of k of e experts by each of b tokens."""
    from itertools import combinations, product
    choices = list(combinations(range(e), k))
    total = sum(len(set().union(*picks)) for picks in product(choices, repeat=b))
    return total / len(choices) ** b


def test_expected_experts_hit():
    """E * (1 - (1 - k/E)^B), against exhaustive enumeration of small cases and by hand for DeepSeek-V3."""
    from dataclasses import replace
    m = get_model("deepseek-v3")
    for e, k, b in ((4, 2, 2), (6, 2, 3), (5, 1, 4)):
        small = replace(m, experts=e, experts_per_tok=k)
        assert small.experts_hit(b) == pytest.approx(_experts_hit_by_enumeration(e, k, b), rel=1e-12)
    assert m.experts_hit(1) == pytest.approx(8.0)
    assert m.experts_hit(64) == pytest.approx(256 * (1 - (31 / 32) ** 64)) == pytest.approx(222.4425, abs=1e-4)
    assert m.experts_hit(100_000) == pytest.approx(256.0)
    assert get_model("llama-3-8b").experts_hit(64) == 0.0


def test_deepseek_v3_params_active_and_total():
    """Per layer, MLA: q_a 7168x1536 + q_b 1536x128x192 + kv_a 7168x576 + kv_b 512x128x256 + o 128x128x7168;
    3 dense MLPs of 18432; 58 sparse layers of 256 routed + 1 shared experts of 3x7168x2048 and a 256x7168 router;
    embedding and LM head 129280x7168. Model card: 671B total, 37B activated (the MTP module not counted)."""
    m = get_model("deepseek-v3")
    attn = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert m.attn_params == attn == 187105280
    expert, dense, router, emb = 3 * 7168 * 2048, 3 * 7168 * 18432, 256 * 7168, 129280 * 7168
    total = 61 * attn + 3 * dense + 58 * (257 * expert + router) + 2 * emb
    active = 61 * attn + 3 * dense + 58 * (9 * expert + router) + emb  # LM head yes, embedding lookup no
    assert m.total_params == total == 671025397760
    assert m.active_params == active == 36624596992
    assert m.total_params == pytest.approx(671e9, rel=0.001)
    assert m.active_params == pytest.approx(37e9, rel=0.02)
    # one token's decode step streams exactly its active weights (fp8: 1 byte each)
    assert m.weight_bytes_read(1) == pytest.approx(active * 1.0, rel=1e-12)
    assert m.weight_bytes == total * 1.0


def test_gpt_oss_120b_params_active_and_total():
    """Per layer: q 2880x4096, k and v 2880x512, o 4096x2880; 128 experts of 3x2880x2880 (gate_up + down), top 4;
    a 128x2880 router; embedding and LM head 201088x2880. Model card: 116.83B total, 5.13B active (biases, sinks
    and norms, ~0.04%, left out). Weights: experts MXFP4 (4.25 bits), the rest bf16: ~65 GB."""
    m = get_model("gpt-oss-120b")
    attn, expert, router, emb = 2880 * 4096 * 2 + 2 * 2880 * 512, 3 * 2880 * 2880, 128 * 2880, 201088 * 2880
    assert m.attn_params == attn
    assert m.total_params == 36 * (attn + 128 * expert + router) + 2 * emb == 116788838400
    assert m.active_params == 36 * (attn + 4 * expert + router) + emb == 5131100160
    assert m.total_params == pytest.approx(116.83e9, rel=0.005)
    assert m.active_params == pytest.approx(5.13e9, rel=0.005)
    routed = 36 * 128 * expert
    assert m.weight_bytes == pytest.approx(routed * 4.25 / 8 + (m.total_params - routed) * 2.0, rel=1e-12)
    assert m.weight_bytes == pytest.approx(65.17e9, rel=0.001)
    assert min_tp(m, get_gpu("H200")) == 1


def test_moe_decode_bound_streams_the_experts_hit():
    """DeepSeek-V3 on 8 x H200 (EP 8, the latent replicated on every rank as the engine holds it), one sequence at
    context 2048: bytes = its active weights + 8 ranks x 2048 x 70,272 KV; at batch 64 the routed experts read
    are 222.44 per layer, not 256."""
    m, g = get_model("deepseek-v3"), get_gpu("H200")
    cm = RooflineCostModel(m, g, 8)
    s = StepShape.decode(1, 2048)
    kv = 8 * 2048 * 70272.0
    assert cm.kv_bytes(s) == kv
    assert cm.bytes(s) == pytest.approx(36624596992 + kv, rel=1e-12)
    assert cm.step_time(s) == pytest.approx((36624596992 + kv) / (8 * 4.8e12), rel=1e-12) == \
        pytest.approx(0.98375e-3, rel=1e-4)
    s64 = StepShape.decode(64, 64 * 2048)
    routed_hit = 58 * 256 * (1 - (31 / 32) ** 64) * 3 * 7168 * 2048
    assert cm.bytes(s64) - cm.kv_bytes(s64) == pytest.approx(36624596992 - 58 * 8 * 3 * 7168 * 2048 + routed_hit,
                                                            rel=1e-12)
    assert cm.bytes(s64) - cm.kv_bytes(s64) < m.weight_bytes_read_per_step  # all experts: the dense formula


def test_ep_all_to_all_bytes():
    """Each token's hidden state (bf16) goes to, and comes back from, every other rank holding one of its experts:
    (ep - 1) * (1 - C(E - E/ep, k) / C(E, k)) ranks on average, checked by enumeration for 4 experts, top 2, 2
    ranks (5/6: only the 1 of 6 pairs held by its own rank stays home)."""
    from dataclasses import replace
    from itertools import combinations
    from math import comb
    m = get_model("deepseek-v3")
    small = replace(m, experts=4, experts_per_tok=2)
    away = [any(x >= 2 for x in pair) for pair in combinations(range(4), 2)]  # rank 0 holds experts 0, 1
    assert small.remote_ranks_per_token(2) == pytest.approx(sum(away) / len(away)) == pytest.approx(5 / 6)
    r8 = 7 * (1 - comb(224, 8) / comb(256, 8))
    assert m.remote_ranks_per_token(8) == pytest.approx(r8, rel=1e-12)
    assert m.a2a_bytes_per_token(8) == pytest.approx(2 * 58 * 7168 * 2 * r8, rel=1e-12)
    assert m.a2a_bytes_per_token(1) == 0.0
    s = StepShape.decode(256, 256 * 2048)
    cm8 = RooflineCostModel(m, get_gpu("H200"), 8)   # one node: all over NVLink
    assert cm8.comm_s(s) == pytest.approx(256 * m.a2a_bytes_per_token(8) / (8 * 450e9), rel=1e-12)
    cm16 = RooflineCostModel(m, get_gpu("H100"), 16)  # two nodes: 8 of the 15 other ranks over IB (50 GB/s)
    per_rank = 256 * m.a2a_bytes_per_token(16) / 16
    assert cm16.comm_s(s) == pytest.approx(per_rank * 8 / 15 / 50e9, rel=1e-12)


def test_gpt_oss_windows_in_the_roofline():
    """A windowed layer reads at most its 128 tokens per sequence: 8 decodes at context 4096 read
    2048 x (18 x 8 x 4096 + 18 x 8 x 128) bytes, not 73,728 x 8 x 4096; a handoff still moves every layer's KV."""
    m = get_model("gpt-oss-120b")
    cm = RooflineCostModel(m, get_gpu("H200"), 1)
    s = StepShape.decode(8, 8 * 4096)
    assert cm.kv_bytes(s) == 2048.0 * (18 * 8 * 4096 + 18 * 8 * 128)
    assert cm.transfer_time(1000) == pytest.approx(1000 * 73728 / 50e9)
    assert cm.kv_blocks(16) == int((0.9 * 141e9 - m.weight_bytes) // (73728 * 16))
