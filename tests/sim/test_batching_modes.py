"""D04 in the simulator: its replicas drive the engine's real Scheduler, so `batching="static"` gives the spec's
static schedule there too (A=1, B=4, C=5; utilisation 0.60) and continuous A=1, C=2, B=4 (0.75)."""
from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.executor import SimReplica, SimRequest


def run(batching: str, reqs) -> dict[str, int]:
    cfg = EngineConfig(block_size=4, max_num_seqs=2, batching=batching)
    rep = SimReplica("x", "both", cfg, 32, LinearCostModel(), fingerprint="f", max_model_len=64, vocab_size=100)
    for rid, n in reqs:
        rep.add(SimRequest(rid, 0.0, [5, 6], n))
    done, tick = {}, 0
    while rep.scheduler.has_work():
        tick += 1
        step = rep.begin_step(float(tick))
        if step is not None:
            for ev in rep.end_step(step[0], float(tick) + step[1]):
                if ev.kind == "finished":
                    done[ev.req.rid] = tick
    assert rep.bm.blocks_in_use == 0
    return done


@pytest.mark.parametrize("batching,expect,util", [("static", {"A": 1, "B": 4, "C": 5}, 0.60),
                                                  ("continuous", {"A": 1, "C": 2, "B": 4}, 0.75)])
def test_d04_in_the_simulator(batching, expect, util):
    done = run(batching, [("A", 1), ("B", 4), ("C", 1)])
    assert done == expect
    assert 6 / (2 * max(done.values())) == pytest.approx(util)
    assert run(batching, [("X", 3), ("Y", 3)]) == {"X": 3, "Y": 3}
