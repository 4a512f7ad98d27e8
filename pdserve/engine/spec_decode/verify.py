"""Verification of speculative candidates against the target model's logits, exact for every sampling setting.

The target forwarded [x, d_1 .. d_k] (x: the last committed token) in one pass over the paged KV, so row j of
its logits is the distribution of the token after d_j (row 0: after x). Position by position, with the request's
sampling state advanced by the tokens accepted so far (penalties, bad words, min_tokens, logprobs: the whole
§3 pipeline applies per position):

* point-mass proposals (the n-gram proposer; a draft model at T = 0): draw y from the target's processed
  distribution p_j with the ordinary sampler; accept while y == d_j. P(accept) = p_j(d_j), and a rejected draw is
  distributed as p_j restricted to y != d_j = norm(max(0, p_j - q_j)) for q_j the point mass at d_j: the
  rejection sampling of Leviathan et al. / Chen et al. exactly. At T = 0 this is greedy equality.
* dense proposals (a draft model at T > 0, d_j ~ q_j): accept with probability min(1, p_j(d_j) / q_j(d_j)),
  else draw from norm(max(0, p_j - q_j)).

After k accepted candidates the last row gives a bonus token, drawn as usual. Every committed token goes through
`EngineCore.commit` one at a time, so EOS, stop strings and max_tokens end the sequence mid-run and the tokens
after the stop are never committed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdserve.engine import logits_processors as lp
from pdserve.engine.outputs import SampleResult
from pdserve.engine.sampler import Sampler, _active, draw_uniform
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sampling_state import SamplingState


def filtered_probs(z: Tensor, params: SamplingParams, filter_order: tuple[str, ...]) -> Tensor | None:
    """The float64 distribution the sampler draws from for processed logits z [V] (temperature, then the
    truncation filters in `filter_order`, renormalised): the full-sort pass of `Sampler._filtered_pass`.
    T = 0: the point mass at the greedy token. None when no token is legal (a dead end)."""
    V = z.shape[0]
    if torch.isneginf(z).all():
        return None
    if params.temperature == 0.0:
        p = torch.zeros(V, dtype=torch.float64)
        p[int(z.argmax())] = 1.0
        return p
    vals, ids = lp.sort_desc(z.float().unsqueeze(0))
    v64 = vals.double()
    w = ((v64 - v64[:, :1]) / params.temperature).exp()
    keep = torch.isfinite(vals)
    active = _active(params, V)
    for name in filter_order:
        if not active[name]:
            continue
        if name == "top_k":
            keep = lp.top_k_keep(w, keep, torch.tensor([params.top_k]))
        elif name == "top_p":
            keep = lp.top_p_keep(w, keep, torch.tensor([params.top_p], dtype=torch.float64))
        elif name == "min_p":
            keep = lp.min_p_keep(w, keep, torch.tensor([params.min_p], dtype=torch.float64))
        else:
            keep = lp.typical_keep(w, keep, torch.tensor([params.typical_p], dtype=torch.float64))
    w = (w * keep)[0]
    p = torch.zeros(V, dtype=torch.float64)
    p[ids[0]] = w / w.sum()
    return p


def _record(state: SamplingState, raw: Tensor, tid: int, p: Tensor) -> SampleResult:
    """What `Sampler.sample` does after choosing a token: logprobs, cumulative raw log-prob, state append."""
    raw_lp = torch.log_softmax(raw.float(), -1)
    n = state.params.logprobs
    chosen, top = None, None
    if n is not None:
        row = p.log().float() if state.params.logprobs_mode == "processed" else raw_lp
        chosen = float(row[tid])
        top = Sampler._top(row, n)
    state.cumulative_logprob += float(raw_lp[tid])
    state.append(tid)
    return SampleResult(tid, chosen, top)


def _draw(p: Tensor, state: SamplingState) -> int:
    """One token from p [V] float64 with the row's generator (a float64 uniform through the cumulative sum)."""
    cdf = p.cumsum(-1)
    u = draw_uniform(state)
    return int(torch.searchsorted(cdf, (u * cdf[-1]).unsqueeze(0), right=True).clamp_(max=p.shape[0] - 1))


def _plain_greedy(state: SamplingState) -> bool:
    """T = 0 with nothing that edits logits or asks for logprobs: each row's token is its argmax (lowest id on
    ties, as torch.argmax and the sampler's greedy branch), whatever the tokens before it."""
    return state.params.temperature == 0.0 and not state.needs_logit_edit and state.params.logprobs is None


def verify(sampler: Sampler, state: SamplingState, logits: Tensor, drafts: list[int],
           draft_probs: list[Tensor] | None, commit) -> tuple[int, int, list[SampleResult]]:
    """Walk the k + 1 rows of `logits` (row j: after d_j). `commit(token) -> finish reason | None` appends one
    token to the sequence. Returns (candidates accepted, tokens committed, their sample results)."""
    results: list[SampleResult] = []
    accepted = 0
    if draft_probs is None and _plain_greedy(state):  # the common case in one pass: argmax of every row
        raw = logits.float()
        best = raw.argmax(-1).tolist()
        lse = torch.logsumexp(raw, -1)
        for j, tid in enumerate(best):
            state.cumulative_logprob += float(raw[j, tid] - lse[j])
            state.append(tid)
            res = SampleResult(tid, None, None)
            results.append(res)
            ok = j < len(drafts) and tid == drafts[j]
            accepted += ok
            if commit(tid) is not None or not ok:
                break
        return accepted, len(results), results
    for j in range(len(drafts) + 1):
        row = logits[j:j + 1]
        bonus = j == len(drafts)
        if bonus or draft_probs is None:
            res = sampler.sample(row, [state])[0]
            ok = not bonus and res.token_id == drafts[j] and not state.dead_end
        else:
            z = sampler.process_logits(row.float(), [state])[0]
            p = filtered_probs(z, state.params, sampler.filter_order)
            if p is None:  # no legal token: the sampler's dead-end handling
                res, ok = sampler.sample(row, [state])[0], False
            else:
                d, q = drafts[j], draft_probs[j]
                ok = bool(draw_uniform(state) * q[d] < p[d])  # P = min(1, p(d) / q(d)); q(d) > 0 as d ~ q
                if ok:
                    tid = d
                else:
                    resid = (p - q).clamp_(min=0.0)
                    tid = _draw(resid if resid.sum() > 0 else p, state)
                res = _record(state, row[0], tid, p)
        results.append(res)
        accepted += ok
        if commit(res.token_id) is not None or not ok:
            break
    return accepted, len(results), results
