"""Every container command of every rendered scenario through pdserve's own argument parser, and every PDSERVE_*
variable a pod sets a flag of its command or a declared knob; the guided-output defaults equal the code's."""
from __future__ import annotations

import pytest
import yaml

from tests.helm._chart import (
    CHART,
    FULL,
    SCENARIOS,
    by_kind,
    container_env,
    objects,
    parse_pdserve,
    pdserve_containers,
    pod_template,
)


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
