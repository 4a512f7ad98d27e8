"""The 14-state machine: every illegal transition raises; every terminal path reclaims exactly once."""
from __future__ import annotations

import itertools

import pytest

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.errors import IllegalTransition
from pdserve.engine.request_state import INITIAL, TERMINAL, TRANSITIONS, RequestState, check_transition
from pdserve.engine.sampling_params import SamplingParams

# The spec's guard table (§0.2), written out independently of the implementation's table.
SPEC_EXITS = {
    "QUEUED": {"RUNNABLE", "TIMED_OUT", "CANCELLED", "DEGRADED"},
    "DEGRADED": {"RUNNABLE"},
    "RUNNABLE": {"PREFILLING", "DECODING", "PREEMPTED"},
    "PREFILLING": {"DECODING", "FINISHED", "BACKPRESSURED", "PREEMPTED", "CANCELLED", "TIMED_OUT", "FAILED"},
    "DECODING": {"FINISHED", "BACKPRESSURED", "PREEMPTED", "CANCELLED", "TIMED_OUT", "FAILED"},
    "BACKPRESSURED": {"DECODING", "PREEMPTED", "CANCELLED"},
    "PREEMPTED": {"RESUMED", "CANCELLED", "TIMED_OUT", "SWAPPED"},
    "SWAPPED": {"RESUMED"},
    "RESUMED": {"RUNNABLE"},
}


def test_fourteen_states_five_terminal():
    assert len(RequestState) == 14
    assert {s.value for s in TERMINAL} == {"REJECTED", "TIMED_OUT", "CANCELLED", "FAILED", "FINISHED"}
    for s in TERMINAL:
        assert TRANSITIONS[s] == frozenset()


def test_spec_transitions_allowed():
    for src, dsts in SPEC_EXITS.items():
        for dst in dsts:
            check_transition(RequestState[src], RequestState[dst])


def test_every_illegal_transition_raises():
    allowed_count = 0
    for a, b in itertools.product(RequestState, RequestState):
        if b in TRANSITIONS[a]:
            allowed_count += 1
            continue
        with pytest.raises(IllegalTransition):
            check_transition(a, b)
    for b in RequestState:
        if b not in INITIAL:
            with pytest.raises(IllegalTransition):
                check_transition(None, b)
    # beyond the spec's table only cancellation/failure/timeout of live states is added
    extra = {(a.value, b.value) for a in RequestState for b in TRANSITIONS[a]} - {
        (a, b) for a, dsts in SPEC_EXITS.items() for b in dsts}
    assert all(b in ("CANCELLED", "FAILED", "TIMED_OUT") for _, b in extra)


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture()
def engine(tiny_llama):
    return Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64,
                                                           max_num_batched_tokens=6))


def drain(engine):
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_no_leak_finish_and_aborts(engine):
    engine.add_request("done", list(range(10, 20)), GREEDY)
    engine.add_request("mid-prefill", list(range(30, 60)), GREEDY)  # 30 tokens at 6 per tick
    engine.add_request("mid-decode", list(range(5, 9)), GREEDY)
    engine.add_request("queued", list(range(70, 75)), GREEDY)
    engine.step()
    engine.step()
    seqs = {rid: r.seqs[0] for rid, r in engine.requests.items()}
    assert seqs["mid-prefill"].num_computed_tokens < 30
    engine.abort("mid-prefill", "CANCELLED")
    for _ in range(3):
        engine.step()
    assert seqs["mid-decode"].num_output_tokens > 0
    engine.abort("mid-decode", "TIMED_OUT")
    engine.abort("queued", "FAILED")
    engine.abort("mid-decode", "CANCELLED")  # a second reclaim is a no-op
    outs = drain(engine)
    assert engine.block_manager.blocks_in_use == 0
    assert not engine.scheduler.has_work()
    by_id = {}
    for r in engine.usage_records:
        by_id.setdefault(r.request_id, []).append(r)
    assert {k: len(v) for k, v in by_id.items()} == {"done": 1, "mid-prefill": 1, "mid-decode": 1, "queued": 1}
    assert by_id["mid-decode"][0].state == "TIMED_OUT"
    assert by_id["mid-prefill"][0].state == "CANCELLED"
    assert by_id["queued"][0].state == "FAILED"
    assert by_id["done"][0].state == "FINISHED" and by_id["done"][0].generated_tokens == 20
    assert seqs["done"].history[:4] == [RequestState.QUEUED, RequestState.RUNNABLE, RequestState.PREFILLING,
                                        RequestState.DECODING]
    final = {o.request_id: o for o in outs if o.finished}
    assert final["done"].state == "FINISHED"


def test_abort_unknown_is_noop_and_bad_state_rejected(engine):
    engine.abort("nope")
    engine.add_request("x", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError):
        engine.abort("x", "FINISHED")
    engine.abort("x")
    engine.abort("x")
    drain(engine)
    assert [r.request_id for r in engine.usage_records] == ["x"]


def test_prefill_only_pins_until_released(engine):
    engine.add_request("p", list(range(10, 27)), GREEDY, prefill_only=True)  # 17 tokens -> 5 blocks
    outs = drain(engine)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "prefill"
    blocks, n = engine.pinned_kv("p")
    assert n == 17 and len(blocks) == 5
    assert engine.block_manager.blocks_in_use == 5
    engine.release_pinned("p")
    engine.release_pinned("p")  # idempotent
    assert engine.block_manager.blocks_in_use == 0


def test_a_refused_request_enters_rejected_and_is_counted():
    """A worker's refusal (invalid parameters, a schema that does not compile) is the NEW -> REJECTED move: legal
    from nothing, terminal, counted among the state entries the workers export."""
    from pdserve.engine.request_state import ENTERED, enter_rejected
    before = dict(ENTERED)
    assert enter_rejected() is RequestState.REJECTED and RequestState.REJECTED.terminal
    assert {k: ENTERED[k] - before[k] for k in ENTERED if ENTERED[k] != before[k]} == {"REJECTED": 1}
    with pytest.raises(IllegalTransition):
        check_transition(RequestState.QUEUED, RequestState.REJECTED)  # only a request never admitted is REJECTED
