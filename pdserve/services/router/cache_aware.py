"""`cache-aware` placement (the router's default; policy_registry.py): minimise predicted completion time
(cost.py) using the prefix index and measured load. `place` is candidates -> scores -> pick:

- candidates (candidates.py): local workers and (prefill, decode) pairs the mode allows, after `exclude`;
- scores (`_score`): each candidate's predicted completion time, with its prefix hit by tier, plus the spread
  terms;
- pick (`_kind`, `_pick`): local or disaggregated, then one near-equal candidate of that kind at random.

`auto` disaggregates only when the best pair beats the best local candidate by more than `disagg_margin_s`
(the pair's cost already contains the KV transfer and the hand-off overhead). `disagg` always disaggregates
while both pools are up; `colocated` uses `both` workers only. Within the chosen kind, every candidate within
`tie_rel`/`tie_abs_s` of the best is near-equal and one is picked at random: identical scores never break the
same way, so equal workers share a burst instead of one taking it all.

A prefill pool that is down (decode workers alive, no prefill worker) or whose workers all failed this request
degrades to local prefill on a decode worker - counted in pdserve_route_degraded_total and logged, never
silent.

Next to the predicted completion time each candidate pays the failure-domain, price and fairness terms of
spread.py (weights `--weights`; all in seconds), and `x-pdserve-route` shows them.

Reports lag a burst (heartbeats about once a second): the router adds what it placed on a worker since that
worker's last report (`Inflight`) to the reported load.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from pdserve.services.metrics import router as M
from pdserve.services.registry import WorkerRecord
from pdserve.services.router.candidates import Candidates, candidates
from pdserve.services.router.cost import CostModel, CostParams, Estimate, Inflight, WorkerCost, peer_priors
from pdserve.services.router.placement import NoWorkers, Placement, RouteInput  # noqa: F401 (NoWorkers: what place raises)
from pdserve.services.router.prefix_index import PrefixIndex, TierHit, chain_hashes
from pdserve.services.router.spread import RouteWeights, Spread, Terms, zone_of

log = logging.getLogger("pdserve.router")

MODES = ("auto", "disagg", "colocated")


@dataclass
class Scored:
    local: list[Estimate]
    pairs: list[Estimate]
    terms: dict[int, Terms]  # id(estimate) -> its spread terms; empty when no term is weighted
    keys: list[tuple]  # the request's spread keys (spread.py), recorded against the chosen worker
    device: dict[str, int]  # worker id -> its device-tier hit in tokens (a decode worker's side of a pair)
    stalled: float = float("inf")  # the best local cost the stall cap dropped (cost.stalls_streams); inf: none


class Policy:
    def __init__(self, mode: str = "auto", index: PrefixIndex | None = None, params: CostParams | None = None,
                 rng: random.Random | None = None, clock=time.time, inflight_ttl_s: float = 3.0,
                 weights: RouteWeights | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        self.index = index
        self.cost = CostModel(params)
        self.rng = rng or random.Random()
        self.clock = clock
        self.inflight_ttl_s = inflight_ttl_s
        self.spread = Spread(weights or RouteWeights(), clock)
        # worker id -> [(time placed, prefill tokens, seqs, blocks)] not yet covered by a load report
        self._placed: dict[str, list[tuple[float, int, int, int]]] = {}
        self._last_degraded_log = 0.0

    # ---- load bookkeeping -------------------------------------------------------------------------------------
    def _inflight(self, rec: WorkerRecord) -> Inflight:
        seen = rec.load.report_time or rec.updated or 0.0
        now = self.clock()
        keep = [x for x in self._placed.get(rec.worker_id, []) if x[0] > seen and now - x[0] < self.inflight_ttl_s]
        self._placed[rec.worker_id] = keep
        return Inflight(sum(x[1] for x in keep), sum(x[2] for x in keep), sum(x[3] for x in keep))

    def _note(self, worker_id: str, prefill_tokens: int, seqs: int, blocks: int) -> None:
        self._placed.setdefault(worker_id, []).append((self.clock(), prefill_tokens, seqs, blocks))

    # ---- prefix lookup ----------------------------------------------------------------------------------------
    def cached_tokens(self, req: RouteInput, workers: list[WorkerRecord]) -> dict[str, int]:
        """Per worker, predicted prefix-cache hit in tokens, any tier (0 without the index or the token ids)."""
        bs = {w.worker_id: w.layout.block_size or 16 for w in workers}
        return {wid: hit.blocks * bs[wid] for wid, hit in self.prefix_hits(req, workers).items()}

    def prefix_hits(self, req: RouteInput, workers: list[WorkerRecord]) -> dict[str, TierHit]:
        """Per worker, its predicted prefix-cache hit in blocks by tier (device / host / disk)."""
        out = {w.worker_id: TierHit() for w in workers}
        if self.index is None or not req.prompt_token_ids:
            return out
        groups: dict[tuple[str, int], list[str]] = {}
        for w in workers:
            groups.setdefault((w.layout.fingerprint, w.layout.block_size or 16), []).append(w.worker_id)
        for (fp, bs), ids in groups.items():
            hashes = chain_hashes(req.prompt_token_ids, bs, fp, req.namespace)
            out.update(self.index.match_tiers(hashes, req.namespace, ids))
        return out

    # ---- the decision: candidates -> scores -> pick ------------------------------------------------------------
    def place(self, workers: list[WorkerRecord], exclude: set[str] = frozenset(), prefer: str = "",
              req: RouteInput | None = None) -> Placement:
        req = req or RouteInput(exclude=set(exclude), prefer=prefer)
        excl = set(req.exclude) | set(exclude)
        live = [w for w in workers if w.worker_id not in excl]
        mode = req.prefer if req.prefer in ("colocated", "disagg", "local") else self.mode
        now = self.clock()
        wc = {w.worker_id: WorkerCost.of(w, peer_priors(self.cost.p.priors, w, workers), self._inflight(w), now)
              for w in live}
        cands = candidates(mode, list(wc.values()), any(w.role == "prefill" for w in workers), len(excl))
        scored = self._score(req, live, wc, cands)
        kind, reason, alt = self._kind(cands, scored, mode)
        chosen = self._pick(scored.local if kind == "local" else scored.pairs)
        return self._commit(req, kind, reason, chosen, alt, scored, cands.degraded)

    def _score(self, req: RouteInput, live: list[WorkerRecord], wc: dict[str, WorkerCost],
               cands: Candidates) -> Scored:
        """Predicted completion time of every candidate (prefix hits by tier, queues, transfer), plus the spread
        terms when any is weighted."""
        n, out = req.n_prompt, self.cost.out_tokens(req.max_tokens)
        hits = self.prefix_hits(req, live)
        cached = {wid: h.blocks * wc[wid].block_size for wid, h in hits.items()}
        device = {wid: h.device * wc[wid].block_size for wid, h in hits.items()}
        recall = {wid: self.cost.recall_s(wc[wid], h.host, h.disk) for wid, h in hits.items()}
        local = [self.cost.local(w, n, cached[w.rec.worker_id], out, recall[w.rec.worker_id]) for w in cands.local]
        pairs = [self.cost.disagg(p, d, n, cached[p.rec.worker_id], device[d.rec.worker_id], out,
                                  recall[p.rec.worker_id])
                 for p, d in cands.pairs]
        stalled = float("inf")  # the best local cost the stall cap dropped
        if pairs and local:  # a choice between the two: no local prefill that would stall the streams there
            local, stalled = self._stall_cap(local, min(pairs, key=lambda e: e.cost))
        keys = self.spread.keys(req.namespace, req.prompt_token_ids)
        return Scored(local, pairs, self._spread_terms(req, live, local + pairs, keys, out), keys, device, stalled)

    def _stall_cap(self, local: list[Estimate], best_pair: Estimate) -> tuple[list[Estimate], float]:
        """The local estimates kept, and the best cost of those dropped: one that would stall its worker's streams
        past the cap (cost.stalls_streams) is dropped unless the best pair's KV pull alone would take longer than
        `local_stall_yield` x that stall summed over the streams (a link so slow that the pull outweighs it). A
        long queue at the prefill pool is no reason to keep it: that is overload, and moving prefills onto the
        decode worker then trades every stream's TPOT for one request's TTFT."""
        y = self.cost.p.local_stall_yield
        drop = [e for e in local if self.cost.stalls_streams(e)
                and best_pair.transfer_s <= y * e.interference_compute_s * e.decode.running]
        kept = [e for e in local if all(e is not d for d in drop)]
        return kept, min((e.cost for e in drop), default=float("inf"))

    def _spread_terms(self, req: RouteInput, live: list[WorkerRecord], ests: list[Estimate], keys: list[tuple],
                      out: int) -> dict[int, Terms]:
        """spread.py's failure-domain, price and fairness terms per estimate (by id), added to its cost."""
        fd, fair = self.spread.per_worker(keys, req.namespace, live)
        if not (fd or fair or self.spread.weights.price):
            return {}
        terms = {id(e): self.spread.terms(e, req.n_prompt, out, fd, fair) for e in ests}
        # relative to the smallest: a constant changes neither the choice nor the near-equal band
        floor = min((t.total for t in terms.values()), default=0.0)
        for e in ests:
            e.extra_s = terms[id(e)].total - floor
        return terms

    def _kind(self, cands: Candidates, scored: Scored, mode: str) -> tuple[str, str, float]:
        """local or disagg, why, and the best cost of the kind not chosen (0: none)."""
        best_local = min((e.cost for e in scored.local), default=float("inf"))
        best_pair = min((e.cost for e in scored.pairs), default=float("inf"))
        if cands.degraded:
            kind, reason, alt = "local", f"degraded_{cands.degraded}", best_pair
        elif not scored.pairs:
            kind, alt = "local", 0.0
            reason = "colocated_only" if not cands.decode_pool else \
                ("local_forced" if mode in ("colocated", "local") else "local_only")
        elif not scored.local:
            kind, alt = "disagg", 0.0
            reason = "disagg_forced" if mode == "disagg" else self._capped_reason(scored.stalled, best_pair)
        elif best_pair + self.cost.p.disagg_margin_s < best_local:
            kind, reason, alt = "disagg", "disagg_faster", best_local
        else:
            kind, reason, alt = "local", "local_faster", best_pair
        return kind, reason, (0.0 if alt == float("inf") else alt)

    def _capped_reason(self, stalled: float, best_pair: float) -> str:
        """Disaggregated with no local candidate left: by its own cost, because the stall cap dropped the local
        ones that were cheaper, or because there were none."""
        if stalled == float("inf"):
            return "disagg_only"
        return "disagg_faster" if best_pair + self.cost.p.disagg_margin_s < stalled else "local_would_stall"

    def _pick(self, ests: list[Estimate]) -> Estimate:
        best = min(e.cost for e in ests)
        tol = best * self.cost.p.tie_rel + self.cost.p.tie_abs_s
        near = [e for e in ests if e.cost <= best + tol]
        return self.rng.choice(near)

    def _commit(self, req: RouteInput, kind: str, reason: str, chosen: Estimate, alt: float, scored: Scored,
                degraded: str) -> Placement:
        """The placement, with what it adds to the chosen workers' load until their next report."""
        n = req.n_prompt
        blocks = -(-(n + self.cost.out_tokens(req.max_tokens)) // chosen.decode.block_size)
        if kind == "local":
            self._note(chosen.prefill.rec.worker_id, n - chosen.cached_tokens, 1, blocks)
            pl = Placement("colocated", both=chosen.prefill.rec)
        else:
            self._note(chosen.prefill.rec.worker_id, n - chosen.cached_tokens, 0, 0)
            self._note(chosen.decode.rec.worker_id, 0, 1, blocks)
            pl = Placement("disagg", prefill=chosen.prefill.rec, decode=chosen.decode.rec,
                           decode_cached_tokens=scored.device[chosen.decode.rec.worker_id])
        pl.reason, pl.cached_tokens, pl.ttft_s, pl.e2e_s = reason, chosen.cached_tokens, chosen.ttft_s, chosen.e2e_s
        pl.alternative_s, pl.n_candidates = alt, len(scored.local) + len(scored.pairs)
        pl.terms = scored.terms.get(id(chosen)) or Terms(zone=zone_of(chosen.decode.rec))
        self.spread.record(scored.keys, req.namespace, chosen.decode.rec)
        self._count(pl, n, degraded)
        return pl

    def _count(self, pl: Placement, n_prompt: int, degraded: str) -> None:
        M.ROUTE_DECISIONS.labels(pl.mode, pl.reason).inc()
        M.ROUTE_PREDICTED_TTFT.observe(pl.ttft_s)
        M.ROUTE_PROMPT_TOKENS.inc(n_prompt)
        M.ROUTE_CACHED_TOKENS.inc(pl.cached_tokens)
        if degraded:
            M.ROUTE_DEGRADED.labels(degraded).inc()
            now = time.monotonic()
            if now - self._last_degraded_log > 10.0:  # loud, but not one line per request
                self._last_degraded_log = now
                log.warning("prefill pool unavailable (%s): prefilling locally on decode workers "
                            "(pdserve_route_degraded_total counts every such request)", degraded)
