"""Iteration-level scheduler: one `schedule()` per tick builds a mixed prefill/decode batch (spec §5.1).

Per tick: running sequences keep their place (allocating blocks for this tick's tokens, preempting the
lowest-priority running sequence by recompute or swap when blocks run out), swapped sequences come back when
nothing was preempted this tick, then queued sequences are admitted while `max_num_seqs`, the token budget
`max_num_batched_tokens` and free blocks allow. Physical blocks are taken only here, when a tick selects a
sequence (spec §1.2: admission is a reservation, allocation happens on selection).

The order of the running sequences and of the queue is the scheduling policy's (spec §1.3; sched_policy.py:
fcfs, decode-priority, prefill-priority, priority, shortest-predicted-first), looked up once by name.
Backpressured sequences (`seq.paused`) are skipped everywhere and are the first preemption victims.

`batching="static"` (spec §5.2, the D04 baseline): queued requests are admitted only on a tick where no batch is
in flight (nothing running, swapped or preempted-waiting); a member preempted mid-batch comes back, but a slot a
finished member leaves stays empty until the whole batch is done.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sched_policy import scheduling_policy
from pdserve.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this tick, starting at seq.num_computed_tokens
    num_draft: int = 0  # of which speculative candidates to verify (spec_decode/)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last position yields the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.bm = block_manager
        self.policy = scheduling_policy(cfg.policy)
        self.waiting: deque[Sequence] = deque()  # QUEUED, or PREEMPTED by recompute (at the front)
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.recall = None  # kv_offload.KVOffload: waiting sequences whose prefix is recalled from host / disk

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if self.recall is not None:
            self.recall.cancel(seq)
        for q in (self.waiting, self.running, self.swapped):
            if seq in q:
                q.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- policy -----------------------------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple:
        return (seq.priority, seq.arrival_time, seq.seq_id)

    def _waiting_order(self) -> list[Sequence]:
        return self.policy.waiting_order(self.waiting, max(1, self.cfg.max_num_batched_tokens),
                                         self.cfg.starvation_age_s)

    def _victim(self, cands: list[Sequence]) -> Sequence:
        """Backpressured sequences first (nobody is reading them), then the lowest priority / latest arrival."""
        paused = [s for s in cands if s.paused]
        return max(paused or cands, key=self._key)

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence outside a tick (backpressure limit): frees its blocks."""
        if seq in self.running:
            self._preempt(seq, SchedulerOutput())

    def _running_order(self) -> list[Sequence]:
        return self.policy.running_order(sorted(self.running, key=self._key))

    # ---- the tick ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        if self.recall is not None:
            self.recall.poll()  # finished recalls are device prefix-cache blocks from here on
        order = self._running_order()
        if self.policy.prefill_first:
            # New prompts go before running decodes: they take budget first, decodes get what is left.
            prefills = [s for s in order if s.is_prefill]
            decodes = [s for s in order if not s.is_prefill]
            budget = self._schedule_running(prefills, out, budget)
            budget = self._schedule_swapped(out, budget)
            budget = self._schedule_waiting(out, budget)
            self._schedule_running(decodes, out, budget)
        else:
            budget = self._schedule_running(order, out, budget)
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        if self.recall is not None:
            self.recall.end_of_tick()
        return out

    def _schedule_running(self, order: list[Sequence], out: SchedulerOutput, budget: int) -> int:
        scheduled_ids = {id(s.seq) for s in out.scheduled}
        running = set(self.running)  # membership per sequence: a list scan each would be quadratic in the batch
        for seq in order:
            if seq not in running or budget <= 0 or seq.paused:
                continue
            need = seq.num_tokens - seq.num_computed_tokens
            del seq.draft_token_ids[max(0, budget - need):]  # speculative candidates only within the budget
            n = min(need, budget) if self.cfg.enable_chunked_prefill else need
            if n > budget or need == 0:  # need 0: a beam waiting for its siblings' logits (engine/beam.py)
                continue
            while True:
                try:
                    self.bm.allocate(seq, n + len(seq.draft_token_ids))
                    break
                except NoFreeBlocks:
                    if seq.draft_token_ids:  # KV short: verify no candidates rather than preempt anyone
                        seq.draft_token_ids = []
                        continue
                    victims = [s for s in self.running if s is not seq and id(s) not in scheduled_ids]
                    victim = self._victim(victims) if victims else seq
                    self._preempt(victim, out)
                    running.discard(victim)
                    if victim is seq:
                        break
            if seq in running:
                k = len(seq.draft_token_ids)
                out.scheduled.append(ScheduledSeq(seq, n + k, k))
                scheduled_ids.add(id(seq))
                budget -= n + k
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        if out.preempted:  # blocks just freed by a swap-out must not be refilled by a swap-in in the same tick
            return budget
        for seq in list(self.swapped):
            if budget <= 0 or self.slots_used() >= self.cfg.max_num_seqs:
                break
            if seq.paused:
                continue
            # A sequence swapped out mid-prefill resumes with a chunk, not one token: it needs its own blocks
            # back plus whatever that chunk adds.
            need = seq.num_tokens - seq.num_computed_tokens
            n = min(need, budget) if self.cfg.enable_chunked_prefill else need
            if n > budget:
                break
            blocks = max(len(seq.host_table), self.bm.blocks_needed(seq.num_computed_tokens + n))
            if blocks > self.bm.num_free_for(seq.namespace, blocks):
                break
            self.swapped.remove(seq)
            self.bm.swap_in(seq)
            seq.set_state(S.RESUMED)
            seq.set_state(S.RUNNABLE)
            seq.set_state(S.PREFILLING if seq.is_prefill else S.DECODING)
            self.running.append(seq)
            self.bm.allocate(seq, n)
            if n:  # 0: a beam swapped out while waiting for its siblings' logits
                out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def slots_used(self) -> int:
        """Batch slots taken: running sequences with a token to compute. A beam that has its logits and waits for
        a preempted sibling's (need 0) takes none, or a full batch of such beams would never let the sibling in."""
        return sum(1 for s in self.running if s.num_tokens > s.num_computed_tokens)

    def batch_in_flight(self) -> bool:
        """Static batching: some member of the current batch has not finished (preempted ones included)."""
        return bool(self.running or self.swapped) or any(s.state == S.PREEMPTED for s in self.waiting)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        members_only = self.cfg.batching == "static" and self.batch_in_flight()
        slots = self.slots_used()  # counted once, then by admission: per candidate it was O(running) each
        for seq in self._waiting_order():
            if budget <= 0 or slots >= self.cfg.max_num_seqs:
                break
            if seq.paused or (members_only and seq.state != S.PREEMPTED):
                continue  # backpressured while preempted / not in the static batch in flight: others go ahead
            if self.recall is not None and self.recall.hold(seq):
                continue  # its prefix is being copied back from host / disk: others go ahead meanwhile
            hits = [] if seq.wants_prompt_logprobs else self.bm.lookup(seq)
            remaining = seq.num_tokens - len(hits) * self.bm.block_size
            n = min(remaining, budget) if self.cfg.enable_chunked_prefill else remaining
            if n > budget or not self.bm.can_allocate(seq, n, hits):
                break  # in policy order: a later request does not jump the head of the queue
            self.waiting.remove(seq)
            self.bm.allocate(seq, n, hits)
            if self.recall is not None:
                self.recall.admitted(seq)
            if seq.state == S.PREEMPTED:
                seq.set_state(S.RESUMED)
            seq.set_state(S.RUNNABLE)
            seq.set_state(S.PREFILLING)
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            slots += seq.num_tokens > seq.num_computed_tokens  # as slots_used counts it
            budget -= n
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free seq's device blocks: swap them to host when configured and possible, else drop and recompute."""
        self.running.remove(seq)
        seq.set_state(S.PREEMPTED)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.cfg.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            self.bm.swap_out(seq)
            seq.set_state(S.SWAPPED)
            self.swapped.append(seq)
            self.num_preemptions["swap"] += 1
        else:
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.block_hashes = []
            self.waiting.appendleft(seq)
            self.num_preemptions["recompute"] += 1
