"""The simulator drives the engine's real Scheduler / BlockManager, and makes the same decisions as a real
Engine run on the builtin model for the same arrival pattern (tick-by-tick batch composition)."""
from __future__ import annotations

import random

import pytest

from pdserve.engine import block_manager as bm_mod
from pdserve.engine import scheduler as sched_mod
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.executor import SimReplica, SimRequest


def _workload(seed: int, n: int = 14):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 4000) for _ in range(40)]
    out = []
    for i in range(n):
        plen = rng.choice([5, 17, 40, 90, 150])
        prompt = [rng.randrange(3, 4000) for _ in range(plen)]
        if i % 3 == 0:  # some share a 40-token prefix: prefix-cache hits in both
            prompt = shared + prompt
        out.append((rng.randrange(0, 12), f"r{i}", prompt, rng.choice([1, 2, 5, 9, 20])))
    return sorted(out, key=lambda x: (x[0], x[1]))


def _cfg(mode: str) -> EngineConfig:
    return EngineConfig(num_gpu_blocks=48, block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
                        preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0, policy="fcfs")


def _ticks_of(sched, log: list) -> None:
    orig = sched.schedule

    def schedule():
        out = orig()
        log.append(([(it.seq.request_id, it.num_tokens) for it in out.scheduled],
                    [s.request_id for s in out.preempted]))
        return out

    sched.schedule = schedule


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_same_batches_as_real_engine(mode):
    work = _workload(1)
    eng = Engine.from_pretrained("builtin", _cfg(mode))
    real: list = []
    _ticks_of(eng.scheduler, real)
    i = tick = 0
    while i < len(work) or eng.has_unfinished():
        while i < len(work) and work[i][0] <= tick:
            t, rid, prompt, m = work[i]
            eng.add_request(rid, prompt, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0),
                            arrival_time=float(t))
            i += 1
        eng.step()
        tick += 1

    rep = SimReplica("x", "both", _cfg(mode), eng.block_manager.num_blocks, LinearCostModel(),
                     fingerprint=eng.fingerprint, max_model_len=eng.max_model_len, vocab_size=4096)
    # by construction, not by name: the replica holds the engine module's own classes
    assert type(rep.scheduler) is sched_mod.Scheduler and type(rep.bm) is bm_mod.BlockManager
    assert type(eng.scheduler) is type(rep.scheduler) and type(eng.block_manager) is type(rep.bm)
    sim: list = []
    _ticks_of(rep.scheduler, sim)
    i = tick = 0
    finished = set()
    while i < len(work) or rep.scheduler.has_work():
        while i < len(work) and work[i][0] <= tick:
            t, rid, prompt, m = work[i]
            rep.add(SimRequest(rid, float(t), prompt, m))
            i += 1
        step = rep.begin_step(float(tick))
        if step is not None:
            for ev in rep.end_step(step[0], float(tick) + step[1]):
                if ev.kind == "finished":
                    finished.add(ev.req.rid)
        tick += 1
    assert finished == {w[1] for w in work}
    assert sum(1 for _, p in real if p) > 0, "the workload should preempt"
    assert len(real) == len(sim)
    for k, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"tick {k}: engine {a} vs sim {b}"
    assert rep.bm.blocks_in_use == 0 or all(rep.bm.ref[b] == 0 for b in range(rep.bm.num_blocks))
