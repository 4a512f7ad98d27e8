"""helm/pdserve rendered by the real Helm engine: lint, Kubernetes API schema validation (offline), every container
command through pdserve's own argument parser. Metrics, dashboard, autoscaler queries, logging and tracing values:
test_chart_metrics.py; security values: test_chart_security.py."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.helm._chart import (
    CHART,
    FULL,
    NAMESPACE,
    SCENARIOS,
    by_kind,
    container_env,
    helm,
    objects,
    parse_pdserve,
    pdserve_containers,
    pod_specs,
    pod_template,
    render,
)

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (pyproject test extra) bundles the "
                                                       "Kubernetes API JSON schemas")

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion; gRPC probes are GA in 1.27) and the newest
# schema kubernetes-validate ships.
KUBE_VERSIONS = ["1.27.0", kv.utils.latest_version()]

# CRDs have no schema in the Kubernetes API; these pin the fields the chart uses to the CRDs' own (KEDA v2
# ScaledObject, prometheus-operator v1 ServiceMonitor / PodMonitor), unknown fields refused.
_OBJ = {"type": "object"}
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {}, "kind": {}, "metadata": _OBJ, "spec": {
            "type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"}}},
                "minReplicaCount": {"type": "integer"}, "maxReplicaCount": {"type": "integer"},
                "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                      "properties": {"behavior": _OBJ, "name": {"type": "string"}}},
                    "restoreToOriginalReplicaCount": {"type": "boolean"}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                    "properties": {"type": {"const": "prometheus"}, "name": {"type": "string"},
                                   "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                   "metadata": {"type": "object", "required": ["serverAddress", "query", "threshold"],
                                                "additionalProperties": {"type": "string"}}}}}}}}},
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {}, "kind": {}, "metadata": _OBJ, "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
            "properties": {"selector": {
                "type": "object", "additionalProperties": False,
                "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                               "matchExpressions": {"type": "array", "items": {
                                   "type": "object", "additionalProperties": False, "required": ["key", "operator"],
                                   "properties": {"key": {"type": "string"},
                                                  "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                                  "values": {"type": "array", "items": {"type": "string"}}}}}}},
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}},
                                   "any": {"type": "boolean"}}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}}}}}},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {}, "kind": {}, "metadata": _OBJ, "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {"selector": _OBJ, "namespaceSelector": {
                "type": "object", "additionalProperties": False,
                "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}, "any": {"type": "boolean"}}},
                "endpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}}}}}},
}


# ---- render, lint, validate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lint_clean(scenario):
    rep = helm.lint(str(CHART), SCENARIOS[scenario], strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    bad = [m for m in rep["messages"] if m["severity"] >= 2]
    assert not rep["errors"] and not bad, rep


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_objects_validate_against_kubernetes_schema(scenario):
    import jsonschema

    objs = objects(SCENARIOS[scenario])
    seen = set()
    for o in objs:
        key = (o["kind"], o["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        assert len(o["metadata"]["name"]) <= 63
        crd = CRD_SCHEMAS.get((o["apiVersion"], o["kind"]))
        if crd is not None:
            jsonschema.validate(o, crd)
            continue
        for v in KUBE_VERSIONS:
            try:
                kv.validate(o, v, strict=True)
            except kv.ValidationError as e:
                raise AssertionError(f"{key} against {v}: {'.'.join(map(str, e.path))}: {e.message}") from None
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount"} <= kinds


def test_values_schema_refuses_bad_values():
    render({"mode": "auto"})  # the router's default policy is a chart mode too
    for bad in ({"mode": "split"}, {"prefil": {"replicas": 2}}, {"decode": {"replicas": -1}},
                {"model": {"source": "s3"}}, {"decode": {"autoscaling": {"targets": {"kvUsageRatio": 1.5}}}},
                {"autoscaling": {"provider": "hpa"}}, {"redis": {"external": {"url": "http://x"}}}):
        with pytest.raises(helm.HelmError):
            render(bad)
    with pytest.raises(helm.HelmError, match="claimName"):
        render({"model": {"source": "pvc"}})
    with pytest.raises(helm.HelmError, match="redis.external.url"):
        render({"redis": {"enabled": False}})
    with pytest.raises(helm.HelmError, match="at least one target"):
        render({"prefill": {"autoscaling": {"enabled": True, "targets": {"queueDepth": None, "ttftP90Seconds": None}}}})


# ---- commands ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_command_is_one_pdserve_accepts(scenario, monkeypatch):
    from pdserve.cli import _default_served_name

    vals = SCENARIOS[scenario]
    objs = objects(vals)
    svcs = by_kind(objs, "Service")
    parsed = {}
    for o, c in pdserve_containers(objs):
        a = parse_pdserve(c, monkeypatch)
        parsed[o["metadata"]["name"]] = a
        assert a.command in ("gateway", "router", "worker", "planner") and a.host == "0.0.0.0"
        if a.command == "worker":  # workers.quantization reaches the engine flag (None when unset)
            assert a.quantization == (vals.get("workers", {}).get("quantization") or None)
            assert a.deterministic == (True if vals.get("workers", {}).get("deterministic") else None)
            assert a.kv_cache_dtype == (vals.get("workers", {}).get("kvCacheDtype") or None)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        # the model path is mounted (or the builtin model needs nothing)
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        assert a.model == "builtin" or any(a.model.startswith(m) for m in mounts), (a.model, mounts)
        if a.command == "gateway":
            assert (a.port, a.grpc_port) == (ports["http"], ports["grpc"])
            host, port = a.router.rsplit(":", 1)
            router_svc = svcs[host]
            assert int(port) in {p["port"] for p in router_svc["spec"]["ports"]}
            if vals.get("gateway", {}).get("apiKeys", {}).get("enabled"):
                assert a.api_keys_file, "the API-key Secret is mounted but the gateway is not told to read it"
            else:
                assert a.api_keys_file is None
            # PDSERVE_MIGRATION_LIMIT, read by the gateway's own parser (docs/reliability.md)
            assert a.migration_limit == vals.get("gateway", {}).get("migrationLimit", 2)
            assert a.max_logprob_entries == vals.get("gateway", {}).get("maxLogprobEntries", 500_000)
            assert bool(a.require_disagg) == vals.get("gateway", {}).get("requireDisagg", False)
        if a.command in ("gateway", "worker"):  # guidedOutput: the same limits on both (grammar_limits.py)
            g = vals.get("guidedOutput", {})
            assert a.max_enum_values == g.get("maxEnumValues", 1000) and a.max_schema_depth == 64
            assert a.grammar_compile_timeout == g.get("grammarCompileTimeout", 10)
            assert getattr(a, "grammar_processes", None) == (g.get("grammarProcesses", 2) if a.command == "worker"
                                                             else None)
        if a.command == "router":
            assert a.mode == vals.get("mode", "disagg")  # the router's disaggregation mode is the chart's mode
            assert a.placement == vals.get("router", {}).get("placement", "cache-aware")
        if True:  # every component has the Redis URL, the gateway too: limits/quotas/reservations are shared
            env = container_env(c)
            if vals.get("redis", {}).get("enabled", True):
                assert a.redis_url == f"redis://{FULL}-redis:6379/0" and f"{FULL}-redis" in svcs
            else:
                assert a.redis_url.startswith("secret:") and a.redis_url == env["PDSERVE_REDIS_URL"]
            if a.command in ("router", "worker"):
                assert (a.port, a.metrics_port) == (ports["grpc"], ports["metrics"])
            if a.command == "planner":  # it scrapes the gateway's metrics Service port
                assert a.metrics_port == ports["metrics"]
                host, port = a.metrics_url[0].removeprefix("http://").split("/")[0].split(":")
                assert int(port) in {p["port"] for p in svcs[host]["spec"]["ports"]}
            if a.command == "worker":
                assert a.advertise_host == "10.1.2.3" and a.worker_id == "pod-0"  # pod IP, pod name
                pool = o["metadata"]["name"].removeprefix(FULL + "-")
                flex = vals.get("flex", {}).get("initialRole", "decode")  # the flex pool's first role
                assert a.role == {"worker": "both", "flex": flex}.get(pool, pool)
                pv = vals.get(pool, {})
                assert a.drain_timeout == pv.get("drainTimeout", 30)
                assert a.num_gpu_blocks == pv.get("numGpuBlocks")
    # every component registers / routes under one model name (the Redis keys are pdserve:{model}:...)
    names = {a.served_model_name for a in parsed.values()}
    model = parsed[f"{FULL}-gateway"].model
    m = vals.get("model", {})
    hf_repo = m.get("hf", {}).get("repo") if m.get("source") == "hf" else None  # served under the hub id
    assert names == {m.get("servedModelName") or hf_repo or _default_served_name(model)}, names
    roles = sorted(a.role for a in parsed.values() if a.command == "worker")
    flex = [vals["flex"].get("initialRole", "decode")] if vals.get("flex", {}).get("enabled") else []
    assert roles == sorted(["both"] if vals.get("mode") == "colocated" else ["decode", "prefill", *flex])
    assert len({a.redis_url for a in parsed.values()}) == 1
    assert {a.command for a in parsed.values()} == {"gateway", "router", "worker"} | (
        {"planner"} if vals.get("planner", {}).get("enabled") else set())


def test_guided_output_defaults_are_the_codes():
    """The chart sets every limit explicitly: its defaults must be the ones the code and docs state."""
    from dataclasses import asdict

    from pdserve.engine.grammar_limits import LIMIT_FLAGS, GrammarLimits
    from pdserve.engine.grammar_pool import DEFAULT_PROCESSES
    vals = yaml.safe_load((CHART / "values.yaml").read_text())["guidedOutput"]
    camel = {attr: "".join(w.capitalize() if i else w for i, w in enumerate(attr.split("_")))
             for attr, _ in LIMIT_FLAGS.values()}
    assert {camel[k]: v for k, v in asdict(GrammarLimits()).items()} == \
        {k: v for k, v in vals.items() if k != "grammarProcesses"}
    assert vals["grammarProcesses"] == DEFAULT_PROCESSES


def test_service_links_off_because_they_collide_with_pdserve_env(monkeypatch):
    """A Service named `pdserve` would inject PDSERVE_PORT=tcp://..., which every pdserve parser reads as --port."""
    from pdserve.cli import build_parser

    monkeypatch.setenv("PDSERVE_PORT", "tcp://10.0.0.1:8000")
    with pytest.raises(SystemExit):  # a one-line error naming the variable (tests/services/test_cli.py)
        build_parser().parse_args(["gateway"])
    for scenario, vals in SCENARIOS.items():
        for o in objects(vals):
            if o["kind"] in ("Deployment", "StatefulSet"):
                assert pod_template(o)["enableServiceLinks"] is False, (scenario, o["metadata"]["name"])


