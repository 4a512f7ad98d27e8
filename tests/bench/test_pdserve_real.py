"""Against a real `pdserve up` (tiny random checkpoint): a short sweep produces the JSON, PNG and HTML files with
per-stage server metrics, and the break-even study runs both deployments on one cell."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.bench.conftest import env

pytestmark = pytest.mark.e2e  # a whole `pdserve up` deployment (tests/conftest.py)
pytest.importorskip("pdserve.services.up", reason="services (pdserve up) not on this branch yet")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server not on PATH (pdserve up needs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("bench_ck") / "ck", "llama")


@pytest.fixture(scope="module")
def up(ckpt):
    from pdserve.bench.breakeven import Deployment
    d = Deployment(str(ckpt), "colocated", 2, ["--workers", "1", "--num-gpu-blocks", "128"], 90)
    yield d
    d.stop()


def test_short_sweep_against_pdserve_up(up, tmp_path):
    out = tmp_path / "sweep"
    murls = sum((["--metrics-url", u] for u in up.metrics_urls()), [])
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench", "sweep", "--base-url", up.base_url, "--rates", "2,8",
                        "--num-requests", "6", "--prompt-len", "fixed:24", "--output-len", "fixed:8", "--warmup", "1",
                        "--no-progress", "--out", str(out), *murls],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for f in ("results.json", "cdf.png", "latency_throughput.png", "stages.png", "report.html"):
        assert (out / f).stat().st_size > 1000, f
    res = json.loads((out / "results.json").read_text())
    for p in res["points"]:
        s = p["steady"]
        assert s["n_ok"] == 6, s["errors"]
        # ignore_eos + min_tokens gave exact output lengths; the usage record gave exact prompt lengths
        assert all(row["n_out"] == 8 and row["prompt_tokens"] == 24 for row in p["records"] if not row["warmup"])
        assert s["identity_max_abs_residual_s"] < 1e-9
        assert s["prefix_cached_prompt_token_fraction"] == 0  # each point has its own prompts: no cache hits
        st = p["server_stages"]
        assert st["gateway_ttft_count"] >= 6 and st["queue_both_worker_count"] >= 6
        # the gateway's own TTFT (its arrival -> first chunk) is inside ours (scheduled arrival -> chunk read)
        assert st["gateway_ttft_mean_s"] <= s["latency"]["ttft_s"]["mean"] + 1e-3
        # per-request stage distributions from usage.stage_times, not the histograms' means
        assert p["stage_breakdown_source"] == "per_request"
        dist = p["stage_distributions_s"]
        assert dist["n_requests_with_stage_times"] == 6
        for k in ("queue_s", "prefill_s", "decode_s", "e2e_s", "client_to_gateway_s"):
            assert dist[k]["n"] == 6 and all(dist[k][q] is not None for q in ("p50", "p90", "p99")), k
            assert dist[k]["p50"] <= dist[k]["p90"] <= dist[k]["p99"], k
        assert dist["prefill_s"]["p50"] > 0 and dist["client_to_gateway_s"]["p50"] > 0
        # each request's gateway E2E sits inside the client's own E2E (the client's clock starts earlier)
        for row in p["records"]:
            if not row["warmup"]:
                assert row["stages"]["durations"]["e2e"] <= row["e2e_s"] + 1e-3
                assert row["path"].startswith("local; reason=")  # x-pdserve-path: one colocated worker
        assert p["paths"] == {"local": 6}
    # cold start (spec §1.5) reported apart: the first warm-up request against a fresh deployment, and the
    # workers' own load / warm-up / ready seconds scraped from them
    cold = res["points"][0]["warmup"]
    assert cold["n_pre_run"] == 1 and cold["cold_start_ttft_s"] > 0
    assert cold["cold_start_e2e_s"] >= cold["cold_start_ttft_s"]
    assert sum(1 for row in res["points"][0]["records"] if row["warmup"]) == 1
    ready = cold["worker_ready_s"]
    assert ready["load"] > 0 and ready["warmup"] > 0 and ready["ready"] >= ready["load"] + ready["warmup"] - 0.05
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "usage.stage_times" in html and "p99 ms" in html


def test_breakeven_one_cell(ckpt, tmp_path):
    from pdserve.sim.costmodel import LinearCostModel
    out, costs = tmp_path / "be", tmp_path / "costs"
    costs.mkdir()  # a hand-set cost model stands in for the profile (its accuracy is tests/sim's business)
    LinearCostModel(a=0.002, b=1e-5, c=1e-4, kv_bytes_per_token=256, link_bytes_per_s=1e9,
                    handoff_s=0.005).save(costs / "costs_t1.json")  # disagg's 1-thread workers
    shutil.copy(costs / "costs_t1.json", costs / "costs_t2.json")  # the 1x2 colocated worker
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench", "breakeven", "--model", str(ckpt),
                        "--prompt-lens", "48", "--output-lens", "8", "--rates", "4", "--requests-per-cell", "6",
                        "--modes", "colocated,disagg", "--sim-costs", str(costs),
                        "--num-gpu-blocks", "128", "--no-progress", "--out", str(out)],
                       env=env(), capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "breakeven.json").read_text())
    (row,) = res["comparison"]
    assert row["winner"] in ("disagg", "colocated", "tie")
    assert row["kv_transfer_mean_s"] and row["kv_transfer_mean_s"] > 0  # measured on the decode worker
    # each measured cell carries the simulator's prediction next to the measurement, with its error
    for mode in ("colocated", "disagg"):
        cell = res["results"][mode]["cells"]["48x8x4"]
        sim = cell["sim"]["ttft_p50_s"]
        assert sim["measured"] == cell["ttft_p50_s"] and sim["predicted"] > 0
        assert sim["error"] == pytest.approx((sim["predicted"] - sim["measured"]) / sim["measured"])
    # the fallback target read every disaggregated answer's path: all labelled, none a fallback
    (fb,) = res["targets"]["unlabelled_fallback"]["rows"]
    assert fb["n_ok"] == 6 and fb["unlabelled"] == 0 and fb["fallback_header"] == 0 and fb["fallback_metric"] == 0
    assert (out / "breakeven_table.md").read_text().count("| 48 | 8 | 4 |") == 2
    dis = res["results"]["disagg"]["deployment"]["pinning"]
    assert sorted(v["cores"] for v in dis.values()) == [[0], [1]]
    for f in ("breakeven_heatmap.png", "breakeven_detail.png", "breakeven.html"):
        assert (out / f).stat().st_size > 1000, f
