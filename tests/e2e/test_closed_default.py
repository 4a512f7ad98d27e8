"""A `pdserve up` with no security flags is closed: it generates an internal token and a password
for its private Redis, so a local process can neither call the router or a worker nor plant a worker in the registry
and receive prompts. Before, a worker registered by hand in this Redis received 4 of 8 prompts.

The attacker's side is built by hand (grpc, redis-py), not with pdserve's helpers."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import NUM_BLOCKS, PROMPTS, ROOT, _env

MODEL = "ck"


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def env(state_dir) -> dict:
    # its own state dir: `pdserve status` must find this `up`, not another one running on the machine
    return {**_env(), "PDSERVE_STATE_DIR": str(state_dir)}


@pytest.fixture(scope="module")
def up(tiny_llama, env):
    d = UpProcess(["--model", str(tiny_llama), "--num-gpu-blocks", str(NUM_BLOCKS), "--served-model-name", MODEL],
                  env, 90)
    yield d
    d.stop()


def test_default_up_generates_a_token_and_a_redis_password(up, state_dir, env):
    files = [Path(up.info[k]) for k in ("internal_token_file", "redis_password_file")]
    for f in files:
        assert f.parent.parent == state_dir and stat.S_IMODE(f.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 and len(f.read_text().strip()) >= 32
    secrets = [f.read_text().strip() for f in files]
    assert secrets[0] != secrets[1]
    assert not any(s in line for s in secrets for line in up.lines)  # paths are printed, never the values
    open_lines = [l for l in up.lines if "unauthenticated" in l or "pdserve up: WARNING" in l]
    assert not open_lines, open_lines  # nothing is said to be open
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(up.info["redis_url"]).ping()
    # `pdserve status` finds the token and the password through up's state file
    out = subprocess.run([sys.executable, "-m", "pdserve", "status", "--json"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert sorted(w["role"] for w in st["workers"] if w["healthy"]) == ["decode", "prefill"], st


class _Trap(worker_pb2_grpc.WorkerServicer):
    """The fake worker: counts every call it gets."""

    def __init__(self):
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        yield common_pb2.GenerateResponse(request_id=request.request_id)

    async def GenerateFromPrefill(self, request, context):
        self.calls += 1
        yield common_pb2.GenerateResponse(request_id=request.request_id)

    async def Prefill(self, request, context):
        self.calls += 1
        return worker_pb2.PrefillResponse(request_id=request.request_id)


def _complete(up, prompt: str) -> int:
    r = httpx.post(up.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                          "temperature": 0}, timeout=60)
    return r.status_code


def test_a_worker_registered_by_hand_receives_no_prompt(up):
    from pdserve.services.registry import index_key, workers_key
    real = up.workers("decode")[0]
    genuine = {k.decode(): v for k, v in up.redis().hgetall(workers_key(MODEL, real["worker_id"])).items()}

    async def main():
        trap = _Trap()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(trap, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        info = common_pb2.WorkerInfo.FromString(genuine["info"])
        info.worker_id, info.address = "impostor", f"127.0.0.1:{port}"
        stop = asyncio.Event()
        refused = []

        def plant(r: redis.Redis) -> None:
            fields = {**genuine, "info": info.SerializeToString(), "updated": str(time.time()).encode(),
                      "load": common_pb2.LoadReport(worker_id="impostor").SerializeToString()}
            fields.pop("sig", None)
            r.hset(workers_key(MODEL, "impostor"), mapping=fields)
            r.sadd(index_key(MODEL), "impostor")

        async def keep_planting():  # heartbeats like a worker, both as a local process and as one holding the password
            bare, authed = redis.Redis.from_url(up.info["redis_url"]), up.redis()
            while not stop.is_set():
                try:
                    plant(bare)
                except redis.exceptions.AuthenticationError:
                    refused.append(True)
                plant(authed)
                await asyncio.sleep(0.3)

        writer = asyncio.create_task(keep_planting())
        await asyncio.sleep(1.0)  # a heartbeat TTL's worth: the router has read the registry since
        with cf.ThreadPoolExecutor(8) as ex:
            codes = await asyncio.get_running_loop().run_in_executor(
                None, lambda: list(ex.map(lambda i: _complete(up, PROMPTS[i % len(PROMPTS)]), range(8))))
        stop.set()
        await writer
        up.redis().delete(workers_key(MODEL, "impostor"))
        up.redis().srem(index_key(MODEL), "impostor")
        await server.stop(0)
        return codes, trap.calls, refused

    codes, calls, refused = asyncio.run(main())
    assert codes == [200] * 8 and calls == 0, (codes, calls)
    assert refused  # without the password a local process cannot even write


def test_internal_rpcs_refuse_callers_without_the_token(up):
    async def main():
        out = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{up.process('router')['port']}") as r, \
                grpc.aio.insecure_channel(f"127.0.0.1:{up.workers('decode')[0]['port']}") as w:
            rt, wk = router_pb2_grpc.RouterStub(r), worker_pb2_grpc.WorkerStub(w)
            route = router_pb2.RouteRequest(request_id="x", prompt_token_ids=[2, 3, 4], num_prompt_tokens=3)
            calls = {"route": lambda md: rt.Route(route, metadata=md, timeout=10),
                     "list": lambda md: rt.ListWorkers(router_pb2.ListWorkersRequest(), metadata=md, timeout=10),
                     "stats": lambda md: wk.GetStats(worker_pb2.GetStatsRequest(), metadata=md, timeout=10)}
            for name, call in calls.items():
                try:
                    await call(())
                    out[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    out[name] = e.code()
            out["list_with_token"] = len((await calls["list"](up.grpc_metadata())).workers)  # the control
        return out

    out = asyncio.run(main())
    assert {k: out[k] for k in ("route", "list", "stats")} == dict.fromkeys(("route", "list", "stats"),
                                                                        grpc.StatusCode.UNAUTHENTICATED), out
    assert out["list_with_token"] == 2


def test_generated_secrets_are_removed_when_up_stops(up):
    """Last in the module: it stops the deployment (the fixture's own stop is then a no-op)."""
    folder = Path(up.info["internal_token_file"]).parent
    assert folder.is_dir()
    up.stop()
    assert not folder.exists()
