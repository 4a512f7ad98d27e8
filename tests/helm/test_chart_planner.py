"""The chart's planner (helm/pdserve/templates/planner.yaml): on and off, HPAs out of its way, network reach.
The RBAC-vs-calls check is tests/planner/test_kubernetes.py (through the real client)."""
from __future__ import annotations

import pytest

from tests.helm._chart import FULL, SCENARIOS, by_kind, helm, objects, parse_pdserve, pod_template, render


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


def _args(objs, name: str) -> list[str]:
    return pod_template(by_kind(objs, "Deployment")[name])["containers"][0]["args"]


def test_flex_pool_off_by_default():
    objs = objects(SCENARIOS["planner"])
    assert f"{FULL}-flex" not in by_kind(objs, "Deployment")
    assert "--flex-selector" not in _args(objs, f"{FULL}-planner")
    assert [r["resources"] for r in by_kind(objs, "Role")[f"{FULL}-planner"]["rules"]] == [["deployments/scale"]]


def test_flex_pool_workers_may_take_either_role(monkeypatch):
    objs = objects(SCENARIOS["flex"])
    deps = by_kind(objs, "Deployment")
    flex = deps[f"{FULL}-flex"]
    assert flex["spec"]["replicas"] == 3  # its own count, never autoscaled (decode's HPA is the planner's anyway)
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    # the same worker as the decode pool (a switch keeps the KV pool: same engine flags), first role prefill; only
    # the flex pods say how a switch hands off its streams
    fa, da = _args(objs, f"{FULL}-flex"), _args(objs, f"{FULL}-decode")
    assert "--switch-handoff" not in da
    h = fa.index("--switch-handoff")
    fa = fa[:h] + fa[h + 2:]
    i = fa.index("--role")
    assert fa[i + 1] == "prefill" and fa[:i + 1] + fa[i + 2:] == da[:i + 1] + da[i + 2:]
    labels = flex["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "flex" and labels["pdserve.io/role"] == "prefill"
    # the planner lists those pods and may switch them: its selector, the workers' port, list/patch on pods
    a = parse_pdserve(pod_template(deps[f"{FULL}-planner"])["containers"][0], monkeypatch)
    sel = dict(kv.split("=", 1) for kv in a.flex_selector.split(","))
    assert sel.items() <= labels.items() and sel == flex["spec"]["selector"]["matchLabels"]
    w = parse_pdserve(pod_template(flex)["containers"][0], monkeypatch)
    assert a.flex_port == w.port and a.drain_timeout == w.drain_timeout
    rules = by_kind(objs, "Role")[f"{FULL}-planner"]["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]} in rules
    # the workers' NetworkPolicy covers the flex pods and lets the planner reach their gRPC port
    np = by_kind(objs, "NetworkPolicy")[f"{FULL}-workers"]["spec"]
    comp = next(e for e in np["podSelector"]["matchExpressions"] if e["key"] == "app.kubernetes.io/component")
    assert "flex" in comp["values"]
    grpc_from = np["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "rel",
                                            "app.kubernetes.io/component": "planner"}}} in grpc_from


def test_flex_pool_switch_handoff(monkeypatch):
    """`flex.switchHandoff` reaches the flex workers as their `--switch-handoff`, drain unless set; the schema
    refuses a handoff the worker does not know."""
    def handoff(values: dict) -> str:
        dep = by_kind(objects({"flex": {"enabled": True, **values}}), "Deployment")[f"{FULL}-flex"]
        return parse_pdserve(pod_template(dep)["containers"][0], monkeypatch).switch_handoff

    assert handoff({}) == "drain"
    assert handoff({"switchHandoff": "migrate"}) == "migrate"
    with pytest.raises(helm.HelmError, match="switchHandoff"):
        render({"flex": {"enabled": True, "switchHandoff": "cut"}})


def test_flex_pool_extra_args_and_colocated_refusal():
    objs = objects({"flex": {"enabled": True, "extraArgs": ["--max-num-seqs", "8"]},
                    "decode": {"extraArgs": ["--enable-prefix-caching"]}})
    assert _args(objs, f"{FULL}-flex")[-3:] == ["--enable-prefix-caching", "--max-num-seqs", "8"]
    assert _args(objs, f"{FULL}-flex")[_args(objs, f"{FULL}-flex").index("--role") + 1] == "decode"
    with pytest.raises(Exception, match="auto or disagg"):
        render({"mode": "colocated", "flex": {"enabled": True}})
