"""Failure-domain spread, price and tenant fairness: the terms added to a candidate's predicted completion time
(spec §4.5 "故障域隔离", §6.1, Q15 "控制成本、跨租户公平性"; docs/routing.md, "Failure domains, price and fairness").

Every term is in seconds, so it sits next to the cost model's completion time (cost.py) and the policy still
minimises one number:

    score = cost + fd + price + fair

- fd (failure domain): keys K of a request = its tenant (namespace) and its prefix (namespace + the first
  PREFIX_TOKENS prompt tokens, when the prompt has them). share_k(z) = fraction of key k's last `window`
  placements (within `ttl_s`) that went to zone z (0 with no history). For a worker w:
      fd(w) = zone_w * mean_k share_k(zone(w)) + node_w * mean_k share_k(node(w))
  so a zone already holding most of a hot prefix's (or tenant's) placements costs more, and placements spread
  until zone_w x (share difference) equals what the other zone loses in cache hits and load. Workers without
  labels are all in zone "" / node "": the term is then the same for every candidate and changes nothing.
- price: worker-seconds the request uses x the worker's `price` label (default 1):
      price(w) = price_w * price(w) * (u / rate(w) + out * (step(w) + step_per_seq(w)) / (running(w) + 1))
  (its uncached prefill compute, plus its share of each decode step: a step serves the whole batch).
- fair (across tenants): over(t) = max(0, n_t / N - 1 / T) over the router's last `fair_window` placements
  (N of them, T distinct tenants, n_t of tenant t): how far t is above an equal share of recent traffic.
      fair(w) = fairness_w * over(t) * others(w)
  with others(w) = recent placements on w of other tenants: a tenant above its share is steered away from
  workers serving the others (its load lands on its own), one within its share pays nothing.
A disaggregated pair (p, d) takes the mean fd of p and d, the price of p's prefill and d's decode, and the
fairness of d (where the request lives longest).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

PREFIX_TOKENS = 16  # a prefix key: the namespace + this many leading prompt tokens (a system prompt's start)


@dataclass
class RouteWeights:
    zone: float = 0.05       # seconds per unit of zone share (fd)
    node: float = 0.02       # seconds per unit of node share (fd)
    price: float = 0.0       # seconds of completion time one price-unit x worker-second is worth (0: off)
    fairness: float = 0.0    # seconds per (unit of excess share x other tenant's recent placement) (0: off)
    window: int = 32         # placements remembered per key (fd)
    fair_window: int = 64    # placements remembered over all tenants (fair)
    ttl_s: float = 120.0     # older placements are forgotten

    @classmethod
    def of(cls, d: dict[str, float] | None) -> "RouteWeights":
        return cls(**(d or {}))


@dataclass
class Terms:
    fd_s: float = 0.0
    price_s: float = 0.0
    fair_s: float = 0.0
    zone: str = ""

    @property
    def total(self) -> float:
        return self.fd_s + self.price_s + self.fair_s


def zone_of(rec) -> str:
    return rec.labels.get("zone", "")


def node_of(rec) -> str:
    return rec.labels.get("node", "")


def price_of(rec) -> float:
    try:
        return float(rec.labels.get("price", 1.0))
    except ValueError:
        return 1.0


@dataclass
class Spread:
    weights: RouteWeights = field(default_factory=RouteWeights)
    clock: object = time.time
    _by_key: dict[tuple, deque] = field(default_factory=dict)  # key -> (t, zone, node)
    _recent: deque = field(default_factory=deque)               # (t, tenant, worker id)

    def keys(self, namespace: str, prompt: list[int]) -> list[tuple]:
        ks: list[tuple] = [("tenant", namespace)]
        if len(prompt) >= PREFIX_TOKENS:
            ks.append(("prefix", namespace, tuple(prompt[:PREFIX_TOKENS])))
        return ks

    def _live(self, q: deque) -> deque:
        cut = self.clock() - self.weights.ttl_s
        while q and q[0][0] < cut:
            q.popleft()
        return q

    def _share(self, keys: list[tuple], idx: int, value: str) -> float:
        shares = []
        for k in keys:
            q = self._live(self._by_key.get(k, deque()))
            shares.append(sum(1 for x in q if x[idx] == value) / len(q) if q else 0.0)
        return sum(shares) / len(shares) if shares else 0.0

    def over(self, tenant: str) -> float:
        q = self._live(self._recent)
        if not q:
            return 0.0
        tenants = {x[1] for x in q}
        return max(0.0, sum(1 for x in q if x[1] == tenant) / len(q) - 1.0 / len(tenants))

    def per_worker(self, keys: list[tuple], tenant: str, recs) -> tuple[dict[str, float], dict[str, float]]:
        """fd and fair of each worker, computed once per decision (a pair reuses its two workers' values;
        16 x 16 pools have 256 pairs but 32 workers), each share once per distinct zone / node."""
        w = self.weights
        fd: dict[str, float] = {}
        # one zone and one node for all (e.g. no labels): the term is equal everywhere and changes nothing
        if (w.zone or w.node) and (len({zone_of(r) for r in recs}) > 1 or len({node_of(r) for r in recs}) > 1):
            zs: dict[str, float] = {}
            ns: dict[str, float] = {}
            for r in recs:
                z, n = zone_of(r), node_of(r)
                if z not in zs:
                    zs[z] = self._share(keys, 1, z)
                if n not in ns:
                    ns[n] = self._share(keys, 2, n)
                fd[r.worker_id] = w.zone * zs[z] + w.node * ns[n]
        fair: dict[str, float] = {}
        over = self.over(tenant) if w.fairness else 0.0
        if over:
            counts: dict[str, int] = {}
            for x in self._live(self._recent):
                if x[1] != tenant:
                    counts[x[2]] = counts.get(x[2], 0) + 1
            fair = {r.worker_id: w.fairness * over * counts.get(r.worker_id, 0) for r in recs}
        return fd, fair

    def terms(self, est, n_prompt: int, out: int, fd: dict[str, float], fair: dict[str, float]) -> Terms:
        """The three terms of one candidate (an Estimate from cost.py), from `per_worker`'s values."""
        p, d = est.prefill, est.decode
        pid, did = p.rec.worker_id, d.rec.worker_id
        f = fd.get(did, 0.0) if p is d else (fd.get(pid, 0.0) + fd.get(did, 0.0)) / 2
        price = 0.0
        if self.weights.price:
            u = max(0, n_prompt - est.cached_tokens)
            price = self.weights.price * (price_of(p.rec) * u / p.rate
                                          + price_of(d.rec) * out * (d.step + d.step_per_seq) / (d.running + 1))
        return Terms(f, price, fair.get(did, 0.0), zone_of(d.rec))

    def record(self, keys: list[tuple], tenant: str, rec) -> None:
        now = self.clock()
        for k in keys:
            self._by_key.setdefault(k, deque(maxlen=self.weights.window)).append((now, zone_of(rec), node_of(rec)))
        self._recent.append((now, tenant, rec.worker_id))
        while len(self._recent) > self.weights.fair_window:
            self._recent.popleft()
        if len(self._by_key) > 100_000:  # bounded: forget the keys with nothing live
            for k in [k for k, q in self._by_key.items() if not self._live(q)]:
                del self._by_key[k]
