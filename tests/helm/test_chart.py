"""helm/pdserve rendered by the real Helm engine: lint, Kubernetes API schema validation (offline) and the values
schema's refusals. The rest of the chart, one concern per file: container commands and env (test_chart_commands.py),
pools, probes and disruption (test_chart_pools.py), pod security and pod extras (test_chart_pods.py), the model
volume (test_chart_model.py), Redis (test_chart_redis.py), API keys (test_chart_api_keys.py); metrics, dashboard,
autoscaler queries, logging and tracing values: test_chart_metrics.py; security values: test_chart_security.py."""
from __future__ import annotations

import pytest

from tests.helm._chart import CHART, NAMESPACE, SCENARIOS, helm, objects, render

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
