"""UcxLog around a real NIXL agent in a fresh process (UCX reads its logging settings when NIXL first loads it):
UCX's own warning goes on to the worker's log, the variables it set are put back, its file and directory are gone.
The READ tables it reads are checked with a real worker pair in tests/services/worker/test_kv_pair_metrics.py."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import logging, os, torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from pdserve.kv_transfer.ucx_log import UcxLog
from tests.kv_transfer import _peer
log = UcxLog()
log.enable()
from pdserve.kv_transfer.agent import KVAgent
agent = KVAgent("ucx-log-test", torch.zeros(_peer.SHAPE), _peer.layout())
log.open()
print("ACTIVE", log.active, repr(log.reason))
print("ENV", os.environ.get("UCX_LOG_FILE"), os.environ.get("UCX_PROTO_INFO"))
print("LEFT", log._path.startswith("/dev/shm/pdserve-ucx-"), os.path.exists(os.path.dirname(log._path)))
log.poll()
agent.close()
log.close()
"""


def test_ucx_warnings_reach_the_worker_log_and_nothing_is_left_behind():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_PDSERVE_TEST_UNUSED": "1"}
    for k in ("UCX_LOG_FILE", "UCX_PROTO_INFO"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "ACTIVE True ''" in text and "ENV None None" in text and "LEFT True False" in text, text
    # UCX's own words about the unknown variable, through the worker's logger, not on stdout as UCX prints them
    warned = [ln for ln in text.splitlines() if "unused environment variable: UCX_PDSERVE_TEST_UNUSED" in ln]
    assert warned and all(ln.startswith("pdserve.ucx WARNING UCX: ") for ln in warned), text
