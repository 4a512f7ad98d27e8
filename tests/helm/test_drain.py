"""The pod's SIGTERM path with a real process: a worker started with the chart's rendered args and env (ports and
bind address swapped for local ones) gets SIGTERM while a stream is in flight, leaves the Redis registry, finishes
the stream and exits 0 within the rendered terminationGracePeriodSeconds."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helm._chart import FULL, ROOT, by_kind, container_env, objects, pod_template
from tests.helm._pods import host_kernel_cache

# opted out of internal auth (the chart's explicit PDSERVE_INSECURE_INTERNAL): the drain is what is tested here,
# against a plain redis-server of the test's own
VALUES = {"mode": "colocated", "workers": {"device": "cpu", "shm": {"enabled": False}},
          "worker": {"gpus": 0, "numGpuBlocks": 64, "drainTimeout": 10},
          "security": {"internalToken": {"enabled": False}}, "redis": {"auth": {"enabled": False}}}


def _free_port() -> int:
    from pdserve.services.ports import free_port
    return free_port()


@pytest.fixture
def redis_url():
    exe = shutil.which("redis-server")
    if exe is None:  # the worker then runs without a registry; the drain itself is still exercised
        yield ""
        return
    port = _free_port()
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        p.terminate()
        p.wait(10)


def test_sigterm_drains_within_grace_period(redis_url, tmp_path):
    import grpc
    import redis
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services.convert import params_to_pb
    from pdserve.services.grpc_util import WORKER_SERVICE, channel
    from pdserve.services.pb import worker_pb2, worker_pb2_grpc

    dep = by_kind(objects(VALUES), "Deployment")[f"{FULL}-worker"]
    spec = pod_template(dep)
    grace = spec["terminationGracePeriodSeconds"]
    assert grace == 25
    c = spec["containers"][0]
    args = [str(a) for a in c["args"]]
    port, mport = _free_port(), _free_port()
    swap = {"--host": "127.0.0.1", "--port": str(port), "--metrics-port": str(mport)}  # local, not 0.0.0.0
    for flag, val in swap.items():
        args[args.index(flag) + 1] = val
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(container_env(c))
    # the scratch emptyDir (HOME, HF_HOME, the kernel cache) is a container path: a local dir here, and the
    # host's own kernel cache (tests/helm/_pods.py does the same for every rendered pod)
    home = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "scratch" and m["subPath"] == "home")
    for k, v in list(env.items()):
        if v == home or v.startswith(home + "/"):
            env[k] = str(tmp_path) + v[len(home):]
    env["TORCH_EXTENSIONS_DIR"] = host_kernel_cache()  # HOME moved: name the host's cache, or it recompiles
    env.update(PDSERVE_ADVERTISE_HOST="127.0.0.1", PDSERVE_REDIS_URL=redis_url, PDSERVE_LOG_LEVEL="WARNING",
               PYTHONPATH=str(ROOT))
    worker_id = env["PDSERVE_WORKER_ID"]
    assert c["command"] == ["pdserve"]
    p = subprocess.Popen([sys.executable, "-m", "pdserve", *args], env=env, cwd=str(ROOT))

    async def main() -> float:
        health = health_pb2_grpc.HealthStub(channel(f"127.0.0.1:{port}"))
        end = time.monotonic() + 60
        while True:  # what the readiness probe asks
            assert p.poll() is None, "worker exited during startup"
            try:
                r = await health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < end, "worker never became ready"
            await asyncio.sleep(0.2)
        reg = redis.Redis.from_url(redis_url) if redis_url else None
        if reg is not None:  # ready implies registered under the served model name the chart passes
            assert reg.exists(f"pdserve:builtin:workers:{worker_id}")
        stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}"))
        sp = params_to_pb(SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        n, last, t_term = 0, None, None
        async for m in stub.Generate(worker_pb2.GenerateRequest(request_id="drain-1", prompt_token_ids=[2, 3, 4],
                                                                params=sp)):
            n += sum(len(o.token_ids) for o in m.outputs)
            last = m
            if t_term is None:
                p.send_signal(signal.SIGTERM)  # what the kubelet sends first
                t_term = time.monotonic()
                for _ in range(100):
                    st = (await health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=1)).status
                    if st == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.02)
                assert st == health_pb2.HealthCheckResponse.NOT_SERVING  # readiness drops: no new traffic
                if reg is not None:
                    assert not reg.exists(f"pdserve:builtin:workers:{worker_id}")  # router stops placing here
        assert last.finished and last.state == "FINISHED" and n == 200  # the in-flight stream completed
        return t_term

    try:
        t_term = asyncio.run(main())
        rc = p.wait(grace)
        took = time.monotonic() - t_term
        assert rc == 0 and took < grace, (rc, took)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
