"""Routing decisions: the real Policy / cost model / prefix index (through real Redis) on simulated replicas
(`pdserve.sim`: the engine's own scheduler and block manager stepped by a cost model) and on hand-built load
reports. No model; bounded, seconds each."""
import asyncio
import logging
import random

import pytest
import redis.asyncio as aioredis

from pdserve.services.metrics import router as M
from pdserve.services.pb import common_pb2
from pdserve.services.registry import WorkerRecord
from pdserve.services.router.cache_aware import NoWorkers, Policy, RouteInput
from pdserve.services.router.cost import CostParams
from pdserve.services.router.prefix_index import IndexSync, PrefixIndex, chain_hashes
from pdserve.sim.chats import ChatWorkload
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.placer import RouterSpec

REDIS = "redis://127.0.0.1:6379/0"
FP = "sim-model"  # fingerprint and block size of the hand-built load reports below
BS = 16
# 4000 prompt tokens/s and 10 ms + 0.4 ms per sequence per decode step; KV of a 16-token block is 2 MiB
COST = LinearCostModel(a=0.01, b=1 / 4000, c=0.0004, kv_bytes_per_token=2 * 1024 * 1024 / BS,
                       link_bytes_per_s=5e9, handoff_s=0.002)


def _cluster(policy: str, seed: int, index: str = "direct", workers: int = 4) -> Cluster:
    """`workers` colocated replicas of 600 KV blocks each (the prefix caches' room), load reports every 0.5 s."""
    spec = ClusterSpec(colocated=workers, num_blocks=600, report_s=0.5, seed=seed, admission=None,
                       router=RouterSpec(policy=policy, index=index, redis_url=REDIS, track_best_hit=True))
    return Cluster(spec, COST)


def _run(policy: str, wl: ChatWorkload, index: str = "direct") -> Cluster:
    c = _cluster(policy, wl.seed, index)
    try:
        c.run(wl.generate())
    finally:
        c.close()
    assert all(r.state == "FINISHED" for r in c.requests)
    return c


def _spread(values: list[float]) -> float:
    return max(values) / max(1e-9, min(values))


@pytest.mark.timeout(60)
def test_multi_prefix_hit_ratio_near_oracle_and_balanced():
    """16 system prompts (Zipf), multi-turn chats, 4 replicas; the cache-aware router's index through Redis."""
    wl = ChatWorkload(rate=25.0, n=600, seed=1)
    ours = _run("cache-aware", wl, index="redis")
    oracle = _run("oracle", wl)
    served = [r.placed for r in ours.replicas]
    print(f"cache-aware hit={ours.prefix_hit_ratio():.3f} (per-decision best {ours.best_hit_ratio():.3f}), "
          f"oracle policy hit={oracle.prefix_hit_ratio():.3f}, served={served}, "
          f"oracle served={[r.placed for r in oracle.replicas]}")
    assert ours.prefix_hit_ratio() >= 0.9 * oracle.prefix_hit_ratio()
    assert ours.prefix_hit_ratio() >= 0.9 * ours.best_hit_ratio()  # each decision vs the best cache then
    assert _spread(served) <= 1.5
    assert _spread([r.busy_s for r in ours.replicas]) <= 1.5
    # and the baselines it is measured against do worse on the same trace
    assert ours.prefix_hit_ratio() > 1.5 * _run("round-robin", wl).prefix_hit_ratio()


@pytest.mark.timeout(60)
def test_shared_system_prompt_does_not_herd():
    """Every request starts with the same system prompt: all replicas get it cached, none takes everything."""
    wl = ChatWorkload(rate=25.0, n=400, seed=2, shared_system=True, groups=8)
    res = _run("cache-aware", wl)
    served = [r.placed for r in res.replicas]
    print("served", served, "hit", round(res.prefix_hit_ratio(), 3))
    assert min(served) > 0 and _spread(served) <= 1.5
    assert res.prefix_hit_ratio() > 0.5  # the shared prompt is still reused (on every replica)


def _rec(wid, role="both", pending=0, running=0, rate=4000.0, step=0.01, bw=0.0, kv_used=0, **load):
    return WorkerRecord(wid, role, f"sim:{wid}", capacity_blocks=1000,
                        layout=common_pb2.KvLayout(fingerprint=FP, block_size=BS, block_bytes=2 * 1024 * 1024),
                        load=common_pb2.LoadReport(
                            pending_prefill_tokens=pending, num_running=running, kv_blocks_total=1000,
                            kv_blocks_in_use=kv_used, prefill_tokens_per_s=rate, prefill_overhead_s=0.01,
                            decode_step_s=step, decode_step_per_seq_s=0.0005, kv_bytes_per_s=bw,
                            report_time=1e12, **{"handoff_overhead_s": 0.005, **load}))


