"""The chart's planner (helm/pdserve/templates/planner.yaml): on and off, HPAs out of its way, network reach.
The RBAC-vs-calls check is tests/planner/test_kubernetes.py (through the real client)."""
from __future__ import annotations

import pytest

from tests.helm._chart import FULL, SCENARIOS, by_kind, objects, parse_pdserve, pod_template, render


def test_off_by_default():
    objs = objects()
    assert f"{FULL}-planner" not in by_kind(objs, "Deployment")
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")


def test_planner_replaces_the_pool_autoscalers():
    on = objects(SCENARIOS["planner"])
    assert not by_kind(on, "HorizontalPodAutoscaler")
    off = objects({**SCENARIOS["planner"], "planner": {"enabled": False}})
    assert set(by_kind(off, "HorizontalPodAutoscaler")) == {f"{FULL}-prefill", f"{FULL}-decode"}
    keda = objects({**SCENARIOS["planner"], "autoscaling": {"provider": "keda"}})
    assert not [o for o in keda if o["kind"] == "ScaledObject"]


def test_planner_pod_flags_and_reach(monkeypatch):
    objs = objects(SCENARIOS["planner"])
    dep = by_kind(objs, "Deployment")[f"{FULL}-planner"]
    spec = pod_template(dep)
    a = parse_pdserve(spec["containers"][0], monkeypatch)
    assert (a.planner_interval, a.dry_run, a.connector) == (15, True, "kubernetes")
    assert a.redis_url == f"redis://{FULL}-redis:6379/0"
    assert a.internal_token_file  # it verifies the signed registry and signs its decisions
    assert a.metrics_url == [f"http://{FULL}-gateway:9100/metrics"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert spec["automountServiceAccountToken"] is True and spec["serviceAccountName"] == f"{FULL}-planner"
    # the shared account keeps no API token
    assert by_kind(objs, "ServiceAccount")[FULL]["automountServiceAccountToken"] is False
    nps = by_kind(objs, "NetworkPolicy")
    redis_from = nps[f"{FULL}-redis"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"]
    assert "planner" in next(e["values"] for e in redis_from if e["key"] == "app.kubernetes.io/component")
    gw_metrics = nps[f"{FULL}-gateway"]["spec"]["ingress"][1]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "rel",
                                            "app.kubernetes.io/component": "planner"}}} in gw_metrics


def test_colocated_planner_fails_with_a_reason():
    with pytest.raises(Exception, match="auto or disagg"):
        render({"mode": "colocated", "planner": {"enabled": True}})
