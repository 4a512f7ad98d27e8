"""Scheduling must not change greedy results: chunking, prefix caching (incl. a full hit), preemption."""
from __future__ import annotations

import pytest

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.errors import RequestRejected
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sampling_state import branch_seed

PROMPTS = [list(range(10, 10 + n)) for n in (3, 17, 32, 9, 40, 16)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(ckpt, prompts=PROMPTS, params=GREEDY, **cfg):
    eng = Engine.from_pretrained(ckpt, EngineConfig(block_size=4, **{"num_gpu_blocks": 128, **cfg}))
    outs = eng.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], eng


@pytest.fixture(scope="module")
def reference(tiny_llama):
    toks, _ = run(tiny_llama, enable_chunked_prefill=False, enable_prefix_caching=False,
                  max_num_batched_tokens=4096)
    return toks


def test_chunked_prefill_same_tokens(tiny_llama, reference):
    toks, eng = run(tiny_llama, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert toks == reference
    assert max(t for _, t in eng.batch_sizes) == 7  # prompts of up to 40 tokens really were chunked


def test_prefix_cache_hits_same_tokens(tiny_llama, reference):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=128))
    first = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]
    again = eng.generate(PROMPTS, GREEDY)  # every full block of every prompt is cached now
    assert first == reference
    assert [o.outputs[0].token_ids for o in again] == reference
    # prompt of 32 tokens = 8 full blocks: a full hit still recomputes the block holding the last token
    assert again[2].num_cached_tokens == 28
    assert again[4].num_cached_tokens == 36
    assert eng.block_manager.hit_ratio > 0.4
    assert eng.block_manager.blocks_in_use == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_same_tokens(tiny_llama, reference, mode):
    # 14 blocks of 4 slots cannot hold six sequences of up to 52 tokens: running sequences get preempted.
    toks, eng = run(tiny_llama, num_gpu_blocks=14, preemption_mode=mode, num_cpu_blocks=64,
                    enable_prefix_caching=False)
    assert toks == reference
    assert eng.scheduler.num_preemptions[mode] > 0
    assert eng.block_manager.blocks_in_use == 0
    assert eng.stats().cpu_blocks_in_use == 0


def test_swap_space_sizes_the_host_pool_and_swaps(tiny_llama, reference):
    """--swap-space (GiB) instead of a block count: the host pool holds floor(GiB * 2^30 / block bytes) blocks, a
    block being K and V of every layer for block_size tokens (the checkpoint's config, read independently)."""
    import json
    cfg = json.loads((tiny_llama / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    toks, eng = run(tiny_llama, num_gpu_blocks=14, preemption_mode="swap", swap_space=0.001,
                    enable_prefix_caching=False)
    elt = eng.kv_cache.data.element_size()
    assert eng.block_manager.num_cpu_blocks == int(0.001 * 2 ** 30) // (cfg["num_hidden_layers"] * 2 * 4 * heads
                                                                        * head_dim * elt)
    assert toks == reference and eng.scheduler.num_preemptions["swap"] > 0


@pytest.mark.parametrize("policy", ["decode-priority", "prefill-priority"])
def test_policies_same_tokens(tiny_llama, reference, policy):
    toks, _ = run(tiny_llama, policy=policy, max_num_batched_tokens=8, max_num_seqs=3)
    assert toks == reference


def test_n_branches_share_prompt_blocks(tiny_llama):
    """Branch b of a seeded n=3 request draws exactly what a lone request seeded seed+b draws: the branches
    read the shared prompt KV (copy-on-write tail) correctly."""
    prompt = list(range(30, 48))  # 18 tokens: a partial tail block that the branches share then copy
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64,
                                                          enable_prefix_caching=False))
    eng.add_request("multi", prompt, SamplingParams(n=3, seed=7, **sampled))
    eng.step()  # prefill + fork
    # 5 prompt blocks are shared; each branch's first decode write copies the shared tail: 5 + 3 blocks
    eng.step()
    assert eng.block_manager.blocks_in_use == 5 - 1 + 3
    while eng.has_unfinished():
        outs = eng.step()
        multi = [o for o in outs if o.finished]
    branches = [o.token_ids for o in multi[0].outputs]
    for b in range(3):
        eng.add_request(f"alone{b}", prompt, SamplingParams(n=1, seed=7, **sampled))
        eng.requests[f"alone{b}"].seqs[0].sampling.generator.manual_seed(branch_seed(7, b))
        while eng.has_unfinished():
            alone = [o for o in eng.step() if o.finished]
        assert branches[b] == alone[0].outputs[0].token_ids
    assert len(set(map(tuple, branches))) > 1


