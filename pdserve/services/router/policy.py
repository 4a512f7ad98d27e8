"""Placement: minimise predicted completion time (cost.py) using the prefix index and measured load.

Candidates per request (after `exclude`):
- local: every `both` worker, and in `auto` mode every `decode` worker (it prefills the prompt itself; every
  role answers Generate - services/worker.py);
- disaggregated: every (prefill, decode) pair.

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
from dataclasses import dataclass, field

from pdserve.services.metrics import router as M
from pdserve.services.registry import WorkerRecord
from pdserve.services.router.cost import CostModel, CostParams, Estimate, Inflight, WorkerCost, peer_priors
from pdserve.services.router.prefix_index import PrefixIndex, TierHit, chain_hashes
from pdserve.services.router.spread import RouteWeights, Spread, Terms, zone_of

log = logging.getLogger("pdserve.router")

MODES = ("auto", "disagg", "colocated")


class NoWorkers(RuntimeError):
    """No live worker can take the request (maps to HTTP 503 / gRPC UNAVAILABLE)."""


@dataclass
class RouteInput:
    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # used when the token ids are not given (no prefix lookup then)
    namespace: str = ""
    max_tokens: int = 0
    exclude: set[str] = field(default_factory=set)
    prefer: str = ""  # "" | "colocated" | "disagg" | "local" (a both or decode worker, never a pair)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_token_ids) or self.num_prompt_tokens


@dataclass
class Placement:
    mode: str  # disagg | colocated (the gateway's two request paths)
    prefill: WorkerRecord | None = None
    decode: WorkerRecord | None = None
    both: WorkerRecord | None = None
    reason: str = ""
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    alternative_s: float = 0.0  # best cost of the kind not chosen (0: none)
    n_candidates: int = 0
    terms: Terms = field(default_factory=Terms)  # the chosen candidate's spread.py terms

    def header(self) -> str:
        """The `x-pdserve-route` debug header."""
        ws = f"prefill={self.prefill.worker_id};decode={self.decode.worker_id}" if self.mode == "disagg" \
            else f"worker={self.both.worker_id}"
        return (f"mode={self.mode};reason={self.reason};{ws};cached_tokens={self.cached_tokens};"
                f"ttft_s={self.ttft_s:.4f};e2e_s={self.e2e_s:.4f};alt_s={self.alternative_s:.4f};"
                f"candidates={self.n_candidates};zone={self.terms.zone};fd_s={self.terms.fd_s:.4f};"
                f"price_s={self.terms.price_s:.4f};fair_s={self.terms.fair_s:.4f}")


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

    # ---- the decision -----------------------------------------------------------------------------------------
    def place(self, workers: list[WorkerRecord], exclude: set[str] = frozenset(), prefer: str = "",
              req: RouteInput | None = None) -> Placement:
        req = req or RouteInput(exclude=set(exclude), prefer=prefer)
        excl = set(req.exclude) | set(exclude)
        live = [w for w in workers if w.worker_id not in excl]
        pri = self.cost.p.priors
        now = self.clock()
        wc = {w.worker_id: WorkerCost.of(w, peer_priors(pri, w, workers), self._inflight(w), now) for w in live}
        pre = [wc[w.worker_id] for w in live if w.role == "prefill"]
        dec = [wc[w.worker_id] for w in live if w.role == "decode"]
        both = [wc[w.worker_id] for w in live if w.role == "both"]
        mode = req.prefer if req.prefer in ("colocated", "disagg", "local") else self.mode
        if not (pre or dec or both):
            raise NoWorkers(f"no live workers (prefill=0, decode=0, both=0; excluded {len(excl)})")

        degraded = ""
        if mode == "colocated":
            local, pairs = both, []
            if not both:  # no colocated pool: serve disaggregated rather than fail
                pairs = [(p, d) for p in pre for d in dec]
        elif mode == "local":  # one worker prefills and decodes (a migrated request resumes so: gateway/migration.py)
            local, pairs = both + dec, []
        elif mode == "disagg":
            pairs = [(p, d) for p in pre for d in dec]
            local = both if not pairs else []
        else:  # auto
            pairs = [(p, d) for p in pre for d in dec]
            local = both + dec
        if not pairs and not local and dec:
            local = dec  # decode workers exist but no pair is possible: the prefill pool is down
        if dec and not pre and any(x in local for x in dec):
            had_prefill = any(w.role == "prefill" for w in workers)
            degraded = "prefill_excluded" if had_prefill else "prefill_pool_down"
        if not pairs and not local:
            raise NoWorkers(f"no placement (prefill={len(pre)}, decode={len(dec)}, both={len(both)}, "
                            f"mode={mode})")

        n = req.n_prompt
        out = self.cost.out_tokens(req.max_tokens)
        hits = self.prefix_hits(req, live)
        cached = {wid: h.blocks * wc[wid].block_size for wid, h in hits.items()}
        device = {wid: h.device * wc[wid].block_size for wid, h in hits.items()}
        recall = {wid: self.cost.recall_s(wc[wid], h.host, h.disk) for wid, h in hits.items()}
        ests_local = [self.cost.local(w, n, cached[w.rec.worker_id], out, recall[w.rec.worker_id]) for w in local]
        ests_pair = [self.cost.disagg(p, d, n, cached[p.rec.worker_id], device[d.rec.worker_id], out,
                                      recall[p.rec.worker_id])
                     for p, d in pairs]
        keys = self.spread.keys(req.namespace, req.prompt_token_ids)
        fd, fair = self.spread.per_worker(keys, req.namespace, live)
        terms: dict[int, Terms] = {}
        if fd or fair or self.spread.weights.price:
            for e in ests_local + ests_pair:
                terms[id(e)] = self.spread.terms(e, n, out, fd, fair)
            # relative to the smallest: a constant changes neither the choice nor the near-equal band
            floor = min((t.total for t in terms.values()), default=0.0)
            for e in ests_local + ests_pair:
                e.extra_s = terms[id(e)].total - floor
        best_local = min((e.cost for e in ests_local), default=float("inf"))
        best_pair = min((e.cost for e in ests_pair), default=float("inf"))

        if degraded:
            kind, reason, pool, alt = "local", f"degraded_{degraded}", ests_local, best_pair
        elif not ests_pair:
            kind, pool, alt = "local", ests_local, 0.0
            reason = "colocated_only" if not dec else ("local_forced" if mode in ("colocated", "local") else "local_only")
        elif not ests_local:
            kind, pool, alt = "disagg", ests_pair, 0.0
            reason = "disagg_forced" if mode == "disagg" else "disagg_only"
        elif best_pair + self.cost.p.disagg_margin_s < best_local:
            kind, reason, pool, alt = "disagg", "disagg_faster", ests_pair, best_local
        else:
            kind, reason, pool, alt = "local", "local_faster", ests_local, best_pair
        chosen = self._pick(pool)
        if alt == float("inf"):
            alt = 0.0

        blocks = -(-(n + out) // chosen.decode.block_size)
        if kind == "local":
            self._note(chosen.prefill.rec.worker_id, n - chosen.cached_tokens, 1, blocks)
            pl = Placement("colocated", both=chosen.prefill.rec)
        else:
            self._note(chosen.prefill.rec.worker_id, n - chosen.cached_tokens, 0, 0)
            self._note(chosen.decode.rec.worker_id, 0, 1, blocks)
            pl = Placement("disagg", prefill=chosen.prefill.rec, decode=chosen.decode.rec)
        pl.reason, pl.cached_tokens, pl.ttft_s, pl.e2e_s = reason, chosen.cached_tokens, chosen.ttft_s, chosen.e2e_s
        pl.alternative_s, pl.n_candidates = alt, len(ests_local) + len(ests_pair)
        pl.terms = terms.get(id(chosen)) or Terms(zone=zone_of(chosen.decode.rec))
        self.spread.record(keys, req.namespace, chosen.decode.rec)
        self._count(pl, n, degraded)
        return pl

    def _pick(self, ests: list[Estimate]) -> Estimate:
        best = min(e.cost for e in ests)
        tol = best * self.cost.p.tie_rel + self.cost.p.tie_abs_s
        near = [e for e in ests if e.cost <= best + tol]
        return self.rng.choice(near)

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
