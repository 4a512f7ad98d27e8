"""Prefix index: chain matching, the Redis mirror (two replicas agree, a restarted router rebuilds), evictions,
dead workers; and a real worker process whose KV events reach the router's index."""
import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pdserve.engine.block_manager import KVEvent, block_hash
from pdserve.services.kv_events import KvEventPublisher, blocks_key, stream_key
from pdserve.services.router.prefix_index import IndexSync, PrefixIndex, chain_hashes
from tests.services._workers import drop_model_keys, wait_registered

REDIS = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parents[3]


def test_block_hash_is_fixed_bytes():
    """The hash of a block is blake2b-64 over fixed bytes (parent or root + fingerprint + namespace, then each id
    as 4 bytes little-endian): routers, workers and stored KV tiers of other versions must agree on it."""
    import hashlib
    toks = [0, 1, 255, 256, 70000, 2**32 - 1]

    def ref(parent, head: bytes) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(head + b"".join(t.to_bytes(4, "little") for t in toks))
        return int.from_bytes(h.digest(), "little")

    root = block_hash(None, toks, "fp", "ns")
    assert root == ref(None, b"root" + b"fp" + b"\x00ns")
    assert block_hash(root, toks, "fp", "ns") == ref(root, root.to_bytes(8, "little"))


def test_chain_hashes_are_the_engines():
    toks = list(range(1, 50))  # 49 tokens, block 16: blocks 0..2 full; the last token is alone in block 3
    hs = chain_hashes(toks, 16, "fp", "ns")
    assert len(hs) == 3
    assert hs[0] == block_hash(None, toks[:16], "fp", "ns")
    assert hs[1] == block_hash(hs[0], toks[16:32], "fp", "ns")
    assert chain_hashes(list(range(1, 49)), 16, "fp", "ns") == hs[:2]  # 48 tokens: block 2 has the last one
    assert chain_hashes(toks, 16, "fp", "other")[0] != hs[0]  # tenants never share keys


def test_match_stops_at_first_miss_per_worker():
    idx = PrefixIndex()
    hs = [11, 12, 13, 14]
    for h in hs:
        idx.add("a", ("", h))
    for h in hs[:2]:
        idx.add("b", ("", h))
    idx.add("c", ("", 12))  # holds a later block but not the first: useless to the engine
    assert idx.match(hs, "", ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}
    assert idx.match(hs, "tenant2", ["a"]) == {"a": 0}
    idx.remove("a", ("", 13))
    assert idx.match(hs, "", ["a"]) == {"a": 2}
    assert idx.drop_worker("a") == 3
    assert idx.match(hs, "", ["a", "b"]) == {"a": 0, "b": 2}


def _ev(kind, h, ns=""):
    return KVEvent(kind, h, ns)


