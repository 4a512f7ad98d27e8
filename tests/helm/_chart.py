"""Render helm/pdserve with the real Helm engine (helm-python-sdk: Helm's Go SDK behind a C ABI, in a PyPI wheel;
no helm binary, no cluster) and helpers shared by the chart tests."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (pyproject test extra) renders the chart")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
RELEASE, NAMESPACE = "rel", "llm"
FULL = f"{RELEASE}-pdserve"

# Values for the deployment scenarios the chart supports (and its other switches), each rendered, linted and validated.
GPU_SCHED = {
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}}]}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE}}}],
}
SCENARIOS: dict[str, dict] = {
    "defaults": {},
    "disagg_hpa": {
        "prefill": {"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
        "decode": {"replicas": 3, "autoscaling": {"enabled": True, "maxReplicas": 12,
                                                  "targets": {"queueDepth": 8}}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                    "dashboard": {"enabled": True}},
        "networkPolicy": {"enabled": True,
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
    },
    "disagg_keda": {
        "autoscaling": {"provider": "keda"},
        "workers": {"kvCacheDtype": "fp8_e4m3"},  # both pools get the same quantized KV (the handshake checks it)
        "prefill": {"autoscaling": {"enabled": True}},
        "decode": {"autoscaling": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "colocated": {
        "mode": "colocated",
        "workers": {"device": "cpu", "quantization": "int8", "deterministic": True},  # CPU, int8, batch-invariant
        "worker": {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 4}},
        "model": {"source": "pvc", "pvc": {"claimName": "llama-weights"}, "subPath": "Llama-3.1-8B-Instruct"},
        "networkPolicy": {"enabled": True},
    },
    "external_redis": {
        "redis": {"enabled": False, "external": {"url": "rediss://:s3cret@redis.example.internal:6380/2"}},
    },
    "external_redis_secret": {
        "redis": {"enabled": False, "external": {"existingSecret": "team-redis", "existingSecretKey": "url"}},
        "model": {"source": "hostPath", "hostPath": {"path": "/mnt/models/qwen2"}, "servedModelName": "qwen"},
    },
    "gpu": {
        "workers": {"gpuResourceName": "nvidia.com/gpu", "dtype": "bfloat16", "blockSize": 32, "maxModelLen": 8192,
                    "shm": {"sizeLimit": "32Gi"},
                    "rdma": {"enabled": True, "resources": {"rdma/ib": 1, "nvidia.com/hostdev": 2},
                             "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}},
                    "extraEnv": [{"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"}]},
        "prefill": {"gpus": 2, "numGpuBlocks": 4096, "maxNumSeqs": 64, "maxNumBatchedTokens": 8192, **GPU_SCHED},
        "guidedOutput": {"maxEnumValues": 5000, "grammarCompileTimeout": 2.5, "grammarProcesses": 4},
        "router": {"placement": "least-loaded"},
        "decode": {"gpus": 1, "drainTimeout": 60, "priorityClassName": "inference", "gpuMemoryUtilization": 0.85,
                   "preemptionMode": "swap", "swapSpace": 8, **GPU_SCHED},
        "model": {"source": "download", "download": {"url": "s3:models/llama", "envFrom": [
            {"secretRef": {"name": "model-store"}}]}, "subPath": "llama"},
        "gateway": {"apiKeys": {"enabled": True, "keys": ["sk-one", "sk-two"]}, "replicas": 2,
                    "service": {"type": "LoadBalancer"}},
    },
    "auto": {
        "mode": "auto",
        "gateway": {"replicas": 2, "requireDisagg": True, "apiKeys": {"enabled": True, "tenants": {
            "acme": {"keys": ["sk-acme"], "rate_rps": 5, "burst": 10, "quota_tokens": 200000, "priority": 0}}}},
    },
    "extras_hf_podmonitor": {
        "model": {"source": "hf", "hf": {"repo": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "main",
                                         "tokenSecret": "hf-token", "volume": {"type": "pvc", "claimName": "hf"}}},
        "metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}},
        "podLabels": {"team": "ml"}, "gateway": {"podLabels": {"tier": "edge"}},
        "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
        "workers": {"runtimeClassName": "nvidia",
                    "extraVolumes": [{"name": "kcache", "persistentVolumeClaim": {"claimName": "kernels"}}],
                    "extraVolumeMounts": [{"name": "kcache", "mountPath": "/kcache"}]},
        "decode": {"runtimeClassName": "nvidia-cdi", "podLabels": {"pool": "fast"}},
    },
    "secured": {  # internal token (generated), mTLS from a cert-manager Secret, Redis AUTH (generated)
        "security": {"internalToken": {"enabled": True}, "tls": {"enabled": True, "secretName": "pdserve-mtls"}},
        "redis": {"auth": {"enabled": True}},
        "networkPolicy": {"enabled": True},
    },
    "planner": {  # the SLA planner sizes the pools; their HPAs are then not rendered
        "planner": {"enabled": True, "dryRun": True, "interval": 15},
        "prefill": {"autoscaling": {"enabled": True}}, "decode": {"autoscaling": {"enabled": True}},
        "security": {"internalToken": {"enabled": True}}, "networkPolicy": {"enabled": True,
                                                                            "metricsFrom": [{"podSelector": {}}]},
    },
    "flex": {  # a pool of workers the planner switches between the roles (planner/connectors/kubernetes.py)
        "planner": {"enabled": True}, "flex": {"enabled": True, "replicas": 3, "initialRole": "prefill"},
        "decode": {"autoscaling": {"enabled": True}}, "security": {"internalToken": {"enabled": True}},
        "networkPolicy": {"enabled": True},
    },
    "plain_keys_secret": {
        "gateway": {"apiKeys": {"enabled": True, "existingSecret": "team-keys", "secretKey": "api-keys"}},
    },
}


@functools.lru_cache(maxsize=None)
def _render_json(values_json: str) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(values: dict | None = None) -> dict[str, str]:
    """template path -> rendered text (NOTES.txt included)."""
    return _render_json(json.dumps(values or {}, sort_keys=True))


def objects(values: dict | None = None) -> list[dict]:
    out = []
    for path, text in sorted(render(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append(doc)
    return out


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_template(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def container_env(container: dict) -> dict[str, str]:
    """The env a container would see, with stand-ins for downward-API / Secret references."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            src = e["valueFrom"]
            if "fieldRef" in src:
                env[e["name"]] = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "spec.nodeName": "node-1",
                                  "metadata.labels['topology.kubernetes.io/zone']": "zone-a"}[src["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in src:
                env[e["name"]] = f"secret:{src['secretKeyRef']['name']}/{src['secretKeyRef']['key']}"
            else:
                raise AssertionError(f"unexpected env source {src}")
    return env


def parse_pdserve(container: dict, monkeypatch) -> "object":
    """Run a rendered container's command line through pdserve's own parser, with the container's env applied
    (a flag not on the command line is read from PDSERVE_<FLAG> when the command line is parsed)."""
    from pdserve.cli import build_parser

    assert container["command"] == ["pdserve"], container["command"]
    for k in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(k)
    for k, v in container_env(container).items():
        monkeypatch.setenv(k, v)
    env = container_env(container)
    # Kubernetes expands $(VAR) in args from the container's env
    args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(a)) for a in container["args"]]
    return build_parser().parse_args(args)


def pdserve_containers(objs):
    """(object, container) for every container of a Deployment/StatefulSet that runs `pdserve`."""
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            for c in pod_template(o)["containers"]:
                if c.get("command") == ["pdserve"]:
                    yield o, c


def pod_specs(objs):
    """(object, pod spec) for every Deployment/StatefulSet."""
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, pod_template(o)
