"""A real `pdserve worker` process: its `--labels` reach the registry (the router's failure domains), and the
tenant's `kv_share` sent in the request's Lifecycle protects that tenant's cached prefix on the worker from
another tenant's churn, over real gRPC (docs/engine.md "Tenant-fair eviction", docs/routing.md)."""
import asyncio
import random
import uuid

import redis.asyncio as aioredis

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import lifecycle_to_pb, params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.registry import record_from_hash, workers_key
from tests.services._workers import start_worker, stop_worker, wait_serving

REDIS = "redis://127.0.0.1:6379/0"
P = params_to_pb(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


async def _gen(stub, rid, prompt, ns, share=None):
    last = None
    async for m in stub.Generate(worker_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=P, namespace=ns,
            lifecycle=lifecycle_to_pb(None, 1, None, share))):
        last = m
    assert last.state == "FINISHED", last
    return last


def test_labels_registered_and_share_protects_prefix_over_grpc(tiny_llama):
    model = f"kvs-{uuid.uuid4().hex[:8]}"
    rng = random.Random(0)
    quiet = [rng.randrange(3, 300) for _ in range(33)]
    other = [rng.randrange(3, 300) for _ in range(33)]
    # 24 blocks of 4 tokens; a 33-token prompt caches 8 full blocks
    p, port = start_worker(tiny_llama, "both", "--served-model-name", model, "--labels", "zone=a,node=n1",
                           "--num-gpu-blocks", "24", "--block-size", "4", redis_url=REDIS)

    async def main():
        await wait_serving(port)
        r = aioredis.from_url(REDIS)
        rec = record_from_hash(await r.hgetall(workers_key(model, f"both-{port}")))
        stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
        first = await _gen(stub, "q1", quiet, "tenant:quiet", 0.35)   # floor(0.35 x 24) = 8 blocks guaranteed
        await _gen(stub, "o1", other, "tenant:other")                 # no share: plain LRU
        for i in range(4):  # the noisy tenant: 3 concurrent 26-token prompts per round, 24 blocks of demand
            await asyncio.gather(*[_gen(stub, f"n{i}-{j}", [rng.randrange(3, 300) for _ in range(26)],
                                        "tenant:noisy") for j in range(3)])
        again = await _gen(stub, "q2", quiet, "tenant:quiet", 0.35)
        other_again = await _gen(stub, "o2", other, "tenant:other")
        await r.delete(workers_key(model, f"both-{port}"))
        await r.aclose()
        return rec, first, again, other_again

    try:
        rec, first, again, other_again = asyncio.run(main())
    finally:
        rc = stop_worker(p)
    assert rc == 0  # a clean drain (checked outside the finally: it must not mask the test's own failure)
    assert rec.labels == {"zone": "a", "node": "n1"}
    assert again.usage.cached_tokens == 32 and first.usage.cached_tokens == 0
    assert other_again.usage.cached_tokens == 0  # the unprotected tenant's prefix was churned out
