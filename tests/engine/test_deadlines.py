"""Request lifecycle in the engine: deadlines (TIMED_OUT from QUEUED / PREEMPTED / running), cancel-vs-timeout
races, backpressure (BACKPRESSURED and back, preempted past the limit), priority / shortest-predicted-first."""
from __future__ import annotations

import asyncio
import time

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampling_params import SamplingParams

P = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(tiny_llama, **kw) -> Engine:
    return Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64, **kw))


def _run(eng: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("engine did not drain")


def test_timeout_from_queued(tiny_llama):
    eng = _engine(tiny_llama, max_num_seqs=1)
    eng.add_request("a", [5, 6, 7], P)
    eng.add_request("b", [8, 9], P, deadline=time.time() + 0.05)
    eng.step()  # a runs; b waits (one sequence slot)
    assert eng.requests["b"].seqs[0].state == S.QUEUED
    time.sleep(0.06)
    outs = eng.step()
    b = next(o for o in outs if o.request_id == "b")
    assert b.finished and b.state == "TIMED_OUT" and b.outputs[0].finish_reason == "timeout"
    _run(eng)
    rec = {r.request_id: r for r in eng.usage_records}
    assert rec["b"].state == "TIMED_OUT" and rec["a"].state == "FINISHED"
    assert eng.block_manager.blocks_in_use == 0 and len(eng.usage_records) == 2


def test_timeout_from_preempted_and_running(tiny_llama):
    eng = _engine(tiny_llama)
    eng.add_request("p", list(range(5, 15)), P)
    eng.add_request("r", [5, 6], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    eng.step()
    eng.step()
    seq = eng.requests["p"].seqs[0]
    eng.scheduler.preempt(seq)  # what block pressure does; deterministic here
    assert seq.state == S.PREEMPTED
    eng.requests["p"].deadline = time.time() - 1
    eng.requests["r"].deadline = time.time() + 0.05
    eng.step()
    assert seq.history[-2:] == [S.PREEMPTED, S.TIMED_OUT]
    time.sleep(0.06)
    _run(eng)
    states = {r.request_id: r.state for r in eng.usage_records}
    assert states == {"p": "TIMED_OUT", "r": "TIMED_OUT"}  # running past its deadline: partial output, TIMED_OUT
    assert eng.block_manager.blocks_in_use == 0


def test_cancel_and_timeout_race_one_record(tiny_llama):
    eng = _engine(tiny_llama)
    eng.add_request("x", [5, 6, 7], P, deadline=time.time() - 1)
    eng.abort("x", "CANCELLED")  # cancel lands first ...
    eng.step()  # ... then the deadline check: a no-op
    eng.abort("x", "TIMED_OUT")
    eng.abort("x", "CANCELLED")
    assert [r.state for r in eng.usage_records] == ["CANCELLED"]
    assert eng.block_manager.blocks_in_use == 0 and eng.terminal_counts == {"CANCELLED": 1}


def _order_of_first_schedule(eng: Engine, ids: list[str]) -> list[str]:
    _run(eng)
    recs = {r.request_id: r for r in eng.usage_records}
    return sorted(ids, key=lambda i: recs[i].times.first_scheduled)


def test_priority_policy_and_age_bound(tiny_llama):
    eng = _engine(tiny_llama, max_num_seqs=1, policy="priority")
    eng.add_request("head", [5, 6], P)
    eng.step()
    eng.add_request("low", [7, 8], P, priority=5)
    eng.add_request("high", [9, 10], P, priority=0)
    assert _order_of_first_schedule(eng, ["low", "high"]) == ["high", "low"]
    # a request older than the age bound goes first whatever its class
    eng = _engine(tiny_llama, max_num_seqs=1, policy="priority", starvation_age_s=0.0)
    eng.add_request("head", [5, 6], P)
    eng.step()
    eng.add_request("low", [7, 8], P, priority=5)
    eng.add_request("high", [9, 10], P, priority=0)
    assert _order_of_first_schedule(eng, ["low", "high"]) == ["low", "high"]


def test_shortest_predicted_first(tiny_llama):
    eng = _engine(tiny_llama, max_num_seqs=1, policy="shortest-predicted-first")
    eng.add_request("head", [5, 6], P)
    eng.step()
    eng.add_request("long", [7, 8], P, predicted_output_tokens=100)
    eng.add_request("short", [9, 10], P, predicted_output_tokens=2)
    eng.add_request("default", [11, 12], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert _order_of_first_schedule(eng, ["long", "short", "default"]) == ["short", "default", "long"]


def _reference(tiny_llama, prompt, params):
    return _engine(tiny_llama).generate([prompt], params)[0].outputs[0].token_ids


def test_backpressure_pauses_and_resumes(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _reference(tiny_llama, [5, 6, 7], params)
    eng = _engine(tiny_llama, max_buffered_outputs=4, backpressure_preempt_s=60)

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        slow = aeng.generate("slow", [5, 6, 7], params)
        first = await slow.__anext__()
        fast_ids = []
        async for out in aeng.generate("fast", [8, 9, 10], params):  # runs while "slow" is not read
            fast_ids += out.outputs[0].new_token_ids
        states = await aeng.run(lambda e: e.state_counts())
        slow_seq = eng.requests["slow"].seqs[0]
        ids = list(first.outputs[0].new_token_ids)
        async for out in slow:
            ids += out.outputs[0].new_token_ids
        await aeng.stop()
        return states, slow_seq, ids, fast_ids

    states, seq, ids, fast_ids = asyncio.run(main())
    assert states == {"BACKPRESSURED": 1}  # parked: no decode steps while its buffer is full
    assert len(fast_ids) == 40  # the other stream was not held up
    hist = [s.value for s in seq.history]
    i = hist.index("BACKPRESSURED")
    assert hist[i + 1] == "DECODING" and "PREEMPTED" not in hist
    assert ids == want  # nothing lost or duplicated across the pause
    assert eng.block_manager.blocks_in_use == 0


def test_backpressure_past_limit_preempts(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _reference(tiny_llama, [5, 6, 7], params)
    eng = _engine(tiny_llama, max_buffered_outputs=4, backpressure_preempt_s=0.1)

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        slow = aeng.generate("slow", [5, 6, 7], params)
        ids = list((await slow.__anext__()).outputs[0].new_token_ids)
        for _ in range(100):
            await asyncio.sleep(0.02)
            st = await aeng.run(lambda e: (e.state_counts(), e.block_manager.blocks_in_use))
            if st[0] == {"PREEMPTED": 1}:
                break
        async for out in slow:
            ids += out.outputs[0].new_token_ids
        await aeng.stop()
        return st, ids

    (states, blocks), ids = asyncio.run(main())
    assert states == {"PREEMPTED": 1} and blocks == 0  # KV given back while nobody reads
    assert ids == want
    assert eng.block_manager.blocks_in_use == 0
