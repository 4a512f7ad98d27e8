"""The break-even study's link axis (`pdserve bench breakeven --link ...`): one comparison per link, each against
the same colocated run, and the link named in every row and verdict."""
from __future__ import annotations

import pytest

from pdserve.bench.breakeven import LabDeployment, compare, verdict


def _cell(goodput: float, n_slo: int, kv_s: float | None) -> dict:
    return {"goodput_req_per_s": goodput, "n_slo": n_slo, "n": 40, "kv_transfer_mean_s": kv_s, "ttft_p50_s": 0.1,
            "itl_p99_s": 0.02, "interference_itl_p99_over_isolated": 1.0}


def test_one_comparison_per_link_against_the_same_colocated_run():
    grid = [(512, 16, 4.0)]
    k = "512x16x4"
    results = {"colocated": {"cells": {k: _cell(2.0, 20, None)}},
               "disagg@10gbit": {"cells": {k: _cell(3.0, 36, 0.004)}},
               "disagg@100mbit": {"cells": {k: _cell(1.0, 10, 0.30)}}}
    fast, slow = compare(results, grid, "disagg@10gbit"), compare(results, grid, "disagg@100mbit")
    assert [r["link"] for r in fast + slow] == ["10gbit", "100mbit"]
    assert fast[0]["goodput_ratio_disagg_over_colocated"] == pytest.approx(1.5) and fast[0]["winner"] == "disagg"
    assert slow[0]["goodput_ratio_disagg_over_colocated"] == pytest.approx(0.5) and slow[0]["winner"] == "colocated"
    assert slow[0]["kv_transfer_share_of_ttft_p50"] == pytest.approx(3.0)
    lines = verdict(fast + slow)
    assert lines[0].startswith("link 10gbit: P=512") and lines[1].startswith("link 100mbit: P=512")
    assert compare(results, grid) == []  # no same-host disagg run: nothing to compare


def test_a_bad_link_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="not a rate"):
        LabDeployment("builtin", "fast", [], 1.0)


def test_replot_rebuilds_the_study_options_and_workloads_from_its_argv():
    """`--replot OLD --sim-costs DIR` predicts again: the workloads must be the measured ones, rebuilt from the
    recorded argv (seeds per cell, counts from rate x duration with the minimum)."""
    from pdserve.bench.breakeven import _original_args, cell_specs
    a = _original_args(["bench", "breakeven", "--prompt-lens", "32,512", "--rates", "2,6", "--cell-duration", "4",
                        "--min-requests-per-cell", "10", "--seed", "5", "--link", "10gbit", "--num-gpu-blocks", "256"])
    assert (a.prompt_lens, a.seed, a.link, a.num_gpu_blocks) == ("32,512", 5, ["10gbit"], 256)
    assert len(cell_specs(a, 32, 16, 2.0, 0)) == 10  # max(10, round(2 x 4))
    assert len(cell_specs(a, 32, 16, 6.0, 1)) == 24
    one, again = cell_specs(a, 512, 16, 6.0, 3), cell_specs(a, 512, 16, 6.0, 3)
    assert [s.prompt for s in one] == [s.prompt for s in again] and len(one[0].prompt) == 512
    assert cell_specs(a, 512, 16, 6.0, 2)[0].prompt != one[0].prompt  # another cell, other prompts
    iso = cell_specs(a, 32, 16, 0.0, None)  # the isolated requests, sent one at a time: distinct prompts
    assert len(iso) == 9 and all(len(s.prompt) == 32 and s.output_len == 16 for s in iso)
    assert len({tuple(s.prompt) for s in iso}) == 9
