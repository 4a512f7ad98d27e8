"""Per worker pair KV transfer figures on the decode worker: bytes and seconds of each pull, failures, expired
leases, labelled by the prefill peer (`peer`, its worker id; the decode worker is the scrape target).

Cardinality is bounded: the first MAX_PEERS distinct peers keep their own label, later ones share "other". A
restarted prefill worker keeps its worker id (and so its label), so the bound is only reached by a pool that
really has that many prefill workers, or one whose ids change on every restart (set `--worker-id`).
"""
from __future__ import annotations

from pdserve.kv_transfer.agent import TransferFailure
from pdserve.services.metrics import worker as M

MAX_PEERS = 64
OTHER = "other"


class PeerLabels:
    def __init__(self, cap: int = MAX_PEERS):
        self.cap = cap
        self._seen: set[str] = set()

    def __call__(self, peer: str) -> str:
        peer = peer or "unknown"
        if peer in self._seen:
            return peer
        if len(self._seen) < self.cap:
            self._seen.add(peer)
            return peer
        return OTHER


class PairMetrics:
    def __init__(self, cap: int = MAX_PEERS):
        self.label = PeerLabels(cap)
        self._transport: dict[str, str] = {}  # peer label -> its pdserve_kv_pair_transport_info sample's value

    def pulled(self, peer: str, nbytes: int, seconds: float) -> None:
        lbl = self.label(peer)
        M.KV_PAIR_BYTES.labels(lbl).observe(nbytes)
        M.KV_PAIR_SECONDS.labels(lbl).observe(seconds)

    def failed(self, peer: str, kind: TransferFailure) -> None:
        lbl = self.label(peer)
        M.KV_PAIR_FAILURES.labels(lbl, kind.value).inc()
        if kind is TransferFailure.LEASE_EXPIRED:
            M.KV_PAIR_LEASES_EXPIRED.labels(lbl).inc()

    def probed(self, peer: str, latency_s: float, bytes_per_s: float) -> None:
        lbl = self.label(peer)
        M.KV_PAIR_PROBE_LATENCY.labels(lbl).set(latency_s)
        M.KV_PAIR_PROBE_BANDWIDTH.labels(lbl).set(bytes_per_s)

    def transport(self, peer: str, observed: str) -> None:
        """One sample per peer: what UCX chose for its READs; a restarted peer's replaces its previous one. Peers
        past the cap are not shown (one `other` sample could not say which of them took which transport)."""
        lbl = self.label(peer)
        if lbl == OTHER:
            return
        old = self._transport.get(lbl)
        if old is not None and old != observed:
            M.KV_PAIR_TRANSPORT_INFO.remove(lbl, old)
        self._transport[lbl] = observed
        M.KV_PAIR_TRANSPORT_INFO.labels(lbl, observed).set(1)