def _index_with(prompt, worker) -> PrefixIndex:
    idx = PrefixIndex()
    for h in chain_hashes(prompt, BS, FP, ""):
        idx.add(worker, ("", h))
    return idx


def test_hit_worker_with_deep_queue_loses_to_idle_worker():
    prompt = list(range(1, 2001))
    idx = _index_with(prompt, "hit")
    req = RouteInput("r", prompt, max_tokens=16)
    # deep queue: 40k tokens ahead (10 s) vs recomputing 2000 tokens on an idle worker (0.5 s)
    pol = Policy("auto", index=idx, rng=random.Random(0), inflight_ttl_s=0)
    p = pol.place([_rec("hit", pending=40_000), _rec("idle")], req=req)
    assert p.both.worker_id == "idle" and p.cached_tokens == 0
    # a shallow queue: the hit (saves ~0.5 s) wins
    p = pol.place([_rec("hit", pending=400), _rec("idle")], req=req)
    assert p.both.worker_id == "hit" and p.cached_tokens == 1984
    # a slower measured rate on the idle worker tips it back: rates are read from the reports
    p = pol.place([_rec("hit", pending=2000), _rec("idle", rate=500.0)], req=req)
    assert p.both.worker_id == "hit"


def test_near_equal_candidates_break_ties_at_random():
    pol = Policy("auto", rng=random.Random(3), inflight_ttl_s=0)  # no in-flight bookkeeping: pure ties
    ws = [_rec(f"w{i}") for i in range(4)]
    picks = [pol.place(ws, req=RouteInput("r", list(range(40)))).both.worker_id for _ in range(400)]
    counts = {w: picks.count(w) for w in set(picks)}
    assert len(counts) == 4 and min(counts.values()) > 60, counts
    # with in-flight bookkeeping a burst between two reports spreads evenly
    pol = Policy("auto", rng=random.Random(3))
    picks = [pol.place(ws, req=RouteInput("r", list(range(400)))).both.worker_id for _ in range(8)]
    assert sorted(picks.count(f"w{i}") for i in range(4)) == [2, 2, 2, 2]


def _count(reason, mode):
    return M.ROUTE_DECISIONS.labels(mode, reason)._value.get()


def test_auto_local_for_short_disagg_for_long_and_flips_with_bandwidth():
    """Measured: 4000 tok/s prefill everywhere, 30 ms hand-off, a decode worker with 2 running sequences that a
    long local prefill would stall; the link's bandwidth is what changes."""
    pol = Policy("auto", rng=random.Random(0), inflight_ttl_s=0)
    fast = [_rec("p0", "prefill"), _rec("d0", "decode", running=2, bw=20e9, handoff_overhead_s=0.03)]
    before = _count("disagg_faster", "disagg"), _count("local_faster", "colocated")
    short = pol.place(fast, req=RouteInput("s", list(range(1, 33)), max_tokens=32))
    assert short.mode == "colocated" and short.both.worker_id == "d0" and short.reason == "local_faster"
    long = pol.place(fast, req=RouteInput("l", list(range(1, 4001)), max_tokens=32))
    assert long.mode == "disagg" and long.reason == "disagg_faster"
    assert long.prefill.worker_id == "p0" and long.decode.worker_id == "d0"
    assert "mode=disagg;reason=disagg_faster" in long.header()
    # the measured link got slow: 4000 tokens of KV (500 MB) over 50 MB/s is 10 s -> prefill locally
    slow = [_rec("p0", "prefill"), _rec("d0", "decode", running=2, bw=50e6, handoff_overhead_s=0.03)]
    long2 = pol.place(slow, req=RouteInput("l2", list(range(1, 4001)), max_tokens=32))
    assert long2.mode == "colocated" and long2.reason == "local_faster"
    assert _count("disagg_faster", "disagg") == before[0] + 1
    assert _count("local_faster", "colocated") == before[1] + 2
    # an idle decode worker never gains from disaggregating (same rates): local even for long prompts
    idle = [_rec("p0", "prefill"), _rec("d0", "decode", running=0, bw=20e9, handoff_overhead_s=0.03)]
    assert pol.place(idle, req=RouteInput("l3", list(range(1, 4001)))).mode == "colocated"
    # disagg mode disaggregates regardless; colocated preference is honoured
    assert Policy("disagg").place(idle, req=RouteInput("x", list(range(1, 33)))).reason == "disagg_forced"


