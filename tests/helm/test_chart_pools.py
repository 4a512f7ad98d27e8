"""Pools, resources, probes and disruption in the rendered chart: which pools each mode makes, GPU / RDMA / shm
and scheduling, the probes' gRPC health names, PodDisruptionBudgets and grace periods, the workers' NetworkPolicy."""
from __future__ import annotations

import json

import pytest

from tests.helm._chart import FULL, SCENARIOS, by_kind, objects, pod_template


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
