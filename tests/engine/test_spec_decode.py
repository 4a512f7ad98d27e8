"""Speculative decoding (spec §5.1 step 3, §7, Q16): greedy equality against transformers, the exact distribution
at T > 0 (chi-square against float64 probabilities computed from transformers' logits), KV rollback invariants,
the Q16 counts, and the decode-side entry point of a disaggregated request."""
from __future__ import annotations

import itertools
import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.outputs import FirstToken
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from tests.conftest import make_checkpoint
from tests.engine.test_sampler import chi2_critical

# Repetitive prompts (the n-gram proposer finds earlier occurrences) and a plain one.
PROMPTS = [[10, 11, 12] * 6, list(range(40, 57)), [5, 6, 7, 8] * 3 + [5, 6], [3, 9, 27, 81, 3, 9, 27]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BASE = dict(block_size=4, num_gpu_blocks=128, dtype="float32")


@pytest.fixture(scope="module")
def draft_small(tmp_path_factory):
    """A different, smaller checkpoint with the same tokenizer: mostly rejected candidates."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), hidden=32, layers=1, seed=3)


@pytest.fixture(scope="module")
def draft_close(tiny_llama, tmp_path_factory):
    """The target's weights plus noise: a draft that agrees often but not always."""
    d = tmp_path_factory.mktemp("draft_close")
    for f in tiny_llama.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    g = torch.Generator().manual_seed(5)
    for f in tiny_llama.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: v + 0.005 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in t.items()},
                  d / f.name)
    return d


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def engine(ckpt, **cfg) -> Engine:
    return Engine.from_pretrained(ckpt, EngineConfig(**{**BASE, **cfg}))


def spec_cfgs(draft_small, draft_close):
    return {"ngram": dict(speculative="ngram", num_speculative_tokens=3),
            "draft": dict(speculative="draft", draft_model=str(draft_small), num_speculative_tokens=4),
            "draft-close": dict(speculative="draft", draft_model=str(draft_close), num_speculative_tokens=4)}


