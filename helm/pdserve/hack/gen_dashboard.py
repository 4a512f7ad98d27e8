"""Write dashboards/pdserve.json, the Grafana dashboard the chart ships (metrics.dashboard.enabled).

Every query uses metrics that pdserve/services/metrics/ defines, and every family defined there is on it (tests/helm
checks both). Variables: namespace, model (the `model` label every sample carries) and pool (the `role` label of the
worker pools: prefill / decode / both), which the worker panels filter on.
Run from the repository root: python helm/pdserve/hack/gen_dashboard.py
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "dashboards" / "pdserve.json"
SEL = 'namespace="$namespace",model=~"$model"'
POOL = SEL + ',role=~"$pool"'  # worker families only: the gateway's and router's samples have no role


def q(h: str, metric: str, by: str = "", sel: str = SEL) -> str:
    grp = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({h}, sum by ({grp}) (rate({metric}_bucket{{{sel}}}[$__rate_interval])))"


def rate(metric: str, by: str = "", sel: str = SEL) -> str:
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{{{sel}}}[$__rate_interval]))"


PANELS = [
    # (title, unit, [(expr, legend)])
    ("TTFT (gateway)", "s", [(q("0.5", "pdserve_ttft_seconds", "mode"), "p50 {{mode}}"),
                             (q("0.9", "pdserve_ttft_seconds", "mode"), "p90 {{mode}}"),
                             (q("0.99", "pdserve_ttft_seconds", "mode"), "p99 {{mode}}")]),
    ("ITL (gateway)", "s", [(q("0.5", "pdserve_itl_seconds", "mode"), "p50 {{mode}}"),
                            (q("0.9", "pdserve_itl_seconds", "mode"), "p90 {{mode}}"),
                            (q("0.99", "pdserve_itl_seconds", "mode"), "p99 {{mode}}")]),
    ("TPOT (gateway)", "s", [(q("0.5", "pdserve_tpot_seconds", "mode"), "p50 {{mode}}"),
                             (q("0.9", "pdserve_tpot_seconds", "mode"), "p90 {{mode}}")]),
    ("End-to-end latency (gateway)", "s", [(q("0.5", "pdserve_e2e_seconds", "mode"), "p50 {{mode}}"),
                                           (q("0.9", "pdserve_e2e_seconds", "mode"), "p90 {{mode}}")]),
    ("Request rate by terminal state", "reqps",
     [(rate("pdserve_requests_terminal_total", "state"), "{{state}}")]),
    ("HTTP responses by endpoint and status", "reqps",
     [(rate("pdserve_http_requests_total", "endpoint, status"), "{{endpoint}} {{status}}")]),
    ("In-flight HTTP requests / client disconnects", "short",
     [(f"sum by (endpoint) (pdserve_http_requests_in_flight{{{SEL}}})", "in flight {{endpoint}}"),
      (rate("pdserve_client_disconnects_total"), "disconnects/s")]),
    ("Mid-stream migrations by reason", "reqps",
     [(rate("pdserve_migrations_total", "reason"), "{{reason}}")]),
    ("Requests by path (disagg / local / fallback) and reason", "reqps",
     [(rate("pdserve_requests_by_path_total", "path, reason"), "{{path}} {{reason}}")]),
    ("Token throughput (gateway)", "short",
     [(rate("pdserve_prompt_tokens_total"), "prompt tokens/s"),
      (rate("pdserve_generation_tokens_total"), "generated tokens/s")]),
    ("Prompt / output length per request", "short",
     [(q("0.5", "pdserve_request_prompt_tokens"), "prompt p50"), (q("0.9", "pdserve_request_prompt_tokens"), "prompt p90"),
      (q("0.5", "pdserve_request_output_tokens"), "output p50"),
      (q("0.9", "pdserve_request_output_tokens"), "output p90")]),
    ("Rejections by reason", "reqps",
     [(f"sum by (reason) (rate(pdserve_rejections_total{{{SEL}}}[$__rate_interval]))", "{{reason}}")]),
    ("Router placements", "reqps",
     [(f"sum by (mode) (rate(pdserve_routed_total{{{SEL}}}[$__rate_interval]))", "{{mode}}")]),
    ("Queue time (engine arrival -> scheduled)", "s",
     [(q("0.9", "pdserve_queue_time_seconds", "role", POOL), "p90 {{role}}")]),
    ("Prefill time (scheduled -> first token)", "s",
     [(q("0.9", "pdserve_prefill_time_seconds", "role", POOL), "p90 {{role}}")]),
    ("Waiting requests per pod", "short", [(f"pdserve_num_waiting{{{POOL}}}", "{{pod}}")]),
    ("Running requests per pod", "short", [(f"pdserve_num_running{{{POOL}}}", "{{pod}}")]),
    ("KV usage per pod", "percentunit", [(f"pdserve_kv_usage_fraction{{{POOL}}}", "{{pod}}")]),
    ("KV usage per pool (blocks in use / blocks)", "percentunit",
     [(f"sum by (role) (pdserve_kv_blocks_in_use{{{POOL}}}) / clamp_min(sum by (role) "
       f"(pdserve_kv_blocks_total{{{POOL}}}), 1)", "{{role}}")]),
    ("KV blocks pinned for transfer (prefill)", "short", [(f"pdserve_kv_blocks_pinned{{{POOL}}}", "{{pod}}")]),
    ("Prefix cache hit rate (tokens)", "percentunit",
     [(f"{rate('pdserve_prefix_cache_hits_total', 'role', POOL)} / "
       f"clamp_min({rate('pdserve_prefix_cache_queries_total', 'role', POOL)}, 1)", "{{role}}"),
      (f"avg(pdserve_prefix_hit_ratio{{{POOL}}})", "lifetime ratio (deprecated)")]),
    # host / disk KV tier (docs/engine.md, Host KV tier)
    ("Prefix hits by tier (tokens/s)", "short",
     [(rate("pdserve_kv_tier_hit_tokens_total", "role, tier", POOL), "{{role}} {{tier}}")]),
    ("KV tier occupancy (host / disk)", "percentunit",
     [(f"sum by (role, tier) (pdserve_kv_tier_blocks{{{POOL}}}) / clamp_min(sum by (role, tier) "
       f"(pdserve_kv_tier_capacity_blocks{{{POOL}}}), 1)", "{{role}} {{tier}}")]),
    ("KV tier bytes moved", "Bps",
     [(rate("pdserve_kv_offload_bytes_total", "direction", POOL), "{{direction}}")]),
    ("KV recall latency (host / disk -> device)", "s",
     [(q("0.5", "pdserve_kv_recall_seconds", sel=POOL), "p50"),
      (q("0.99", "pdserve_kv_recall_seconds", sel=POOL), "p99")]),
    ("Engine requests by terminal state (workers)", "reqps",
     [(rate("pdserve_engine_requests_terminal_total", "role, state", POOL), "{{role}} {{state}}")]),
    ("KV transfer time (one batched NIXL READ)", "s",
     [(q("0.5", "pdserve_kv_transfer_seconds", sel=POOL), "p50"),
      (q("0.9", "pdserve_kv_transfer_seconds", sel=POOL), "p90")]),
    ("KV transfer throughput", "Bps",
     [(rate("pdserve_kv_transfer_bytes_total", "pod", POOL), "{{pod}}")]),
    ("KV transfer failures / lease expiries", "short",
     [(f"sum by (reason) (increase(pdserve_kv_transfer_failures_total{{{POOL}}}[$__rate_interval]))",
       "failed {{reason}}"),
      (f"sum (increase(pdserve_kv_leases_expired_total{{{POOL}}}[$__rate_interval]))", "leases expired")]),
    # per worker pair, on the decode pods (peer: the prefill worker pulled from; docs/metrics.md)
    ("KV pull rate per pair (decode pod <- prefill peer)", "Bps",
     [(f"sum by (pod, peer) (rate(pdserve_kv_pair_transfer_bytes_sum{{{POOL}}}[$__rate_interval])) / "
       f"sum by (pod, peer) (rate(pdserve_kv_pair_transfer_seconds_sum{{{POOL}}}[$__rate_interval]))",
       "{{pod}} <- {{peer}}")]),
    ("KV pull failures / expired leases per pair", "short",
     [(f"sum by (pod, peer, reason) (increase(pdserve_kv_pair_failures_total{{{POOL}}}[$__rate_interval]))",
       "{{pod}} <- {{peer}} {{reason}}"),
      (f"sum by (pod, peer) (increase(pdserve_kv_pair_leases_expired_total{{{POOL}}}[$__rate_interval]))",
       "{{pod}} <- {{peer}} lease expired")]),
    # the transport self-test when a pair first meets (kv_transfer/probe.py): what the router's cost starts from
    ("KV link self-test bandwidth per pair", "Bps",
     [(f"max by (pod, peer) (pdserve_kv_pair_probe_bytes_per_second{{{POOL}}})", "{{pod}} <- {{peer}}")]),
    ("KV link self-test READ latency per pair", "s",
     [(f"max by (pod, peer) (pdserve_kv_pair_probe_latency_seconds{{{POOL}}})", "{{pod}} <- {{peer}}")]),
    # decode-side prefix reuse (docs/kv_transfer.md): the blocks a pull skipped because the decode worker held them
    ("KV blocks pulled vs reused from the decode side's cache", "short",
     [(f"sum by (pod) (rate(pdserve_kv_pull_blocks_total{{{POOL}}}[$__rate_interval]))", "{{pod}} pulled"),
      (f"sum by (pod) (rate(pdserve_kv_pull_reused_blocks_total{{{POOL}}}[$__rate_interval]))", "{{pod}} reused")]),
    # mixture-of-experts load (docs/engine.md, "Expert load"): a hot expert is a slow step
    ("MoE tokens per expert", "short",
     [(f"sum by (expert) (rate(pdserve_moe_expert_tokens_total{{{POOL}}}[$__rate_interval]))", "expert {{expert}}")]),
    ("MoE expert imbalance (max / mean)", "short",
     [(f"max by (pod) (pdserve_moe_expert_imbalance{{{POOL}}})", "{{pod}}")]),
    # runtime role switches (docs/planner.md, "Role switches")
    ("Role switches", "short",
     [(f"sum by (from_role, to_role, outcome) (increase(pdserve_role_switches_total{{{POOL}}}[$__rate_interval]))",
       "{{from_role}} -> {{to_role}} {{outcome}}"),
      (f"sum by (pod) (increase(pdserve_role_switch_handoffs_total{{{POOL}}}[$__rate_interval]))",
       "{{pod}} streams handed off")]),
    ("Role switch duration p90", "s",
     [(f"histogram_quantile(0.9, sum by (le) (rate(pdserve_role_switch_seconds_bucket{{{POOL}}}[$__rate_interval])))",
       "p90")]),
    # configured (kv_transfer/transport.py), then what UCX chose per peer (kv_transfer/ucx_log.py): a
    # shared-memory kind (cma, posix, sysv) between pods means the KV never crossed the network
    ("KV transport per pod (configured)", "short",
     [(f"max by (pod, backend, transport, source) (pdserve_kv_transport_info{{{POOL}}})",
       "{{pod}} {{backend}}/{{transport}} ({{source}})")]),
    ("KV transport per pair (observed: what UCX chose)", "short",
     [(f"max by (pod, peer, observed) (pdserve_kv_pair_transport_info{{{POOL}}})",
       "{{pod}} <- {{peer}} {{observed}}")]),
    # what dtype=auto chose on each pod's CPU (docs/engine.md): a pool on mixed node types shows it here
    ("Engine path per pod (ISA, dtype, weights, kernels)", "short",
     [(f"max by (pod, isa, dtype, weights, kernels) (pdserve_engine_info{{{POOL}}})",
       "{{pod}} {{isa}} {{dtype}} weights={{weights}} {{kernels}}")]),
    # one per (decode, prefill incarnation) pair; a steady rate means prefill workers keep restarting
    ("KV handshakes (new or restarted prefill peers)", "short",
     [(f"sum by (side) (increase(pdserve_kv_handshakes_total{{{POOL}}}[$__rate_interval]))", "{{side}}")]),
    # internal security (docs/services.md, Trust model): anything above zero is a forged or mis-keyed worker
    ("Registry records refused (HMAC does not verify)", "short",
     [(f"sum by (service) (increase(pdserve_registry_rejected_records_total{{{SEL}}}[$__rate_interval]))",
       "{{service}}")]),
    # guided output (docs/reliability.md, Hostile neighbours): compiles run off the engine thread, under limits
    ("Grammar compile time by outcome", "s",
     [(q("0.5", "pdserve_grammar_compile_seconds", "outcome", POOL), "p50 {{outcome}}"),
      (q("0.99", "pdserve_grammar_compile_seconds", "outcome", POOL), "p99 {{outcome}}")]),
    ("Grammar compile cache", "bytes",
     [(f"sum by (role) (pdserve_grammar_cache_bytes{{{POOL}}})", "{{role}}")]),
    # logs (docs/observability.md): anything above zero is a log sink that did not keep up
    ("Log lines dropped (sink not keeping up)", "short",
     [(f"sum by (service) (increase(pdserve_log_lines_dropped_total{{{SEL}}}[$__rate_interval]))",
       "{{service}}")]),
    # router (docs/routing.md)
    ("Route decisions by mode and reason", "reqps",
     [(f"sum by (mode, reason) (rate(pdserve_route_decisions_total{{{SEL}}}[$__rate_interval]))",
       "{{mode}} {{reason}}")]),
    ("Degraded to local prefill (prefill pool down)", "reqps",
     [(f"sum by (reason) (rate(pdserve_route_degraded_total{{{SEL}}}[$__rate_interval]))", "{{reason}}")]),
    ("Router's predicted TTFT", "s", [(q("0.9", "pdserve_route_predicted_ttft_seconds"), "p90")]),
    ("Routed prefix hit ratio", "percentunit",
     [(f"sum(rate(pdserve_route_cached_tokens_total{{{SEL}}}[$__rate_interval])) / "
       f"clamp_min(sum(rate(pdserve_route_prompt_tokens_total{{{SEL}}}[$__rate_interval])), 1)", "hit ratio")]),
    ("Prefix index", "short",
     [(f"pdserve_prefix_index_blocks{{{SEL}}}", "blocks {{pod}}"),
      (f"sum(rate(pdserve_prefix_index_events_total{{{SEL}}}[$__rate_interval]))", "events applied/s"),
      (f"sum by (kind) (rate(pdserve_kv_events_published_total{{{POOL}}}[$__rate_interval]))",
       "published {{kind}}/s")]),
    # admission and lifecycle (docs/admission.md)
    ("Live engine sequences per state (workers)", "short",
     [(f"sum by (state) (pdserve_requests_in_state{{{POOL}}})", "{{state}}")]),
    ("Sequences entering each state (workers)", "short",
     [(rate("pdserve_request_state_entries_total", "state", POOL), "{{state}}")]),
    ("Client requests queued / degraded (gateway)", "short",
     [(f"sum by (state) (pdserve_gateway_requests_in_state{{{SEL}}})", "{{state}}")]),
    ("Admission reservations", "short",
     [(f"max(pdserve_admission_reserved_blocks{{{SEL}}})", "blocks reserved"),
      (f"max(pdserve_admission_reserved_requests{{{SEL}}})", "requests reserved")]),
    ("Admission calibration (measured / estimated service time, per gateway)", "short",
     [(f"max by (pod) (pdserve_admission_calibration_factor{{{SEL}}})", "{{pod}}")]),
    ("Admission wait / rejection latency", "s",
     [(q("0.9", "pdserve_admission_wait_seconds"), "admission wait p90"),
      (q("0.99", "pdserve_rejection_latency_seconds"), "rejection latency p99")]),
    ("Degraded requests and Redis fallbacks", "reqps",
     [(f"sum(rate(pdserve_degraded_total{{{SEL}}}[$__rate_interval]))", "n reduced"),
      (f"sum(rate(pdserve_ingress_degraded_total{{{SEL}}}[$__rate_interval]))", "ingress without Redis"),
      (f"sum(rate(pdserve_admission_degraded_total{{{SEL}}}[$__rate_interval]))", "admission without Redis")]),
    ("Billing records by tenant and state", "reqps",
     [(f"sum by (tenant, state) (rate(pdserve_usage_records_total{{{SEL}}}[$__rate_interval]))",
       "{{tenant}} {{state}}")]),
    ("Billed tokens by tenant and kind", "short",
     [(f"sum by (tenant, kind) (rate(pdserve_usage_tokens_total{{{SEL}}}[$__rate_interval]))",
       "{{tenant}} {{kind}}")]),
    ("Speculative decoding: acceptance rate", "percentunit",
     [(f"{rate('pdserve_spec_accepted_tokens_total', 'role', POOL)} / "
       f"clamp_min({rate('pdserve_spec_proposed_tokens_total', 'role', POOL)}, 1e-9)", "{{role}}"),
      (f"avg by (role) (pdserve_spec_acceptance_rate{{{POOL}}})", "{{role}} lifetime")]),
    ("Speculative decoding: mean accepted length (tokens per verification)", "short",
     [(f"{rate('pdserve_spec_emitted_tokens_total', 'role', POOL)} / "
       f"clamp_min({rate('pdserve_spec_verify_steps_total', 'role', POOL)}, 1e-9)", "{{role}}"),
      (f"avg by (role) (pdserve_spec_mean_accepted_length{{{POOL}}})", "{{role}} lifetime")]),
    # cold start (spec §1.5, docs/engine.md): load, warm-up and process start -> SERVING of each pod, set once
    ("Worker cold start per pod (load, warm-up, ready)", "s",
     [(f"max by (pod, phase) (pdserve_worker_ready_seconds{{{POOL}}})", "{{pod}} {{phase}}")]),
]


def build() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": e, "legendFormat": lg}
                        for j, (e, lg) in enumerate(targets)],
        })
    return {
        "title": "pdserve", "uid": "pdserve", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "tags": ["pdserve", "llm"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "namespace", "type": "query", "label": "Namespace",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": "label_values(pdserve_kv_blocks_total, namespace)", "refresh": 2},
            {"name": "model", "type": "query", "label": "Model", "includeAll": True, "multi": True,
             "allValue": ".*", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": 'label_values(pdserve_kv_blocks_total{namespace="$namespace"}, model)', "refresh": 2},
            {"name": "pool", "type": "query", "label": "Pool", "includeAll": True, "multi": True,
             "allValue": ".*", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": 'label_values(pdserve_kv_blocks_total{namespace="$namespace",model=~"$model"}, role)',
             "refresh": 2},
        ]},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {OUT}")