def test_redis_mirror_replicas_agree_restart_rebuilds_and_dead_worker_leaves():
    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        r = aioredis.from_url(REDIS)
        try:
            pa, pb = KvEventPublisher(r, model, "wa"), KvEventPublisher(r, model, "wb")
            await pa.reset()
            await pb.reset()
            r1 = IndexSync(r, model)
            await r1.sync_workers(["wa", "wb"])
            await pa.publish([_ev("stored", 1), _ev("stored", 2), _ev("stored", 3, "t")])
            await pb.publish([_ev("stored", 1)])
            await r1.poll()
            assert r1.index.match([1, 2], "", ["wa", "wb"]) == {"wa": 2, "wb": 1}
            # eviction reflected
            await pa.publish([_ev("evicted", 2)])
            await r1.poll()
            assert r1.index.match([1, 2], "", ["wa", "wb"]) == {"wa": 1, "wb": 1}
            # a second replica / a restarted router: snapshot + stream -> the same index
            r2 = IndexSync(r, model)
            await r2.sync_workers(["wa", "wb"])
            await r2.poll()
            assert r2.index.holders == r1.index.holders
            # events racing the snapshot replay correctly on both
            await pa.publish([_ev("stored", 2), _ev("evicted", 1)])
            await pb.publish([_ev("stored", 2)])
            await r1.poll()
            await r2.poll()
            assert r1.index.holders == r2.index.holders
            assert r1.index.match([1, 2], "", ["wa", "wb"]) == {"wa": 0, "wb": 2}
            # a restarted worker (reset) holds nothing
            await pb.reset()
            await r1.poll()
            assert r1.index.match([1, 2], "", ["wa", "wb"]) == {"wa": 0, "wb": 0}
            assert await r.scard(blocks_key(model, "wb")) == 0
            # a dead worker (left the live view) disappears from the index
            await r1.sync_workers(["wb"])
            assert "wa" not in r1.index.workers() and ("t", 3) not in r1.index.holders
            # ... and its Redis set expires by itself (the worker no longer refreshes the TTL)
            assert 0 < await r.pttl(blocks_key(model, "wa")) <= 60_000
        finally:
            for k in [stream_key(model), blocks_key(model, "wa"), blocks_key(model, "wb")]:
                await r.delete(k)
            await r.aclose()

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_real_worker_kv_events_reach_the_index_evictions_and_death(tiny_llama):
    """A worker process publishes stored/evicted events; the router index follows; SIGKILL -> gone."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services.convert import params_to_pb
    from pdserve.services.grpc_util import channel
    from pdserve.services.pb import worker_pb2, worker_pb2_grpc
    from pdserve.services.ports import free_port
    from pdserve.services.registry import Registry

    model = f"test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="WARNING")
    # 12 blocks of 16 tokens: a few 64-token prompts are enough to evict the first one's blocks
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--model", str(tiny_llama),
                             "--served-model-name", model, "--role", "both", "--port", str(port),
                             "--worker-id", "w-real", "--redis-url", REDIS, "--heartbeat-ttl", "1",
                             "--num-gpu-blocks", "12", "--device", "cpu"], env=env)

    async def main():
        reg = Registry(REDIS, model, ttl_s=1.0)
        sync = IndexSync(reg.r, model)
        try:
            live = await wait_registered(reg, proc)
            rec = live[0]
            fp, bs = rec.layout.fingerprint, rec.layout.block_size
            await sync.sync_workers([rec.worker_id])
            stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
            params = params_to_pb(SamplingParams(temperature=0.0, max_tokens=2))

            async def gen(prompt, ns=""):
                async for _ in stub.Generate(worker_pb2.GenerateRequest(request_id=uuid.uuid4().hex,
                                                                         prompt_token_ids=prompt, params=params,
                                                                         namespace=ns), timeout=30):
                    pass

            async def matched(prompt, ns=""):
                await sync.poll(block_ms=100)
                return sync.index.match(chain_hashes(prompt, bs, fp, ns), ns, ["w-real"])["w-real"]

            first = [5 + i % 50 for i in range(64)]  # 4 blocks; 3 can hit (the last token's block never)
            await gen(first, ns="tenant-a")
            end = time.monotonic() + 5
            while await matched(first, "tenant-a") < 3 and time.monotonic() < end:
                pass
            assert await matched(first, "tenant-a") == 3
            assert await matched(first, "tenant-b") == 0  # namespaces are separate keys
            # fill the 12-block pool with other prompts: the LRU evicts the first prompt's blocks
            for k in range(4):
                await gen([100 + k * 7 + i % 40 for i in range(64)])
            end = time.monotonic() + 5
            while await matched(first, "tenant-a") > 0 and time.monotonic() < end:
                pass
            assert await matched(first, "tenant-a") == 0
            assert len(sync.index.by_worker["w-real"]) > 0
            # death: SIGKILL (no deregistration); the heartbeat lapses, the live view drops it, so does the index
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            end = time.monotonic() + 10
            while await reg.live_workers() and time.monotonic() < end:
                await asyncio.sleep(0.2)
            await sync.sync_workers([w.worker_id for w in await reg.live_workers()])
            assert "w-real" not in sync.index.workers() and len(sync.index) == 0
        finally:
            await drop_model_keys(reg.r, model)
            await reg.close()

    try:
        asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
