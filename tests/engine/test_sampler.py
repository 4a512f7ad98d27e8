"""Sampler tests against the spec's worked numbers (§3, §8 [D01]-[D02], §A 1-2) and against an
independent pure-Python reference of the support definitions (never the sampler's own output).

Every test runs once per device (cpu always, cuda where there is one): the logits are moved to the device and the
requests' generators live there, as in the engine; results are read back on the host."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.engine import sampler as sampler_mod
from pdserve.engine.sampler import select_best
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams

torch.set_num_threads(1)

DEV = torch.device("cpu")  # the device of the current parametrisation (set by the fixture below)


@pytest.fixture(scope="module", autouse=True, params=[
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))])
def _device(request):
    global DEV
    DEV = torch.device(request.param)
    yield DEV
    DEV = torch.device("cpu")


def SamplingState(*args, **kw):  # noqa: N802 (stands in for the class: a state whose generator is on DEV)
    return sampler_mod.SamplingState(*args, device=DEV, **kw)


class Sampler(sampler_mod.Sampler):
    """The real sampler, fed logits on DEV."""

    def sample(self, logits, states):
        return super().sample(logits.to(DEV), states)

    def prompt_logprobs(self, logits, prompt_token_ids, k):
        return super().prompt_logprobs(logits.to(DEV), prompt_token_ids, k)


def edit(sampler, z, states):
    """Steps 1-2 (constraints, bias, penalties) on DEV, read back."""
    return sampler.process_logits(z.to(DEV), states).cpu()


# ---------------------------------------------------------------- pure-Python reference (spec §3.1)
def ref_softmax(z: list[float], T: float = 1.0) -> list[float]:
    m = max(z)
    e = [math.exp((x - m) / T) if x != -math.inf else 0.0 for x in z]
    s = sum(e)
    return [x / s for x in e]


def _renorm(p, keep):
    s = sum(p[i] for i in keep)
    return [p[i] / s if i in keep else 0.0 for i in range(len(p))]


def ref_top_k(p, k):
    order = sorted((i for i in range(len(p)) if p[i] > 0), key=lambda i: (-p[i], i))
    return _renorm(p, set(order[:k]))


def ref_top_p(p, top_p):
    if top_p >= 1.0:  # the only prefix whose exact mass reaches 1 is the whole support (no tolerance can apply)
        return p
    order = sorted((i for i in range(len(p)) if p[i] > 0), key=lambda i: (-p[i], i))
    keep, cum = set(), 0.0
    for i in order:
        keep.add(i)
        cum += p[i]
        if cum >= top_p - 1e-9:  # first prefix reaching >= p (boundary kept)
            break
    return _renorm(p, keep)


def ref_min_p(p, alpha):
    m = max(p)
    return _renorm(p, {i for i in range(len(p)) if p[i] > 0 and p[i] >= alpha * m})


def ref_typical(p, mass):
    if mass >= 1.0:  # as top_p = 1: the whole support
        return p
    H = -sum(x * math.log(x) for x in p if x > 0)
    order = sorted((i for i in range(len(p)) if p[i] > 0), key=lambda i: (abs(-math.log(p[i]) - H), -p[i], i))
    keep, cum = set(), 0.0
    for i in order:
        keep.add(i)
        cum += p[i]
        if cum >= mass - 1e-9:
            break
    return _renorm(p, keep)


REF = {"top_k": ref_top_k, "top_p": ref_top_p, "min_p": ref_min_p, "typical_p": ref_typical}


def ref_pipeline(z, T=1.0, order=("top_k", "top_p", "min_p", "typical_p"), **f):
    p = ref_softmax(z, T)
    for name in order:
        if name in f:
            p = REF[name](p, f[name])
    return p


def support(p):
    return {i for i, x in enumerate(p) if x > 0}


# ---------------------------------------------------------------- helpers around the real sampler
def logits_of(p: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in p]], dtype=torch.float32)


def processed(z: torch.Tensor, sampler: Sampler | None = None, **kw) -> list[float]:
    """The sampler's final distribution, read back through processed logprobs of every token."""
    V = z.shape[-1]
    params = SamplingParams(logprobs=min(V, 20), logprobs_mode="processed", seed=0, **kw)
    st_ = SamplingState(params, [], V, [])
    res = (sampler or Sampler(V)).sample(z.reshape(1, V), [st_])[0]
    out = [0.0] * V
    for tid, lp in res.top_logprobs:
        out[tid] = math.exp(lp)
    return out


def sup(z, sampler=None, **kw):
    return support(processed(z, sampler, **kw))


