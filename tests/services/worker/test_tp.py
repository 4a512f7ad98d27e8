"""A tensor-parallel worker (`pdserve worker --tensor-parallel-size 2`): serves the offline engine's tokens, and
when one of its ranks dies the whole worker exits and the registry forgets it within two heartbeat TTLs
(no half-alive worker heartbeating on without the rank it needs for every forward)."""
import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import redis.asyncio as aioredis

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tp.group import RANK_EXIT_CODE
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.registry import workers_key
from tests.services._workers import start_worker, wait_serving

REDIS = "redis://127.0.0.1:6379/0"
TTL_S = 1.0


def rank_children(pid: int) -> list[int]:
    """The TP rank processes started by worker `pid` (its children running pdserve.engine.tp.rank)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"pdserve.engine.tp.rank" in cmd:
            out.append(int(d.name))
    return out


def test_tp_worker_serves_and_dies_with_a_rank(tiny_llama):
    model = f"tp-{uuid.uuid4().hex[:8]}"
    p, port = start_worker(tiny_llama, "both", "--served-model-name", model, "--heartbeat-ttl", str(TTL_S),
                           "--tensor-parallel-size", "2", "--dtype", "float32", "--threads", "1",
                           redis_url=REDIS)
    key = workers_key(model, f"both-{port}")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(5, 25))

    async def main():
        await wait_serving(port)
        r = aioredis.from_url(REDIS)
        assert await r.exists(key)
        stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
        tokens = []
        async for m in stub.Generate(worker_pb2.GenerateRequest(request_id="tp1", prompt_token_ids=prompt,
                                                                params=params_to_pb(params))):
            for o in m.outputs:
                tokens.extend(o.token_ids)
        load = (await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)).load
        assert load.tensor_parallel_size == 2 and load.kv_blocks_total == 64  # the replica's blocks, all ranks
        ranks = rank_children(p.pid)
        assert len(ranks) == 1, ranks
        t_kill = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        while await r.exists(key) and time.monotonic() - t_kill < 10:
            await asyncio.sleep(0.05)
        gone_after = time.monotonic() - t_kill
        await r.aclose()
        return tokens, gone_after

    try:
        tokens, gone_after = asyncio.run(main())
        code = p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    ref = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=64, dtype="float32")).generate(
        [prompt], params)[0].outputs[0].token_ids
    assert tokens == ref
    assert code == RANK_EXIT_CODE
    assert gone_after <= 2 * TTL_S, gone_after
