"""Host / disk KV tier (engine/kv_offload.py): a prefix evicted from the device pool is recalled, not recomputed.

References are independent of the tier: greedy continuations from HF transformers on the same tiny checkpoint,
and computed-token counts from first principles (prompt length minus the full blocks a lookup may hit).
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import transformers as tf

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
A = [(7 * i) % 300 + 2 for i in range(40)]  # 10 blocks; a lookup may hit (40 - 1) // 4 = 9 of them
FILLERS = [[(k * i + 3 * k) % 300 + 4 for i in range(40)] for k in (11, 13, 17)]


@pytest.fixture(scope="module")
def hf_ref(tiny_llama):
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def ref(prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    return ref


def engine(ckpt, **cfg) -> Engine:
    return Engine.from_pretrained(ckpt, EngineConfig(block_size=BS, dtype="float32", **{"num_gpu_blocks": 24, **cfg}))


def prompt_hashes(eng: Engine, prompt: list[int]) -> list[int]:
    from pdserve.services.router.prefix_index import chain_hashes
    return chain_hashes(prompt, BS, eng.fingerprint, "")


def check_accounting(eng: Engine) -> None:
    """Nothing held once idle; every tier within capacity; every block hash in exactly one tier."""
    bm, off = eng.block_manager, eng.kv_offload
    off.poll()
    assert bm.blocks_in_use == 0 and sum(bm.ref) == 0
    assert not off.recalls
    assert len(off.host_free) + len(off.host_lru) == off.num_host_blocks
    assert sorted(list(off.host_free) + [e.slot for e in off.host_lru.values()]) == list(range(off.num_host_blocks))
    assert len(off.disk_lru) <= off.num_disk_blocks or off.num_disk_blocks == 0 and not off.disk_lru
    tiers = [set(bm.cached), set(off.host_lru), set(off.disk_lru)]
    assert all(not (a & b) for i, a in enumerate(tiers) for b in tiers[i + 1:])
    for h, b in bm.cached.items():
        assert bm.hash_of[b] == h


def run_counting(eng: Engine, prompt: list[int]) -> tuple[list[int], int, object]:
    """Greedy output, tokens the forward computed for it (from the engine's batch log), its final output."""
    n0 = eng.num_steps
    out = eng.generate([prompt], GREEDY)[0]
    computed = sum(t for _, t in list(eng.batch_sizes)[len(eng.batch_sizes) - (eng.num_steps - n0):])
    return out.outputs[0].token_ids, computed, out


def test_host_hit_recalls_instead_of_recomputing(tiny_llama, hf_ref):
    eng = engine(tiny_llama, kv_offload_bytes=64 * 1024 * 1024)
    first = eng.generate([A], GREEDY)[0].outputs[0].token_ids
    for p in FILLERS:  # 3 x 12 blocks through a 24-block pool: A's blocks are evicted
        eng.generate([p], GREEDY)
    hashes = prompt_hashes(eng, A)
    assert len(hashes) == 9
    tiers = [eng.kv_offload.tier_of(h) for h in hashes]
    assert "host" in tiers and None not in tiers, tiers
    on_host = tiers.count("host")
    events = eng.drain_kv_events()
    assert any(ev.kind == "stored" and ev.tier == "host" and ev.block_hash == hashes[0] for ev in events)

    toks, computed, out = run_counting(eng, A)
    assert toks == hf_ref(A) == first
    assert out.num_cached_tokens == 9 * BS  # the whole hittable prefix, device part + recalled part
    # computed: the 4 tokens of the last block (never a hit), then one token per decode step
    assert computed == (len(A) - 9 * BS) + (GREEDY.max_tokens - 1)
    st = eng.stats()
    assert st.tier.hit_tokens["host"] == on_host * BS
    assert st.tier.recalls == 1 and len(st.tier.recall_seconds) == 1
    assert st.tier.bytes_moved["host_to_device"] == on_host * eng.kv_cache.block_bytes
    assert all(eng.kv_offload.tier_of(h) == "device" for h in hashes)
    assert any(ev.kind == "stored" and ev.tier == "device" for ev in eng.drain_kv_events())
    check_accounting(eng)


def test_without_tier_the_evicted_prefix_is_recomputed(tiny_llama, hf_ref):
    """The peer of the test above: same pool, no host tier -> the whole prompt is computed again."""
    eng = engine(tiny_llama)
    eng.generate([A], GREEDY)
    for p in FILLERS:
        eng.generate([p], GREEDY)
    toks, computed, out = run_counting(eng, A)
    assert toks == hf_ref(A)
    assert computed == len(A) + GREEDY.max_tokens - 1 and out.num_cached_tokens == 0


def test_disk_tier_round_trip(tiny_llama, hf_ref, tmp_path):
    eng = engine(tiny_llama, kv_offload_bytes=2 * 1024, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=64 * 1024 * 1024)
    bb = eng.kv_cache.block_bytes
    assert eng.kv_offload.num_host_blocks == (2 * 1024) // bb
    eng.generate([A], GREEDY)
    for p in FILLERS:
        eng.generate([p], GREEDY)
    hashes = prompt_hashes(eng, A)
    tiers = [eng.kv_offload.tier_of(h) for h in hashes]
    assert "disk" in tiers and None not in tiers, tiers
    on_disk = tiers.count("disk")
    eng.kv_offload.io.submit(lambda: None).result()  # the background writes have landed
    files = os.listdir(eng.kv_offload.disk_dir)
    assert len(files) == len(eng.kv_offload.disk_lru) and os.path.commonpath([eng.kv_offload.disk_dir, str(tmp_path)])
    assert all(os.path.getsize(os.path.join(eng.kv_offload.disk_dir, f)) == bb for f in files)

    toks, computed, out = run_counting(eng, A)
    assert toks == hf_ref(A)
    assert computed == (len(A) - 9 * BS) + (GREEDY.max_tokens - 1)
    st = eng.stats()
    assert st.tier.hit_tokens["disk"] == on_disk * BS
    assert st.tier.bytes_moved["disk_to_device"] == on_disk * bb
    eng.kv_offload.io.submit(lambda: None).result()
    assert len(os.listdir(eng.kv_offload.disk_dir)) == len(eng.kv_offload.disk_lru)  # recalled files deleted
    check_accounting(eng)


def test_host_tier_capacity_and_lru(tiny_llama):
    cap = 5
    eng = engine(tiny_llama, num_gpu_blocks=12)
    bb = eng.kv_cache.block_bytes
    eng = engine(tiny_llama, num_gpu_blocks=12, kv_offload_bytes=cap * bb + bb // 2)  # 5.5 blocks -> 5
    assert eng.kv_offload.num_host_blocks == cap
    order = []  # device eviction order of cached blocks = host insertion order
    seen = set()
    for p in [A] + FILLERS:
        eng.generate([p], GREEDY)
        for ev in eng.drain_kv_events():
            if ev.tier == "host" and ev.kind == "stored":
                order.append(ev.block_hash)
            elif ev.kind == "evicted":
                seen.add(ev.block_hash)
    assert len(order) > cap
    assert eng.stats().tier.host_blocks_in_use == cap
    assert list(eng.kv_offload.host_lru) == order[-cap:]  # the most recently evicted stay, oldest first
    assert set(order[:-cap]) <= seen  # the older ones fell off the last tier, each with an `evicted` event
    assert all(eng.kv_offload.tier_of(h) is None for h in order[:-cap])
    check_accounting(eng)


def test_recall_is_asynchronous_and_cancel_is_safe(tiny_llama, hf_ref):
    """While A's prefix is being copied back, A waits QUEUED and B keeps decoding every step; A aborted during
    its recall leaves nothing held; recalled again it matches transformers."""
    eng = engine(tiny_llama, kv_offload_bytes=64 * 1024 * 1024)
    eng.generate([A], GREEDY)
    for p in FILLERS:
        eng.generate([p], GREEDY)
    gate = threading.Event()
    eng.kv_offload.io.submit(gate.wait, 30)  # the I/O thread is busy: A's recall queues behind this
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("b", [9, 8, 7, 6, 5, 4, 3, 2, 1], long)  # nothing of it cached anywhere
    eng.step()  # b prefills
    eng.add_request("a", A, GREEDY)
    for _ in range(5):
        outs = {o.request_id: o for o in eng.step()}
        assert len(outs["b"].outputs[0].new_token_ids) == 1  # b decodes one token every step
        assert eng.requests["a"].seqs[0].state == S.QUEUED and eng.stats().tier.recalls_in_flight == 1
    eng.abort("a")
    gate.set()
    while eng.has_unfinished():
        eng.step()
    check_accounting(eng)
    assert eng.stats().tier.recalls == 1  # the copy completed and its blocks joined the device cache
    toks, computed, _ = run_counting(eng, A)
    assert toks == hf_ref(A)
    check_accounting(eng)


def test_tier_needs_a_block_and_dir_needs_the_tier(tiny_llama):
    with pytest.raises(ValueError, match="holds no KV block"):
        engine(tiny_llama, kv_offload_bytes=16)
    with pytest.raises(ValueError, match="needs kv_offload_bytes"):
        engine(tiny_llama, kv_offload_dir="/tmp/x")


def test_finished_recall_never_blocks_the_queue_head(tiny_llama, hf_ref):
    """A recalled sequence queued behind a more urgent one that needs most of the pool: the recall's pins must not
    outlive the tick its copy completed in, or the head could never fit (a deadlock). Both finish, correctly."""
    # no starvation rule to rescue x after 10 s: only the pins' release lets the head in
    eng = engine(tiny_llama, kv_offload_bytes=64 * 1024 * 1024, policy="priority", starvation_age_s=3600)
    eng.generate([A], GREEDY)
    for p in FILLERS:
        eng.generate([p], GREEDY)
    gate = threading.Event()
    eng.kv_offload.io.submit(gate.wait, 30)
    eng.add_request("x", A, GREEDY, priority=1)
    eng.step()
    assert eng.stats().tier.recalls_in_flight == 1
    head = [(5 * i) % 290 + 7 for i in range(80)]  # 20 blocks of the 24: fits only if x's pins are gone
    eng.add_request("h", head, GREEDY, priority=0)
    gate.set()
    final = {}
    deadline = time.monotonic() + 20  # idle steps are instant while the copy runs: bound by time, not steps
    while time.monotonic() < deadline:
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
        if not eng.has_unfinished():
            break
    assert final == {"h": hf_ref(head), "x": hf_ref(A)}
    check_accounting(eng)