def test_rejects_prompts_that_can_never_fit(tiny_llama):
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=8))
    with pytest.raises(RequestRejected, match="context"):
        eng.add_request("long", [5] * 600, GREEDY)
    with pytest.raises(RequestRejected, match="KV blocks"):
        eng.add_request("big", [5] * 40, GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        eng.add_request("bad", [5, 6], SamplingParams(top_p=0))
    assert not eng.requests


def test_context_limit_finishes_with_length(tmp_path):
    from tests.conftest import make_checkpoint
    ck = make_checkpoint(tmp_path / "short", max_pos=24)
    eng = Engine.from_pretrained(ck, EngineConfig(block_size=4, num_gpu_blocks=16))
    out = eng.generate([list(range(5, 25 - 4))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24


def test_queued_prefill_tokens_subtracts_prefix_cache_hits(tiny_llama):
    """The routing load report's queued prefill work: a waiting request whose prefix is cached counts only its
    uncached tokens (and the worker's load report uses it)."""
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=128))
    prefix = list(range(10, 30))  # 20 tokens = 5 full blocks
    eng.generate([prefix + [40, 41]], GREEDY)  # caches the prefix's blocks (freed, still hashed)
    assert eng.queued_prefill_tokens() == 0
    eng.add_request("hit", prefix + [50, 51, 52], GREEDY)    # 23 tokens, 5 cached blocks -> 3 to compute
    eng.add_request("miss", list(range(100, 111)), GREEDY)   # 11 tokens, nothing cached
    assert eng.block_manager.blocks_in_use == 0  # still waiting: nothing allocated, the lookups took nothing
    assert eng.queued_prefill_tokens() == 3 + 11
    assert eng.pending_prefill_tokens() == 3 + 11
    # a full hit still recomputes the block holding the last token (the first token needs logits)
    eng.add_request("full", prefix, GREEDY)  # 20 tokens: 4 of 5 blocks can hit -> 4 to compute
    assert eng.queued_prefill_tokens() == 3 + 11 + 4
    while eng.has_unfinished():
        eng.step()
    assert eng.queued_prefill_tokens() == 0 and eng.pending_prefill_tokens() == 0


def test_decode_groups_same_tokens(tiny_llama, reference, monkeypatch):
    """Decodes split into small length-sorted attention groups give the tokens of one big padded group."""
    from pdserve.engine.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "DECODE_GROUP", 2)
    toks, eng = run(tiny_llama, native_kernels=False)
    assert toks == reference
    assert max(n for n, _ in eng.batch_sizes) > 2  # several groups in one step really happened


def test_native_decode_attention_same_tokens_as_torch_path(tiny_llama):
    """The compiled in-place decode attention and the torch gather formulation pick the same greedy tokens (fp32;
    in bf16 the torch path rounds probabilities to bf16 and may flip near-ties: tests/engine/test_kernels.py
    bounds both against float64 instead)."""
    native, eng = run(tiny_llama)
    assert eng.runner.native_ops is not None
    torch_path, eng2 = run(tiny_llama, native_kernels=False)
    assert eng2.runner.native_ops is None
    assert native == torch_path


def _handoff(ckpt, prompt, params):
    """A disaggregated request between two engines in this process: prefill-only with all branches on one, the
    prompt's blocks copied once (what the NIXL READ does), the branches forked on the other from the branches'
    first tokens. Returns (decode side's final output, prefill's pinned block count, decode's blocks in use
    right after the commit)."""
    from pdserve.engine.outputs import FirstToken
    cfg = dict(block_size=4, num_gpu_blocks=64, enable_prefix_caching=False)
    pre = Engine.from_pretrained(ckpt, EngineConfig(**cfg))
    pre.add_request("r", prompt, params, prefill_only=True)
    while pre.has_unfinished():
        done = [o for o in pre.step() if o.finished]
    firsts = [FirstToken(c.token_ids[0], c.cumulative_logprob, c.logprobs[0] if c.logprobs else None)
              for c in done[0].outputs]
    assert len(firsts) == params.num_branches and all(c.finish_reason == "prefill" for c in done[0].outputs)
    src, ntok = pre.pinned_kv("r")
    assert ntok == len(prompt) and pre.block_manager.blocks_in_use == len(src)  # pinned once, not per branch
    dec = Engine.from_pretrained(ckpt, EngineConfig(**cfg))
    dst, cached = dec.add_prefilled_request("r", prompt, firsts, params)
    assert cached == 0 and len(dst) == len(src)
    dec.kv_cache.data[dst] = pre.kv_cache.data[src]
    pre.release_pinned("r")
    assert pre.block_manager.blocks_in_use == 0
    assert dec.commit_prefilled("r")
    shared = dec.block_manager.blocks_in_use
    final = None
    while dec.has_unfinished():
        final = next((o for o in dec.step() if o.finished), final)
    assert dec.block_manager.blocks_in_use == 0
    return final, len(src), shared


