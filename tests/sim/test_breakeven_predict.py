"""The simulator's prediction of break-even cells (pdserve/sim/breakeven_predict.py): the link as the KV transfer
cost, the served-step overhead from the isolated requests, and the per-cell error, against hand-computed values."""
from __future__ import annotations

import pytest

from pdserve.sim import breakeven_predict as BS
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.workload import SLO, make_workload

COST = LinearCostModel(a=0.01, b=0.001, c=0.002, d=0.0, kv_bytes_per_token=1000, link_bytes_per_s=1e9,
                       handoff_s=0.005)


def test_the_link_is_the_transfer_cost():
    c = BS.link_cost(COST, "8mbit")  # 8e6 bit/s = 1e6 B/s
    assert c.link_bytes_per_s == 1e6 and c.handoff_s == 0.005
    assert c.transfer_time(100) == pytest.approx(0.005 + 100 * 1000 / 1e6)  # 0.105 s
    d = BS.link_cost(COST, "10gbit,delay=2ms")  # one round trip of the delay: + 4 ms
    assert d.link_bytes_per_s == 1.25e9 and d.handoff_s == pytest.approx(0.009)
    assert BS.link_cost(COST, None) is COST  # one host: the profiled copy bandwidth
    assert COST.link_bytes_per_s == 1e9  # not mutated


def test_layouts_and_blocks():
    assert BS.layout("colocated", "1x2") == BS.SimLayout({"colocated": 1}, "colocated", 2)
    assert BS.layout("colocated", "2x1") == BS.SimLayout({"colocated": 2}, "colocated", 1)
    assert BS.layout("auto@1gbit") == BS.SimLayout({"prefill": 1, "decode": 1}, "auto", 1)
    assert BS.link_of("disagg@1gbit") == "1gbit" and BS.link_of("disagg") is None
    with pytest.raises(ValueError):
        BS.layout("both")
    # 256 MiB / (4096 B x 16 tokens) = 4096 blocks; given: as given
    assert BS.num_blocks(LinearCostModel(kv_bytes_per_token=4096), None) == 4096
    assert BS.num_blocks(COST, 300) == 300


def test_rel_err_and_cell_prediction():
    assert BS.rel_err(1.2, 1.0) == pytest.approx(0.2) and BS.rel_err(0.5, 2.0) == pytest.approx(-0.75)
    assert BS.rel_err(1.0, 0.0) is None and BS.rel_err(None, 1.0) is None
    sim = {"slo": {"goodput_req_per_s": 3.0, "attainment_ratio": 0.75}, "latency": {"ttft_s": {"p50": 0.1},
           "tpot_s": {"p50": 0.02}}, "cluster": {"mean_transfer_s": 0.004}}
    meas = {"goodput_req_per_s": 4.0, "attainment_ratio": 1.0, "ttft_p50_s": 0.08, "tpot_p50_s": None,
            "kv_transfer_mean_s": 0.005}
    p = BS.cell_prediction(sim, meas)
    assert p["goodput_req_per_s"] == {"predicted": 3.0, "measured": 4.0, "error": pytest.approx(-0.25)}
    assert p["ttft_p50_s"]["error"] == pytest.approx(0.25)
    assert p["attainment_ratio"]["error"] == pytest.approx(-0.25)  # a difference, not a ratio
    assert p["tpot_p50_s"]["error"] is None


def test_one_request_over_a_link_is_hand_computable():
    """1P+1D over an 8 Mbit/s link, one 100-token prompt, 4 tokens out. The isolated TPOT 15 ms against the
    simulated 12 ms (a + c) prices the served step at +3 ms, so every step costs 3 ms more:
    TTFT = prefill (0.013 + 100 x 0.001) + transfer (0.005 + 100 x 1000 B / 1e6 B/s) = 0.113 + 0.105 = 0.218 s;
    TPOT = 0.013 + 0.002 = 0.015 s."""
    def make(plen, olen, rate, ci):
        return make_workload(1, 1.0, f"fixed:{plen}", f"fixed:{olen}", seed=0)

    res = {"isolated": {"100x4": {"itl_p50_s": 0.00001, "tpot_s": 0.015}},  # a burst: the ITL p50 is no step
           "cells": {"100x4x1": {"goodput_req_per_s": 1.0, "attainment_ratio": 1.0, "ttft_p50_s": 0.2,
                                 "tpot_p50_s": 0.015, "kv_transfer_mean_s": 0.1}}}
    info = BS.predict_mode({1: COST}, "disagg@8mbit", res, [(100, 4, 1.0)], make, SLO(ttft=1.0, tpot=0.1),
                           colocated_layout="1x2", num_gpu_blocks=64, max_num_seqs=8)
    assert info["served_step_overhead_s"] == pytest.approx(0.003)
    assert info["link_bytes_per_s"] == 1e6 and info["num_blocks"] == 64
    sim = res["cells"]["100x4x1"]["sim"]
    assert sim["ttft_p50_s"]["predicted"] == pytest.approx(0.218)
    assert sim["ttft_p50_s"]["error"] == pytest.approx(0.09)  # (0.218 - 0.2) / 0.2
    assert sim["tpot_p50_s"]["predicted"] == pytest.approx(0.015)
    assert sim["kv_transfer_mean_s"]["predicted"] == pytest.approx(0.105)
    # colocated (one 2-thread replica): prefill then 3 decode steps on one replica, no transfer
    # an isolated entry recorded before TPOT was: its ITL p50 stands in
    res2 = {"isolated": {"100x4": {"itl_p50_s": 0.012}}, "cells": {"100x4x1": dict(res["cells"]["100x4x1"])}}
    BS.predict_mode({2: COST}, "colocated", res2, [(100, 4, 1.0)], make, SLO(ttft=1.0, tpot=0.1),
                    colocated_layout="1x2", num_gpu_blocks=64, max_num_seqs=8)
    assert res2["sim"]["served_step_overhead_s"] == 0.0
    assert res2["cells"]["100x4x1"]["sim"]["ttft_p50_s"]["predicted"] == pytest.approx(0.11)
