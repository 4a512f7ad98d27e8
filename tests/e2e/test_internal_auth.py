"""Internal auth on a real deployment (`pdserve up`, real processes, real gRPC, real Redis): with a token, router
and worker RPCs refuse callers without it; with mTLS, callers without a certificate the CA signed; the gateway's
own path through router and workers still works; a worker record forged straight into Redis is never routed to.

Clients here build their channels and metadata by hand (grpc, not pdserve's helpers), so what is checked is the
wire, not the code under test agreeing with itself."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests._tls import Pki
from tests.e2e.conftest import PROMPTS, Up, metric, wait_until

TOKEN = "s3cret-internal-token-0123456789abcdef"
REDIS_PASSWORD = "redis-pw-for-the-private-server"
MODEL = "ck"


def _http_greedy(up, prompt: str = PROMPTS[0]) -> list[int]:
    r = httpx.post(up.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _generate(ch: grpc.aio.Channel, metadata=()) -> list[int]:
    stub = worker_pb2_grpc.WorkerStub(ch)
    toks = []
    async for m in stub.Generate(worker_pb2.GenerateRequest(
            request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=[2, 3, 4, 5],
            params=params_to_pb(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))),
            metadata=metadata, timeout=30):
        for o in m.outputs:
            toks += list(o.token_ids)
    return toks


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# ---- token only -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("secret") / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    return f


@pytest.fixture(scope="module")
def redis_password_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("secret") / "redis-password"
    f.write_text(REDIS_PASSWORD)
    return f


@pytest.fixture(scope="module")
def up(tiny_llama, token_file, redis_password_file):
    # `up`'s private redis-server takes the password too: every process reaches it only through the file
    d = Up(tiny_llama, "--served-model-name", MODEL, "--mode", "disagg", "--internal-token-file", str(token_file),
           "--redis-password-file", str(redis_password_file))
    yield d
    d.stop()


def test_gateway_path_works_with_token(up, offline_greedy):
    assert _http_greedy(up) == list(offline_greedy[0][0])
    assert up.info["mode"] == "disagg"  # gateway -> router -> prefill -> decode (decode -> prefill gRPC too)


def test_worker_and_router_refuse_without_token(up):
    worker = up.workers("decode")[0]
    prefill = up.workers("prefill")[0]
    router = up.process("router")

    async def main():
        out = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker['port']}") as w, \
                grpc.aio.insecure_channel(f"127.0.0.1:{prefill['port']}") as p, \
                grpc.aio.insecure_channel(f"127.0.0.1:{router['port']}") as r:
            rt = router_pb2_grpc.RouterStub(r)
            route = router_pb2.RouteRequest(request_id="x", prompt_token_ids=[2, 3, 4], num_prompt_tokens=3)
            out["generate_none"] = await _code(_generate(w))
            out["generate_wrong"] = await _code(_generate(w, _bearer(TOKEN[:-1] + "X")))
            out["generate_not_bearer"] = await _code(_generate(w, (("authorization", TOKEN),)))
            out["prefill_none"] = await _code(worker_pb2_grpc.WorkerStub(p).Prefill(
                worker_pb2.PrefillRequest(request_id="p", prompt_token_ids=[2, 3, 4]), timeout=10))
            out["route_none"] = await _code(rt.Route(route, timeout=10))
            out["route_wrong"] = await _code(rt.Route(route, metadata=_bearer("nope" * 8), timeout=10))
            # the KV handshake hands out the NIXL region: a caller without the token gets nothing
            out["handshake_none"] = await _code(worker_pb2_grpc.WorkerStub(p).KvHandshake(
                worker_pb2.KvHandshakeRequest(protocol_version=1), timeout=10))
            out["list_none"] = await _code(rt.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10))
            # with the token the same calls go through
            out["generate_ok"] = await _generate(w, _bearer(TOKEN))
            out["route_ok"] = (await rt.Route(route, metadata=_bearer(TOKEN), timeout=10)).mode
            # health stays open (probes carry no credentials); reflection is closed
            hs = health_pb2_grpc.HealthStub(w)
            out["health"] = (await hs.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Worker"),
                                            timeout=10)).status
            refl = reflection_pb2_grpc.ServerReflectionStub(w)

            listed = []

            async def reflect():
                async for m in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                        list_services="")]), metadata=_bearer(TOKEN), timeout=10):
                    listed.append(m)
            out["reflection"] = await _code(reflect())
            out["reflection_listed"] = listed
        return out

    out = asyncio.run(main())
    for k in ("generate_none", "generate_wrong", "generate_not_bearer", "prefill_none", "route_none", "route_wrong",
              "handshake_none", "list_none"):
        assert out.get(k, grpc.StatusCode.UNAUTHENTICATED) == grpc.StatusCode.UNAUTHENTICATED, (k, out.get(k))
    assert len(out["generate_ok"]) == 3
    assert out["route_ok"] in ("disagg", "colocated", "local")
    assert out["health"] == health_pb2.HealthCheckResponse.SERVING
    # closed: the call fails and lists nothing. The code is UNIMPLEMENTED, except that once in a CI run the client
    # saw INTERNAL (grpc-aio's request writer racing the server's immediate trailers on a loaded box; never
    # reproduced in 600 calls alone), so the code itself is not what is held to.
    assert out["reflection"] != grpc.StatusCode.OK and out["reflection_listed"] == [], out["reflection"]
    assert "evil" not in json.dumps(httpx.get(up.base_url + "/health", timeout=10).json())


class _Trap(worker_pb2_grpc.WorkerServicer):
    """An impostor decode worker: counts every call it gets (it should get none)."""

    def __init__(self):
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        yield common_pb2.GenerateResponse(request_id=request.request_id)

    async def GenerateFromPrefill(self, request, context):
        self.calls += 1
        yield common_pb2.GenerateResponse(request_id=request.request_id)


def test_forged_registry_record_is_never_routed_to(up, token_file):
    from pdserve.services.internal_security import InternalSecurity
    from pdserve.services.registry import SIG_FIELD, index_key, record_sig, workers_key
    real = up.workers("decode")[0]
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(up.info["redis_url"]).ping()
    r = redis.Redis.from_url(up.info["redis_url"], password=REDIS_PASSWORD)
    genuine = {k.decode(): v for k, v in r.hgetall(workers_key(MODEL, real["worker_id"])).items()}
    assert SIG_FIELD in genuine  # the worker signs what it writes
    router_port = up.process("router")["port"]
    key = InternalSecurity(token=TOKEN).registry_key()

    async def main():
        trap = _Trap()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(trap, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = asyncio.Event()

        def forged(signed: bool) -> dict[str, bytes]:
            info = common_pb2.WorkerInfo.FromString(genuine["info"])
            info.worker_id, info.address = "impostor", f"127.0.0.1:{port}"
            f = {**genuine, "info": info.SerializeToString(), "updated": str(time.time()).encode(),
                 "load": common_pb2.LoadReport(worker_id="impostor").SerializeToString()}
            f.pop(SIG_FIELD)
            if signed:  # the control: what a process holding the token could write
                f[SIG_FIELD] = record_sig(key, MODEL, f).encode()
            return f

        async def keep_writing(signed_: dict):  # a forger "heartbeats" too, or its record lapses
            while not stop.is_set():
                f = forged(signed_["on"])
                r.delete(workers_key(MODEL, "impostor"))
                r.hset(workers_key(MODEL, "impostor"), mapping=f)
                r.sadd(index_key(MODEL), "impostor")
                await asyncio.sleep(0.3)

        signed = {"on": False}
        writer = asyncio.create_task(keep_writing(signed))
        await asyncio.sleep(1.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router_port}") as ch:
            rt = router_pb2_grpc.RouterStub(ch)
            route = router_pb2.RouteRequest(request_id="f", prompt_token_ids=[2, 3, 4], num_prompt_tokens=3,
                                            exclude_worker_ids=[real["worker_id"]])
            unsigned_code = await _code(rt.Route(route, metadata=_bearer(TOKEN), timeout=10))
            listed = [w.worker_id for w in (await rt.ListWorkers(router_pb2.ListWorkersRequest(),
                                                                 metadata=_bearer(TOKEN), timeout=10)).workers]
            toks = await asyncio.to_thread(lambda: [_http_greedy(up, p) for p in PROMPTS])
            calls_unsigned = trap.calls
            signed["on"] = True
            await asyncio.sleep(1.0)
            placed = await rt.Route(route, metadata=_bearer(TOKEN), timeout=10)
        stop.set()
        await writer
        r.delete(workers_key(MODEL, "impostor"))
        r.srem(index_key(MODEL), "impostor")
        await server.stop(0)
        return unsigned_code, listed, toks, calls_unsigned, placed

    unsigned_code, listed, toks, calls_unsigned, placed = asyncio.run(main())
    # unsigned: invisible to the router, every real request served by the real workers, the trap never called
    assert unsigned_code == grpc.StatusCode.UNAVAILABLE and "impostor" not in listed, (unsigned_code, listed)
    assert all(len(t) == 12 for t in toks) and calls_unsigned == 0
    # the control: the very same record, signed with the token, is placed on (so the refusal above is the HMAC's)
    assert placed.decode.worker_id == "impostor"
    assert wait_until(lambda: metric(up.process("router")["metrics_port"],
                                     "pdserve_registry_rejected_records_total") > 0, 5)


def test_colocated_gateway_path_with_token(tiny_llama, token_file, offline_greedy):
    """Colocated: the gateway's Generate stream to a `both` worker carries the token too (a unary-stream call, the
    kind grpc.aio files under its own interceptor list)."""
    d = Up(tiny_llama, "--served-model-name", MODEL, "--mode", "colocated", "--internal-token-file", str(token_file))
    try:
        assert _http_greedy(d) == list(offline_greedy[0][0])
        [w] = d.workers("both")

        async def bare() -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{w['port']}") as ch:
                return await _code(_generate(ch))
        assert asyncio.run(bare()) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        d.stop()


# ---- mTLS + token ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = Pki(root / "good")
    internal = ca.leaf("internal")
    rogue_ca = Pki(root / "rogue", "rogue")
    return ca, internal, rogue_ca.leaf("rogue")


@pytest.fixture(scope="module")
def up_mtls(tiny_llama, token_file, pki):
    ca, internal, _ = pki
    d = Up(tiny_llama, "--served-model-name", MODEL, "--mode", "disagg", "--internal-token-file", str(token_file),
           "--tls-cert", str(internal.cert), "--tls-key", str(internal.key), "--tls-ca", str(ca.ca))
    yield d
    d.stop()


def test_mtls_gateway_path_works(up_mtls, offline_greedy):
    assert _http_greedy(up_mtls) == list(offline_greedy[0][0])


def test_mtls_refuses_callers_without_a_certificate(up_mtls, pki):
    ca, internal, rogue = pki
    worker = up_mtls.workers("decode")[0]
    router = up_mtls.process("router")

    def creds(leaf=None):
        if leaf is None:
            return grpc.ssl_channel_credentials(root_certificates=ca.ca.read_bytes())
        return grpc.ssl_channel_credentials(root_certificates=ca.ca.read_bytes(), private_key=leaf.key.read_bytes(),
                                            certificate_chain=leaf.cert.read_bytes())

    async def main():
        out = {}
        addr = f"127.0.0.1:{worker['port']}"
        async with grpc.aio.insecure_channel(addr) as ch:
            out["plaintext"] = await _code(_generate(ch, _bearer(TOKEN)))
        async with grpc.aio.secure_channel(addr, creds()) as ch:
            out["no_cert"] = await _code(_generate(ch, _bearer(TOKEN)))
        async with grpc.aio.secure_channel(addr, creds(rogue)) as ch:
            out["rogue_cert"] = await _code(_generate(ch, _bearer(TOKEN)))
        async with grpc.aio.secure_channel(addr, creds(internal)) as ch:
            out["cert_no_token"] = await _code(_generate(ch))
            out["cert_and_token"] = await _generate(ch, _bearer(TOKEN))
        async with grpc.aio.secure_channel(f"127.0.0.1:{router['port']}", creds()) as ch:
            out["router_no_cert"] = await _code(router_pb2_grpc.RouterStub(ch).ListWorkers(
                router_pb2.ListWorkersRequest(), metadata=_bearer(TOKEN), timeout=10))
        async with grpc.aio.secure_channel(f"127.0.0.1:{router['port']}", creds(internal)) as ch:
            out["router_ok"] = len((await router_pb2_grpc.RouterStub(ch).ListWorkers(
                router_pb2.ListWorkersRequest(), metadata=_bearer(TOKEN), timeout=10)).workers)
        return out

    out = asyncio.run(main())
    # a refused handshake surfaces as UNAVAILABLE: the call never reaches the service
    for k in ("plaintext", "no_cert", "rogue_cert", "router_no_cert"):
        assert out[k] == grpc.StatusCode.UNAVAILABLE, (k, out[k])
    assert out["cert_no_token"] == grpc.StatusCode.UNAUTHENTICATED  # both layers hold on their own
    assert len(out["cert_and_token"]) == 3
    assert out["router_ok"] == 2


def test_tls_health_probe_needs_the_certificate(up_mtls, pki):
    """The chart's exec probe (`python -m pdserve.services.health_probe`) against a real mTLS worker: SERVING with
    the pod's certificate env, refused (exit 1) without it."""
    import os
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT
    ca, internal, _ = pki
    port = str(up_mtls.workers("decode")[0]["port"])
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    base["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pdserve.services.health_probe", "--port", port, "--service", "pdserve.v1.Worker"]
    with_cert = {**base, "PDSERVE_TLS_CERT": str(internal.cert), "PDSERVE_TLS_KEY": str(internal.key),
                 "PDSERVE_TLS_CA": str(ca.ca)}
    assert subprocess.run(cmd, env=with_cert, timeout=30).returncode == 0
    assert subprocess.run(cmd, env=base, timeout=30).returncode == 1  # plaintext against TLS
    named = {**with_cert, "PDSERVE_TLS_SERVER_NAME": "not-in-the-cert"}
    assert subprocess.run(cmd, env=named, timeout=30).returncode == 1  # the server's name is checked