def check_invariants(eng: Engine) -> None:
    """Between ticks: refcounts equal the block tables referencing each block; a running sequence holds exactly
    the blocks its committed KV needs (nothing left over from rejected candidates); every block registered in the
    prefix cache holds committed tokens of the sequences using it."""
    bm = eng.block_manager
    refs = [0] * bm.num_blocks
    live = [s for r in eng.requests.values() for s in r.seqs if not s.finished]
    for s in live:
        for b in s.block_table:
            refs[b] += 1
        if s.block_table and s.num_output_tokens > 0 and not s.is_prefill:
            assert len(s.block_table) == bm.blocks_needed(s.num_computed_tokens), s
        assert s.num_computed_tokens <= s.num_tokens - 1 or s.num_output_tokens == 0
        for i, b in enumerate(s.block_table):
            if bm.hash_of[b] is not None:
                assert bm.tokens_of[b] == tuple(s.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
    assert refs == bm.ref
    assert len(bm.free_ids) + len(bm.evictable) + sum(1 for r in refs if r) == bm.num_blocks


def run_checked(eng: Engine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        check_invariants(eng)
    return [final[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-close"])
def test_greedy_same_tokens_as_transformers(tiny_llama, hf, draft_small, draft_close, method):
    cfg = spec_cfgs(draft_small, draft_close)[method]
    plain = engine(tiny_llama)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for prompt, w in zip(PROMPTS, want):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert w == ref
    eng = engine(tiny_llama, **cfg)
    assert run_checked(eng, PROMPTS, GREEDY) == want
    st = eng.spec.stats
    assert st.steps > 0 and st.proposed > 0
    if method != "draft":
        assert st.accepted > 0  # some candidates were accepted: multi-token steps really happened
    assert st.accepted < st.proposed or method == "draft-close"
    # after finish: no block held, and the prefix cache holds exactly the blocks the plain run registered
    assert eng.block_manager.blocks_in_use == plain.block_manager.blocks_in_use == 0
    assert set(eng.block_manager.cached) == set(plain.block_manager.cached)


def test_usage_records_count_verified_accepted_kv_growth(tiny_llama):
    plain, spec = engine(tiny_llama), engine(tiny_llama, speculative="ngram", num_speculative_tokens=3)
    plain.generate(PROMPTS[:1], GREEDY)
    spec.generate(PROMPTS[:1], GREEDY)
    p, s = plain.usage_records[-1], spec.usage_records[-1]
    n = GREEDY.max_tokens
    # Plain decode: one position per step, each kept; the first token came from the prefill.
    assert (p.verified_tokens, p.accepted_tokens, p.kv_growth_tokens) == (n - 1, 0, n - 1)
    st = spec.spec.stats
    assert s.generated_tokens == s.emitted_tokens == n
    assert s.kv_growth_tokens == n - 1  # the committed KV is the same: rejected candidates were rolled back
    assert s.accepted_tokens == st.accepted > 0
    assert s.verified_tokens == st.proposed + st.steps + (n - 1 - st.emitted)  # k+1 per verify step, 1 per plain
    assert s.verified_tokens - s.kv_growth_tokens == st.rolled_back
    # the same counts on the wire (the decode worker's last GenerateResponse)
    from pdserve.services.convert import DeltaEncoder
    out = spec.generate(PROMPTS[:1], GREEDY)[0]
    u = DeltaEncoder().encode(out).usage
    r = spec.usage_records[-1]
    assert (u.verified_tokens, u.accepted_tokens, u.kv_growth_tokens) == \
        (r.verified_tokens, r.accepted_tokens, r.kv_growth_tokens)


def test_flags_reach_the_engine_config(tmp_path):
    """`--speculative/--num-speculative-tokens/--draft-model` on `pdserve worker` (and env PDSERVE_*) and on
    `pdserve generate` become EngineConfig fields."""
    import os

    from pdserve.cli import build_parser
    from pdserve.services.worker import engine_config_from_args
    args = build_parser().parse_args(["worker", "--speculative", "draft", "--num-speculative-tokens", "6",
                                      "--draft-model", str(tmp_path)])
    cfg = engine_config_from_args(args)
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.draft_model) == ("draft", 6, str(tmp_path))
    os.environ["PDSERVE_SPECULATIVE"] = "ngram"
    try:
        cfg = engine_config_from_args(build_parser().parse_args(["worker"]))
    finally:
        del os.environ["PDSERVE_SPECULATIVE"]
    assert cfg.speculative == "ngram" and cfg.draft_model is None
    gen = build_parser().parse_args(["generate", "--prompt", "x", "--speculative", "ngram"])
    assert gen.speculative == "ngram"
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(speculative="draft").validate()


@pytest.mark.parametrize("method", ["ngram", "draft-close"])
def test_pipeline_applies_per_verified_position(tiny_llama, draft_small, draft_close, method):
    """Penalties, logprobs, stop tokens and stop strings give what plain decoding gives."""
    cfg = spec_cfgs(draft_small, draft_close)[method]
    plain, spec = engine(tiny_llama), engine(tiny_llama, **cfg)
    pen = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                         frequency_penalty=0.2, logprobs=2)
    a, b = plain.generate(PROMPTS, pen), spec.generate(PROMPTS, pen)
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert [r.logprob for r in y.outputs[0].logprobs] == pytest.approx([r.logprob for r in x.outputs[0].logprobs],
                                                                            abs=1e-4)
        assert [r.top_logprobs[0][0] for r in y.outputs[0].logprobs] == \
            [r.top_logprobs[0][0] for r in x.outputs[0].logprobs]
        assert y.outputs[0].cumulative_logprob == pytest.approx(x.outputs[0].cumulative_logprob, abs=1e-4)
    stopped = 0
    for prompt in PROMPTS:
        ref = plain.generate([prompt], GREEDY)[0].outputs[0]
        tok = next((t for i, t in enumerate(ref.token_ids) if i >= 3 and t not in ref.token_ids[:i]), None)
        mid = len(ref.text) // 2
        cases = [SamplingParams(temperature=0, max_tokens=20, stop=[ref.text[mid:mid + 2]])]
        if tok is not None:
            cases.append(SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]))
        for params in cases:
            x, y = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
            assert (y.outputs[0].token_ids, y.outputs[0].text, y.outputs[0].finish_reason) == \
                (x.outputs[0].token_ids, x.outputs[0].text, x.outputs[0].finish_reason)
            stopped += x.outputs[0].finish_reason == "stop" and len(x.outputs[0].token_ids) < 20
            # a stop inside a speculative step: the KV kept is that of the committed tokens, as in plain decoding
            rp, rs = plain.usage_records[-1], spec.usage_records[-1]
            assert rs.kv_growth_tokens == rp.kv_growth_tokens == rp.generated_tokens - 1
            assert rs.verified_tokens >= rs.kv_growth_tokens
    assert stopped >= 2  # stops really fell inside multi-token steps' range
    assert spec.block_manager.blocks_in_use == 0


