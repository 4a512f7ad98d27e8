"""bench/host_overhead.py runs and accounts for its step time (forward + sampler + host bookkeeping = the whole)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_bench_reports_its_parts():
    p = subprocess.run([sys.executable, str(ROOT / "bench/host_overhead.py"), "--requests", "6"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"(\d+) tokens in ([\d.]+) s: forward ([\d.]+) s, sampler ([\d.]+) s, host bookkeeping ([\d.]+) s "
                  r"= ([\d.]+) us/token", p.stdout)
    assert m, p.stdout
    toks, total, fwd, smp, host, per_token = (float(x) for x in m.groups())
    assert toks > 6 * 16 - 1  # every request ran to its max_tokens (>= 16 each)
    assert abs(fwd + smp + host - total) <= 0.02 and host > 0
    assert abs(per_token * toks / 1e6 - host) <= 0.006  # seconds are printed to 0.01
