"""READs from a prefill peer that stopped answering do not starve the decode worker's heartbeat.

Found by the lab's asymmetric-partition row (docs/reliability.md, "Link faults"): with decode -> prefill cut, both
decode workers left the registry. A READ holds its thread until its timeout; the READs ran in asyncio's default
pool (6 threads on 2 vCPUs), and so did the heartbeat's UCX log poll, which queued behind them. Here the peer is a
real prefill worker frozen with SIGSTOP after its Prefill replies, the KV over UCX's TCP transport (so the READs
need the frozen process: no shared memory or CMA read of its pages), and more READs than that pool's threads.
"""
import asyncio
import os
import signal
import time
import uuid

import redis.asyncio as aioredis

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.registry import workers_key
from tests.services._workers import start_worker, stop_worker, wait_serving

REDIS = "redis://127.0.0.1:6379/0"
TTL_S = 1.0
PULLS = 12  # > asyncio's default pool on a 2-vCPU box (min(32, cores + 4) = 6)
TRANSFER_TIMEOUT_S = 5.0


async def _missing_polls(r: aioredis.Redis, key: str, seconds: float) -> tuple[int, int]:
    polls = missing = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        polls += 1
        missing += not await r.exists(key)
        await asyncio.sleep(0.05)
    return polls, missing


def test_reads_from_a_frozen_peer_leave_the_heartbeat_alone(tiny_llama):
    model = f"sp-{uuid.uuid4().hex[:8]}"
    tcp = {"UCX_TLS": "tcp"}
    common = ("--served-model-name", model, "--heartbeat-ttl", str(TTL_S))
    pp, pport = start_worker(tiny_llama, "prefill", *common, env=tcp, redis_url=REDIS)
    dp, dport = start_worker(tiny_llama, "decode", *common, "--transfer-timeout", str(TRANSFER_TIMEOUT_S),
                             env=tcp, redis_url=REDIS)
    key = workers_key(model, f"decode-{dport}")
    frozen = False

    async def main():
        nonlocal frozen
        await asyncio.gather(wait_serving(pport), wait_serving(dport))
        sp = params_to_pb(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        pre_stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
        ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))

        async def decode(rid, pre, prompt):
            return [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                request_id=rid, prompt_token_ids=prompt, params=sp, first_tokens=pre.first_tokens, kv=pre.kv))]

        # the pair meets first (handshake and link self-test done), so what follows waits on READs only
        prompt = list(range(2, 40))
        warm = await decode("w0", await pre_stub.Prefill(worker_pb2.PrefillRequest(
            request_id="w0", prompt_token_ids=prompt, params=sp)), prompt)
        assert warm[-1].state == "FINISHED", warm[-1]
        await asyncio.sleep(1.0)
        prompts = [list(range(3 + i, 60 + i)) for i in range(PULLS)]
        pres = [await pre_stub.Prefill(worker_pb2.PrefillRequest(request_id=f"s{i}", prompt_token_ids=p, params=sp))
                for i, p in enumerate(prompts)]
        os.kill(pp.pid, signal.SIGSTOP)
        frozen = True
        r = aioredis.from_url(REDIS)
        t0 = time.monotonic()
        calls = [asyncio.create_task(decode(f"s{i}", pre, p)) for i, (pre, p) in enumerate(zip(pres, prompts))]
        polls, missing = await _missing_polls(r, key, TRANSFER_TIMEOUT_S - 1.0)  # while the READs hang
        ends = await asyncio.wait_for(asyncio.gather(*calls), TRANSFER_TIMEOUT_S + 20)
        took = time.monotonic() - t0
        os.kill(pp.pid, signal.SIGCONT)
        frozen = False
        stats = await ds.GetStats(worker_pb2.GetStatsRequest())
        await r.aclose()
        return polls, missing, [m[-1] for m in ends], took, stats

    try:
        polls, missing, last, took, stats = asyncio.run(main())
    finally:
        if frozen:
            os.kill(pp.pid, signal.SIGCONT)
        rc = [stop_worker(p) for p in (dp, pp)]
    # the READs really hung on the frozen peer: every pickup failed on its transfer, none before the READ timeout
    assert all(m.finished and m.state == "FAILED" and "transfer" in m.error for m in last), last
    assert took >= TRANSFER_TIMEOUT_S * 0.8, took
    assert stats.load.kv_blocks_in_use == 0, stats.load
    # ... and meanwhile the decode worker's registry entry (TTL 1 s) never lapsed
    assert polls >= 30 and missing == 0, (polls, missing)
    assert rc == [0, 0], rc
