"""Run what the chart renders: values variants (API keys on, two gateway replicas, each `mode`) are
rendered by the real Helm engine and turned into local processes by tests/helm/_pods.py (the rendered commands,
args, env and Secret files; only addresses, ports and mount paths made local). Every variant's command lines go
through `pdserve`'s own parser and its keys file through the gateway's own loader; the disagg variant is started
for real (Redis, router, prefill, decode, two gateways) and answers requests with API keys, its two gateways
sharing one rate-limit bucket through the Redis URL the chart now gives them. A second started variant turns on
the internal token, mTLS and Redis AUTH and shows the router, the workers and Redis refusing callers without them."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helm._chart import ROOT, objects
from tests.helm._pods import LocalPod, plan

CPU_POOL = {"gpus": 0, "numGpuBlocks": 64, "extraArgs": ["--threads", "1"]}
KEYS = {"enabled": True, "keys": ["sk-plain"],
        "tenants": {"acme": {"keys": ["sk-acme"], "priority": 0},
                    "metered": {"keys": ["sk-metered"], "rate_rps": 0.001, "burst": 1}}}


def variant(mode: str) -> dict:
    return {"mode": mode, "workers": {"device": "cpu"},
            "prefill": CPU_POOL, "decode": CPU_POOL, "worker": CPU_POOL,
            "model": {"source": "pvc", "pvc": {"claimName": "weights"}, "subPath": "ck"},
            "gateway": {"replicas": 2, "readinessRequiresWorkers": True, "apiKeys": KEYS}}


MODES = ("disagg", "auto", "colocated")


def _by_component(pods: list[LocalPod]) -> dict[str, list[LocalPod]]:
    out: dict[str, list[LocalPod]] = {}
    for p in pods:
        out.setdefault(p.component, []).append(p)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_rendered_commands_parse_and_connect(mode, tmp_path, monkeypatch):
    """Every rendered pdserve command line, made local, is one `pdserve <component>` accepts; the addresses it
    names are the local pods behind the Services; the mounted keys file loads with the gateway's loader."""
    from pdserve.cli import build_parser
    from pdserve.services.gateway.tenants import TenantDirectory

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    pods = plan(objects(variant(mode)), tmp_path / "pods", ckpt)
    comp = _by_component(pods)
    [redis] = comp["redis"]
    redis_url = f"redis://127.0.0.1:{redis.port('redis')}/0"
    assert len(comp["gateway"]) == 2 and len(comp["router"]) == 2  # routers: active-active, 2 by default
    pools = ["worker"] if mode == "colocated" else ["prefill", "decode"]
    parsed = {}
    for p in pods:
        if p.component == "redis":
            continue
        for k in [k for k in os.environ if k.startswith("PDSERVE_")]:
            monkeypatch.delenv(k)
        for k, v in p.env.items():
            monkeypatch.setenv(k, v)
        a = parsed[p.name] = build_parser().parse_args(p.argv[3:])
        assert a.command == {"gateway": "gateway", "router": "router"}.get(p.component, "worker")
        assert a.redis_url == redis_url, (p.name, a.redis_url)  # every component, both gateways included
        assert a.host == "127.0.0.1" and a.port == p.port(p.container["ports"][0]["name"])  # http / grpc
        if a.command == "router":
            assert a.mode == mode
        elif a.command == "worker":
            assert a.role == {"worker": "both"}.get(p.component, p.component) and p.component in pools
            assert a.model == str(tmp_path / "pods" / p.name / "model" / "ck")
            assert os.path.samefile(a.model, ckpt) and a.worker_id == p.name and a.advertise_host == "127.0.0.1"
            assert a.device == "cpu" and a.threads == 1
        else:
            assert a.router in {f"127.0.0.1:{r.port('grpc')}" for r in comp["router"]}  # the Service's pods
            assert os.path.samefile(a.model, ckpt)
            d = TenantDirectory(a.api_keys_file)
            assert d.authenticate("sk-acme").name == "acme" and d.authenticate("sk-acme").priority == 0
            assert d.authenticate("sk-plain").name == "default"
            assert d.authenticate("sk-metered").rate_rps == 0.001 and d.authenticate("nope") is None
    assert {a.served_model_name for a in parsed.values()} == {"ck"}
    assert sorted(p.component for p in pods if p.component in pools) == sorted(pools)


# ---- the disagg variant, started -------------------------------------------------------------------------------

