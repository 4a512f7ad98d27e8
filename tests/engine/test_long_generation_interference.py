"""Spec Q21 on the real engine: a long generation does not block the batch, but (1) its growing context makes
every decode step of the batch it is in longer, so the other requests' inter-token latency grows with it; (2) it
holds KV blocks and a sequence slot for its whole life; (3) with KV tight, that raises preemptions of the
others. The cost model (sim/costmodel.py) carries (1) as its per-context-token term `d * sum_context`; here the
engine itself is measured, against a control that differs only in the fifth request's context length."""
from __future__ import annotations

import statistics
import time

import pytest

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import make_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8 KV heads of 32 over 4 layers and an 8k context: attention over a few thousand positions costs more
    than a step's fixed work, as it does for real models at long contexts."""
    return make_checkpoint(tmp_path_factory.mktemp("q21"), "llama", hidden=256, layers=4, heads=8, kv_heads=8,
                           max_pos=8192)


def _step_times(eng: Engine, short_ids: set[str], steps: int) -> list[float]:
    """Wall time of each step in which every short request emitted a token: their inter-token latency."""
    out = []
    while len(out) < steps:
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids} >= short_ids:
            out.append(dt)
    return out


def _itl_beside(eng: Engine, tag: str, fifth_prompt: int) -> float:
    """Median step time of 4 short decodes beside a fifth request whose context is `fifth_prompt` tokens."""
    eng.add_request(f"{tag}-fifth", [3 + i % 300 for i in range(fifth_prompt)], SamplingParams(max_tokens=400, **GREEDY))
    while not any(o.request_id == f"{tag}-fifth" and o.outputs[0].token_ids for o in eng.step()):
        pass  # its prefill (chunked) done: it decodes from here on
    short = {f"{tag}-s{i}" for i in range(4)}
    for i, rid in enumerate(sorted(short)):
        eng.add_request(rid, [5 + i] * 8, SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(3):  # their prefills
        eng.step()
    med = statistics.median(_step_times(eng, short, 25))
    eng.abort(f"{tag}-fifth")
    while eng.has_unfinished():
        eng.step()
    return med


def test_long_context_stretches_the_batchs_itl(wide):
    eng = Engine.from_pretrained(str(wide), EngineConfig(num_gpu_blocks=1024, block_size=16, num_threads=1))
    try:
        # interleaved, so a burst of load from other processes hits both arms alike
        short_arm, long_arm = [], []
        for r in range(2):
            short_arm.append(_itl_beside(eng, f"c{r}", 16))
            long_arm.append(_itl_beside(eng, f"l{r}", 6000))
        ratio = min(long_arm) / max(short_arm)
        print(f"Q21 ITL: beside a 16-token fifth {short_arm} s, beside a 6000-token one {long_arm} s")
        assert ratio > 1.5, (short_arm, long_arm)
    finally:
        eng.close()


def _preemptions(eng: Engine) -> int:
    return sum(eng.stats().preemptions.values())


def _run(eng: Engine, long_first: bool) -> dict:
    before = _preemptions(eng)
    if long_first:
        eng.add_request("long", [7] * 16, SamplingParams(max_tokens=400, **GREEDY))
        for _ in range(100):  # 116 tokens: 8 blocks, and growing
            eng.step()
    held = eng.stats().kv_blocks_in_use
    for i in range(4):
        eng.add_request(f"s{i}", [9 + i] * 16, SamplingParams(max_tokens=64, **GREEDY))  # 80 tokens: 5 blocks
    done = {}
    while len(done) < 4:
        for o in eng.step():
            if o.finished and o.request_id.startswith("s"):
                done[o.request_id] = o
    eng.abort("long")
    while eng.has_unfinished():
        eng.step()
    return {"held_before": held, "preempted": _preemptions(eng) - before,
            "tokens": [len(o.outputs[0].token_ids) for o in done.values()]}


def test_long_generation_holds_kv_and_raises_preemptions():
    """24 blocks of 16: four 80-token requests (5 blocks each, 20) fit alone; beside a long generation already
    holding 8 blocks and growing they do not, so the engine preempts (and they still finish whole)."""
    import tempfile
    from pathlib import Path
    ck = make_checkpoint(Path(tempfile.mkdtemp()), "llama")
    eng = Engine.from_pretrained(str(ck), EngineConfig(num_gpu_blocks=24, block_size=16, num_threads=1))
    try:
        alone = _run(eng, long_first=False)
        beside = _run(eng, long_first=True)
    finally:
        eng.close()
    assert alone["held_before"] == 0 and alone["preempted"] == 0
    assert beside["held_before"] == 8  # ceil(116 / 16): its KV, held for its whole life
    assert beside["preempted"] > 0
    assert alone["tokens"] == beside["tokens"] == [64] * 4
