"""`pdserve bench run/sweep` end to end against the mock server: report files; Ctrl-C keeps what was measured."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tests.bench.conftest import env


def _bench(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pdserve.bench", *args, "--no-progress"], env=env(),
                          capture_output=True, text=True, timeout=60, **kw)


def test_sweep_writes_report(mock_factory, tmp_path):
    m = mock_factory("--ttft", "0.01", "--itl", "0.003")
    out = tmp_path / "sw"
    r = _bench("sweep", "--base-url", m.url, "--rates", "10,40", "--num-requests", "20", "--output-len", "fixed:4",
               "--prompt-len", "uniform:4:16", "--arrival", "gamma", "--cv", "2", "--warmup", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    for f in ("results.json", "cdf.png", "latency_throughput.png", "report.html"):
        assert (out / f).stat().st_size > 1000, f
    res = json.loads((out / "results.json").read_text())
    assert [p["offered_rate_req_per_s"] for p in res["points"]] == [10.0, 40.0]
    p = res["points"][0]
    assert p["steady"]["n_ok"] == 20 and p["warmup"]["n_pre_run"] == 1 and p["warmup"]["cold_start_ttft_s"] > 0
    assert set(p["steady"]["throughput"]) >= {"request_throughput_req_per_s", "output_token_throughput_tok_per_s",
                                              "total_token_throughput_tok_per_s"}
    assert res["knee"]["criteria"]["attainment_target"] == 0.9
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "<img" in html and "src=\"cdf.png\"" not in html


def test_chat_closed_loop_with_tenants(mock_factory, tmp_path):
    m = mock_factory()
    r = _bench("run", "--base-url", m.url, "--endpoint", "chat", "--concurrency", "2", "--num-requests", "6",
               "--api-key", "k1", "--api-key", "k2", "--tenants", "2", "--prompt-format", "text",
               "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    p = json.loads((tmp_path / "c" / "results.json").read_text())["points"][0]
    assert p["mode"] == "closed-loop(concurrency=2)" and p["steady"]["n_ok"] == 6
    assert {row["tenant"] for row in p["records"]} == {0, 1}


def test_ctrl_c_reports_partial(mock_factory, tmp_path):
    m = mock_factory("--itl", "0.01")
    out = tmp_path / "int"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench", "run", "--base-url", m.url, "--rate", "5",
                             "--num-requests", "200", "--output-len", "fixed:8", "--warmup", "0", "--no-progress",
                             "--out", str(out)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    so, se = proc.communicate(timeout=30)
    assert proc.returncode == 130, se
    res = json.loads((out / "results.json").read_text())
    assert res["interrupted"] is True
    p = res["points"][0]
    assert p["interrupted"] and 3 <= p["steady"]["n_ok"] < 200
    assert "INTERRUPTED" in se and "html:" in so


def test_report_without_matplotlib(mock_factory, tmp_path):
    """matplotlib is the `bench` extra: without it a run still writes its JSON and tables, and says why no plots."""
    m = mock_factory("--ttft", "0.01", "--itl", "0.003")
    out = tmp_path / "noplt"
    blocker = tmp_path / "site"
    blocker.mkdir()
    # a `matplotlib` that cannot be imported, first on the path (as on an install without the extra)
    (blocker / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    e = env()
    e["PYTHONPATH"] = f"{blocker}:{e.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-m", "pdserve.bench", "run", "--base-url", m.url, "--num-requests", "5",
                        "--output-len", "fixed:4", "--prompt-len", "uniform:4:16", "--out", str(out), "--no-progress"],
                       env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "results.json").read_text())["points"][0]["steady"]["n_ok"] == 5
    assert not list(out.glob("*.png"))
    assert "pip install pdserve[bench]" in (out / "report.html").read_text()