def _ready(pod: LocalPod) -> bool:
    """The container's rendered readinessProbe, asked of the local process."""
    pr = pod.container["readinessProbe"]
    try:
        if "grpc" in pr:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            with grpc.insecure_channel(f"127.0.0.1:{pod.port(pr['grpc']['port'])}") as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=pr["grpc"].get("service", "")), timeout=1)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in pr:
            url = f"http://127.0.0.1:{pod.port(pr['httpGet']['port'])}{pr['httpGet']['path']}"
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        if "exec" in pr and pr["exec"]["command"][0] == "redis-cli":  # `redis-cli -p PORT ping`
            import redis
            cmd = pr["exec"]["command"]
            return redis.Redis(port=pod.port(int(cmd[cmd.index("-p") + 1])), socket_timeout=1,
                               password=pod.env.get("REDISCLI_AUTH")).ping()  # redis-cli reads it too
        if "exec" in pr and pr["exec"]["command"][:3] == ["python", "-m", "pdserve.services.health_probe"]:
            cmd = list(pr["exec"]["command"])  # run in the pod's env (its TLS files), on its local port
            cmd[cmd.index("--port") + 1] = str(pod.port(int(cmd[cmd.index("--port") + 1])))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
            env.update(pod.env, PYTHONPATH=str(ROOT))
            return subprocess.run([sys.executable, *cmd[1:]], env=env, timeout=10).returncode == 0
    except Exception:
        return False
    raise AssertionError(f"{pod.name}: no local check for probe {pr}")


