"""The host KV tier seen from the router: a real engine's KV events carry the tier through real Redis into the
prefix index (stream and snapshot alike), and the cost model prices a host-tier hit between a device hit and a
miss (docs/routing.md)."""
import asyncio
import random
import uuid

import redis.asyncio as aioredis

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.kv_events import KvEventPublisher, blocks_key
from pdserve.services.router.cache_aware import Policy, RouteInput
from pdserve.services.router.cost import WorkerCost
from pdserve.services.router.prefix_index import IndexSync, PrefixIndex, chain_hashes
from tests.services._workers import drop_model_keys, wait_registered
from tests.services.router.test_routing import BS, FP, _rec

REDIS = "redis://127.0.0.1:6379/0"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
A = [(7 * i) % 300 + 2 for i in range(40)]
FILLERS = [[(k * i + 3 * k) % 300 + 4 for i in range(40)] for k in (11, 13, 17)]


def test_kv_events_carry_the_tier_into_the_router_index(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=24, dtype="float32",
                                                          kv_offload_bytes=32 * 1024 * 1024))
    hashes = chain_hashes(A, 4, eng.fingerprint, "")

    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        r = aioredis.from_url(REDIS)
        try:
            pub = KvEventPublisher(r, model, "w1")
            await pub.reset()
            live = IndexSync(r, model)
            await live.sync_workers(["w1"])

            async def publish() -> None:
                await pub.publish(eng.drain_kv_events())
                await live.poll()

            eng.generate([A], GREEDY)
            await publish()
            assert [live.index.tier("w1", ("", h)) for h in hashes] == ["device"] * len(hashes)
            for p in FILLERS:
                eng.generate([p], GREEDY)
            await publish()
            want = [eng.kv_offload.tier_of(h) for h in hashes]
            assert "host" in want and None not in want
            assert [live.index.tier("w1", ("", h)) for h in hashes] == want
            hit = live.index.match_tiers(hashes, "", ["w1"])["w1"]
            assert (hit.device, hit.host, hit.disk) == (want.count("device"), want.count("host"), 0)
            # a router started now reads the same from the snapshot set (one member per block, tier-tagged)
            fresh = IndexSync(r, model)
            await fresh.sync_workers(["w1"])
            assert [fresh.index.tier("w1", ("", h)) for h in hashes] == want
            members = {m.decode() for m in await r.smembers(blocks_key(model, "w1"))}
            assert f"{hashes[want.index('host')]:x}@host:" in members
            assert len(members) == len({m.replace("@host", "") for m in members})  # one tier per block
            # recalled: back on the device, in both routers' views
            eng.generate([A], GREEDY)
            await publish()
            await fresh.poll()
            assert [live.index.tier("w1", ("", h)) for h in hashes] == ["device"] * len(hashes)
            assert fresh.index.holders == live.index.holders and fresh.index.offloaded == live.index.offloaded
        finally:
            await r.aclose()

    asyncio.run(main())


def test_host_tier_hit_is_priced_between_device_hit_and_miss():
    prompt = list(range(1, 2001))
    hashes = chain_hashes(prompt, BS, FP, "")
    idx = PrefixIndex()
    for h in hashes:
        idx.add("dev", ("", h))
        idx.add("host", ("", h), "host")
        idx.add("disk", ("", h), "disk")
    pol = Policy("auto", index=idx, rng=random.Random(0), inflight_ttl_s=0)
    recs = [_rec(w) for w in ("dev", "host", "disk", "miss")]
    req = RouteInput("r", prompt, max_tokens=16)
    hits = pol.prefix_hits(req, recs)
    assert (hits["host"].host, hits["host"].device, hits["miss"].blocks) == (len(hashes), 0, 0)
    assert pol.cached_tokens(req, recs)["host"] == len(hashes) * BS
    ttft = {}
    for rec in recs:
        w = WorkerCost.of(rec, pol.cost.p.priors)
        h = hits[rec.worker_id]
        ttft[rec.worker_id] = pol.cost.local(w, len(prompt), h.blocks * BS, 16,
                                             pol.cost.recall_s(w, h.host, h.disk)).ttft_s
    pri = pol.cost.p.priors
    # the documented formula, from the report's figures: 124 blocks x 2 MiB at the host prior's bandwidth
    assert abs((ttft["host"] - ttft["dev"]) - len(hashes) * 2 * 1024 * 1024 / pri.host_recall_bytes_per_s) < 1e-9
    assert ttft["dev"] < ttft["host"] < ttft["miss"]
    assert ttft["host"] < ttft["disk"] <= ttft["miss"]  # a disk recall is never priced above recomputing
    # the router's choice follows: the device hit, else the host hit, else (equal) the disk hit or the miss
    assert pol.place(recs, req=req).both.worker_id == "dev"
    assert pol.place(recs, req=RouteInput("r", prompt, max_tokens=16, exclude={"dev"})).both.worker_id == "host"