def test_prefilled_branches_match_colocated(tiny_llama):
    """n=3 handed off: one prompt prefill, the prompt's blocks transferred once and shared by three branches,
    each continuing from its own first token: the same tokens, logprobs and cumulative logprobs as the same
    seeded n=3 request on one engine."""
    prompt = list(range(30, 48))  # 18 tokens: 5 blocks, the last partial
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=2)
    ref = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64,
                                                          enable_prefix_caching=False)).generate([prompt], params)[0]
    got, pinned, shared = _handoff(tiny_llama, prompt, params)
    assert pinned == 5 and shared == 5  # three branches on five prompt blocks (each copies the tail later)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert len({tuple(c.token_ids) for c in got.outputs}) > 1
    for g, r in zip(got.outputs, ref.outputs):
        assert g.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-5)
        assert [x.token_id for x in g.logprobs] == [x.token_id for x in r.logprobs] == r.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in r.logprobs], abs=1e-5)


def test_best_of_returns_highest_cumulative_logprob(tiny_llama):
    """best_of=3, n=1 returns the branch of highest cumulative logprob among the three branches the same seeded
    n=3 request produces, colocated and handed off; with the branch's whole output in its one message."""
    prompt = list(range(60, 75))
    sampled = dict(seed=5, temperature=1.0, max_tokens=6, ignore_eos=True)
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))
    three = eng.generate([prompt], SamplingParams(n=3, **sampled))[0].outputs
    best = max(three, key=lambda c: c.cumulative_logprob)
    assert len({c.cumulative_logprob for c in three}) == 3
    eng.add_request("b", prompt, SamplingParams(n=1, best_of=3, **sampled))
    shown = []
    while eng.has_unfinished():
        shown += [c for o in eng.step() for c in o.outputs]
    assert len(shown) == 1 and shown[0].index == 0  # nothing of the losers, nothing before the end
    assert shown[0].new_token_ids == shown[0].token_ids == best.token_ids
    assert eng.usage_records[-1].committed_tokens == 6 and eng.usage_records[-1].generated_tokens == 18
    got, _, _ = _handoff(tiny_llama, prompt, SamplingParams(n=1, best_of=3, **sampled))
    assert [c.token_ids for c in got.outputs] == [best.token_ids]
    assert got.outputs[0].new_token_ids == best.token_ids


def test_prefilled_first_tokens_must_match_branches(tiny_llama):
    from pdserve.engine.outputs import FirstToken
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))
    with pytest.raises(ValueError, match="first tokens"):
        eng.add_prefilled_request("x", [5, 6, 7], [FirstToken(1)], SamplingParams(n=2))
    with pytest.raises(ValueError, match="first tokens"):
        eng.add_prefilled_request("x", [5, 6, 7], [FirstToken(10**6)], SamplingParams())
    assert eng.block_manager.blocks_in_use == 0 and not eng.remote_pending


def test_usage_records_are_bounded(tiny_llama):
    from pdserve.engine import engine as engine_mod
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))
    eng.generate([[5, 6, 7]] * (engine_mod.USAGE_RECORDS_KEPT + 3), SamplingParams(max_tokens=1))
    assert len(eng.usage_records) == engine_mod.USAGE_RECORDS_KEPT


def test_usage_log_line_is_the_record_with_ordered_times(tiny_llama, caplog):
    """Each request's `pdserve.usage` line is its UsageRecord as JSON; its timestamps are in lifecycle order and
    agree with the output the client got."""
    import json
    import logging
    import time
    from dataclasses import asdict
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=64))
    t0 = time.time()
    with caplog.at_level(logging.INFO, logger="pdserve.usage"):
        out = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.usage"]
    assert len(lines) == 1
    line, rec = lines[0], eng.usage_records[-1]
    assert line == json.loads(json.dumps(asdict(rec)))
    assert (line["request_id"], line["state"], line["prompt_tokens"], line["generated_tokens"],
            line["committed_tokens"], line["finish_reasons"]) == (out.request_id, "FINISHED", 5, 4, 4, ["length"])
    t = line["times"]
    assert t0 <= t["arrival"] <= t["queued"] <= t["first_scheduled"] <= t["first_token"] <= t["finished"] <= time.time()
    assert out.times == rec.times and out.times.finished == t["finished"]
