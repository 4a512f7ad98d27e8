"""A worker whose engine thread is busy for longer than the heartbeat TTL stays registered.

The engine's steps are slowed by fault injection (`PDSERVE_FAULT_STEP_DELAY_S`, a sleep inside Engine.step
before the forward: the engine thread is really held) to 1.5 s, against a 1 s registry TTL in real Redis. A
heartbeat that waits for the engine thread misses the TTL on every step; one that reads the published snapshot
does not. A wedged engine (one step far longer than the stall limit) does leave the registry.
"""
import asyncio
import time
import uuid

import redis.asyncio as aioredis

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.registry import Registry, workers_key
from tests.services._workers import start_worker, stop_worker, wait_serving

REDIS = "redis://127.0.0.1:6379/0"
TTL_S = 1.0
STEP_S = 1.5  # each engine step holds the engine thread this long: 1.5 x the TTL


async def _watch(r: aioredis.Redis, key: str, stop: asyncio.Event) -> tuple[int, int, list[float]]:
    """Poll the registry entry every 50 ms until stopped: (polls, polls that found it missing, heartbeat times)."""
    polls = missing = 0
    updated: list[float] = []
    while not stop.is_set():
        h = await r.hgetall(key)
        polls += 1
        if not h:
            missing += 1
        else:
            u = float(h[b"updated"])
            if not updated or u != updated[-1]:
                updated.append(u)
        await asyncio.sleep(0.05)
    return polls, missing, updated


def test_busy_engine_keeps_its_registry_entry(tiny_llama):
    model = f"hb-{uuid.uuid4().hex[:8]}"
    p, port = start_worker(tiny_llama, "both", "--served-model-name", model, "--heartbeat-ttl", str(TTL_S),
                           redis_url=REDIS, env={"PDSERVE_FAULT_STEP_DELAY_S": str(STEP_S)})
    key = workers_key(model, f"both-{port}")

    async def main():
        await wait_serving(port)
        r = aioredis.from_url(REDIS)
        stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
        stop = asyncio.Event()
        watch = asyncio.create_task(_watch(r, key, stop))
        t0 = time.monotonic()
        token_times = []
        async for m in stub.Generate(worker_pb2.GenerateRequest(
                request_id="hb1", prompt_token_ids=list(range(2, 40)),
                params=params_to_pb(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))):
            if any(o.token_ids for o in m.outputs):
                token_times.append(time.monotonic() - t0)
        stop.set()
        polls, missing, updated = await watch
        await r.aclose()
        return token_times, polls, missing, updated

    try:
        token_times, polls, missing, updated = asyncio.run(main())
    finally:
        rc = stop_worker(p)
    assert rc == 0  # a clean drain (checked outside the finally: it must not mask the test's own failure)
    gaps = [b - a for a, b in zip(updated, updated[1:])]
    print(f"tokens at {[round(t, 2) for t in token_times]} s; {polls} polls, {missing} missing; "
          f"{len(updated)} heartbeats, longest gap {max(gaps, default=0):.2f} s")
    # the engine thread really was held longer than the TTL, step after step
    assert len(token_times) == 3 and token_times[0] >= STEP_S * 0.9, token_times
    assert all(b - a >= STEP_S * 0.9 for a, b in zip(token_times, token_times[1:])), token_times
    # ... and the entry never lapsed, refreshed every ~TTL/3 throughout
    assert polls >= 50 and missing == 0, (polls, missing)
    assert len(updated) >= 3 * token_times[-1] / TTL_S * 0.8 and max(gaps) < TTL_S, gaps


def test_wedged_engine_leaves_the_registry(tiny_llama):
    """In process, on real Redis: a step longer than the stall limit stops the heartbeat (the entry lapses);
    once the engine moves again the worker is back."""
    from pdserve.services.worker import Worker, _heartbeat_loop

    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64, fault_step_delay_s=2.0))

    async def main():
        w = Worker(eng, "both", "wedged", "127.0.0.1:1")
        await w.host.start()
        reg = Registry(REDIS, f"hb-{uuid.uuid4().hex[:8]}", ttl_s=0.5)
        key = workers_key(reg.model, "wedged")
        hb = asyncio.create_task(_heartbeat_loop(w, reg, interval_s=0.1, stall_s=0.6))
        await asyncio.sleep(0.3)
        before = await reg.r.exists(key)
        gen = w.host.generate("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        job = asyncio.ensure_future(_drain(gen))
        await asyncio.sleep(1.6)  # 0.6 s stall limit + 0.5 s TTL + slack, still inside the 2 s step
        during = await reg.r.exists(key)
        await job
        await asyncio.sleep(0.4)
        after = await reg.r.exists(key)
        hb.cancel()
        await reg.deregister("wedged")
        await reg.close()
        await w.host.stop()
        return before, during, after

    assert asyncio.run(main()) == (1, 0, 1)


async def _drain(gen):
    async for _ in gen:
        pass
