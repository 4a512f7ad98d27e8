"""`EngineCore` is the one copy of the step bookkeeping: the real `Engine` (builtin model, greedy) and the
simulator's `SimReplica` both drive it, and on the same arrival trace they schedule the same batches and commit
the same tokens with the same finish reasons, states and block tables, tick by tick. The engine is the
independent reference: its forward pass and sampler pick the tokens, which the replica replays as its token
source; everything else (which sequences sample when, when they finish, what is pinned or freed) must come out
of the shared bookkeeping."""
from __future__ import annotations

import random

from pdserve.engine import core as core_mod
from pdserve.engine.engine import Engine, EngineConfig, FirstToken
from pdserve.engine.sampling_params import SamplingParams
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.executor import SimReplica, SimRequest


def _trace(seed: int, n: int = 12):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 4000) for _ in range(24)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 4000) for _ in range(rng.choice([3, 11, 30, 70]))]
        if i % 3 == 0:  # a shared prefix: prefix-cache hits
            prompt = shared + prompt
        out.append((rng.randrange(0, 10), f"r{i}", prompt, rng.choice([1, 2, 6, 25])))
    return sorted(out, key=lambda x: (x[0], x[1]))


def _cfg() -> EngineConfig:  # small enough to chunk prefills and preempt
    return EngineConfig(num_gpu_blocks=24, block_size=8, max_num_seqs=5, max_num_batched_tokens=48, policy="fcfs")


def _log_commits(core: core_mod.EngineCore, log: list, tick: list) -> None:
    """Record every commit made through this core instance: what was committed and what it left behind."""
    orig = core.commit

    def commit(seq, token_id, prefill_only=False):
        reason = orig(seq, token_id, prefill_only)
        log.append((tick[0], seq.request_id, seq.num_output_tokens, token_id, reason, seq.state.value,
                    tuple(seq.block_table), tuple(sorted((r, tuple(b)) for r, (b, _) in core.pinned.items()))))
        return reason

    core.commit = commit


def _run_engine(trace, prefill_only: bool):
    eng = Engine.from_pretrained("builtin", _cfg())
    log, tick = [], [0]
    _log_commits(eng.core, log, tick)
    i = 0
    tokens: dict[str, list[int]] = {}
    while i < len(trace) or eng.has_unfinished():
        while i < len(trace) and trace[i][0] <= tick[0]:
            t, rid, prompt, m = trace[i]
            eng.add_request(rid, prompt, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0),
                            arrival_time=float(t), prefill_only=prefill_only)
            i += 1
        for rid in list(eng.core.pinned):  # the decode side pulled last tick's prompts
            eng.release_pinned(rid)
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        tick[0] += 1
    return eng, log, tokens


def _run_replica(trace, tokens, eng, prefill_only: bool):
    rep = SimReplica("x", "prefill" if prefill_only else "both", _cfg(), eng.block_manager.num_blocks,
                     LinearCostModel(), fingerprint=eng.fingerprint, max_model_len=eng.max_model_len,
                     token_source=lambda seq: tokens[seq.request_id][seq.num_output_tokens])
    log, tick = [], [0]
    _log_commits(rep.core, log, tick)
    i = 0
    while i < len(trace) or rep.scheduler.has_work():
        while i < len(trace) and trace[i][0] <= tick[0]:
            t, rid, prompt, m = trace[i]
            rep.add(SimRequest(rid, float(t), prompt, m), prefill_only)
            i += 1
        for rid in list(rep.core.pinned):
            rep.release_pinned(rid)
        step = rep.begin_step(float(tick[0]))
        if step is not None:
            rep.end_step(step[0], float(tick[0]) + step[1])
        tick[0] += 1
    return rep, log


def _same(real: list, sim: list) -> None:
    assert len(real) == len(sim), (len(real), len(sim))
    for k, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"commit {k}: engine {a} vs replica {b}"


def test_engine_and_replica_share_the_core_and_commit_the_same_sequence():
    trace = _trace(1)
    eng, real, tokens = _run_engine(trace, prefill_only=False)
    rep, sim = _run_replica(trace, tokens, eng, prefill_only=False)
    assert type(eng.core) is core_mod.EngineCore and type(rep.core) is core_mod.EngineCore
    assert eng.scheduler.num_preemptions["recompute"] > 0, "the trace should preempt"
    assert eng.block_manager.hit_tokens > 0, "the trace should hit the prefix cache"
    # one commit per output token of every request, each one "length" at its max_tokens
    assert len(real) == sum(m for *_, m in trace)
    assert sorted(r[1] for r in real if r[4] == "length") == sorted(rid for _, rid, _, _ in trace)
    _same(real, sim)
    assert rep.scheduler.num_preemptions == eng.scheduler.num_preemptions
    assert rep.bm.hit_tokens == eng.block_manager.hit_tokens
    assert all(x == 0 for x in rep.bm.ref) and all(x == 0 for x in eng.block_manager.ref)


def test_prefill_only_pins_and_decode_side_handoff_the_same():
    trace = _trace(2, n=8)
    eng, real, tokens = _run_engine(trace, prefill_only=True)
    rep, sim = _run_replica(trace, tokens, eng, prefill_only=True)
    # one commit per request: "prefill", or "length" where max_tokens is 1 (pinned all the same)
    assert [r[4] for r in real] == ["length" if m == 1 else "prefill" for m in
                                    [dict((rid, m) for _, rid, _, m in trace)[r[1]] for r in real]]
    assert sorted(r[1] for r in real) == sorted(rid for _, rid, _, _ in trace)
    _same(real, sim)  # including the pinned block ids after every commit
    assert {p[0] for r in real for p in r[7]} == {rid for _, rid, _, _ in trace}
    assert rep.core.pinned == eng.core.pinned and eng.core.pinned
    for rid in list(eng.core.pinned):
        eng.release_pinned(rid)
        rep.release_pinned(rid)
    assert eng.block_manager.blocks_in_use == rep.bm.blocks_in_use == 0

    # the decode side of the handoff: allocate (with local prefix hits), commit the first token, decode
    dec = Engine.from_pretrained("builtin", _cfg())
    decoded: dict[str, list[int]] = {}  # the decode engine's tokens so far, replayed by the replica
    drep = SimReplica("d", "decode", _cfg(), dec.block_manager.num_blocks, LinearCostModel(),
                      fingerprint=dec.fingerprint, max_model_len=dec.max_model_len,
                      token_source=lambda seq: decoded[seq.request_id][seq.num_output_tokens])
    dlog, slog, tick = [], [], [0]
    _log_commits(dec.core, dlog, tick)
    _log_commits(drep.core, slog, tick)
    for t, rid, prompt, m in trace[:4]:
        m = max(m, 3)
        got = dec.add_prefilled_request(rid, prompt, [FirstToken(tokens[rid][0])],
                                        SamplingParams(max_tokens=m, ignore_eos=True, temperature=0))
        req = SimRequest(rid, float(t), prompt, m)
        cached = drep.add_prefilled(req)
        assert got is not None and cached == got[1] * drep.bm.block_size
        assert dec.commit_prefilled(rid) and not drep.commit_prefilled(req, tokens[rid][0])
    while dec.has_unfinished():
        for out in dec.step():
            decoded[out.request_id] = out.outputs[0].token_ids
        step = drep.begin_step(float(tick[0]))
        if step is not None:
            drep.end_step(step[0], float(tick[0]) + step[1])
        tick[0] += 1
    assert not drep.scheduler.has_work()
    assert len(dlog) > 4
    _same(dlog, slog)
