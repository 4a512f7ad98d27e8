"""Predicted vs measured against a real `pdserve up` (disaggregated: 1 prefill + 1 decode worker, 1 thread each,
the built-in model) driven by `pdserve bench`: one light-load cell (prompt 32, 2 req/s, output 16, 8 requests).

What is asserted, and why these bounds (measured here, docs/sim.md):
- TPOT, which the decode worker's step time sets. The cost model is profiled on the engine alone, and a served
  worker is slower per step (its event loop and gRPC stream share the GIL with the engine thread): the raw
  prediction was 6-67% under the real TPOT on a Zen 5, so it is asserted only as a lower bound (25% slack for
  the profile's own noise). With the served step overhead three probe requests price on the same deployment
  just before (`serving_overhead`), the prediction must be within 50%.
- TTFT: the simulator leaves out the HTTP/gRPC hops (client -> gateway -> router -> workers, ~20-40 ms per
  request on this box, read from the servers' histograms as `frontend_s`), so it must not predict *more* than the
  real TTFT, and the rest (real minus front-end) must be within 50% + 20 ms of the prediction.
One retry absorbs a burst of contention from other jobs on the 2 shared cores. ~25 s.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.sim import validate_up as VU
from pdserve.sim.costmodel import profile
from pdserve.sim.workload import SLO
from tests.sim.test_validate import SMALL_GRID

pytestmark = pytest.mark.e2e  # a whole `pdserve up` deployment (tests/conftest.py)


def _attempt(dep, cost, seed: int) -> dict:
    specs = VU.cell_specs(32, 16, 2.0, 8, seed)
    over = VU.serving_overhead(dep, cost, "disagg", 512, 16, SLO(0.5, 0.05), seed + 100)
    real = VU.measure(dep, specs, SLO(0.5, 0.05), "disagg P=32 2/s", warmup=VU.cell_specs(32, 16, 0.0, 2, seed + 1))
    sim = VU.simulate(VU.served(cost, over), specs, "disagg", 512, 16, SLO(0.5, 0.05))
    raw = VU.simulate(cost, specs, "disagg", 512, 16, SLO(0.5, 0.05))
    row = VU.compare(real["steady"], sim, real.get("stage_breakdown_mean_s"))
    row["tpot_s_mean_sim_raw"] = raw["latency"]["tpot_s"].get("mean")
    row["admission"] = sim["admission"]
    row["serving_overhead_s"] = over
    return row


def _ok(r: dict) -> bool:
    if r["tpot_s_mean_err"] is None or abs(r["tpot_s_mean_err"]) > 0.5 or r["frontend_s"] is None:
        return False
    # the engine alone is not slower than served; 25% slack: the profile and the cell run at different moments,
    # and the profiled step of this cell moved 2.1 -> 3.1 ms between two runs on one box
    if r["tpot_s_mean_sim_raw"] > 1.25 * r["tpot_s_mean_real"]:
        return False
    worker_side = r["ttft_s_mean_real"] - r["frontend_s"]
    # 20 ms absolute: `frontend_s` is measured apart and, with the gateway's per-request usage-ledger round trips
    # on a shared 2-core box, jitters by ~10 ms (seen 17.6 ms one run, enough to leave a 28 ms real TTFT a ~1 ms
    # worker side the next); the sim must still not exceed the real TTFT
    return r["ttft_s_mean_sim"] <= r["ttft_s_mean_real"] and \
        abs(r["ttft_s_mean_sim"] - worker_side) <= 0.5 * max(0.0, worker_side) + 0.020


def test_disagg_cell_against_pdserve_up():
    torch.set_num_threads(1)
    cost = profile("builtin", threads=1, grid=SMALL_GRID)
    dep = VU.start("builtin", "disagg", 512, 16)
    try:
        r = _attempt(dep, cost, 11)
        if not _ok(r):
            r = _attempt(dep, cost, 23)
    finally:
        dep.stop()
    assert r["n_ok_real"] == r["n_ok_sim"] == 8, r
    assert r["admission"]["admitted"] == 8 and r["admission"]["queued"] == 0, r
    assert _ok(r), r
