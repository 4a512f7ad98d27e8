"""Warm-up before ready (spec §1.5): forwards at each typical batch size, and nothing of it stays behind."""
from __future__ import annotations

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.request_state import ENTERED
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.warmup import batch_sizes, warm_up


def test_warm_up_runs_each_batch_size_and_leaves_no_trace(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=64,
                                                          max_num_seqs=8))
    shapes = []
    orig = eng.runner.execute

    def execute(batch, *a):
        shapes.append((len(batch), sum(it.num_tokens for it in batch)))
        return orig(batch, *a)

    eng.runner.execute = execute
    entered = dict(ENTERED)
    rep = warm_up(eng)
    assert rep.batch_sizes == [1, 2, 4, 8] and rep.seconds > 0
    # one prefill and one decode forward at every batch size
    assert shapes == [s for b in (1, 2, 4, 8) for s in ((b, 16 * b), (b, b))]
    bm = eng.block_manager
    assert bm.blocks_in_use == 0 and not bm.cached and bm.queried_tokens == 0 and bm.hit_tokens == 0
    assert dict(ENTERED) == entered and not eng.usage_records and not eng.requests and eng.num_steps == 0
    # the engine serves as before, same tokens as an engine never warmed
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = Engine.from_pretrained(tiny_llama, EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=64))
    assert eng.generate([[5, 6, 7]], p)[0].outputs[0].token_ids == cold.generate([[5, 6, 7]], p)[0].outputs[0].token_ids


def test_batch_sizes_fit_the_pool(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=20,
                                                          max_num_seqs=64))
    assert batch_sizes(eng) == [1, 2, 4]  # 20 blocks / 5 per sequence
    warm_up(eng)
    assert eng.block_manager.blocks_in_use == 0
