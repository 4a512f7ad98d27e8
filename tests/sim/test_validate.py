"""Predicted vs measured on a small real run: calibrate the linear cost model on the real engine here, run a
small open-loop workload on the real in-process engine (colocated), simulate the same workload with the same
scheduler config, compare mean TTFT and mean TPOT.

Tolerance: |sim - real| / real <= 50% per metric, at light load (no queueing, so a step-time error is not
amplified by the queue). This box has 2 cores shared with other jobs: a step can take 2-3x longer when a
neighbour runs, and the profile and the run see different neighbours. The measured error at light load on a
quiet box is ~5-20% (docs/sim.md), but these steps take 1-30 ms, so one stall of a few ms moves a mean by tens of
percent: on a Sapphire Rapids box, 4 attempts in a row gave a worst error of -51%, -31%, +31%, +17%. Up to two
retries (re-profile, re-run) absorb that; a model off by more than 50% fails all three.
"""
from __future__ import annotations

import torch

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.sim import validate as V
from pdserve.sim.costmodel import profile
from pdserve.sim.workload import SLO

TOL = 0.5
SMALL_GRID = {"prefill": [(16, 1), (128, 1), (256, 2), (512, 1)],
              "decode": [(16, 1, 10), (16, 4, 10), (16, 16, 10), (256, 4, 10)]}


def _attempt():
    cost = profile("builtin", threads=1, grid=SMALL_GRID)
    eng = Engine.from_pretrained("builtin", EngineConfig(num_gpu_blocks=1024))
    rows = [V.cell(eng, cost, 32, 16, 3.0, 8, SLO(ttft=0.5, tpot=0.05), seed=1, with_disagg=False),
            V.cell(eng, cost, 256, 16, 2.0, 6, SLO(ttft=0.5, tpot=0.05), seed=2, with_disagg=False)]
    errs = {(r["prompt_len"], m): r[f"{m}_mean_err"] for r in rows for m in ("ttft_s", "tpot_s")}
    return errs, rows


def test_predicted_vs_measured_small_run():
    torch.set_num_threads(1)
    for _ in range(3):
        errs, rows = _attempt()
        if all(e is not None and abs(e) <= TOL for e in errs.values()):
            break
    assert all(e is not None and abs(e) <= TOL for e in errs.values()), (errs, rows)
