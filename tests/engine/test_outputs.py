"""A running sequence's output carries its cumulative token ids and logprobs as a `Prefix` of the sequence's own
lists (no copy a step); it must read exactly like the copy it replaced, and stay what it was at its step while
the sequence goes on."""
from __future__ import annotations

import itertools

import pytest

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.outputs import Prefix
from pdserve.engine.sampling_params import SamplingParams


def test_prefix_reads_as_the_slice_it_stands_for():
    src = list(range(100, 120))
    p, ref = Prefix(src, 3, 15), src[3:15]
    src.extend([7, 8, 9])  # appended later: not part of it
    assert len(p) == 12 and list(p) == ref and p == ref and p == tuple(ref) and ref == p
    assert p != ref[:-1] and p != ref + [7] and p != "x"
    for i in range(-12, 12):
        assert p[i] == ref[i]
    for bad in (12, -13):
        with pytest.raises(IndexError):
            p[bad]
    bounds = [None, -30, -5, -1, 0, 1, 5, 11, 12, 30]
    for a, b, step in itertools.product(bounds, bounds, [None, 1, 2, -1, -3]):
        assert p[a:b:step] == ref[a:b:step], (a, b, step)
    assert repr(p) == repr(ref)


def test_running_outputs_keep_their_step_and_finished_ones_are_lists(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=128))
    eng.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                                                         logprobs=2))
    seen = []
    while eng.has_unfinished():
        for out in eng.step():
            c = out.outputs[0]
            # what the output said at its own step, copied now, before later steps append to the sequence
            seen.append((c, list(c.token_ids), list(c.new_token_ids), list(c.logprobs), out.finished))
    assert len(seen) == 12 and seen[-1][4]
    so_far = []
    for c, ids, new, lps, finished in seen:
        so_far += new
        assert ids == so_far and len(lps) == len(so_far)
        assert c.token_ids == ids and list(c.logprobs) == lps  # unchanged after the sequence went on
        assert [r.token_id for r in c.logprobs] == ids
        assert isinstance(c.token_ids, list) == finished and isinstance(c.logprobs, list) == finished
