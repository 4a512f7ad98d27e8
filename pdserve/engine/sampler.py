"""Batched sampler: logits [B, V] -> one token per sequence.

Pipeline per row (spec §3.1):
  1. hard constraints / logit_bias: logit_bias is added, then illegal tokens are set to -inf
     (grammar bitmask, allowed_token_ids, bad words matched on the generated suffix,
     no_repeat_ngram, min_tokens suppression of EOS / stop_token_ids);
  2. penalties: sign-aware repetition (prompt + output), then frequency / presence (output only);
  3. temperature: T = 0 is its own greedy branch (argmax, lowest token id on ties; truncation
     filters do not apply); T > 0 divides the logits;
  4. truncation filters in `filter_order` (default top_k -> top_p -> min_p -> typical_p), each
     renormalising over the support left by the previous one;
  5. renormalise and draw with the row's own generator: one float64 uniform per row, inverted
     through the float64 cumulative sum of the kept probabilities.

Logprobs (`params.logprobs`): "raw" = log_softmax of the model's logits as passed in;
"processed" = log of the distribution actually sampled from (after the whole pipeline; -inf
outside the support; for greedy rows, log_softmax of the constrained/penalised logits).
`SamplingState.cumulative_logprob` always sums *raw* log-probs (best_of ranks by model likelihood).

Dead ends: if a row has no legal token left (e.g. allowed_token_ids disjoint from the grammar,
or min_tokens banning the only token the grammar allows), the sampler returns the first EOS id
(0 if none), does not feed it to the grammar, and sets `state.dead_end`; the output processor
then finishes the request with "stop" without emitting that token's text.

Device: the pipeline runs where the logits are (CPU or an accelerator) and never reads a value back per row:
per-row parameters go to the device in batched non-blocking copies, each request's generator lives on that
device (SamplingState(device=...)), dead ends and greedy/sampled rows are resolved with tensor selects, and
`finish` reads the step's tokens, dead-end flags and requested log-probs back in one copy (engine/host_copy.py).
The one host decision left is the candidate-set escalation of truncated rows (`_sample_filtered`): it is taken on
CPU only, where reading the `fits` flags is a memory read; elsewhere truncated rows take one full-sort pass, which
keeps the same support and the same draw (tests/engine/test_sampler.py checks the two agree).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.engine import logits_processors as lp
from pdserve.engine.host_copy import read_back, to_device
from pdserve.engine.outputs import SampleResult  # noqa: F401 (re-export: the sampler returns these)
from pdserve.engine.sampling_state import SamplingState, bad_words_to_ids, select_best  # noqa: F401 (re-export)

DEFAULT_FILTER_ORDER = ("top_k", "top_p", "min_p", "typical_p")
_NEG_INF = float("-inf")


def _active(p, V: int) -> dict[str, bool]:
    return {
        "top_k": 0 < p.top_k < V,
        "top_p": p.top_p < 1.0,
        "min_p": p.min_p > 0.0,
        "typical_p": p.typical_p < 1.0,
    }


def draw_uniform(state: SamplingState) -> Tensor:
    """One float64 uniform from the state's own generator, on the generator's device."""
    g = state.generator
    return torch.rand((), generator=g, dtype=torch.float64, device=g.device)


@dataclass
class DeviceSample:
    """A step's result before it leaves the device: everything `Sampler.finish` reads back in one copy."""
    tokens: Tensor  # [B] long: the sampled ids (dead rows: their dead-end token)
    dead: Tensor  # [B] bool: no legal token was left
    raw_chosen: Tensor  # [B] float32: raw log-prob of the sampled token
    lp_rows: list[int]  # rows that asked for logprobs (host data)
    chosen_lp: Tensor  # [len(lp_rows)] float32: the sampled token's log-prob in the row's logprobs_mode
    top_vals: Tensor  # [len(lp_rows), n_max] float32, sorted by (-logprob, id)
    top_ids: Tensor  # [len(lp_rows), n_max] long


