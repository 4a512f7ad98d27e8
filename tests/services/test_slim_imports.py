"""The gateway and the router serve without torch and without the engine: a fresh
interpreter that imports their server modules and builds the gateway app for the builtin model has loaded
neither."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import asyncio, json, sys
import pdserve.services.gateway.server
import pdserve.services.router.server
from pdserve.services.gateway.app import GatewayConfig, create_gateway

async def main():
    gw = create_gateway(GatewayConfig("builtin", "builtin", "127.0.0.1:1"))
    ids = gw.tokenizer.encode("the quick brown fox")
    return len(ids)

n = asyncio.run(main())
print(json.dumps({"tokens": n, "heavy": sorted(m for m in sys.modules
                  if m == "torch" or m.startswith("torch.") or m.startswith("pdserve.engine.engine")
                  or m in ("pdserve.engine.model", "pdserve.engine.grammar", "xgrammar"))}))
"""


def test_gateway_and_router_import_neither_torch_nor_the_engine():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] > 0  # the app really tokenizes (the `tokenizers` library)
    assert got["heavy"] == [], got["heavy"]


def test_up_state_file_and_status_import_no_torch():
    """`pdserve up` writes its state file (services/status.py) between its workers' readiness and its PDSERVE_UP
    line, and `pdserve status` runs the same module: neither may pull in torch or the simulator through the
    planner's decision record (that import cost every deployment ~2 s before it was announced)."""
    probe = ("import json, sys; import pdserve.services.status; "
             "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pdserve.sim'))))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
