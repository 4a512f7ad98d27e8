"""`pdserve sim run --out DIR` writes bench's report: results.json, cdf.png, report.html."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sim_run_writes_bench_report(tmp_path):
    out = tmp_path / "rep"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "pdserve", "sim", "run", "--colocated", "1", "--rate", "5",
                        "--requests", "40", "--prompt-len", "fixed:256", "--output-len", "fixed:32", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "admission: 40 admitted" in p.stdout
    res = json.loads((out / "results.json").read_text())
    (pt,) = res["points"]
    assert pt["steady"]["n_requests"] == 40 and pt["steady"]["n_ok"] == 40
    assert len(pt["records"]) == 40 and all(r["ttft_s"] > 0 for r in pt["records"])
    assert res["meta"]["admission"]["admitted"] == 40
    assert (out / "cdf.png").stat().st_size > 1000
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "simulated open-loop" in html
