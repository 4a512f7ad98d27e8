"""The simulator's own placement baseline, `oracle`: registered `sim_only` because it reads the replicas' exact
state, which a deployment's router cannot. The other baselines (round-robin, least-loaded) are the router's
(services/router/baselines.py), so a deployment can run them too."""
from __future__ import annotations

import random

from pdserve.services.registry import WorkerRecord
from pdserve.services.router.baselines import colocated
from pdserve.services.router.placement import Placement, RouteInput
from pdserve.services.router.policy_registry import register


class Oracle:
    """Knows every replica's prefix cache exactly (no index, no delay): the longest cached prefix wins, ties go
    to the replica with the fewest sequences waiting or running. The hit ratio any router could reach."""

    def __init__(self, replicas: dict, rng: random.Random):
        self.replicas = replicas  # worker id -> SimReplica
        self.rng = rng

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        ws = colocated(workers, req, "oracle")
        hits = {w.worker_id: self.replicas[w.worker_id].cached_prefix(req.prompt_token_ids, req.namespace)
                for w in ws}
        best = max(hits.values())
        cands = [w for w in ws if hits[w.worker_id] == best]
        q = {w.worker_id: self.replicas[w.worker_id].outstanding() for w in cands}
        m = min(q.values())
        return Placement("colocated", both=self.rng.choice([w for w in cands if q[w.worker_id] == m]),
                         reason="oracle")


register("oracle", lambda ctx: Oracle(ctx.replicas, ctx.rng), sim_only=True)
