"""Engine, part: what services read of its load and set on it. Per-state counts, queued prefill work (the
router's estimate), the stats snapshot, and tenant KV shares."""
from __future__ import annotations

from types import MappingProxyType

from pdserve.engine.stats import EngineStats


class EngineLoad:
    """Load reports of `Engine` (engine.py), which sets the attributes used here."""

    def state_counts(self) -> dict[str, int]:
        """Live sequences per state (the per-state gauges)."""
        counts: dict[str, int] = {}
        for req in list(self.requests.values()) + list(self.remote_pending.values()):
            for seq in req.seqs:
                if seq.state is not None and not seq.finished:
                    counts[seq.state.value] = counts.get(seq.state.value, 0) + 1
        return counts

    def queued_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens of waiting sequences that prefill will actually compute: each one's
        current prefix-cache hit is subtracted, so a queued request whose prefix is cached counts only its
        uncached tail (the router's queued-work estimate, docs/routing.md). `lookup` is a pure read; a hit can
        still be evicted before the sequence is scheduled, so this is an estimate of the moment."""
        bs = self.block_manager.block_size
        n = 0
        for seq in list(self.scheduler.waiting):
            hit = len(self.block_manager.lookup(seq)) * bs
            n += max(0, seq.num_tokens - max(hit, seq.num_computed_tokens))
        return n

    def pending_prefill_tokens(self) -> int:
        """Prefill work queued ahead of a new request: the waiting queue's uncached tokens
        (`queued_prefill_tokens`) + what running sequences still have to prefill (chunked prefill in progress)."""
        n = self.queued_prefill_tokens()
        for s in list(self.scheduler.running):
            n += max(0, s.num_prompt_tokens - s.num_computed_tokens)
        return n

    def has_waiting(self) -> bool:
        """Any sequence queued for its (first or re-)prefill."""
        return bool(self.scheduler.waiting)

    def set_tenant_share(self, namespace: str, fraction: float) -> None:
        """The namespace's guaranteed fraction of the KV blocks for fair eviction (engine/kv_fairness.py); 0 lifts
        it. In force for every allocation after this call."""
        self.block_manager.set_share(namespace, fraction)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        logical = sum(s.num_computed_tokens for r in self.requests.values() for s in r.seqs if not s.finished)
        return EngineStats(
            kv_blocks_in_use=bm.blocks_in_use, kv_blocks_total=bm.num_blocks, kv_blocks_cached_free=len(bm.evictable),
            kv_blocks_pinned=self.core.num_pinned_blocks(), kv_logical_slots=logical,
            kv_allocated_slots=bm.blocks_in_use * bm.block_size, cpu_blocks_in_use=bm.num_cpu_blocks - len(bm.cpu_free),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), states=MappingProxyType(self.state_counts()),
            prefix_hit_ratio=bm.hit_ratio, prefix_queried_tokens=bm.queried_tokens, prefix_hit_tokens=bm.hit_tokens,
            preemptions=MappingProxyType(dict(self.scheduler.num_preemptions)),
            terminal=MappingProxyType(dict(self.terminal_counts)),
            tier=self.kv_offload.stats() if self.kv_offload is not None else None,
            spec=self.spec.stats.snapshot() if self.spec is not None else None,
            expert_tokens=self.runner.model.expert_tokens())