# ---- pools, resources, probes, drain ----------------------------------------------------------------------------

def test_pools_follow_mode():
    d = by_kind(objects(), "Deployment")
    assert set(d) == {f"{FULL}-{c}" for c in ("gateway", "router", "prefill", "decode")}
    c = by_kind(objects(SCENARIOS["colocated"]), "Deployment")
    assert set(c) == {f"{FULL}-{c}" for c in ("gateway", "router", "worker")}
    assert c[f"{FULL}-worker"]["spec"]["template"]["metadata"]["labels"]["pdserve.io/role"] == "both"
    # replicas are per pool; an autoscaled pool leaves replicas to its HPA
    d = by_kind(objects({"prefill": {"replicas": 3}, "decode": {"replicas": 5}}), "Deployment")
    assert d[f"{FULL}-prefill"]["spec"]["replicas"] == 3 and d[f"{FULL}-decode"]["spec"]["replicas"] == 5
    h = by_kind(objects(SCENARIOS["disagg_hpa"]), "Deployment")
    assert "replicas" not in h[f"{FULL}-prefill"]["spec"]


def test_gpu_rdma_shm_and_scheduling():
    vals = SCENARIOS["gpu"]
    d = by_kind(objects(vals), "Deployment")
    pre, dec = d[f"{FULL}-prefill"], d[f"{FULL}-decode"]
    for dep, gpus in ((pre, 2), (dec, 1)):
        spec = pod_template(dep)
        c = spec["containers"][0]
        for k in ("limits", "requests"):
            assert c["resources"][k]["nvidia.com/gpu"] == gpus
            assert c["resources"][k]["rdma/ib"] == 1 and c["resources"][k]["nvidia.com/hostdev"] == 2
        assert c["resources"]["limits"]["memory"] == "64Gi"
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        for k in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints"):
            assert spec[k] == GPU_SCHED_EXPECTED[k]
        assert dep["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"} in c["env"]
        # model downloaded by an init container into the volume --model points at
        init = spec["initContainers"][0]
        assert {"name": "MODEL_DIR", "value": "/models/llama"} in init["env"]
        assert init["envFrom"] == [{"secretRef": {"name": "model-store"}}]
    assert pod_template(dec)["priorityClassName"] == "inference"
    assert pod_template(dec)["terminationGracePeriodSeconds"] == 75  # drainTimeout 60 + 15
    # defaults: one GPU each, none for gateway/router; rdma off
    d = by_kind(objects(), "Deployment")
    assert pod_template(d[f"{FULL}-decode"])["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod_template(d[f"{FULL}-decode"])["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for comp in ("gateway", "router"):
        assert "nvidia.com/gpu" not in json.dumps(d[f"{FULL}-{comp}"])
    cpu = by_kind(objects({"workers": {"device": "cpu"}, "prefill": {"gpus": 0}}), "Deployment")
    assert "nvidia.com/gpu" not in json.dumps(cpu[f"{FULL}-prefill"])


GPU_SCHED_EXPECTED = __import__("tests.helm._chart", fromlist=["GPU_SCHED"]).GPU_SCHED


def test_probes_ask_the_services_own_health_names():
    from pdserve.services.grpc_util import GATEWAY_SERVICE, ROUTER_SERVICE, WORKER_SERVICE

    d = by_kind(objects(), "Deployment")
    w = pod_template(d[f"{FULL}-decode"])["containers"][0]
    assert w["startupProbe"]["grpc"] == {"port": 7100, "service": WORKER_SERVICE}
    assert w["readinessProbe"]["grpc"] == {"port": 7100, "service": WORKER_SERVICE}
    assert "tcpSocket" in w["livenessProbe"]  # a draining worker is NOT_SERVING, not dead
    r = pod_template(d[f"{FULL}-router"])["containers"][0]
    assert r["readinessProbe"]["grpc"]["service"] == ROUTER_SERVICE
    g = pod_template(d[f"{FULL}-gateway"])["containers"][0]
    assert g["livenessProbe"]["grpc"] == {"port": 50051, "service": GATEWAY_SERVICE}
    assert g["readinessProbe"]["httpGet"]["path"] == "/v1/models"
    g = pod_template(by_kind(objects({"gateway": {"readinessRequiresWorkers": True}}), "Deployment")[
        f"{FULL}-gateway"])["containers"][0]
    assert g["readinessProbe"]["httpGet"]["path"] == "/health"


def test_named_health_service_is_not_serving_until_set():
    """Why the probes name the service: grpc's HealthServicer answers SERVING for "" from the start, while a named
    service is NOT_FOUND until the worker calls set_serving (after the model is loaded and it registered)."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.services.grpc_util import WORKER_SERVICE, channel, make_server, set_serving
    from pdserve.services.ports import free_port

    async def main():
        server, hs = make_server([WORKER_SERVICE])
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            stub = health_pb2_grpc.HealthStub(channel(f"127.0.0.1:{port}"))
            chk = lambda s: stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)  # noqa: E731
            assert (await chk("")).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await chk(WORKER_SERVICE)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            await set_serving(hs, [WORKER_SERVICE], True)
            assert (await chk(WORKER_SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
            await set_serving(hs, [WORKER_SERVICE], False)
            assert (await chk(WORKER_SERVICE)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_pdbs_and_grace_periods():
    objs = objects()
    pdbs = by_kind(objs, "PodDisruptionBudget")
    assert set(pdbs) == {f"{FULL}-{c}" for c in ("gateway", "router", "prefill", "decode")}
    d = by_kind(objs, "Deployment")
    for pool in ("prefill", "decode"):
        assert pdbs[f"{FULL}-{pool}"]["spec"]["selector"]["matchLabels"] == \
            d[f"{FULL}-{pool}"]["spec"]["selector"]["matchLabels"]
        assert pod_template(d[f"{FULL}-{pool}"])["terminationGracePeriodSeconds"] == 45  # drain 30 + 15
        assert d[f"{FULL}-{pool}"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# ---- redis, model ------------------------------------------------------------------------------------------------

def test_redis_bundled_or_external():
    objs = objects()
    ss = by_kind(objs, "StatefulSet")[f"{FULL}-redis"]
    args = pod_template(ss)["containers"][0]["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    # no URL Secret: only the generated internal token and Redis password (closed by default)
    assert set(by_kind(objs, "Secret")) == {f"{FULL}-internal-token", f"{FULL}-redis-auth"}

    ext = objects(SCENARIOS["external_redis"])
    assert not by_kind(ext, "StatefulSet")
    sec = by_kind(ext, "Secret")[f"{FULL}-redis-url"]
    assert sec["stringData"]["redis-url"] == "rediss://:s3cret@redis.example.internal:6380/2"
    for name in (f"{FULL}-router", f"{FULL}-prefill", f"{FULL}-decode"):
        env = pod_template(by_kind(ext, "Deployment")[name])["containers"][0]["env"]
        ref = next(e for e in env if e["name"] == "PDSERVE_REDIS_URL")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{FULL}-redis-url", "key": "redis-url"}
    assert "s3cret" not in json.dumps(by_kind(ext, "Deployment"))

    own = objects(SCENARIOS["external_redis_secret"])
    # the user's URL Secret: none made for it, no password invented for its Redis (only the internal token)
    assert set(by_kind(own, "Secret")) == {f"{FULL}-internal-token"} and not by_kind(own, "StatefulSet")
    env = pod_template(by_kind(own, "Deployment")[f"{FULL}-router"])["containers"][0]["env"]
    assert next(e for e in env if e["name"] == "PDSERVE_REDIS_URL")["valueFrom"]["secretKeyRef"] == \
        {"name": "team-redis", "key": "url"}


@pytest.mark.parametrize("source,vol_key", [("pvc", "persistentVolumeClaim"), ("hostPath", "hostPath"),
                                            ("download", "emptyDir"), ("hf", "emptyDir")])
def test_model_sources(source, vol_key):
    vals = {"model": {"source": source, "subPath": "m", "pvc": {"claimName": "c"}, "hostPath": {"path": "/w"},
                      "download": {"url": "s3:b/m"}, "hf": {"repo": "org/m"}}}
    d = by_kind(objects(vals), "Deployment")
    for name in (f"{FULL}-gateway", f"{FULL}-prefill", f"{FULL}-decode"):
        spec = pod_template(d[name])
        vol = next(v for v in spec["volumes"] if v["name"] == "model")
        assert vol_key in vol
        c = spec["containers"][0]
        assert c["args"][c["args"].index("--model") + 1] == "/models/m"
        writable = source in ("download", "hf")
        assert {"name": "model", "mountPath": "/models", "readOnly": not writable} in c["volumeMounts"]
        assert ("initContainers" in spec) == writable
    # builtin: no volume, no init container (router never needs the model)
    d = by_kind(objects(), "Deployment")
    for name, dep in d.items():
        spec = pod_template(dep)
        assert "initContainers" not in spec and all(v["name"] != "model" for v in spec.get("volumes", []))


def _tenants_from_secret(objs, tmp_path, name=f"{FULL}-api-keys"):
    """The keys file as the gateway pod sees it (the Secret's file at the path --api-keys-file names), read by
    the gateway's own loader."""
    from pdserve.services.gateway.tenants import TenantDirectory

    g = pod_template(by_kind(objs, "Deployment")[f"{FULL}-gateway"])
    args = g["containers"][0]["args"]
    path = args[args.index("--api-keys-file") + 1]
    mount = next(m for m in g["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    vol = next(v for v in g["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"] == name
    [(key, text)] = by_kind(objs, "Secret")[name]["stringData"].items()
    assert path == f"{mount['mountPath']}/{key}"
    local = tmp_path / key
    local.write_text(text)
    return TenantDirectory(str(local))


def test_api_keys_secret_is_a_file_the_gateway_loads(tmp_path):
    """Issue 21: the chart wrote `sk-one\nsk-two\n` under `api-keys` and the gateway crash-looped on it."""
    d = _tenants_from_secret(objects(SCENARIOS["gpu"]), tmp_path)
    assert d.authenticate("sk-one").name == d.authenticate("sk-two").name == "default"
    assert d.authenticate("sk-three") is None
    tenants = {"acme": {"keys": ["sk-acme"], "rate_rps": 5, "burst": 10, "quota_tokens": 200000, "priority": 0},
               "team": {"keys": ["sk-team"], "quota_window_s": 60}}
    for key in ("tenants.yaml", "tenants.json", "keys"):
        vals = {"gateway": {"apiKeys": {"enabled": True, "keys": ["sk-plain", "12345"], "defaultTenant": "team",
                                        "tenants": tenants, "secretKey": key}}}
        objs = objects(vals)
        d = _tenants_from_secret(objs, tmp_path)
        acme = d.authenticate("sk-acme")
        assert (acme.name, acme.rate_rps, acme.burst, acme.quota_tokens, acme.priority) == ("acme", 5, 10, 200000, 0)
        for k in ("sk-team", "sk-plain", "12345"):  # plain keys join the default tenant's own
            assert d.authenticate(k).name == "team" and d.authenticate(k).quota_window_s == 60, k
        # the pod template changes with the keys, so a `helm upgrade` with new keys rolls the gateways
        ann = by_kind(objs, "Deployment")[f"{FULL}-gateway"]["spec"]["template"]["metadata"]["annotations"]
        vals["gateway"]["apiKeys"]["keys"] = ["sk-new"]
        ann2 = by_kind(objects(vals), "Deployment")[f"{FULL}-gateway"]["spec"]["template"]["metadata"]["annotations"]
        assert ann["checksum/api-keys"] != ann2["checksum/api-keys"]
    own = objects(SCENARIOS["plain_keys_secret"])
    assert not [n for n in by_kind(own, "Secret") if "api-keys" in n]
    g = pod_template(by_kind(own, "Deployment")[f"{FULL}-gateway"])
    assert g["containers"][0]["args"][-2:] == ["--api-keys-file", "/etc/pdserve/api-keys/api-keys"]
    assert next(v for v in g["volumes"] if v["name"] == "api-keys")["secret"]["secretName"] == "team-keys"
    with pytest.raises(helm.HelmError, match="needs gateway.apiKeys.keys or gateway.apiKeys.tenants"):
        render({"gateway": {"apiKeys": {"enabled": True}}})
    with pytest.raises(helm.HelmError):  # a tenant without keys
        render({"gateway": {"apiKeys": {"enabled": True, "tenants": {"acme": {"rate_rps": 1}}}}})


# ---- autoscaling and metrics -------------------------------------------------------------------------------------

def test_network_policy_lets_workers_talk_nixl():
    nps = by_kind(objects(SCENARIOS["disagg_hpa"]), "NetworkPolicy")
    assert set(nps) == {f"{FULL}-{c}" for c in ("gateway", "router", "workers", "redis")}
    w = nps[f"{FULL}-workers"]["spec"]
    peer = next(r for r in w["ingress"] if "ports" not in r)  # all ports between workers (UCX picks them)
    exprs = {e["key"]: e["values"] for e in peer["from"][0]["podSelector"]["matchExpressions"]}
    assert sorted(exprs["app.kubernetes.io/component"]) == ["decode", "prefill"]
    # Redis: the gateway too (shared rate limits, quotas, reservations), not only router and workers
    r = nps[f"{FULL}-redis"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"]
    comps = next(e["values"] for e in r if e["key"] == "app.kubernetes.io/component")
    assert sorted(comps) == ["decode", "gateway", "prefill", "router"]


# ---- pod security, extra volumes, labels, runtime class, PodMonitor ----------------------------------------------

@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_container_is_restricted_by_default(scenario):
    """Pod Security Standard `restricted` for every container (init containers included), and a writable
    emptyDir for everything pdserve writes (HOME, /tmp, compiled kernels, the hub cache) under the read-only root."""
    objs = objects(SCENARIOS[scenario])
    n = 0
    for o, spec in pod_specs(objs):
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0 and psc["fsGroup"] != 0
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            n += 1
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (o["metadata"]["name"], c["name"])
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}  # RDMA pinned memory only
            writable = {m["mountPath"] for m in c.get("volumeMounts", [])
                        if "emptyDir" in vols[m["name"]] or not m.get("readOnly")}
            if c["name"] == "redis":
                assert "/data" in writable
                continue
            assert "/tmp" in writable
            env = container_env(c)
            for k in ("HOME", "TORCH_EXTENSIONS_DIR", "HF_HOME"):
                assert any(env[k] == w or env[k].startswith(w + "/") for w in writable), (c["name"], k, env[k])
    assert n >= 4


def test_default_uid_is_the_images_user():
    """The chart's default UID/GID is the user docker/Dockerfile and docker/Dockerfile.cpu create and run as."""
    from tests.helm._chart import ROOT
    chart = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    for df in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "docker" / df).read_text()
        uid = int(re.search(r"^USER (\d+)$", text, re.M).group(1))
        assert re.search(rf"useradd --uid {uid} ", text)
        assert chart["runAsUser"] == uid and chart["fsGroup"] == uid and chart["runAsGroup"] == uid, df


def test_security_context_is_overridable():
    vals = {"podSecurityContext": {"runAsUser": 2000, "fsGroup": None},
            "securityContext": {"readOnlyRootFilesystem": None},
            "gateway": {"securityContext": {"readOnlyRootFilesystem": True, "runAsUser": 3000}},
            "decode": {"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["SYS_NICE"]}}}}
    d = by_kind(objects(vals), "Deployment")
    for name, dep in d.items():
        spec = pod_template(dep)
        assert spec["securityContext"]["runAsUser"] == 2000 and "fsGroup" not in spec["securityContext"]
        sc = spec["containers"][0]["securityContext"]
        if name == f"{FULL}-gateway":
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsUser"] == 3000
        else:
            assert "readOnlyRootFilesystem" not in sc
        assert sc["allowPrivilegeEscalation"] is False
        caps = {"drop": ["ALL"], "add": ["SYS_NICE"]} if name == f"{FULL}-decode" else {"drop": ["ALL"]}
        assert sc["capabilities"] == caps, name


def test_extra_volumes_labels_and_runtime_class():
    vals = SCENARIOS["extras_hf_podmonitor"]
    objs = objects(vals)
    d = by_kind(objs, "Deployment")
    for name, dep in d.items():
        comp = name.removeprefix(FULL + "-")
        spec, labels = pod_template(dep), dep["spec"]["template"]["metadata"]["labels"]
        assert labels["team"] == "ml"
        assert labels.get("tier") == ("edge" if comp == "gateway" else None)
        assert labels.get("pool") == ("fast" if comp == "decode" else None)
        assert set(dep["spec"]["selector"]["matchLabels"]) <= set(labels)
        assert {"team", "tier", "pool"}.isdisjoint(dep["spec"]["selector"]["matchLabels"])
        assert spec.get("runtimeClassName") == {"prefill": "nvidia", "decode": "nvidia-cdi"}.get(comp)
        vols = [v["name"] for v in spec["volumes"]]
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert "ca" in vols and mounts["ca"] == {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}
        assert (("kcache" in vols), ("kcache" in mounts)) == ((comp != "gateway" and comp != "router"),) * 2
    redis = by_kind(objs, "StatefulSet")[f"{FULL}-redis"]
    assert redis["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    with pytest.raises(helm.HelmError, match="podLabels may not set app.kubernetes.io/component"):
        render({"router": {"podLabels": {"app.kubernetes.io/component": "x"}}})


def test_new_values_schema():
    for bad in ({"securityContext": {"capabilities": {"drop": "ALL"}}}, {"securityContext": {"privileged": "no"}},
                {"podSecurityContext": {"runAsUser": -1}}, {"podSecurityContext": {"runAsUsr": 1000}},
                {"podLabels": {"team": 1}}, {"extraVolumeMounts": [{"name": "x"}]},
                {"extraVolumes": [{"emptyDir": {}}]}, {"gateway": {"runtimeClassName": 5}},
                {"decode": {"extraVolumeMounts": [{"name": "x", "mountPath": "rel"}]}},
                {"metrics": {"podMonitor": {"interval": "15"}}}, {"metrics": {"podMonitor": {"enable": True}}},
                {"scratch": {"mountPath": "home"}}, {"model": {"source": "hf", "hf": {"repo": "not a repo"}}},
                {"model": {"hf": {"volume": {"type": "hostPath"}}}}):
        with pytest.raises(helm.HelmError):
            render(bad)
    with pytest.raises(helm.HelmError, match="model.hf.repo is required"):
        render({"model": {"source": "hf"}})
    with pytest.raises(helm.HelmError, match="model.hf.volume.claimName"):
        render({"model": {"source": "hf", "hf": {"repo": "org/m", "volume": {"type": "pvc"}}}})


def test_hf_init_container_downloads_the_snapshot(tmp_path):
    """The rendered init container's command, run here with its rendered env and the real huggingface_hub against a
    local stand-in for the hub (`HF_ENDPOINT`, which an operator sets through `model.hf.env` for a mirror): it
    fetches the files `allowPatterns` selects into the directory `--model` names, with the token from the Secret;
    a second run on the filled volume (a reused cache claim) lists the repo but downloads nothing; a repo the hub
    does not have fails the init container (non-zero), so the pod never starts without its model."""
    import os
    import subprocess
    import sys

    from tests.helm._fakehub import FakeHub

    d = by_kind(objects(SCENARIOS["extras_hf_podmonitor"]), "Deployment")
    spec = pod_template(d[f"{FULL}-decode"])
    [init] = spec["initContainers"]
    c = spec["containers"][0]
    model_dir = c["args"][c["args"].index("--model") + 1]
    assert model_dir == "/models/Qwen/Qwen2.5-0.5B-Instruct"
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert next(v for v in spec["volumes"] if v["name"] == "model")["persistentVolumeClaim"] == {"claimName": "hf"}
    tok = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert tok["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    env = container_env(init)
    assert env["HF_REPO"] == "Qwen/Qwen2.5-0.5B-Instruct" and env["HF_REVISION"] == "main"
    assert env["MODEL_DIR"] == model_dir and env["HF_TOKEN"] == "secret:hf-token/token"
    assert init["command"][0] == "python"  # the image's venv python
    # container paths -> local ones; the Secret's value -> a token
    local = tmp_path / "models" / "Qwen" / "Qwen2.5-0.5B-Instruct"
    env.update(MODEL_DIR=str(local), HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "home" / "hf"),
               HF_TOKEN="hf_from_secret", PATH=os.environ["PATH"])
    env.pop("TORCH_EXTENSIONS_DIR")
    files = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
             "model.safetensors": b"w" * 4096, "pytorch_model.bin": b"dup", "README.md": b"# card"}
    with FakeHub("Qwen/Qwen2.5-0.5B-Instruct", files) as hub:
        env["HF_ENDPOINT"] = hub.endpoint

        def run():
            return subprocess.run([sys.executable, *init["command"][1:]], env=env, capture_output=True, text=True,
                                  timeout=60)
        r = run()
        assert r.returncode == 0 and f"model ready in {local}" in r.stdout, r.stderr[-2000:]
        got = {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()}
        assert got == {k: files[k] for k in ("config.json", "tokenizer.json", "model.safetensors")}
        repo_calls = [q for q in hub.requests if "Qwen" in q[1]]
        assert repo_calls and all(a == "Bearer hf_from_secret" for _, _, a in repo_calls)
        assert sum(m == "GET" and "/resolve/" in p for m, p, _ in repo_calls) == 3
        hub.requests.clear()
        r = run()
        assert r.returncode == 0, r.stderr[-2000:]
        assert not [q for q in hub.requests if q[0] == "GET" and "/resolve/" in q[1]], hub.requests
        env.update(HF_REPO="Qwen/missing", MODEL_DIR=str(tmp_path / "other"))
        r = run()
        assert r.returncode != 0 and not (tmp_path / "other" / "config.json").exists()



@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_pdserve_variable_is_a_flag_or_a_knob(scenario):
    """The chart speaks to pdserve through PDSERVE_* variables: each one a pod sets is a flag of the command it runs
    (PDSERVE_<FLAG>, parsed like the flag) or a declared environment-only setting (pdserve/env_knobs.py). A value
    under a name nothing reads (a renamed flag) would otherwise be ignored in silence."""
    from pdserve.cli import build_parser
    from pdserve.cli_args import env_name
    from pdserve.env_knobs import KNOBS

    commands = build_parser()._subparsers._group_actions[0].choices
    seen = 0
    for o, c in pdserve_containers(objects(SCENARIOS[scenario])):
        cmd = commands[str(c["args"][0])]
        flags = {env_name(a.dest) for a in cmd._actions if a.option_strings}
        for k in container_env(c):
            if k.startswith("PDSERVE_"):
                seen += 1
                assert k in flags or k in KNOBS, (o["metadata"]["name"], c["args"][0], k)
    assert seen >= 10
