"""Each process exports only its own families, all labelled with the model; the vLLM aliases
carry the values of the native families; metrics ports bind the service host. One real disagg deployment
(`pdserve up --metrics-compat vllm`: redis, router, prefill + decode workers, gateway as processes)."""
from __future__ import annotations

import json
import os
import time
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Up, samples, wait_until

MODEL = "ck"

# Who owns what: written out here (not read from pdserve/services/metrics/) so that a family moving to the wrong
# process, or a new one no owner claims, fails this test.
SHARED = {"pdserve_rejections", "pdserve_registry_rejected_records", "pdserve_log_lines_dropped"}
GATEWAY = {
    "pdserve_ttft_seconds", "pdserve_itl_seconds", "pdserve_tpot_seconds", "pdserve_e2e_seconds",
    "pdserve_requests_terminal", "pdserve_rejection_latency_seconds", "pdserve_prompt_tokens",
    "pdserve_generation_tokens", "pdserve_request_prompt_tokens", "pdserve_request_output_tokens",
    "pdserve_client_disconnects", "pdserve_http_requests", "pdserve_http_requests_in_flight",
    "pdserve_gateway_requests_in_state", "pdserve_ingress_degraded", "pdserve_admission_degraded",
    "pdserve_admission_reserved_blocks", "pdserve_admission_reserved_requests", "pdserve_admission_wait_seconds",
    "pdserve_admission_calibration_factor",
    "pdserve_degraded", "pdserve_usage_records", "pdserve_usage_tokens", "pdserve_migrations",
    "pdserve_requests_by_path"}
ROUTER = {
    "pdserve_routed", "pdserve_route_decisions", "pdserve_route_degraded", "pdserve_route_predicted_ttft_seconds",
    "pdserve_route_prompt_tokens", "pdserve_route_cached_tokens", "pdserve_prefix_index_blocks",
    "pdserve_prefix_index_events"}
WORKER = {
    "pdserve_queue_time_seconds", "pdserve_prefill_time_seconds", "pdserve_kv_transfer_seconds",
    "pdserve_kv_transfer_bytes", "pdserve_kv_transfer_failures", "pdserve_kv_leases_expired",
    "pdserve_kv_events_published", "pdserve_kv_handshakes", "pdserve_engine_requests_terminal",
    "pdserve_kv_blocks_in_use",
    "pdserve_kv_blocks_total", "pdserve_kv_blocks_pinned", "pdserve_kv_usage_fraction",
    "pdserve_kv_offload_bytes", "pdserve_kv_recall_seconds", "pdserve_kv_tier_blocks", "pdserve_kv_tier_capacity_blocks",
    "pdserve_kv_tier_hit_tokens",
    "pdserve_spec_verify_steps", "pdserve_spec_proposed_tokens", "pdserve_spec_accepted_tokens",
    "pdserve_spec_emitted_tokens", "pdserve_spec_acceptance_rate", "pdserve_spec_mean_accepted_length",
    "pdserve_prefix_cache_queries", "pdserve_prefix_cache_hits", "pdserve_prefix_hit_ratio", "pdserve_num_running",
    "pdserve_num_waiting", "pdserve_requests_in_state", "pdserve_request_state_entries", "pdserve_engine_info",
    "pdserve_worker_ready_seconds", "pdserve_grammar_compile_seconds", "pdserve_grammar_cache_bytes",
    "pdserve_moe_expert_tokens", "pdserve_moe_expert_imbalance",
    "pdserve_kv_pair_transfer_bytes", "pdserve_kv_pair_transfer_seconds", "pdserve_kv_pair_failures",
    "pdserve_kv_pair_leases_expired", "pdserve_kv_pair_probe_latency_seconds", "pdserve_kv_pair_probe_bytes_per_second",
    "pdserve_kv_transport_info", "pdserve_kv_pair_transport_info", "pdserve_kv_pull_blocks", "pdserve_kv_pull_reused_blocks",
    "pdserve_role_switches", "pdserve_role_switch_seconds", "pdserve_role_switch_handoffs"}

# vLLM's name -> (pdserve's family, owner, labels selecting the native samples): the table in docs/metrics.md
ALIASES = {
    "vllm:time_to_first_token_seconds": ("pdserve_ttft_seconds", "gateway", {}),
    "vllm:e2e_request_latency_seconds": ("pdserve_e2e_seconds", "gateway", {}),
    "vllm:inter_token_latency_seconds": ("pdserve_itl_seconds", "gateway", {}),
    "vllm:time_per_output_token_seconds": ("pdserve_tpot_seconds", "gateway", {}),
    "vllm:prompt_tokens": ("pdserve_prompt_tokens", "gateway", {}),
    "vllm:generation_tokens": ("pdserve_generation_tokens", "gateway", {}),
    "vllm:request_success": ("pdserve_requests_terminal", "gateway", {"state": "FINISHED"}),
    "vllm:request_prompt_tokens": ("pdserve_request_prompt_tokens", "gateway", {}),
    "vllm:request_generation_tokens": ("pdserve_request_output_tokens", "gateway", {}),
    "vllm:num_requests_running": ("pdserve_num_running", "worker", {}),
    "vllm:num_requests_waiting": ("pdserve_num_waiting", "worker", {}),
    "vllm:kv_cache_usage_perc": ("pdserve_kv_usage_fraction", "worker", {}),
    "vllm:prefix_cache_queries": ("pdserve_prefix_cache_queries", "worker", {}),
    "vllm:prefix_cache_hits": ("pdserve_prefix_cache_hits", "worker", {}),
}