def test_worker_metrics_count_tier_hits_bytes_and_recalls(tiny_llama):
    """The engine's tier stats reach the worker's families (counters grow by what grew, per label)."""
    from pdserve.services.metrics import worker as M

    def val(metric, **labels):
        return M.WORKER.get_sample_value(metric, labels) or 0.0

    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=24, dtype="float32",
                                                          kv_offload_bytes=32 * 1024 * 1024))
    exp = M.EngineStatsExporter([])
    before = {t: val("pdserve_kv_tier_hit_tokens_total", tier=t) for t in ("device", "host")}
    moved0 = val("pdserve_kv_offload_bytes_total", direction="host_to_device")
    n0 = val("pdserve_kv_recall_seconds_count")
    eng.generate([A], GREEDY)
    for p in FILLERS:
        eng.generate([p], GREEDY)
    on_host = [eng.kv_offload.tier_of(h) for h in chain_hashes(A, 4, eng.fingerprint, "")].count("host")
    exp.update(eng.stats())
    eng.generate([A], GREEDY)
    exp.update(eng.stats())
    exp.update(eng.stats())  # an unchanged snapshot adds nothing
    st = eng.stats()
    assert val("pdserve_kv_tier_hit_tokens_total", tier="host") - before["host"] == on_host * 4
    assert val("pdserve_kv_tier_hit_tokens_total", tier="device") - before["device"] == \
        st.prefix_hit_tokens - on_host * 4
    assert val("pdserve_kv_offload_bytes_total", direction="host_to_device") - moved0 == \
        on_host * eng.kv_cache.block_bytes
    assert val("pdserve_kv_recall_seconds_count") - n0 == 1
    assert val("pdserve_kv_tier_capacity_blocks", tier="host") == eng.kv_offload.num_host_blocks
    assert val("pdserve_kv_tier_blocks", tier="host") == st.tier.host_blocks_in_use


def test_real_worker_host_tier_events_and_metrics(tiny_llama):
    """A worker process with the tier from its env (PDSERVE_KV_OFFLOAD_BYTES): an evicted prompt shows in the
    router's index as held on the host, a repeat recalls it (device again), and /metrics counts the host hit."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from pdserve.services.convert import params_to_pb
    from pdserve.services.grpc_util import channel
    from pdserve.services.pb import worker_pb2, worker_pb2_grpc
    from pdserve.services.ports import free_port
    from pdserve.services.registry import Registry

    root = Path(__file__).resolve().parents[3]
    model = f"test-{uuid.uuid4().hex[:8]}"
    port, mport = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(root), PDSERVE_LOG_LEVEL="WARNING",
               PDSERVE_KV_OFFLOAD_BYTES=str(16 * 1024 * 1024))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--model", str(tiny_llama),
                             "--served-model-name", model, "--role", "both", "--port", str(port),
                             "--worker-id", "w-tier", "--redis-url", REDIS, "--heartbeat-ttl", "1",
                             "--metrics-port", str(mport), "--num-gpu-blocks", "12", "--device", "cpu",
                             "--threads", "1"], env=env)

    async def main():
        reg = Registry(REDIS, model, ttl_s=1.0)
        sync = IndexSync(reg.r, model)
        try:
            live = await wait_registered(reg, proc)
            fp, bs = live[0].layout.fingerprint, live[0].layout.block_size
            await sync.sync_workers(["w-tier"])
            stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
            params = params_to_pb(SamplingParams(temperature=0.0, max_tokens=2))

            async def gen(prompt):
                async for _ in stub.Generate(worker_pb2.GenerateRequest(
                        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=params), timeout=30):
                    pass

            async def tiers(prompt, want):
                end = time.monotonic() + 10
                while True:
                    await sync.poll(block_ms=100)
                    hit = sync.index.match_tiers(chain_hashes(prompt, bs, fp, ""), "", ["w-tier"])["w-tier"]
                    if (hit.device, hit.host) == want or time.monotonic() > end:
                        return hit.device, hit.host

            first = [5 + i % 50 for i in range(64)]  # 4 blocks of 16; 3 can hit
            await gen(first)
            assert await tiers(first, (3, 0)) == (3, 0)
            for k in range(4):  # fill the 12-block pool: the first prompt's blocks go to the host tier
                await gen([100 + k * 7 + i % 40 for i in range(64)])
            assert await tiers(first, (0, 3)) == (0, 3)
            await gen(first)  # recalled, not recomputed
            assert await tiers(first, (3, 0)) == (3, 0)
            end = time.monotonic() + 10
            while True:  # the exporter runs on the worker's stats cadence
                text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
                line = [x for x in text.splitlines() if x.startswith("pdserve_kv_tier_hit_tokens_total")
                        and 'tier="host"' in x]
                if (line and float(line[0].split()[-1]) == 48.0) or time.monotonic() > end:
                    break
                await asyncio.sleep(0.3)
            assert line and float(line[0].split()[-1]) == 48.0, line
            assert "pdserve_kv_recall_seconds_count" in text
        finally:
            await drop_model_keys(reg.r, model)
            await reg.close()

    try:
        asyncio.run(main())
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