# ---------------------------------------------------------------- [D01] worked numbers
def test_top_p_spec_example_keeps_boundary_token():
    assert sup(logits_of([0.4, 0.3, 0.2, 0.1]), top_p=0.65) == {0, 1}


def test_typical_spec_example_excludes_most_probable():
    p = [0.02, 0.35, 0.33, 0.30]
    assert sup(logits_of(p), typical_p=0.63) == {2, 3}  # 2nd and 3rd most probable only


def test_top_k_size_exactly_k_with_tie_break_by_id():
    z = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    assert sup(z, top_k=1) == {1}
    assert sup(z, top_k=2) == {1, 3}
    assert sup(z, top_k=3) == {1, 3, 2}  # tie at the k-th place: lower id (2) before 4
    for k in range(1, 7):
        assert len(sup(z, top_k=k)) == k


def test_greedy_ties_lowest_index_and_negative_temperature_rejected():
    z = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    s = SamplingState(SamplingParams(temperature=0.0), [], 4, [])
    assert Sampler(4).sample(z, [s])[0].token_id == 1
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5).validate(4)


def test_temperature_to_zero_limits():
    uniq = processed(torch.tensor([[1.0, 2.0, 0.5, 1.9]]), temperature=1e-3)
    assert uniq == pytest.approx([0, 1, 0, 0], abs=1e-6)
    tied = processed(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), temperature=1e-3)
    assert tied == pytest.approx([0, 0.5, 0.5, 0], abs=1e-6)


