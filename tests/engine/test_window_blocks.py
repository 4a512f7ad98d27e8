"""Models whose every layer has a sliding window (Mistral-style): a sequence's blocks before its window are released
as it moves on, its table keeps their places as holes, greedy tokens still equal transformers', and prefix-cache
hits stay exact; a prefill-only prompt pins only its window (the hand-off: tests/services/decode/test_pull_plan.py).
gpt-oss (windowed and full layers over one block table) keeps every block: its full layers need
them."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from pdserve.engine.block_manager import HOLE, BlockManager
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from tests.conftest import make_checkpoint

WINDOW = 8
PROMPTS = [list(range(20, 61)), [5, 6, 7, 8, 9, 10, 11], list(range(100, 121)), [3]]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mistral-w8"), arch="mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf_tokens(mistral):
    hf = tf.AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("attention", ["native", "torch", "triton"])  # triton: interpreted on CPU
def test_greedy_equals_transformers_with_blocks_released(mistral, hf_tokens, attention):
    """Chunked prefill (16-token steps cut the 41-token prompt) and batched decodes over tables with holes, then
    the same prompts again from the prefix cache (the released blocks stayed cached, so the chains are whole)."""
    eng = Engine.from_pretrained(mistral, EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16,
                                                       attention=attention))
    assert eng.block_manager.window == WINDOW
    assert type(eng.runner.attention_ops).__name__ == {"native": "module", "torch": "NoneType",
                                                       "triton": "TritonAttention"}[attention]
    released = []
    orig = eng.block_manager.release_out_of_window
    eng.block_manager.release_out_of_window = lambda seq: released.append(orig(seq)) or released[-1]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, params)] == hf_tokens
    assert sum(released) > 0
    if attention == "triton":  # the interpreter is slow: the hits' tables are the same shapes as above
        return
    again = eng.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == hf_tokens
    assert again[0].num_cached_tokens == 40  # 10 full blocks of the 41-token prompt
    assert eng.block_manager.blocks_in_use == 0


def test_blocks_held_per_step_counted_by_hand(mistral):
    """One 21-token prompt, window 8, blocks of 4. After the prefill the next token (position 21) sees keys 14..21:
    blocks 0-2 (positions 0-11) are released, 3-5 held. Then per decode step p -> p + 1 tokens computed:
    22: (22 - 8 + 1) // 4 = 3 released of 6 -> 3; 23: 4 of 6 -> 2; 24: 4 of 6 -> 2; 25: 4 of 7 -> 3.
    Without a window all of them would be held: 6, 6, 6, 6, 7."""
    eng = Engine.from_pretrained(mistral, EngineConfig(block_size=4, num_gpu_blocks=32, enable_prefix_caching=False))
    eng.add_request("r", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seq = eng.requests["r"].seqs[0]
    held, tables = [], []
    for _ in range(5):
        eng.step()
        held.append(eng.block_manager.blocks_in_use)
        tables.append(sum(b == HOLE for b in seq.block_table))
    assert held == [3, 3, 2, 2, 3]
    assert tables == [3, 3, 4, 4, 4]
    while eng.has_unfinished():
        eng.step()
    assert eng.block_manager.blocks_in_use == 0 and eng.block_manager.num_free == 32


def test_gpt_oss_keeps_every_block(tmp_path):
    """Alternating windowed and full layers share one table: nothing can be released."""
    eng = Engine.from_pretrained(make_checkpoint(tmp_path, arch="gpt_oss"), EngineConfig(block_size=4,
                                                                                        num_gpu_blocks=32))
    assert eng.block_manager.window is None
    eng.add_request("r", PROMPTS[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.step()
    assert eng.block_manager.blocks_in_use == 6 and HOLE not in eng.requests["r"].seqs[0].block_table


def test_holes_survive_fork_swap_and_free():
    """Bookkeeping with holes: a fork shares only held blocks, swap-out copies only held blocks and swap-in
    restores the holes in place, and freeing both sequences returns every block."""
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_cpu_blocks=8)
    bm.window = 5
    seq = Sequence(0, "a", list(range(18)))
    bm.allocate(seq, 18)
    seq.num_computed_tokens = 18
    assert bm.release_out_of_window(seq) == 3  # next token at 18 sees 14..18: blocks 0-2 (positions 0-11) done
    assert seq.block_table[:3] == [HOLE] * 3 and bm.blocks_in_use == 2
    child = Sequence(1, "a", list(range(18)), branch=1)
    bm.fork(seq, child)
    assert [bm.ref[b] for b in seq.block_table[3:]] == [2, 2]
    bm.free(child)
    assert bm.can_swap_out(seq)
    held = seq.block_table[3:]
    bm.swap_out(seq)
    assert seq.host_table[:3] == [HOLE] * 3 and len(bm.cpu_free) == 6 and bm.blocks_in_use == 0
    bm.swap_in(seq)
    assert seq.block_table[:3] == [HOLE] * 3 and HOLE not in seq.block_table[3:] and len(bm.cpu_free) == 8
    assert bm.blocks_in_use == len(held)
    bm.free(seq)
    assert bm.num_free == 16 and all(r == 0 for r in bm.ref)


def test_prefill_only_pins_only_the_window(mistral):
    """A prefill-only prompt of 41 tokens: the first decode (position 41) reads keys 34..41, so blocks 0-7
    (positions 0-31) are released, blocks 8-10 pinned for the decode side (which skips the same 8)."""
    eng = Engine.from_pretrained(mistral, EngineConfig(block_size=4, num_gpu_blocks=32))
    eng.add_request("p", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1), prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    blocks, n = eng.core.pinned_kv("p")
    assert n == 41 and blocks[:8] == [HOLE] * 8 and HOLE not in blocks[8:] and len(blocks) == 11
    assert eng.core.num_pinned_blocks() == 3 == eng.block_manager.blocks_in_use
    eng.release_pinned("p")
    assert eng.block_manager.blocks_in_use == 0


@pytest.mark.parametrize("extra", [dict(preemption_mode="recompute"),
                                   dict(preemption_mode="swap", num_cpu_blocks=32),
                                   dict(speculative="ngram", num_speculative_tokens=3)],
                         ids=["preempt-recompute", "preempt-swap", "ngram-speculation"])
def test_holes_through_preemption_and_speculation(mistral, hf_tokens, extra):
    """The 41-token sequence is preempted once its table has holes and comes back (recomputed from scratch, or
    swapped back with its holes in place); verify steps run several query rows over tables with holes. Tokens
    equal transformers'."""
    eng = Engine.from_pretrained(mistral, EngineConfig(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=16,
                                                       **extra))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, params)
    long = eng.requests["0"].seqs[0]
    outs = {}
    for _ in range(5):  # three chunks of the 41-token prompt, then decodes
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    if "preemption_mode" in extra:
        assert long.block_table[0] == HOLE
        eng.scheduler.preempt(long)
        assert eng.scheduler.num_preemptions[extra["preemption_mode"]] == 1
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [outs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == hf_tokens
    assert eng.block_manager.blocks_in_use == 0