def test_a_local_prefill_that_would_stall_the_streams_there_goes_to_the_prefill_pool():
    """The overload the break-even found (docs/bench.md, auto at P = 512, 6/s): the prefill worker's queue is 1.6 s,
    the decode worker runs 8 streams at 12 ms a step. A 512-token local prefill (0.10 s) costs 0.31 s + 9 x 0.10 s
    of stall = 1.23 s against the pair's 2.02 s, so the latency sum prefers it, and every stream there loses 8 steps
    at once. The stall cap (4 steps) sends it to the pair instead, and says so, also with the prefill queue at
    3.2 s (overload is no reason to stall the streams); a link so slow that the pull alone (2.1 s) outlasts the
    stall summed over the streams (8 x 0.10 s) keeps the local prefill (`local_stall_yield`)."""
    def pool(pending, bw=10e9):
        return [_rec("p0", "prefill", pending=pending, rate=5000.0),
                _rec("d0", "decode", running=8, rate=5000.0, step=0.012, bw=bw)]
    req = RouteInput("r", list(range(1, 513)), max_tokens=16)
    before = _count("local_would_stall", "disagg")
    p = Policy("auto", rng=random.Random(0), inflight_ttl_s=0).place(pool(8000), req=req)
    assert p.mode == "disagg" and p.reason == "local_would_stall", p.header()
    assert _count("local_would_stall", "disagg") == before + 1
    off = Policy("auto", params=CostParams(local_stall_steps=0), rng=random.Random(0), inflight_ttl_s=0)
    assert off.place(pool(8000), req=req).reason == "local_faster"  # the latency sum alone
    deep = Policy("auto", rng=random.Random(0), inflight_ttl_s=0).place(pool(16000), req=req)
    assert deep.mode == "disagg" and deep.reason == "local_would_stall"
    slow = Policy("auto", rng=random.Random(0), inflight_ttl_s=0).place(pool(0, bw=32e6), req=req)  # 64 MiB: 2.1 s
    assert slow.mode == "colocated" and slow.reason == "local_faster"
    # a decode worker with nothing running has no streams to stall: local as before
    idle = [_rec("p0", "prefill", pending=8000, rate=5000.0), _rec("d0", "decode", rate=5000.0, step=0.012, bw=10e9)]
    assert Policy("auto", rng=random.Random(0), inflight_ttl_s=0).place(idle, req=req).mode == "colocated"


def test_prefill_pool_down_degrades_loudly(caplog):
    pol = Policy("auto", rng=random.Random(0))
    before = M.ROUTE_DEGRADED.labels("prefill_pool_down")._value.get()
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        p = pol.place([_rec("d0", "decode"), _rec("d1", "decode")], req=RouteInput("r", list(range(100))))
    assert p.mode == "colocated" and p.reason == "degraded_prefill_pool_down"
    assert M.ROUTE_DEGRADED.labels("prefill_pool_down")._value.get() == before + 1
    assert any("prefill pool unavailable" in r.message for r in caplog.records)
    # every prefill worker failed this request (the gateway excludes it): local prefill, counted separately
    b2 = M.ROUTE_DEGRADED.labels("prefill_excluded")._value.get()
    p = Policy("disagg").place([_rec("p0", "prefill"), _rec("d0", "decode")], exclude={"p0"},
                               req=RouteInput("r", list(range(100))))
    assert p.both.worker_id == "d0" and p.reason == "degraded_prefill_excluded"
    assert M.ROUTE_DEGRADED.labels("prefill_excluded")._value.get() == b2 + 1
    with pytest.raises(NoWorkers):
        pol.place([_rec("p0", "prefill")], req=RouteInput("r", [1, 2]))


