"""Admission in the simulator: an overloaded run admits, queues, times out and rejects as the real gateway's
admission does for the same capacity (hand-computed, and checked against the real async `Admission`)."""
from __future__ import annotations

import asyncio
import time

from pdserve.bench.workload import RequestSpec
from pdserve.engine.config import EngineConfig
from pdserve.services import admission as real
from pdserve.sim.admission import AdmissionSpec
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.workload import SLO

# one colocated replica of 64 blocks x 16 tokens; a request = 100 prompt + 28 output tokens
# -> blocks_for(100, 28, 1, 16) = ceil(100/16) + ceil(28/16) = 7 + 2 = 9; 64 // 9 = 7 fit at once
BLOCKS, PROMPT, OUT, BURST = 64, 100, 28, 40
COST = LinearCostModel(a=0.01, b=0.0, c=0.0, d=0.0)  # every step 10 ms: a request lives >= 28 steps = 0.28 s


def _burst(n: int = BURST, extra: list[RequestSpec] = ()) -> list[RequestSpec]:
    specs = [RequestSpec(idx=i, arrival=i * 1e-4, prompt=list(range(3 + i, 3 + i + PROMPT)), prompt_len=PROMPT,
                         output_len=OUT)
             for i in range(n)]  # distinct prompts: no prefix sharing
    return specs + list(extra)


def _run(adm: AdmissionSpec, specs) -> Cluster:
    spec = ClusterSpec(colocated=1, num_blocks=BLOCKS, engine=EngineConfig(max_num_seqs=256), report_s=0,
                       admission=adm)
    c = Cluster(spec, COST)
    c.run(specs)
    return c


def test_overload_burst_hand_computed():
    assert real.blocks_for(PROMPT, OUT, 1, 16) == 9
    # queue wait 50 ms < the 0.28 s before anything is released: every queued request times out
    c = _run(AdmissionSpec(max_queue=16, max_queue_wait_s=0.05), _burst())
    a = c.summary(SLO(ttft=1.0, tpot=0.1))["admission"]
    assert (a["admitted"], a["queued"], a["timed_out"], a["rejected_capacity"]) == (7, 16, 16, 17), a
    assert [r.state for r in c.requests[:7]] == ["FINISHED"] * 7
    assert {r.state for r in c.requests[7:23]} == {"TIMED_OUT"} and {r.state for r in c.requests[23:]} == {"REJECTED"}
    assert c.admission.ledger.entries == {}  # every reservation came back

    # long queue wait: the 16 queued get in as the first 7 finish, in arrival order; the 17 after a full queue
    # are still refused at once (503), and the never-fitting prompt (64 blocks + 1 token) is a 400
    huge = RequestSpec(idx=99, arrival=0.5, prompt=list(range(3, 3 + 64 * 16)), prompt_len=64 * 16, output_len=4)
    c = _run(AdmissionSpec(max_queue=16, max_queue_wait_s=10.0), _burst(extra=[huge]))
    a = c.summary(SLO(ttft=1.0, tpot=0.1))["admission"]
    assert (a["admitted"], a["admitted_after_queue"], a["timed_out"], a["rejected_capacity"],
            a["rejected_context"]) == (23, 16, 0, 17, 1), a
    first_done = min(r.emits[-1] for r in c.requests[:7])
    for r in c.requests[7:23]:
        assert r.state == "FINISHED" and r.emits[0] > first_done  # waited for a release
    assert c.admission.max_queue_len == 16 and c.admission.ledger.entries == {}


def test_same_outcomes_as_the_real_async_admission():
    """The same burst through the gateway's own `Admission` (ledger in process memory, wall clock)."""
    cap = real.Capacity(blocks=BLOCKS, seqs=256, block_size=16, max_worker_blocks=BLOCKS)

    async def capacity():
        return cap

    async def main():
        adm = real.Admission(real.ReservationLedger(None, "m"), capacity, max_queue=16, max_queue_wait_s=0.05)
        far = time.time() + 60
        tasks = [asyncio.create_task(adm.admit(f"r{i}", "default", PROMPT, OUT, 1, 1 << 30, far))
                 for i in range(BURST)]
        out = []
        for t in tasks:
            try:
                tk = await t
                out.append("QUEUED" if tk.states else "ADMITTED")
            except real.AdmissionError as e:
                out.append(e.state)
        return out

    out = asyncio.run(main())
    c = _run(AdmissionSpec(max_queue=16, max_queue_wait_s=0.05), _burst())
    sim = ["ADMITTED" if r.state == "FINISHED" else r.state for r in c.requests]
    assert out == sim, (out, sim)
    assert out.count("ADMITTED") == 7 and out.count("TIMED_OUT") == 16 and out.count("REJECTED") == 17