class Sampler:
    def __init__(self, vocab_size: int, filter_order: tuple[str, ...] = DEFAULT_FILTER_ORDER,
                 row_by_row: bool = False):
        """row_by_row (deterministic mode): each row sampled as a batch of its own, so its reductions over the
        vocabulary never depend on the batch's size or mix of sampling kinds."""
        if sorted(filter_order) != sorted(lp.FILTERS):
            raise ValueError(f"filter_order must be a permutation of {lp.FILTERS}, got {filter_order}")
        self.vocab_size = vocab_size
        self.filter_order = tuple(filter_order)
        self.native_ops = None  # compiled CPU kernels (engine/kernels.py): fused argmax + logsumexp
        self.row_by_row = row_by_row

    # ------------------------------------------------------------------------------------------
    def sample(self, logits: Tensor, states: list[SamplingState]) -> list[SampleResult]:
        if self.row_by_row and len(states) > 1:
            return [r for i, s in enumerate(states) for r in self.sample(logits[i:i + 1], [s])]
        return self.finish(self.sample_on_device(logits, states), states)

    def sample_on_device(self, logits: Tensor, states: list[SamplingState]) -> DeviceSample:
        """The pipeline, on the logits' device; reads nothing back (see the module doc)."""
        B, V = logits.shape
        assert len(states) == B, "one SamplingState per logits row"
        dev = logits.device
        raw = logits.float()
        native = self.native_ops is not None and dev.type == "cpu" and raw.is_contiguous()
        argmax = lse = None
        if native:  # one pass gives the greedy token and the normaliser of the raw log-probs
            argmax, lse = self.native_ops.argmax_logsumexp(raw)
        z = self.process_logits(raw, states)
        # A row can only be all -inf after constraints masked it; unedited model logits never are. Such a row is
        # sampled as zeros (no NaN in the pipeline) and its token replaced below; the request ends there.
        if z is not raw:
            dead = torch.isneginf(z).all(-1)
            z.masked_fill_(dead.unsqueeze(-1), 0.0)
        else:
            dead = torch.zeros(B, dtype=torch.bool, device=dev)
        tokens = torch.zeros(B, dtype=torch.long, device=dev)
        proc_rows: dict[int, Tensor] = {}  # processed log-probs, only for rows that asked for them
        want_proc = [s.params.logprobs is not None and s.params.logprobs_mode == "processed" for s in states]

        greedy, direct, filtered = [], [], []
        for i, s in enumerate(states):
            if s.params.temperature == 0.0:
                greedy.append(i)
            elif any(_active(s.params, V).values()):
                filtered.append(i)
            else:
                direct.append(i)
        if greedy:
            # the common all-greedy batch takes the kernel's argmax (both return the first maximal index)
            tokens = self._greedy(z, greedy, tokens, argmax if z is raw else None, proc_rows, want_proc)
        if direct:
            self._sample_direct(z, direct, states, tokens, proc_rows, want_proc)
        if filtered:
            self._sample_filtered(z, filtered, states, tokens, proc_rows, want_proc)
        if z is not raw:
            dead_tok = to_device([s.eos_token_ids[0] if s.eos_token_ids else 0 for s in states], dev, torch.long)
            tokens = torch.where(dead, dead_tok, tokens)

        if lse is None:
            lse = torch.logsumexp(raw, dim=-1)
        raw_chosen = raw.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
        return self._logprob_rows(raw, tokens, dead, raw_chosen, states, proc_rows, want_proc)

    @staticmethod
    def _greedy(z, greedy, tokens, argmax, proc_rows, want_proc) -> Tensor:
        if len(greedy) == z.shape[0]:  # all greedy: no row gather (a copy of every logit)
            tokens = argmax.clone() if argmax is not None else z.argmax(-1)
        else:
            g = to_device(greedy, z.device, torch.long)
            tokens[g] = z[g].argmax(-1)
        for i in greedy:
            if want_proc[i]:
                proc_rows[i] = torch.log_softmax(z[i], -1)
        return tokens

    @staticmethod
    def _logprob_rows(raw, tokens, dead, raw_chosen, states, proc_rows, want_proc) -> DeviceSample:
        """The chosen token's and the top-n log-probs of the rows that asked, raw or processed."""
        dev = raw.device
        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        n_max = max([states[i].params.logprobs for i in lp_rows], default=0)
        if not lp_rows:
            empty = torch.zeros((0, 0), dtype=torch.long, device=dev)
            return DeviceSample(tokens, dead, raw_chosen, lp_rows, raw_chosen[:0], raw[:0, :0], empty)
        rows = []
        for i in lp_rows:
            if want_proc[i]:  # a dead row sampled from nothing: its processed distribution is all -inf
                rows.append(proc_rows[i].masked_fill(dead[i], _NEG_INF))
            else:
                rows.append(torch.log_softmax(raw[i], -1))
        lpm = torch.stack(rows)
        chosen = lpm.gather(-1, tokens[to_device(lp_rows, dev, torch.long)].unsqueeze(-1)).squeeze(-1)
        if n_max > 0:
            top_vals, top_ids = lp.topk_exact(lpm, n_max)
        else:
            top_vals, top_ids = lpm[:, :0], torch.zeros((len(lp_rows), 0), dtype=torch.long, device=dev)
        return DeviceSample(tokens, dead, raw_chosen, lp_rows, chosen, top_vals, top_ids)

    def finish(self, d: DeviceSample, states: list[SamplingState]) -> list[SampleResult]:
        """Read the step back (one copy) and update each request's state."""
        B, R, n_max = len(states), len(d.lp_rows), d.top_ids.shape[-1]
        flat = read_back([d.tokens, d.dead, d.raw_chosen, d.chosen_lp, d.top_vals, d.top_ids])
        tokens, dead, raw_chosen = flat[:B], flat[B:2 * B], flat[2 * B:3 * B]
        o = 3 * B
        chosen, o = flat[o:o + R], o + R
        top_vals, o = flat[o:o + R * n_max], o + R * n_max
        top_ids = flat[o:o + R * n_max]
        lp_index = {i: j for j, i in enumerate(d.lp_rows)}
        results: list[SampleResult] = []
        for i, s in enumerate(states):
            tid, is_dead = int(tokens[i]), dead[i] != 0.0
            if is_dead:
                s.dead_end = True
            n = s.params.logprobs
            chosen_lp, top = None, None
            if n is not None:
                j = lp_index[i]
                chosen_lp = chosen[j] if not is_dead else _NEG_INF
                base = j * n_max
                top = [(int(top_ids[base + c]), top_vals[base + c]) for c in range(n)]
            s.cumulative_logprob += raw_chosen[i] if not is_dead else _NEG_INF
            s.append(tid)
            results.append(SampleResult(tid, chosen_lp, top))
        return results

    # ------------------------------------------------------------------------------------------
    def process_logits(self, raw: Tensor, states: list[SamplingState]) -> Tensor:
        """Steps 1-2 of the pipeline (constraints, bias, penalties). Returns a new tensor when
        anything applies, else `raw` itself (never modified). Runs on raw's device: the per-row ids and values
        (host data of the states) go over in one batched copy per kind."""
        if not any(s.needs_logit_edit for s in states):
            return raw
        z = raw.clone()
        B, V = z.shape
        dev = z.device
        rows, toks, vals = [], [], []
        for i, s in enumerate(states):
            if s.bias_ids.numel():
                rows.append(torch.full_like(s.bias_ids, i)), toks.append(s.bias_ids), vals.append(s.bias_vals)
        if rows:
            r, t = to_device(torch.cat(rows), dev), to_device(torch.cat(toks), dev)
            z[r, t] += to_device(torch.cat(vals), dev)  # ids are distinct per row (dict keys)

        # hard constraints -> -inf
        ban_rows, ban_toks = [], []
        for i, s in enumerate(states):
            b = s.banned_tokens()
            ban_rows += [i] * len(b)
            ban_toks += b
            if s.allowed_mask is not None:
                z[i].masked_fill_(~s.allowed_mask_on(dev)[:V], _NEG_INF)
        if ban_toks:
            z[to_device(ban_rows, dev, torch.long), to_device(ban_toks, dev, torch.long)] = _NEG_INF
        gram = [i for i, s in enumerate(states) if s.grammar is not None and not s.grammar_terminated]
        if gram:
            import xgrammar as xgr  # loaded on the first constrained step, not at start-up (~1 s of imports)

            bitmask = xgr.allocate_token_bitmask(B, V)  # filled on the host: the matchers are host objects
            for i in gram:
                states[i].grammar.fill_bitmask(bitmask, i)
            xgr.apply_token_bitmask_inplace(z, to_device(bitmask, dev), indices=gram)

        # penalties (masked tokens stay -inf: r * -inf = -inf, -inf - c = -inf)
        rows, toks, rs = [], [], []
        for i, s in enumerate(states):
            if s.rep_counts is not None and s.rep_counts.n:
                ids = s.rep_counts.ids()
                rows.append(torch.full_like(ids, i)), toks.append(ids)
                rs.append(torch.full((len(ids),), s.params.repetition_penalty))
        if rows:
            r, t, pen = (to_device(torch.cat(x), dev) for x in (rows, toks, rs))
            v = z[r, t]
            z[r, t] = torch.where(v > 0, v / pen, v * pen)  # sign-aware: always towards less likely
        rows, toks, sub = [], [], []
        for i, s in enumerate(states):
            if s.out_counts is not None and s.out_counts.n:
                ids, cnt = s.out_counts.ids(), s.out_counts.counts()
                rows.append(torch.full_like(ids, i)), toks.append(ids)
                sub.append(s.params.frequency_penalty * cnt + s.params.presence_penalty * (cnt > 0).float())
        if rows:
            r, t, c = (to_device(torch.cat(x), dev) for x in (rows, toks, sub))
            z[r, t] -= c
        return z

    # ------------------------------------------------------------------------------------------
    def _uniforms(self, states: list[SamplingState], rows: list[int], device: torch.device) -> Tensor:
        """One draw per row from that row's own generator: the draw never depends on batch mates. The draws are
        made on each generator's device (the logits' device for an engine's states) and stacked there."""
        us = [draw_uniform(states[i]) for i in rows]
        if all(u.device == device for u in us):
            return torch.stack(us)
        return to_device(torch.stack([u.cpu() for u in us]), device)  # host generators (tests, mixed callers)

    @staticmethod
    def skip_draw(state: SamplingState) -> None:
        """Consume the draw of a token sampled elsewhere (the prefill worker's first token), so a seeded request
        continues with the same random stream disaggregated as colocated. Greedy rows draw nothing."""
        if state.params.temperature > 0:
            draw_uniform(state)

    def _sample_direct(self, z, rows, states, tokens, dense_proc, want_proc) -> None:
        """Rows with temperature only: sample from the full softmax(z / T)."""
        dev = z.device
        idx = to_device(rows, dev, torch.long)
        zr = z[idx]
        T = to_device([states[i].params.temperature for i in rows], dev, torch.float32).unsqueeze(-1)
        scaled = (zr - zr.max(-1, keepdim=True).values) / T
        cdf = scaled.exp().double().cumsum(-1)
        u = self._uniforms(states, rows, dev).unsqueeze(-1)
        pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=zr.shape[1] - 1)
        tokens[idx] = pick.squeeze(-1)
        for j, i in enumerate(rows):
            if want_proc[i]:
                dense_proc[i] = (scaled[j].double() - cdf[j, -1].log()).float()

    def _sample_filtered(self, z, rows, states, tokens, dense_proc, want_proc) -> None:
        """Rows with at least one truncation filter. Sorting the whole vocabulary is the expensive
        part on CPU, so there we first try a candidate set (the K best tokens by (-logit, id), found with topk)
        and only escalate to a larger K / a full sort for rows whose filtered support provably
        might reach outside it. The kept set, and therefore the draw, is the same either way. Deciding which
        rows escalate reads flags back, so on other devices every row takes the full-sort pass at once."""
        V = z.shape[1]
        pending = list(rows)
        for K in (self.candidate_sizes(V) if z.device.type == "cpu" else [V]):
            if pending:
                pending = self._filtered_pass(z, pending, K, states, tokens, dense_proc, want_proc)
        assert not pending

    @staticmethod
    def candidate_sizes(V: int) -> list[int]:
        return [k for k in (1024, 16384) if k < V // 2] + [V]

    def _filtered_pass(self, z, rows, K, states, tokens, dense_proc, want_proc) -> list[int]:
        """Sample the rows whose support fits in the K best tokens; return the others."""
        V = z.shape[1]
        dev = z.device
        params = [states[i].params for i in rows]
        active = [_active(p, V) for p in params]
        full = K >= V
        if not full:
            later = self._not_reducible(rows, params, active, K)
            if later:
                rows = [i for i in rows if i not in later]
                if not rows:
                    return later
                return self._filtered_pass(z, rows, K, states, tokens, dense_proc, want_proc) + later
            K = max(K, max([p.top_k for p, a in zip(params, active) if a["top_k"]], default=0))
        idx = to_device(rows, dev, torch.long)
        zr = z[idx]
        vals, ids = lp.sort_desc(zr) if full else lp.topk_exact(zr, K)
        T = to_device([p.temperature for p in params], dev, torch.float64).unsqueeze(-1)
        v64 = vals.double()
        w = ((v64 - v64[:, :1]) / T).exp()  # weights relative to the row max (first column)
        outside = self._outside_weight(zr, w, T, active, full)
        keep, fits = self._apply_filters(w, torch.isfinite(vals), outside, params, active, full)
        w = w * keep
        cdf = w.cumsum(-1)
        # full pass: every row fits, nothing to read; candidate pass (CPU only): the flags are host memory
        done = list(range(len(rows))) if full else [j for j, f in enumerate(fits.tolist()) if f]
        if done:
            self._draw(states, rows, done, idx, cdf, ids, tokens)
        for j in done:
            i = rows[j]
            if want_proc[i]:
                row = torch.full((V,), _NEG_INF, dtype=torch.float32, device=dev)
                row[ids[j]] = (w[j] / cdf[j, -1]).log().float()
                dense_proc[i] = row
        done_set = set(done)
        return [rows[j] for j in range(len(rows)) if j not in done_set]

    def _not_reducible(self, rows, params, active, K) -> list[int]:
        """Rows whose support the K best tokens cannot bound. Reduction is exact only if the first active filter
        bounds the support by a rule on sorted position (top_k <= K, top_p / min_p verified after filtering);
        typical_p first is not."""
        first = [next(f for f in self.filter_order if a[f]) for a in active]
        return [i for i, f, p in zip(rows, first, params) if f == "typical_p" or (f == "top_k" and p.top_k > K)]

    def _outside_weight(self, zr, w, T, active, full):
        """Weight of supported tokens outside the candidates, until a filter provably removes them (0 when every
        row's first filter is top_k, or all tokens are candidates)."""
        outside = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        if not full and not all(a["top_k"] and self.filter_order.index("top_k") == min(
                self.filter_order.index(f) for f in a if a[f]) for a in active):
            allw = ((zr - zr.max(-1, keepdim=True).values) / T.float()).exp().sum(-1, dtype=torch.float64)
            outside = (allw - w.sum(-1)).clamp_(min=0.0)
        return outside

    def _apply_filters(self, w, keep, outside, params, active, full):
        """The filters in the spec's order over the candidate weights: (keep mask, rows whose boundary provably
        lies inside the candidates)."""
        dev, W = w.device, w.shape[1]
        fits = torch.ones(w.shape[0], dtype=torch.bool, device=dev)
        for name in self.filter_order:
            on = [a[name] for a in active]
            if not any(on):
                continue
            on_t = to_device(on, dev, torch.bool)
            if name == "top_k":
                k = to_device([p.top_k if a else W for p, a in zip(params, on)], dev, torch.long)
                keep = lp.top_k_keep(w, keep, k)
            elif name == "top_p":
                pp = to_device([p.top_p for p in params], dev, torch.float64)
                before = keep
                keep = lp.top_p_keep(w, keep, pp, outside)
                if not full:  # the boundary must be reached inside the candidates
                    mass = (w * before).sum(-1)
                    fits &= ~on_t | (outside == 0) | (mass >= (pp - lp.MASS_EPS) * (mass + outside))
            elif name == "min_p":
                alpha = to_device([p.min_p for p in params], dev, torch.float64)
                keep = lp.min_p_keep(w, keep, alpha)
                if not full:  # every token outside weighs <= the last candidate, which must fail
                    fits &= ~on_t | (outside == 0) | (w[:, -1] < alpha * w[:, 0])
            else:
                keep = lp.typical_keep(w, keep, to_device([p.typical_p for p in params], dev, torch.float64))
            outside = torch.where(on_t, torch.zeros_like(outside), outside)
        return keep, fits

    def _draw(self, states, rows, done, idx, cdf, ids, tokens) -> None:
        """Inverse-CDF draw for the rows `done` (positions in `rows`) from each one's own generator."""
        all_done = len(done) == len(rows)
        d = None if all_done else to_device(done, cdf.device, torch.long)
        cdf_d, ids_d = (cdf, ids) if all_done else (cdf[d], ids[d])
        u = self._uniforms(states, [rows[j] for j in done], cdf.device).unsqueeze(-1)
        pick = torch.searchsorted(cdf_d, u * cdf_d[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)
        tokens[idx if all_done else idx[d]] = ids_d.gather(-1, pick).squeeze(-1)

    @staticmethod
    def _top(row: Tensor, n: int) -> list[tuple[int, float]]:
        """Top-n (id, log-prob) of one row, read to the host (speculative verification's records)."""
        if n <= 0:
            return []
        vals, ids = lp.topk_exact(row.unsqueeze(0), n)
        return list(zip(ids[0].tolist(), vals[0].tolist()))

    # ------------------------------------------------------------------------------------------
    def prompt_logprobs(self, logits: Tensor, prompt_token_ids: list[int], k: int) -> list[SampleResult | None]:
        """Raw log-probs of each prompt token given its prefix. `logits[j]` is the model output at
        prompt position j (it predicts token j+1); P may be len(prompt) or len(prompt) - 1.
        Entry 0 is None (the first token has no prefix)."""
        n = len(prompt_token_ids)
        out: list[SampleResult | None] = [None]
        if n < 2:
            return out[:n]
        lsm = torch.log_softmax(logits[: n - 1].float(), dim=-1)
        target = to_device(prompt_token_ids[1:], lsm.device, torch.long)
        chosen = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1).tolist()
        if k > 0:
            vals, ids = lp.topk_exact(lsm, k)
            vals, ids = vals.tolist(), ids.tolist()
        for j in range(n - 1):
            top = list(zip(ids[j], vals[j])) if k > 0 else []
            out.append(SampleResult(prompt_token_ids[j + 1], chosen[j], top))
        return out