LONG = "pack my box with five dozen liquor jugs " * 6  # several KV blocks: a repeat hits the prefix cache


@pytest.fixture(scope="module")
def up(tiny_llama):
    import shutil
    model = tiny_llama.parent / MODEL
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    # every engine step >= 10 ms: a 200-token stream is still open when the test looks at it mid-way
    os.environ["PDSERVE_FAULT_STEP_DELAY_S"] = "0.01"
    try:
        d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "1", "--metrics-compat", "vllm")
    finally:
        del os.environ["PDSERVE_FAULT_STEP_DELAY_S"]
    yield d
    assert d.stop() == 0


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _urls(up) -> dict[str, str]:
    out = {"gateway": up.base_url + "/metrics",
           "router": f"http://127.0.0.1:{up.process('router')['metrics_port']}/metrics"}
    for w in up.workers():
        out[w["role"]] = f"http://127.0.0.1:{w['metrics_port']}/metrics"
    return out


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _complete(up, prompt: str, **kw) -> dict:
    r = httpx.post(up.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_some(up, n_chunks: int, hold=None) -> dict | None:
    """Stream 200 tokens; leave (close the connection) after `n_chunks` chunks, calling `hold` first. Returns the
    usage of a stream read to its end."""
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", up.base_url + "/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage") or usage
                n += 1
                if n == n_chunks:
                    if hold is not None:
                        hold()
                    break  # closing the connection mid-stream: the client left
    return usage


def test_each_process_exports_only_its_own_families_with_the_model_label(up):
    _complete(up, "judge my vow")  # labelled families get their first samples
    owners = {"gateway": GATEWAY, "router": ROUTER, "prefill": WORKER, "decode": WORKER}
    for proc, url in _urls(up).items():
        fams = _families(_text(url))
        # (`X_created`: the creation time prometheus_client writes as a family of its own for X)
        mine = {n for n in fams if n.startswith("pdserve_") and not n.endswith("_created")}
        want = owners[proc] | SHARED
        assert mine == want, f"{proc}: foreign {sorted(mine - want)}, missing {sorted(want - mine)}"
        for fam in fams.values():
            for s in fam.samples:
                assert s.labels.get("model", s.labels.get("model_name")) == MODEL, f"{proc}: {s}"
                if proc in ("prefill", "decode") and fam.name.startswith("pdserve_"):
                    assert s.labels.get("role") == proc, f"{proc}: {s}"
    # the router no longer reports an empty KV pool, and no engine terminal is counted at the gateway
    assert "pdserve_kv_blocks_total" not in _families(_text(_urls(up)["router"]))
    # cold start (spec §1.5): each worker warmed up before it became ready, and says how long each phase took
    for proc in ("prefill", "decode"):
        fam = _families(_text(_urls(up)[proc]))["pdserve_worker_ready_seconds"]
        phase = {s.labels["phase"]: s.value for s in fam.samples}
        assert phase["load"] > 0 and phase["warmup"] > 0 and phase["ready"] >= phase["load"] + phase["warmup"]


def test_metrics_ports_bind_the_service_host(up):
    """`pdserve up` starts the router and workers with --host 127.0.0.1: their metrics ports listen there only."""
    ports = [up.process("router")["metrics_port"]] + [w["metrics_port"] for w in up.workers()]
    listening = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    addr, port = local.rsplit(":", 1)
                    listening.setdefault(int(port, 16), set()).add(addr)
    for p in ports:
        assert listening.get(p) == {"0100007F"}, f"metrics port {p} listens on {listening.get(p)}"


def test_request_counts_lengths_and_vllm_aliases_after_real_traffic(up):
    urls = _urls(up)
    time.sleep(1.5)  # worker counters follow the stats snapshot each heartbeat (1 s) takes: let earlier tests land
    g0, p0 = _text(urls["gateway"]), _text(urls["prefill"])
    # a repeated long prompt (prefix-cache hits on the prefill worker), short ones, a stream
    usage = [_complete(up, p)["usage"] for p in (LONG, LONG, "judge my vow", LONG)]
    usage.append(_stream_some(up, 1000))  # to its end: max_tokens 200 < 1000 chunks
    assert usage[-1]["completion_tokens"] == 200
    r = httpx.post(up.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400
    assert httpx.get(up.base_url + "/no/such/route").status_code == 404
    g1 = _text(urls["gateway"])

    def delta(name, labels=""):
        return sum(samples(g1, name, labels)) - sum(samples(g0, name, labels))

    # independent references: the usage the responses reported, the requests this test made
    finished = len(usage)
    assert delta("pdserve_requests_terminal_total", '{state="FINISHED"}') == finished
    prompt = sum(u["prompt_tokens"] for u in usage)
    gen = sum(u["completion_tokens"] for u in usage)
    assert delta("pdserve_prompt_tokens_total") == prompt
    assert delta("pdserve_request_prompt_tokens_sum") == prompt
    assert delta("pdserve_generation_tokens_total") == gen
    assert delta("pdserve_request_output_tokens_count") == finished
    assert delta("pdserve_request_output_tokens_sum") == gen
    assert delta("pdserve_request_output_tokens_bucket", '{le="128.0"}') == finished - 1  # not the stream
    assert delta("pdserve_http_requests_total", '{endpoint="/v1/completions",status="200"}') == finished
    assert delta("pdserve_http_requests_total", '{endpoint="/v1/completions",status="400"}') == 1
    assert delta("pdserve_http_requests_total", '{endpoint="other",status="404"}') == 1
    assert sum(samples(g1, "pdserve_http_requests_in_flight", '{endpoint="/v1/completions"}')) == 0

    # the prefill worker looked every prompt up in its prefix cache; its hits are the cached tokens the responses
    # reported (the counters follow the heartbeat's stats snapshot: wait for it)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage)
    assert cached > 0

    def prefill_delta(name):
        return sum(samples(_text(urls["prefill"]), name)) - sum(samples(p0, name))
    assert wait_until(lambda: prefill_delta("pdserve_prefix_cache_queries_total") == prompt, 5), \
        (prefill_delta("pdserve_prefix_cache_queries_total"), prompt)
    assert wait_until(lambda: prefill_delta("pdserve_prefix_cache_hits_total") == cached, 5), \
        (prefill_delta("pdserve_prefix_cache_hits_total"), cached)

    # aliases: same values as the native samples of the same scrape, every owner
    pre = {proc: _text(url) for proc, url in urls.items()}
    assert sum(samples(pre["prefill"], "pdserve_prefix_cache_hits_total")) > 0
    checked = set()
    for proc, text in pre.items():
        fams = _families(text)
        for alias, (native, owner, only) in ALIASES.items():
            if (owner == "gateway") != (proc == "gateway") or proc == "router":
                assert alias not in fams, f"{alias} on {proc}"
                continue
            a, n = fams[alias], fams[native]
            assert a.type == n.type
            want = sorted((s.name[len(native):], _key(s.labels, only), s.value) for s in n.samples
                          if all(s.labels.get(k) == v for k, v in only.items()))
            got = sorted((s.name[len(alias):], _key(s.labels, {}), s.value) for s in a.samples)
            assert got == want and want, (proc, alias)
            assert all("model" not in s.labels and s.labels["model_name"] == MODEL for s in a.samples)
            checked.add(alias)
    assert checked == set(ALIASES)


def _key(labels: dict, only: dict) -> tuple:
    renamed = {("model_name" if k == "model" else k): v for k, v in labels.items() if k not in only}
    return tuple(sorted(renamed.items()))


def test_kv_usage_in_flight_and_disconnects_while_a_stream_is_open(up):
    urls = _urls(up)
    before = sum(samples(_text(urls["gateway"]), "pdserve_client_disconnects_total"))
    seen = {}

    def look() -> None:  # mid-stream: the decode worker holds the sequence's blocks
        seen["in_flight"] = sum(samples(_text(urls["gateway"]), "pdserve_http_requests_in_flight",
                                        '{endpoint="/v1/completions"}'))
        # the KV gauges follow the stats snapshot each heartbeat (1 s here) refreshes
        assert wait_until(lambda: samples(_text(urls["decode"]), "pdserve_kv_blocks_in_use")[0] > 0, 3)
        d = _text(urls["decode"])
        used, total = samples(d, "pdserve_kv_blocks_in_use")[0], samples(d, "pdserve_kv_blocks_total")[0]
        seen["usage"] = (samples(d, "pdserve_kv_usage_fraction")[0], used / total,
                         samples(d, "vllm:kv_cache_usage_perc")[0])

    _stream_some(up, 5, hold=look)
    assert seen["in_flight"] == 1
    frac, ref, alias = seen["usage"]
    assert 0 < frac <= 1 and alias == frac
    assert abs(frac - ref) < 0.2  # the fraction comes from the heartbeat snapshot; the counts may be a step newer
    assert wait_until(lambda: sum(samples(_text(urls["gateway"]), "pdserve_client_disconnects_total"))
                      == before + 1, 10)
    assert wait_until(lambda: sum(samples(_text(urls["gateway"]), "pdserve_http_requests_in_flight",
                                          '{endpoint="/v1/completions"}')) == 0, 10)
