"""bench/role_switch_goodput.py's ObservedCost: the controller's profile scaled per kind of step to what the
warm-up's requests showed, checked against ratios computed by hand from a linear model with round coefficients."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.bench.metrics import ClientRecord
from pdserve.planner.switch_control import PoolShape
from pdserve.sim.costmodel import LinearCostModel, StepShape

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rsg():
    spec = importlib.util.spec_from_file_location("role_switch_goodput", ROOT / "bench" / "role_switch_goodput.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["role_switch_goodput"] = mod
    spec.loader.exec_module(mod)
    return mod


# step = 1 ms + 2 ms if any prefill + 0.01 ms a prompt token + 0.5 ms a decode sequence (no context terms)
COST = LinearCostModel(a=1e-3, b=1e-5, c=5e-4, d=0.0, e=2e-3, f=0.0)


def _rec(prompt: int, n_out: int, tpot_s: float, prefill_s: float | None) -> ClientRecord:
    emits = [1.0 + i * tpot_s for i in range(n_out)]
    stages = {"durations": {"prefill": prefill_s}} if prefill_s is not None else None
    return ClientRecord(idx=0, scheduled=0.0, sent=0.0, emits=emits, prompt_tokens=prompt, output_tokens=n_out,
                        ok=True, stages=stages)


def test_the_scales_are_the_medians_of_observed_over_modelled(rsg):
    shape = PoolShape(max_num_seqs=8, num_blocks=4096, block_size=16, max_num_batched_tokens=2048)
    # modelled prefill of 500 tokens: 1 + 2 + 5 = 8 ms; observed 16, 24, 40 ms -> ratios 2, 3, 5: median 3
    # a full decode batch (8 sequences; 1 + 4 = 5 ms meets the 100 ms TPOT): observed TPOT 20, 30, 50 ms -> 4, 6, 10
    recs = [_rec(500, 16, t, p) for t, p in ((0.020, 0.016), (0.030, 0.024), (0.050, 0.040))]
    recs.append(ClientRecord(idx=1, scheduled=0.0, ok=False, prompt_tokens=500))  # a failure teaches nothing
    oc = rsg.observed_cost(COST, recs, shape, slo_tpot=0.1)
    assert oc.prefill == pytest.approx(3.0)
    assert oc.decode == pytest.approx(6.0)
    assert oc.step_time(StepShape.prefill(500)) == pytest.approx(0.024)
    assert oc.step_time(StepShape.decode(8, 0)) == pytest.approx(0.030)


def test_nothing_observed_leaves_the_profile_as_it_is(rsg):
    shape = PoolShape(8, 4096, 16, 2048)
    oc = rsg.observed_cost(COST, [_rec(500, 4, 0.02, None)], shape, slo_tpot=0.1)  # too few tokens, no stage times
    assert (oc.prefill, oc.decode) == (1.0, 1.0)
