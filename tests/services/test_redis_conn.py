"""Redis AUTH and TLS against real redis-server processes: a password file (with and without an ACL username in the
URL), rediss:// with a CA, and a real `pdserve router` process that reaches an AUTH Redis only through its flag."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.internal_security import ConfigError
from pdserve.services.ports import free_port
from pdserve.services.redis_conn import RedisAuth, connect
from pdserve.services.registry import Registry, WorkerRecord
from tests._tls import Pki

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "redis-pass-4a1f9c"

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(["redis-server", "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
                             "--loglevel", "warning", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait(p: subprocess.Popen, port: int, **kw) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if p.poll() is not None:
            raise RuntimeError(f"redis-server exited: {p.stderr.read().decode()[-500:]}")
        try:
            redis.Redis(port=port, socket_timeout=0.5, **kw).ping()
            return
        except redis.exceptions.AuthenticationError:
            return  # up, and asking for a password
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            time.sleep(0.05)
    raise TimeoutError("redis-server did not start")


@pytest.fixture(scope="module")
def auth_redis():
    port = free_port()
    p = _start("--port", str(port), "--requirepass", PASSWORD,
               "--user", "alice", "on", ">alice-pass-77", "~*", "&*", "+@all")
    _wait(p, port)
    yield port
    p.terminate()
    p.wait(10)


@pytest.fixture()
def password_file(tmp_path):
    f = tmp_path / "redis-password"
    f.write_text(PASSWORD + "\n")
    return f


async def _round_trip(url: str, auth: RedisAuth, model: str) -> list[str]:
    reg = Registry(url, model, auth=auth)
    try:
        await reg.heartbeat(WorkerRecord("w-1", "decode", "127.0.0.1:1", capacity_blocks=8))
        return [w.worker_id for w in await reg.live_workers()]
    finally:
        await reg.deregister("w-1")
        await reg.close()


def test_registry_round_trip_through_password_file(auth_redis, password_file, tmp_path):
    url = f"redis://127.0.0.1:{auth_redis}/0"
    assert asyncio.run(_round_trip(url, RedisAuth.from_files(str(password_file)), "auth-m")) == ["w-1"]
    # an ACL user: the name in the URL, the password in the file
    alice = tmp_path / "alice"
    alice.write_text("alice-pass-77")
    url_alice = f"redis://alice@127.0.0.1:{auth_redis}/0"
    assert asyncio.run(_round_trip(url_alice, RedisAuth.from_files(str(alice)), "auth-a")) == ["w-1"]

    async def refused(auth: RedisAuth) -> type:
        r = connect(url, auth)
        try:
            await r.ping()
        except redis.exceptions.RedisError as e:
            return type(e)
        finally:
            await r.aclose()
        return type(None)

    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    assert issubclass(asyncio.run(refused(RedisAuth())), redis.exceptions.AuthenticationError)
    assert issubclass(asyncio.run(refused(RedisAuth.from_files(str(wrong)))), redis.exceptions.AuthenticationError)


def test_password_in_url_and_file_is_refused(password_file):
    with pytest.raises(ConfigError, match="both"):
        RedisAuth.from_files(str(password_file)).check("redis://:x@127.0.0.1:6379/0")
    with pytest.raises(ConfigError, match="scheme"):
        RedisAuth().check("http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="rediss"):
        RedisAuth.from_files(ca_file=str(password_file)).check("redis://127.0.0.1:6379/0")


def test_router_process_reaches_auth_redis_only_with_its_password_file(auth_redis, password_file):
    url = f"redis://127.0.0.1:{auth_redis}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}

    def router(*extra: str, env_extra: dict | None = None) -> tuple[subprocess.Popen, int]:
        port = free_port()
        return subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--port", str(port), "--redis-url", url,
                                 *extra], env={**env, **(env_extra or {})}, stderr=subprocess.PIPE), port

    p, _ = router()  # no password: the start-up ping fails, the router exits
    assert p.wait(60) != 0 and b"authenticat" in p.stderr.read().lower()
    # the password file through the environment variable a pod sets
    p, port = router(env_extra={"PDSERVE_REDIS_PASSWORD_FILE": str(password_file)})
    try:
        async def serving() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    try:
                        return (await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Router"),
                                                 timeout=1)).status
                    except grpc.aio.AioRpcError:
                        assert p.poll() is None, p.stderr.read().decode()[-800:]
                        await asyncio.sleep(0.2)
                return -1
        assert asyncio.run(serving()) == health_pb2.HealthCheckResponse.SERVING
    finally:
        p.terminate()
        p.wait(30)


def _redis_supports_tls() -> bool:
    out = subprocess.run(["redis-server", "--port", "0", "--tls-port", "1"], capture_output=True, text=True,
                         timeout=10)
    return "TLS" in out.stdout + out.stderr and "not supported" not in (out.stdout + out.stderr).lower() \
        and "unrecognized" not in (out.stdout + out.stderr).lower()


def test_rediss_with_ca(tmp_path):
    if not _redis_supports_tls():
        pytest.skip("the installed redis-server was built without TLS (--tls-port is refused)")
    pki = Pki(tmp_path / "pki")
    leaf = pki.leaf("redis")
    port = free_port()
    p = _start("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(leaf.cert), "--tls-key-file",
               str(leaf.key), "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no",
               "--requirepass", PASSWORD)
    try:
        _wait(p, port, ssl=True, ssl_ca_certs=str(pki.ca))
        pw = tmp_path / "pw"
        pw.write_text(PASSWORD)
        url = f"rediss://127.0.0.1:{port}/0"
        assert asyncio.run(_round_trip(url, RedisAuth.from_files(str(pw), str(pki.ca)), "tls-m")) == ["w-1"]

        async def without_ca() -> bool:  # the system roots do not know the test CA: the handshake fails
            r = connect(url, RedisAuth.from_files(str(pw)), socket_timeout=2)
            try:
                await r.ping()
            except redis.exceptions.ConnectionError as e:
                return "certificate" in str(e).lower() or "ssl" in str(e).lower()
            finally:
                await r.aclose()
            return False
        assert asyncio.run(without_ca())
    finally:
        p.terminate()
        p.wait(10)


def test_preflight_never_prints_the_url_password():
    from pdserve.services.preflight import check_redis
    problem = str(check_redis(f"redis://alice:{PASSWORD}@127.0.0.1:1/0"))
    assert PASSWORD not in problem and "redis://alice:***@127.0.0.1:1/0" in problem
