"""helm/pdserve's observability, rendered by the real Helm engine: every metric the autoscalers (HPA adapter rules,
KEDA) and the Grafana dashboard use is one the services export, and every exported family is on the dashboard;
the PodMonitor scrapes every metrics port; the metrics, logging and tracing values reach every pdserve process."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.helm._chart import (
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
    render,
)


def exported_metric_names() -> set[str]:
    """Sample names the services expose: every process's families (pdserve/services/metrics/) and their vLLM
    aliases."""
    from pdserve.services.metrics import common, gateway, router, vllm_compat, worker
    types = {fam.name: fam.type for reg in (common.COMMON, gateway.GATEWAY, router.ROUTER, worker.WORKER)
             for fam in reg.collect() if fam.name.startswith("pdserve_")}  # not process_* / python_*
    types |= {a.name: types[a.native] for a in vllm_compat.ALIASES}
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
    return {n + x for n, t in types.items() for x in suffixes.get(t, ("",))}


def promql_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bpdserve_[a-z0-9_]+\b", expr))


def _adapter_rules(objs) -> dict:
    cm = by_kind(objs, "ConfigMap")[f"{FULL}-prometheus-adapter-rules"]
    return yaml.safe_load(cm["data"]["rules.yaml"])


def test_hpa_metrics_are_exported_via_adapter_rules():
    exported = exported_metric_names()
    objs = objects(SCENARIOS["disagg_hpa"])
    rules = _adapter_rules(objs)
    served = {}  # adapter metric name -> (kind, metrics its query reads)
    for kind, key in (("Pods", "rules"), ("External", "externalRules")):
        for r in rules[key]:
            used = promql_metrics(r["seriesQuery"]) | promql_metrics(r["metricsQuery"])
            if "<<.Series>>" in r["metricsQuery"]:
                used |= promql_metrics(r["seriesQuery"])
            assert used and used <= exported, used - exported
            assert any(re.search(r["name"]["matches"], m) for m in exported)
            served[r["name"]["as"]] = kind
    hpas = by_kind(objs, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"{FULL}-prefill", f"{FULL}-decode"}
    want = {"prefill": {"pdserve_num_waiting", "pdserve_ttft_seconds_p90"},
            "decode": {"pdserve_num_waiting", "pdserve_itl_seconds_p90", "pdserve_kv_usage_ratio"}}
    for pool, names in want.items():
        h = hpas[f"{FULL}-{pool}"]["spec"]
        assert h["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-{pool}"}
        got = set()
        for m in h["metrics"]:
            spec = m[m["type"].lower()]
            name = spec["metric"]["name"]
            assert served[name] == m["type"], name
            if m["type"] == "External":  # gateway-measured latency, selected by the gateway Service
                assert spec["metric"]["selector"]["matchLabels"] == {"service": f"{FULL}-gateway"}
            got.add(name)
        assert got == names
    assert hpas[f"{FULL}-prefill"]["spec"]["minReplicas"] == 2
    dec = {m[m["type"].lower()]["metric"]["name"]: m for m in hpas[f"{FULL}-decode"]["spec"]["metrics"]}
    assert dec["pdserve_itl_seconds_p90"]["external"]["target"] == {"type": "Value", "value": "100m"}
    assert dec["pdserve_kv_usage_ratio"]["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    # the ServiceMonitor scrapes what the queries select on: gateway Service (http /metrics), pools (metrics port)
    sm = by_kind(objs, "ServiceMonitor")[FULL]
    scraped = {s for s, o in by_kind(objs, "Service").items()
               if all(o["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())}
    assert scraped == {f"{FULL}-{c}" for c in ("gateway", "router", "prefill", "decode")}


def test_keda_scaled_objects_query_exported_metrics():
    exported = exported_metric_names()
    objs = objects(SCENARIOS["disagg_keda"])
    assert not by_kind(objs, "HorizontalPodAutoscaler") and not by_kind(objs, "ConfigMap")
    sos = by_kind(objs, "ScaledObject")
    assert set(sos) == {f"{FULL}-prefill", f"{FULL}-decode"}
    names = {}
    for n, so in sos.items():
        names[n] = {t["name"] for t in so["spec"]["triggers"]}
        for t in so["spec"]["triggers"]:
            used = promql_metrics(t["metadata"]["query"])
            assert used and used <= exported, used - exported
            assert f'namespace="{NAMESPACE}"' in t["metadata"]["query"]
            float(t["metadata"]["threshold"])
    assert names == {f"{FULL}-prefill": {"queue-depth", "ttft-p90"}, f"{FULL}-decode": {"kv-usage", "itl-p90"}}


def test_dashboard_configmap():
    exported = exported_metric_names()
    cm = by_kind(objects(SCENARIOS["disagg_hpa"]), "ConfigMap")[f"{FULL}-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["pdserve.json"])
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            m = promql_metrics(t["expr"])
            assert m, t["expr"]
            used |= m
    used |= promql_metrics(json.dumps(dash["templating"]))
    assert used <= exported, used - exported
    # every metric family the services export is on the dashboard (under its pdserve name)
    families = {re.sub(r"_(bucket|sum|count)$", "", m) for m in exported if m.startswith("pdserve_")}
    shown = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    assert families == shown, families - shown


def test_pod_monitor_scrapes_every_metrics_port():
    objs = objects(SCENARIOS["extras_hf_podmonitor"])
    [pm] = by_kind(objs, "PodMonitor").values()
    assert not by_kind(objs, "ServiceMonitor")
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    sel = pm["spec"]["selector"]
    [expr] = sel["matchExpressions"]
    scraped = []
    for o, spec in pod_specs(objs):
        labels = o["spec"]["template"]["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in sel["matchLabels"].items()) and labels[expr["key"]] in expr["values"]:
            scraped.append(labels["app.kubernetes.io/component"])
            # the selected pod serves Prometheus on the port named `metrics` (the gateway's --metrics-port too)
            c = spec["containers"][0]
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
            assert c["args"][c["args"].index("--metrics-port") + 1] == str(port)
    assert sorted(scraped) == ["decode", "gateway", "prefill", "router"]
    with pytest.raises(helm.HelmError, match="enable one of them"):
        render({"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}})


def test_metrics_compat_reaches_every_process(monkeypatch):
    """`metrics.compat: vllm` -> gateway, router and every worker parse `--metrics-compat vllm` (from
    PDSERVE_METRICS_COMPAT); unset -> pdserve's names only. The services bind --host 0.0.0.0 in pods, and the
    metrics ports bind that host."""
    for compat, want in (("vllm", "vllm"), ("", None)):
        seen = []
        for o, c in pdserve_containers(objects({"metrics": {"compat": compat}})):
            a = parse_pdserve(c, monkeypatch)
            seen.append(a.command)
            assert a.metrics_compat == want and a.host == "0.0.0.0", (o["metadata"]["name"], a.metrics_compat)
        assert {"gateway", "router", "worker"} <= set(seen)
    with pytest.raises(Exception):
        objects({"metrics": {"compat": "sglang"}})  # the schema names the choices


def test_logging_and_tracing_values_reach_every_process(monkeypatch):
    """`logging.format: json` -> every pdserve process parses `--log-format json` (PDSERVE_LOG_FORMAT);
    `tracing.otlpEndpoint` -> OTEL_EXPORTER_OTLP_ENDPOINT on each, which is what turns tracing on
    (docs/observability.md); defaults: text logs, no tracing variable at all."""
    vals = {"logging": {"format": "json", "level": "DEBUG"},
            "tracing": {"otlpEndpoint": "http://otel-collector.monitoring:4318"}}
    seen = []
    for o, c in pdserve_containers(objects(vals)):
        a = parse_pdserve(c, monkeypatch)
        seen.append(a.command)
        env = container_env(c)
        assert a.log_format == "json" and env["PDSERVE_LOG_LEVEL"] == "DEBUG", o["metadata"]["name"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.monitoring:4318"
    assert {"gateway", "router", "worker"} <= set(seen)
    for o, c in pdserve_containers(objects({})):
        assert parse_pdserve(c, monkeypatch).log_format == "text"
        assert not any(k.startswith("OTEL_") for k in container_env(c)), o["metadata"]["name"]
    for bad in ({"logging": {"format": "xml"}}, {"tracing": {"otlpEndpoint": "collector:4318"}}):
        with pytest.raises(Exception):
            objects(bad)  # the schema names the choices / wants a URL