def test_min_p_always_keeps_max_and_depends_on_temperature():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    sizes = [len(sup(z, temperature=T, min_p=0.3)) for T in (0.2, 0.5, 1.0, 2.0, 5.0)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert 0 in sup(z, min_p=1.0)


# ---------------------------------------------------------------- [D02] order is not commutative
def test_filter_order_not_commutative_spec_d02():
    z = logits_of([0.5, 0.2, 0.15, 0.1, 0.05])
    a = Sampler(5, filter_order=("top_k", "top_p", "min_p", "typical_p"))
    b = Sampler(5, filter_order=("top_p", "top_k", "min_p", "typical_p"))
    assert sup(z, a, top_k=3, top_p=0.8) == {0, 1}
    assert sup(z, b, top_k=3, top_p=0.8) == {0, 1, 2}


def test_filter_order_must_be_permutation():
    with pytest.raises(ValueError, match="filter_order"):
        Sampler(5, filter_order=("top_k", "top_p"))


# ---------------------------------------------------------------- properties (hypothesis)
logit_lists = st.lists(st.floats(-8, 8, allow_nan=False).map(lambda x: round(x, 2)), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(z=logit_lists, c=st.floats(-50, 50), k=st.integers(1, 12), p=st.floats(0.05, 1.0), a=st.floats(0, 1))
def test_supports_shift_invariant(z, c, k, p, a):
    t = torch.tensor([z])
    for kw in ({"top_k": min(k, len(z))}, {"top_p": p}, {"min_p": a}):
        assert sup(t, **kw) == sup(t + c, **kw)


@settings(max_examples=60, deadline=None)
@given(z=logit_lists, p1=st.floats(0.05, 1.0), p2=st.floats(0.05, 1.0), a1=st.floats(0, 1), a2=st.floats(0, 1))
def test_supports_nest_as_thresholds_move(z, p1, p2, a1, a2):
    t = torch.tensor([z])
    lo, hi = sorted((p1, p2))
    assert sup(t, top_p=lo) <= sup(t, top_p=hi)
    lo, hi = sorted((a1, a2))
    assert sup(t, min_p=hi) <= sup(t, min_p=lo)  # support non-decreasing as alpha decreases
    m = max(range(len(z)), key=lambda i: (z[i], -i))
    assert m in sup(t, min_p=hi)


@settings(max_examples=40, deadline=None)
@given(z=logit_lists, a=st.floats(0.01, 0.99), T1=st.floats(0.1, 5), T2=st.floats(0.1, 5))
def test_min_p_support_grows_with_temperature(z, a, T1, T2):
    t = torch.tensor([z])
    lo, hi = sorted((T1, T2))
    assert sup(t, temperature=lo, min_p=a) <= sup(t, temperature=hi, min_p=a)


@settings(max_examples=40, deadline=None)
@given(z=st.lists(st.integers(-5, 5), min_size=2, max_size=10))
def test_temperature_zero_limit_splits_ties_equally(z):
    t = torch.tensor([z], dtype=torch.float32)
    m = max(z)
    winners = [i for i, x in enumerate(z) if x == m]
    got = processed(t, temperature=1e-3)
    assert got == pytest.approx([1 / len(winners) if i in winners else 0 for i in range(len(z))], abs=1e-6)
    s = SamplingState(SamplingParams(temperature=0.0), [], len(z), [])
    assert Sampler(len(z)).sample(t, [s])[0].token_id == winners[0]


@settings(max_examples=40, deadline=None)
@given(z=logit_lists, k=st.integers(1, 12), p=st.floats(0.05, 1.0), a=st.floats(0, 0.9), ty=st.floats(0.05, 1.0),
       T=st.floats(0.3, 3.0))
# Seen once: p(token 1) = e^-22 = 2.8e-10 after T = 0.5, and no filter is on (k = V, p = 1, typical = 1, min_p 0
# or below 2.8e-10). The spec's support is then the whole vocabulary (temperature alone never drops a token, and the
# only prefix whose mass reaches p = 1 is all of it); the reference used to stop its top-p scan at mass 1 - 1e-9.
@example(z=[7.0, -4.0], k=2, p=1.0, a=0.0, ty=1.0, T=0.5)
@example(z=[7.0, -4.0], k=2, p=1.0, a=1e-10, ty=1.0, T=0.5)
def test_matches_reference_pipeline(z, k, p, a, ty, T):
    k = min(k, len(z))
    t = torch.tensor([z])
    got = processed(t, temperature=T, top_k=k, top_p=p, min_p=a, typical_p=ty)
    want = ref_pipeline(z, T, top_k=k, top_p=p, min_p=a, typical_p=ty)
    # boundary cases within float noise of a threshold are excluded rather than guessed
    assert support(got) == support(want) or _near_boundary(z, T, k, p, a, ty)
    if support(got) == support(want):
        assert got == pytest.approx(want, abs=1e-5)


def _near_boundary(z, T, k, p, a, ty):
    for eps in (-1e-4, 1e-4):
        if support(ref_pipeline(z, T, top_k=k, top_p=p + eps, min_p=a + eps, typical_p=ty + eps)) != support(
            ref_pipeline(z, T, top_k=k, top_p=p, min_p=a, typical_p=ty)
        ):
            return True
    return False


def test_tiny_tail_kept_when_no_filter_is_on():
    """The hypothesis example above, spelled out: both tokens stay in the support (p = 1 and typical_p = 1 are off,
    min_p = 1e-10 < 2.8e-10 keeps the tail) and min_p = 1e-9 drops it."""
    z = torch.tensor([[7.0, -4.0]])
    kw = dict(temperature=0.5, top_k=2, top_p=1.0, typical_p=1.0)
    assert sup(z, min_p=0.0, **kw) == {0, 1} == sup(z, min_p=1e-10, **kw)
    assert sup(z, min_p=1e-9, **kw) == {0}
    assert support(ref_pipeline([7.0, -4.0], 0.5, top_k=2, top_p=1.0, min_p=1e-10, typical_p=1.0)) == {0, 1}
    assert processed(z, min_p=0.0, **kw)[1] == pytest.approx(math.exp(-22) / (1 + math.exp(-22)), rel=1e-5)


# ---------------------------------------------------------------- distribution of seeded draws
def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z=3.719 is the normal 1-1e-4 point,
    so a correct sampler fails a given check with probability ~1e-4 (and the seeds are fixed)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


Z8 = [2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -2.0]
CONFIGS = [
    dict(),
    dict(temperature=0.7),
    dict(top_k=3),
    dict(top_p=0.7),
    dict(min_p=0.2),
    dict(typical_p=0.6),
    dict(top_k=5, top_p=0.8, temperature=1.3),
    dict(top_k=6, top_p=0.9, min_p=0.1, typical_p=0.9, temperature=0.8),
    dict(top_p=0.95, min_p=0.05, temperature=1.7),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_draws_match_exact_distribution(cfg):
    N, V = 20_000, len(Z8)
    want = ref_pipeline(Z8, cfg.get("temperature", 1.0), **{k: v for k, v in cfg.items() if k != "temperature"})
    states = [SamplingState(SamplingParams(seed=1000 + i, **cfg), [], V, []) for i in range(N)]
    res = Sampler(V).sample(torch.tensor([Z8]).expand(N, V), states)
    counts = [0] * V
    for r in res:
        counts[r.token_id] += 1
    assert {i for i, c in enumerate(counts) if c} <= support(want), "draw outside the exact support"
    cells = [i for i in range(V) if want[i] > 0]
    chi2 = sum((counts[i] - N * want[i]) ** 2 / (N * want[i]) for i in cells)
    df = len(cells) - 1
    if df:
        assert chi2 < chi2_critical(df), (counts, [round(N * w) for w in want])


# ---------------------------------------------------------------- per-request generators
def test_seeded_request_same_tokens_alone_and_in_batch():
    V, steps = 300, 12
    g = torch.Generator().manual_seed(7)
    step_logits = [torch.randn(17, V, generator=g) * 3 for _ in range(steps)]
    target = dict(seed=1234, top_k=40, top_p=0.9, temperature=0.8, logprobs=3)

    alone = SamplingState(SamplingParams(**target), [1, 2, 3], V, [0])
    sampler = Sampler(V)
    alone_toks = [sampler.sample(lg[:1], [alone])[0].token_id for lg in step_logits]

    others = [
        dict(temperature=0.0), dict(top_p=0.5), dict(), dict(top_k=0, min_p=0.1), dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.5, presence_penalty=0.5), dict(typical_p=0.7), dict(top_k=5, seed=3),
        dict(logit_bias={3: 5.0}), dict(temperature=2.0), dict(allowed_token_ids=[1, 2, 3, 4]),
        dict(no_repeat_ngram_size=2), dict(min_tokens=5), dict(logprobs=2, logprobs_mode="processed"),
        dict(top_p=0.3, temperature=0.5), dict(seed=99),
    ]
    batch = [SamplingState(SamplingParams(**target), [1, 2, 3], V, [0])]
    batch += [SamplingState(SamplingParams(**o), [5, 6], V, [0]) for o in others]
    in_batch = []
    for lg in step_logits:
        batch_logits = torch.cat([step_logits[0][:0], lg[:1], torch.randn(16, V)])
        in_batch.append(sampler.sample(batch_logits, batch)[0].token_id)
    assert alone_toks == in_batch


def test_branches_differ_and_branch0_equals_single_request():
    V = 1000
    z = torch.zeros(1, V)
    base = SamplingState(SamplingParams(seed=5), [], V, [])
    forks = [base.fork(i) for i in range(4)]
    single = SamplingState(SamplingParams(seed=5), [], V, [])
    s = Sampler(V)
    toks = [s.sample(z, [f])[0].token_id for f in forks]
    assert toks[0] == s.sample(z, [single])[0].token_id
    assert len(set(toks)) > 1


def test_select_best_by_cumulative_logprob():
    states = [SamplingState(SamplingParams(n=2, best_of=3), [], 10, [], branch_index=i) for i in range(3)]
    for s, lp_ in zip(states, (-3.0, -1.0, -2.0)):
        s.cumulative_logprob = lp_
    assert select_best(states, 2) == [1, 2]


# ---------------------------------------------------------------- penalties and hard constraints
def test_repetition_penalty_sign_aware_counts_prompt():
    z = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    s = SamplingState(SamplingParams(repetition_penalty=2.0), [0, 1], 4, [])
    out = edit(Sampler(4), z, [s])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    s.append(2)
    assert edit(Sampler(4), z, [s]).tolist() == [[1.0, -4.0, 0.5, 0.5]]


def test_frequency_presence_count_output_only():
    z = torch.zeros(1, 4)
    s = SamplingState(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3, 3, 3], 4, [])
    for t in (1, 1, 2):
        s.append(t)
    assert edit(Sampler(4), z, [s]).tolist() == [[0.0, -1.25, -0.75, 0.0]]


def test_hard_constraints():
    V = 6
    z = torch.zeros(1, V)
    smp = Sampler(V)
    s = SamplingState(SamplingParams(allowed_token_ids=[1, 4], logit_bias={4: 2.0}), [], V, [0])
    out = edit(smp, z, [s])[0]
    assert torch.isinf(out[[0, 2, 3, 5]]).all() and out[1] == 0 and out[4] == 2.0
    # bad words: the sequence [2, 3] bans 3 only right after 2 in the generated suffix; [5] always
    s = SamplingState(SamplingParams(), [2], V, [0], bad_words_ids=[[2, 3], [5]])
    assert torch.isinf(edit(smp, z, [s])[0]).tolist() == [False] * 5 + [True]
    s.append(2)
    assert torch.isinf(edit(smp, z, [s])[0]).tolist() == [False, False, False, True, False, True]
    # no_repeat_ngram over prompt + output: prompt has (1, 2); after generating 1, 2 is banned
    s = SamplingState(SamplingParams(no_repeat_ngram_size=2), [1, 2, 4], V, [0])
    s.append(1)
    assert torch.isinf(edit(smp, z, [s])[0]).nonzero().flatten().tolist() == [2]
    # min_tokens suppresses EOS and stop_token_ids until reached
    s = SamplingState(SamplingParams(min_tokens=1, stop_token_ids=[3]), [], V, [0])
    assert torch.isinf(edit(smp, z, [s])[0]).nonzero().flatten().tolist() == [0, 3]
    s.append(1)
    assert not torch.isinf(edit(smp, z, [s])[0]).any()


def test_dead_end_when_nothing_legal():
    s = SamplingState(SamplingParams(allowed_token_ids=[2], min_tokens=3), [], 4, [2])
    r = Sampler(4).sample(torch.zeros(1, 4), [s])[0]
    assert r.token_id == 2 and s.dead_end


# ---------------------------------------------------------------- logprobs
def test_logprobs_raw_and_processed():
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    raw = torch.log_softmax(z[0], -1)
    s = SamplingState(SamplingParams(top_k=2, logprobs=2, seed=0), [], 4, [])
    r = Sampler(4).sample(z, [s])[0]
    assert r.logprob == pytest.approx(float(raw[r.token_id]))
    assert [t for t, _ in r.top_logprobs] == [0, 1]
    assert s.cumulative_logprob == pytest.approx(float(raw[r.token_id]))
    s = SamplingState(SamplingParams(top_k=2, logprobs=0, logprobs_mode="processed", seed=0), [], 4, [])
    r = Sampler(4).sample(z, [s])[0]
    want = math.log(ref_top_k(ref_softmax([2.0, 1.0, 0.0, -1.0]), 2)[r.token_id])
    assert r.logprob == pytest.approx(want, abs=1e-6) and r.top_logprobs == []
    s = SamplingState(SamplingParams(), [], 4, [])
    r = Sampler(4).sample(z, [s])[0]
    assert r.logprob is None and r.top_logprobs is None


def test_prompt_logprobs():
    z = torch.randn(3, 5)
    out = Sampler(5).prompt_logprobs(z, [4, 1, 3], 2)
    assert out[0] is None
    lsm = torch.log_softmax(z, -1)
    assert out[1].token_id == 1 and out[1].logprob == pytest.approx(float(lsm[0, 1]))
    assert out[2].logprob == pytest.approx(float(lsm[1, 3]))
    assert [t for t, _ in out[1].top_logprobs] == torch.argsort(-lsm[0], stable=True)[:2].tolist()


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
        (dict(top_k=100), "top_k"), (dict(min_p=1.5), "min_p"), (dict(typical_p=0.0), "typical_p"),
        (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"), (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=1e5), "repetition_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"), (dict(presence_penalty=-3.0), "presence_penalty"),
        (dict(logit_bias={99: 1.0}), "logit_bias"), (dict(logit_bias={1: 200.0}), "logit_bias"),
        (dict(stop_token_ids=[99]), "stop_token_ids"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(logprobs=21), "logprobs"), (dict(logprobs_mode="weird"), "logprobs_mode"),
        (dict(stop=[""]), "stop"), (dict(seed=-1), "seed"), (dict(bad_words=[""]), "bad_words"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
        (dict(guided=GuidedSpec(regex="a", grammar="root ::= 'a'")), "guided"),
    ],
)
def test_invalid_params_name_field(kw, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams(**kw).validate(vocab_size=50)


# ---------------------------------------------------------------- candidate reduction == full sort
class FullSortSampler(Sampler):
    @staticmethod
    def candidate_sizes(V):
        return [V]


@pytest.mark.parametrize("shape", ["peaked", "flat"])
@pytest.mark.parametrize(
    "cfg",
    [dict(top_p=0.9), dict(min_p=0.05), dict(top_p=0.8, typical_p=0.9, temperature=1.5),
     dict(top_k=3000, top_p=0.95), dict(typical_p=0.9), dict(min_p=0.01, top_p=0.99, temperature=2.0)],
    ids=str,
)
def test_candidate_reduction_draws_equal_full_sort(shape, cfg):
    V, N = 5000, 200
    g = torch.Generator().manual_seed(11)
    row = torch.randn(V, generator=g) * (6.0 if shape == "peaked" else 0.5)
    logits = row.expand(N, V)
    mk = lambda: [SamplingState(SamplingParams(seed=i, **cfg), [], V, []) for i in range(N)]  # noqa: E731
    fast = [r.token_id for r in Sampler(V).sample(logits, mk())]
    slow = [r.token_id for r in FullSortSampler(V).sample(logits, mk())]
    assert fast == slow
    want = support(ref_pipeline(row.tolist(), cfg.get("temperature", 1.0),
                                **{k: v for k, v in cfg.items() if k != "temperature"}))
    assert set(fast) <= want
    # and a row's draw does not depend on whether batch mates forced a larger candidate set
    alone = Sampler(V).sample(logits[:1], mk()[:1])[0].token_id
    assert alone == fast[0]
