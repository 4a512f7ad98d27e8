"""Cancellation anywhere in the disaggregated hand-off leaks no KV on either worker.

A prefill and a decode worker as real processes (real gRPC, real NIXL READs between them), driven the way the
gateway drives them: Prefill, then GenerateFromPrefill, each call cancelled at random points (before it is sent,
mid-prefill, in the transfer window, right after the first token, mid-stream), and ReleaseKV sent early (while
the Prefill still runs, or for a lease already released). Afterwards both workers must hold 0 blocks and no live
request within 2 s, long before any lease could expire (the lease TTL is 60 s here, so the reaper cannot be what
cleans up).
"""
import asyncio
import random
import signal
import time

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from tests.services._workers import start_worker, wait_serving

N_REQUESTS = 120
CONCURRENCY = 6
SETTLE_S = 2.0  # the target: 0 blocks in use within 2 s of the last cancel


@pytest.fixture(scope="module")
def pd(tiny_llama):
    procs = [start_worker(tiny_llama, role, "--lease-ttl", "60", "--num-gpu-blocks", "256")
             for role in ("prefill", "decode")]

    async def ready():
        await asyncio.gather(*(wait_serving(port) for _, port in procs))

    try:
        asyncio.run(ready())
        yield [port for _, port in procs]
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
        for p, _ in procs:
            assert p.wait(30) == 0


async def _held(stub: worker_pb2_grpc.WorkerStub) -> tuple[int, int, dict]:
    """(blocks in use, blocks pinned under leases, live requests per state) as the engine sees them now."""
    st = await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
    return st.load.kv_blocks_in_use, st.load.pinned_blocks, dict(st.states)


async def _settled(stubs, timeout: float) -> tuple[float, list]:
    t0 = time.monotonic()
    while True:
        held = [await _held(s) for s in stubs]
        if all(h == (0, 0, {}) for h in held) or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, held
        await asyncio.sleep(0.05)


async def _one(i: int, rng: random.Random, ps, ds, stats: dict) -> None:
    rid = f"cx-{i}"
    # distinct prompts (no prefix-cache hit on the decode side), 2-6 blocks, so every hand-off READs
    prompt = [2 + (i * 7 + k * 13) % 300 for k in range(rng.randint(20, 90))]
    sp = params_to_pb(SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    kind = rng.choice(["prefill_cancel", "release_early", "decode_cancel", "decode_cancel", "first_token"])
    stats[kind] = stats.get(kind, 0) + 1
    pre_call = ps.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=sp))
    if kind == "prefill_cancel":  # the gateway gave up on the Prefill (client left mid-prefill)
        await asyncio.sleep(rng.choice([0, rng.uniform(0, 0.01)]))
        pre_call.cancel()
        # What the gateway does after abandoning a Prefill (dispatch.py, `_release_soon`): a reply the worker had
        # already sent when the cancel arrived completed on its side, so only the caller knows it was dropped.
        await ps.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid))
        return
    if kind == "release_early":  # the client left before the pickup: ReleaseKV by request id, Prefill may be running
        await asyncio.sleep(rng.uniform(0, 0.01))
        await ps.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid))
        try:
            pre = await pre_call
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e
            return
        # the Prefill completed first: the release found its lease (or a second release is a no-op)
        r = await ps.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid, lease_id=pre.kv.lease_id))
        assert not r.released
        return
    pre = await pre_call
    assert not pre.finished
    call = ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=sp, first_tokens=pre.first_tokens, kv=pre.kv))
    if kind == "first_token":  # the socket closes right after the first data event (the transfer window)
        async for _ in call:
            break
        call.cancel()
        return  # no ReleaseKV from the "gateway" here: the decode worker itself must have freed the prefill side
    # anywhere in the transfer window: before the call is sent, during alloc, the READ, the commit
    await asyncio.sleep(rng.choice([0, rng.uniform(0, 0.004), rng.uniform(0, 0.03)]))
    call.cancel()
    # what the gateway does when its client leaves before the pickup (it cannot know whether the decode worker
    # got that far, so the release may find the lease gone: idempotent)
    await ps.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid, lease_id=pre.kv.lease_id))


def test_cancel_storm_leaks_nothing(pd):
    pport, dport = pd

    async def main():
        ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pport}"))
        ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
        rng = random.Random(13)
        sem = asyncio.Semaphore(CONCURRENCY)
        stats: dict = {}

        async def run(i):
            async with sem:
                await _one(i, rng, ps, ds, stats)

        t0 = time.monotonic()
        await asyncio.gather(*(run(i) for i in range(N_REQUESTS)))
        storm_s = time.monotonic() - t0
        settle_s, held = await _settled([ps, ds], SETTLE_S)
        print(f"storm: {N_REQUESTS} requests {stats} in {storm_s:.1f}s; settled in {settle_s:.2f}s: {held}")
        assert held == [(0, 0, {}), (0, 0, {})], f"after {settle_s:.1f}s (prefill, decode): {held}"
        # and both still serve a whole hand-off
        prompt = list(range(2, 40))
        sp = params_to_pb(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="after", prompt_token_ids=prompt, params=sp))
        msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
            request_id="after", prompt_token_ids=prompt, params=sp, first_tokens=pre.first_tokens, kv=pre.kv))]
        assert msgs[-1].state == "FINISHED" and sum(len(o.token_ids) for m in msgs for o in m.outputs) == 8
        _, held = await _settled([ps, ds], SETTLE_S)
        assert held == [(0, 0, {}), (0, 0, {})], held

    asyncio.run(main())
