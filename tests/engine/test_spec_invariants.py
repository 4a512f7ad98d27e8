"""Spec §A invariants D04–D08, checked against the real Scheduler/Engine/BlockManager (ticks = engine steps)."""
from __future__ import annotations

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import ModelConfig
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def finish_ticks(engine, arrivals: dict[int, list[tuple]] | None = None):
    """Step until idle; return {request: tick it finished} and {request: ticks it was served}."""
    done, served, tick = {}, {}, 0
    arrivals = arrivals or {}
    while engine.has_unfinished() or any(t > tick for t in arrivals):
        for args in arrivals.get(tick, []):
            engine.add_request(*args)
        tick += 1
        for out in engine.step():
            served.setdefault(out.request_id, []).append(tick)
            if out.finished:
                done[out.request_id] = tick
        assert engine.batch_sizes[-1][0] <= engine.config.max_num_seqs  # active never exceeds capacity
    return done, served


def test_d04_continuous_batching(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=32, max_num_seqs=2))
    for rid, n in (("A", 1), ("B", 4), ("C", 1)):
        eng.add_request(rid, [5, 6], greedy(n))
    done, _ = finish_ticks(eng)
    assert done == {"A": 1, "C": 2, "B": 4}
    served_tokens = sum(r.generated_tokens for r in eng.usage_records)
    assert served_tokens == 6  # token conservation
    assert served_tokens / (2 * max(done.values())) == 0.75  # slot utilisation
    assert eng.block_manager.blocks_in_use == 0  # finishing releases
    # equal-length counterexample: nothing to refill, makespan equals the static schedule's (3)
    eng.add_request("X", [5, 6], greedy(3))
    eng.add_request("Y", [7, 8], greedy(3))
    done, _ = finish_ticks(eng)
    assert done == {"X": 3, "Y": 3}


def test_d04_no_run_before_arrival(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=32, max_num_seqs=2))
    done, served = finish_ticks(eng, {0: [("A", [5], greedy(3))], 2: [("B", [6], greedy(2))]})
    assert min(served["B"]) == 3 and done == {"A": 3, "B": 4}


def d05(tiny_llama, policy):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64, policy=policy,
                                                          max_num_batched_tokens=4))
    done, served = finish_ticks(eng, {0: [("decode", [5], greedy(8))], 1: [("long", list(range(10, 21)), greedy(1))]})
    ttft = done["long"] - 1  # arrived after tick 1, one output token
    gaps = [b - a for a, b in zip(served["decode"], served["decode"][1:])]
    return ttft, max(gaps)


def test_d05_chunked_prefill_tradeoff(tiny_llama):
    # prefill-priority: the 11-token prompt takes the whole 4-token budget of each tick
    assert d05(tiny_llama, "prefill-priority") == (3, 3)
    # decode-priority: the decode keeps its slot every tick; the prompt gets 3 tokens a tick
    assert d05(tiny_llama, "decode-priority") == (4, 1)


def tiny_cfg() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 16, 8, 16, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4,
                       rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                       tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
                       sliding_window=None, checkpoint_dtype=torch.float16)


def test_d06_kv_bytes_per_token():
    kv = KVCache(tiny_cfg(), num_blocks=4, block_size=4, dtype=torch.float16, device="cpu", num_cpu_blocks=0,
                 fingerprint="x")
    assert kv.block_bytes // 4 == 2 * 2 * 2 * 4 * 2 == 64


def seq(i, tokens):
    return Sequence(i, f"r{i}", tokens)


def test_d07_internal_fragmentation():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(0, [1]), seq(1, [1, 2, 3, 4, 5])
    bm.allocate(a, 1)
    bm.allocate(b, 5)
    logical = a.num_tokens + b.num_tokens
    allocated = bm.blocks_in_use * bm.block_size
    assert (logical, allocated) == (6, 12)
    assert (logical * 64, allocated * 64) == (384, 768)


def computed(bm, s):
    hits = bm.lookup(s)
    bm.allocate(s, s.num_tokens - len(hits) * bm.block_size, hits)
    s.num_computed_tokens = s.num_tokens
    bm.mark_computed(s)


def test_d08_prefix_sharing():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = seq(0, [1, 2, 3, 4, 5, 6]), seq(1, [1, 2, 3, 4, 9, 9, 9])
    computed(bm, a)
    computed(bm, b)
    assert bm.blocks_in_use == 3  # 4 without sharing: one full block shared
    assert b.num_cached_tokens == 4
    # sub-block overlap (3 tokens) shares nothing
    bm2 = BlockManager(num_blocks=16, block_size=4)
    c, d = seq(2, [1, 2, 3, 7, 8]), seq(3, [1, 2, 3, 9, 9])
    computed(bm2, c)
    computed(bm2, d)
    assert bm2.blocks_in_use == 4 and d.num_cached_tokens == 0
    # three sequences sharing 2 full blocks: saving is (n - 1) * B_shared
    bm3 = BlockManager(num_blocks=16, block_size=4)
    for i in range(3):
        computed(bm3, seq(10 + i, list(range(8)) + [100 + i]))
    assert bm3.blocks_in_use == 3 * 3 - (3 - 1) * 2


def test_tenant_namespaces_do_not_share():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence(0, "a", list(range(9)), namespace="tenant-a")
    b = Sequence(1, "b", list(range(9)), namespace="tenant-b")
    a2 = Sequence(2, "a2", list(range(9)), namespace="tenant-a")
    computed(bm, a)
    assert bm.lookup(b) == [] and len(bm.lookup(a2)) == 2


def test_hash_collision_verified_against_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(0, [1, 2, 3, 4, 5])
    computed(bm, a)
    block = a.block_table[0]
    bm.tokens_of[block] = (9, 9, 9, 9)  # stored tokens disagree with the hash: must not count as a hit
    assert bm.lookup(seq(1, [1, 2, 3, 4, 5])) == []


def test_lru_evicts_least_recent_unreferenced():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq(0, [1, 2, 3]), seq(1, [5, 6, 7])
    computed(bm, old)
    bm.free(old)
    computed(bm, new)
    bm.free(new)
    assert bm.blocks_in_use == 0 and len(bm.evictable) == 2
    computed(bm, seq(2, [8, 9, 10, 11, 12]))  # needs 3 blocks: 2 free + 1 evicted (the older prefix)
    assert bm.lookup(seq(3, [1, 2, 3])) == [] and len(bm.lookup(seq(4, [5, 6, 7]))) == 1