def test_guided_requests_fall_back_to_plain_decode(tiny_llama):
    spec = engine(tiny_llama, speculative="ngram", num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=8, guided=GuidedSpec(regex="[a-z ]+"))
    plain_out = engine(tiny_llama).generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert spec.generate(PROMPTS[:1], params)[0].outputs[0].token_ids == plain_out
    assert spec.spec.stats.steps == 0


def exact_joint(hf, prompt, T, top_k, n):
    """float64 probability of every n-token continuation under temperature T and top-k (from transformers)."""
    probs = {(): 1.0}
    for _ in range(n):
        prefixes = list(probs)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].double()
        nxt = {}
        for p, z in zip(prefixes, logits):
            vals, ids = torch.sort(z, descending=True, stable=True)
            w = torch.softmax(vals[:top_k] / T, -1)
            for t, q in zip(ids[:top_k].tolist(), w.tolist()):
                nxt[p + (t,)] = probs[p] * q
        probs = nxt
    return probs


@pytest.mark.parametrize("method", ["ngram", "draft-close"])
def test_sampled_distribution_is_exact(tiny_llama, hf, draft_small, draft_close, method):
    """T > 0: seeded draws of a 4-token continuation with speculation follow the target's exact distribution
    (chi-square, cells with < 5 expected merged; fails with probability ~1e-4 for a correct sampler)."""
    cfg = spec_cfgs(draft_small, draft_close)[method]
    base, T, K, N = [7, 8, 9] * 4, 1.2, 3, 1200
    # base + its greedy continuation (this model falls into repeating a token): likely to go on repeating, and
    # the n-gram lookup proposes the repetition
    cont = hf.generate(torch.tensor([base]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(base):].tolist()
    prompt = base + cont
    want = exact_joint(hf, prompt, T, K, 4)
    eng = engine(tiny_llama, max_num_seqs=128, num_gpu_blocks=2048, **cfg)
    outs = eng.generate([prompt] * N, [SamplingParams(temperature=T, top_k=K, max_tokens=4, ignore_eos=True,
                                                      seed=100 + i) for i in range(N)])
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        assert key in want, f"draw {key} outside the exact support"
        counts[key] = counts.get(key, 0) + 1
    st = eng.spec.stats
    assert st.accepted > 0 and st.rolled_back > 0  # both branches of the acceptance test ran
    big = [c for c in want if want[c] * N >= 5]
    small = [c for c in want if want[c] * N < 5]
    cells = [(counts.get(c, 0), want[c] * N) for c in big]
    if small:
        cells.append((sum(counts.get(c, 0) for c in small), sum(want[c] for c in small) * N))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < chi2_critical(len(cells) - 1), sorted(itertools.islice(((c, counts.get(c, 0), round(want[c] * N))
                                                                          for c in big), 30))
    assert eng.block_manager.blocks_in_use == 0


@pytest.mark.parametrize("method", ["ngram", "draft-close"])
def test_disaggregated_decode_side(tiny_llama, draft_small, draft_close, method):
    """The decode worker's entry point (add_prefilled_request / commit_prefilled, the prompt's KV copied as the
    NIXL READ does) with speculation on the decode side: the same greedy tokens as colocated plain decoding."""
    cfg = spec_cfgs(draft_small, draft_close)[method]
    want = [o.outputs[0].token_ids for o in engine(tiny_llama).generate(PROMPTS, GREEDY)]
    pre, dec = engine(tiny_llama), engine(tiny_llama, **cfg)
    for i, prompt in enumerate(PROMPTS):
        rid = f"d{i}"
        pre.add_request(rid, prompt, GREEDY, prefill_only=True)
        done = None
        while pre.has_unfinished():
            done = next((o for o in pre.step() if o.finished), done)
        first = [FirstToken(done.outputs[0].token_ids[0], done.outputs[0].cumulative_logprob)]
        src, _ = pre.pinned_kv(rid)
        dst, cached = dec.add_prefilled_request(rid, prompt, first, GREEDY)
        dec.kv_cache.data[dst[cached:]] = pre.kv_cache.data[src[cached:]]
        pre.release_pinned(rid)
        assert dec.commit_prefilled(rid)
        final = None
        while dec.has_unfinished():
            final = next((o for o in dec.step() if o.finished), final)
            check_invariants(dec)
        assert final.outputs[0].token_ids == want[i]
    assert dec.spec.stats.accepted > 0
    assert dec.block_manager.blocks_in_use == 0 and pre.block_manager.blocks_in_use == 0


def test_candidates_yield_to_budget_and_kv_pressure(tiny_llama):
    """Candidates ride along only within the tick's token budget (chunked prefill or not): same tokens."""
    tight = dict(block_size=4, max_num_batched_tokens=3)  # 1 decode token + at most 2 candidates
    want = [o.outputs[0].token_ids for o in engine(tiny_llama, **tight).generate(PROMPTS, GREEDY)]
    eng = engine(tiny_llama, speculative="ngram", num_speculative_tokens=6, **tight)
    sizes = []
    orig = eng.scheduler.schedule

    def schedule():
        out = orig()
        sizes.append(out.num_batched_tokens)
        assert all(it.num_draft <= 2 for it in out.scheduled)
        return out
    eng.scheduler.schedule = schedule
    assert run_checked(eng, PROMPTS, GREEDY) == want
    assert max(sizes) <= 3 and eng.spec.stats.accepted > 0


def test_candidates_dropped_not_preempting_when_blocks_run_out():
    """A full pool: the candidates that would need a new block are dropped; nobody is preempted for them."""
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.request_state import RequestState as S
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.sequence import Sequence
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sch = Scheduler(EngineConfig(block_size=4), bm)
    a, b = Sequence(0, "a", [1] * 7), Sequence(1, "b", [2] * 7)
    for s in (a, b):
        s.set_state(S.QUEUED)
        sch.add(s)
    assert [it.num_tokens for it in sch.schedule().scheduled] == [7, 7] and bm.num_free == 0
    for s in (a, b):  # prefilled, first token sampled: decoding at position 7, inside the second block
        s.num_computed_tokens = 7
        s.token_ids.append(5)
        s.set_state(S.DECODING)
    a.draft_token_ids = [5, 5, 5]  # positions 8..10 would need a third block
    b.draft_token_ids = []
    out = sch.schedule()
    assert [(it.seq.request_id, it.num_tokens, it.num_draft) for it in out.scheduled] == [("a", 1, 0), ("b", 1, 0)]
    assert not out.preempted and sch.num_preemptions == {"recompute": 0, "swap": 0}
    assert a.draft_token_ids == [] and bm.num_free == 0


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from pdserve.engine.errors import CheckpointError
    other = make_checkpoint(tmp_path / "other", vocab_size=256, hidden=32, layers=1)
    with pytest.raises(CheckpointError, match="vocabulary differs"):
        engine(tiny_llama, speculative="draft", draft_model=str(other))
