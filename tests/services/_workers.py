"""Standalone `pdserve worker` processes for tests that drive the Worker gRPC API directly (real processes, real
gRPC, real NIXL between them)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.grpc_util import channel
from pdserve.services.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def start_worker(model: Path, role: str, *args: str, env: dict | None = None,
                 redis_url: str = "", port: int | None = None) -> tuple[subprocess.Popen, int]:
    """A worker on `port` or a free one (no registry unless `redis_url`); extra CLI `args` and `env` go to it as
    given. Its worker id (and NIXL agent name) is `{role}-{port}`: a restart on the same port keeps it."""
    port = port or free_port()
    penv = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING", **(env or {})}
    p = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--model", str(model), "--role", role,
                          "--port", str(port), "--redis-url", redis_url, "--num-gpu-blocks", "64",
                          "--worker-id", f"{role}-{port}", *args], env=penv)
    return p, port


def stop_worker(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM (the worker's graceful drain), SIGKILL if it has not exited within `timeout`; returns the exit
    status. Call it from a `finally`: a failed assert must not leave a worker holding ports and Redis keys."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


async def wait_serving(port: int, timeout: float = 120) -> None:
    stub = health_pb2_grpc.HealthStub(channel(f"127.0.0.1:{port}"))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Worker"), timeout=1)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"worker on {port} not serving")


async def wait_registered(reg, proc: subprocess.Popen, timeout: float = 60) -> list:
    """The registry's live workers once `proc` (a worker with a registry) appears there; fails if it exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "worker exited"
        live = await reg.live_workers()
        if live:
            return live
        await asyncio.sleep(0.2)
    raise AssertionError("worker did not register")


async def drop_model_keys(r, model: str) -> None:
    """Delete every key of `model` (`pdserve:{model}:*`) from the Redis client `r`: the Redis is shared by the
    whole suite, so a test leaves it as it found it."""
    async for k in r.scan_iter(f"pdserve:{model}:*"):
        await r.delete(k)