@contextlib.contextmanager
def _started(pods: list[LocalPod], tmp_path):
    """Redis first, then every other pod at once (as the kubelet would), each ready by its own rendered probe;
    all stopped (SIGTERM, then SIGKILL) on the way out."""
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(pod: LocalPod) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        env.update(pod.env, PYTHONPATH=str(ROOT))
        with open(logs / f"{pod.name}.log", "w") as out:
            procs[pod.name] = subprocess.Popen(pod.argv, env=env, cwd=str(tmp_path), stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(group: list[LocalPod], timeout: float) -> None:
        end, left = time.monotonic() + timeout, list(group)
        while left:
            for pod in list(left):
                rc = procs[pod.name].poll()
                assert rc is None, f"{pod.name} exited {rc}:\n" + (logs / f"{pod.name}.log").read_text()[-3000:]
                if _ready(pod):
                    left.remove(pod)
            if left and time.monotonic() > end:
                raise AssertionError("not ready: " + ", ".join(
                    f"{p.name}:\n{(logs / f'{p.name}.log').read_text()[-2000:]}" for p in left))
            time.sleep(0.3)

    try:
        redis = [p for p in pods if p.component == "redis"]
        for pod in redis:
            start(pod)
        wait_ready(redis, 15)
        rest = [p for p in pods if p.component != "redis"]
        for pod in rest:  # the kubelet starts them together; the chart's probes say when each is ready
            start(pod)
        wait_ready(rest, 150)
        yield
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _metric(port: int, name: str, labels: str) -> float:
    from tests.e2e.conftest import samples
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return sum(samples(r.read().decode(), name, labels))


@pytest.mark.e2e  # the rendered pods as a whole deployment
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (the rendered Redis pod)")
def test_disagg_variant_serves_requests_as_rendered(tiny_llama, tmp_path):
    import httpx
    import redis

    pods = plan(objects(variant("disagg")), tmp_path / "pods", tiny_llama)
    comp = _by_component(pods)
    with _started(pods, tmp_path):
        g0, g1 = (f"http://127.0.0.1:{g.port('http')}" for g in comp["gateway"])
        body = {"model": "ck", "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
        r = httpx.post(g0 + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 401, r.text  # keys required
        # Every pod is ready by its own probe, the gateways once a pair is registered; a worker may still refuse
        # its first calls (one CI run under load got a 503 no_workers here). That answer carries Retry-After and a
        # client retries it: so does this test, for 30 s, and anything else fails it
        end = time.monotonic() + 30
        while True:
            r = httpx.post(g0 + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-acme"},
                           timeout=60)
            if r.status_code != 503 or time.monotonic() > end:
                break
            assert r.json()["error"]["code"] == "no_workers", r.text
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 4
        r = httpx.post(g1 + "/v1/chat/completions", headers={"Authorization": "Bearer sk-plain"}, timeout=60,
                       json={"model": "ck", "messages": [{"role": "user", "content": "judge my vow"}],
                             "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
        # one bucket for both replicas (burst 1, ~no refill): the second request, on the other gateway, is refused
        one = dict(body, max_tokens=1)
        r = httpx.post(g0 + "/v1/completions", json=one, headers={"x-api-key": "sk-metered"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(g1 + "/v1/completions", json=one, headers={"x-api-key": "sk-metered"}, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        rd = redis.Redis(port=comp["redis"][0].port("redis"), password=comp["redis"][0].env["REDISCLI_AUTH"])
        assert rd.exists("pdserve:ck:ratelimit:metered")
        # the router placed by the chart's mode: every request went prefill -> decode
        end = time.monotonic() + 10
        # read on the metrics port the chart gives the scraper: no key there (the HTTP port wants one)
        while _metric(comp["gateway"][0].port("metrics"), "pdserve_ttft_seconds_count", '{mode="disagg"}') < 2:
            assert time.monotonic() < end, "gateway-0 did not record its two requests as disagg"
            time.sleep(0.2)


@pytest.mark.e2e  # the rendered pods as a whole deployment
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (the rendered Redis pod)")
def test_secured_variant_serves_and_refuses_unauthenticated_callers(tiny_llama, tmp_path):
    """Internal token (generated), mTLS (a cert-manager-style Secret, made here) and Redis AUTH (generated), as
    rendered: requests flow gateway -> router -> prefill -> decode; the router, the workers and Redis refuse a
    caller without the token, the certificate or the password."""
    import asyncio

    import grpc
    import httpx
    import redis

    from pdserve.services.pb import router_pb2, router_pb2_grpc
    from tests._tls import Pki

    pki = Pki(tmp_path / "pki")
    leaf = pki.leaf("internal")
    values = variant("disagg")
    values["gateway"] = {"replicas": 1, "readinessRequiresWorkers": True}
    values["router"] = {"replicas": 1}  # one of each process started here
    values["security"] = {"internalToken": {"enabled": True}, "tls": {"enabled": True, "secretName": "mtls"}}
    values["redis"] = {"auth": {"enabled": True}}
    objs = objects(values)
    objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mtls"}, "type": "kubernetes.io/tls",
                 "stringData": {"tls.crt": leaf.cert.read_text(), "tls.key": leaf.key.read_text(),
                                "ca.crt": pki.ca.read_text()}})
    pods = plan(objs, tmp_path / "pods", tiny_llama)
    comp = _by_component(pods)
    [router] = comp["router"]
    token = open(router.env["PDSERVE_INTERNAL_TOKEN_FILE"]).read().strip()
    with _started(pods, tmp_path):
        g = f"http://127.0.0.1:{comp['gateway'][0].port('http')}"
        r = httpx.post(g + "/v1/completions", json={"model": "ck", "prompt": "the quick brown fox", "max_tokens": 4,
                                                     "temperature": 0}, timeout=60)
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 4, r.text

        async def calls() -> dict[str, grpc.StatusCode]:
            out = {}
            creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), leaf.key.read_bytes(), leaf.cert.read_bytes())
            opts = [("grpc.ssl_target_name_override", "pdserve-internal")]
            req = router_pb2.ListWorkersRequest()
            for name, ch, md in (
                    ("plaintext", grpc.aio.insecure_channel(f"127.0.0.1:{router.port('grpc')}"),
                     (("authorization", f"Bearer {token}"),)),
                    ("cert_no_token", grpc.aio.secure_channel(f"127.0.0.1:{router.port('grpc')}", creds, opts), ()),
                    ("cert_and_token", grpc.aio.secure_channel(f"127.0.0.1:{router.port('grpc')}", creds, opts),
                     (("authorization", f"Bearer {token}"),))):
                async with ch:
                    try:
                        await router_pb2_grpc.RouterStub(ch).ListWorkers(req, metadata=md, timeout=10)
                        out[name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        out[name] = e.code()
            return out

        out = asyncio.run(calls())
        assert out == {"plaintext": grpc.StatusCode.UNAVAILABLE, "cert_no_token": grpc.StatusCode.UNAUTHENTICATED,
                       "cert_and_token": grpc.StatusCode.OK}, out
        rport = comp["redis"][0].port("redis")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=rport, socket_timeout=2).ping()
        rd = redis.Redis(port=rport, password=comp["redis"][0].env["REDISCLI_AUTH"], socket_timeout=2)
        assert len(list(rd.scan_iter("pdserve:ck:workers:*"))) == 2  # both workers registered, signed
        assert all(rd.hget(k, "sig") for k in rd.scan_iter("pdserve:ck:workers:*"))