@pytest.mark.timeout(60)
def test_router_restart_rebuilds_index_without_cold_cliff():
    """Run a workload, then replace the router (new policy, new index from Redis) and keep going."""
    c = _cluster("cache-aware", 4, index="redis")
    try:
        first = c.run(ChatWorkload(rate=25.0, n=300, seed=4).generate())
        c.placer.feed.sync(c.now + 1.0)  # every published event has reached the running router
        old = c.placer.index

        async def fresh_index():  # a router process of our own, on its own connection
            r = aioredis.from_url(REDIS)
            try:
                sync = IndexSync(r, c.placer.feed.model)
                await sync.sync_workers([rep.name for rep in c.replicas])
                await sync.poll()
                return sync.index
            finally:
                await r.aclose()

        fresh = asyncio.run(fresh_index())
        assert fresh.holders == old.holders and len(old) > 0
        # the restarted router routes warm: the next turns of the same chats hit as before
        c.placer.restart_router(seed=5)
        assert c.placer.index is not old and c.placer.index.holders == old.holders
        t0 = c.now + 1
        more = ChatWorkload(rate=25.0, n=300, seed=4).generate()
        for q in more:
            q.idx += 1000
            q.arrival += t0
        n_first = len(first)
        c.run(more)
        before, after = c.prefix_hit_ratio(c.requests[:n_first]), c.prefix_hit_ratio(c.requests[n_first:])
        print("hit before restart", round(before, 3), "after", round(after, 3))
        assert after >= 0.9 * before
    finally:
        c.close()


def test_prefer_local_never_pairs():
    """`prefer="local"` (a migrated request's resume, gateway/migration.py): one worker runs it whole - a decode or
    `both` worker, never a (prefill, decode) pair, even in disagg mode and for a long prompt that disaggregating
    would serve faster; the excluded (dead) worker is never chosen; no local worker left is NoWorkers."""
    ws = [_rec("p0", "prefill"), _rec("d0", "decode", running=2, bw=20e9, handoff_overhead_s=0.03),
          _rec("d1", "decode", running=2, bw=20e9, handoff_overhead_s=0.03)]
    long = list(range(1, 4001))
    assert Policy("auto", rng=random.Random(0)).place(ws, req=RouteInput("l", long, max_tokens=32)).mode == "disagg"
    for mode in ("auto", "disagg"):
        pol = Policy(mode, rng=random.Random(0), inflight_ttl_s=0)
        for _ in range(20):
            p = pol.place(ws, req=RouteInput("l", long, max_tokens=32, exclude={"d0"}, prefer="local"))
            assert p.mode == "colocated" and p.both.worker_id == "d1" and p.reason == "local_forced", p.header()
        with pytest.raises(NoWorkers):
            pol.place(ws, req=RouteInput("l", long, exclude={"d0", "d1"}, prefer="local"))
    both = Policy("colocated").place([_rec("b0"), _rec("d0", "decode")], req=RouteInput("x", [1, 2], prefer="local"))
    assert both.mode == "colocated"


def test_unmeasured_worker_is_priced_like_its_measured_peers():
    """A decode worker just added (nothing measured yet: 0 in its report) is priced from its measured pool peers,
    not from the conservative static prior, under which at light load it would never be chosen and never measure
    itself; a peer of another role or another model layout lends it nothing."""
    from pdserve.services.router.cost import Priors, WorkerCost, peer_priors
    measured = _rec("d-old", role="decode", step=0.004, running=1)
    fresh = _rec("d-new", role="decode", step=0.0, rate=0.0)
    fresh.load.decode_step_per_seq_s = 0.0
    pri = Priors()
    assert pri.decode_step_s == 0.02  # the static prior: 5x the measured 4 ms step
    p = peer_priors(pri, fresh, [measured, fresh])
    assert p.decode_step_s == 0.004 and p.decode_step_per_seq_s == 0.0005 and p.prefill_tokens_per_s == 4000.0
    assert WorkerCost.of(fresh, p).step == pytest.approx(0.004)  # idle: the peer's step, not 0.02
    assert WorkerCost.of(fresh, pri).step == pytest.approx(0.02)
    other_role = _rec("p", role="prefill", step=0.004)
    other_model = _rec("d-other", role="decode", step=0.004)
    other_model.layout.fingerprint = "another-model"
    assert peer_priors(pri, fresh, [fresh, other_role, other_model]) == pri
    # in the policy: both idle, the fresh worker is no longer priced out
    pol = Policy("disagg", rng=random.Random(0), inflight_ttl_s=0)
    ws = [_rec("pre", role="prefill"), measured, fresh]
    picked = pol.place(ws, req=RouteInput("r", list(range(1, 40)), max_tokens=16)).decode.worker_id
    assert picked == "d-new"  # d-old runs one sequence, d-new none: at the same step cost the idle one wins
