"""The engine's per-step bookkeeping without tensors: what happens to sequences and KV blocks around a forward.

`Engine` (a real forward and sampler) and the simulator's `SimReplica` (a cost model and a synthetic token)
both drive one `EngineCore`, so scheduling, committing sampled tokens, finishing, pinning a prefill-only
request's prompt blocks for transfer, and the decode side's half of a KV handoff are written once.

A sequence's `output` decides when it stops: `OutputProcessor` in the engine (stop strings, EOS, max_tokens),
a fixed output length in the simulator. Both answer `step(token, sampling) -> (text delta, finish reason)` and
`finish(reason) -> text delta`.
"""
from __future__ import annotations

from pdserve.engine.block_manager import HOLE, BlockManager
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence


class EngineCore:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        # prefill-only requests whose prompt KV waits for the decode side: request id -> (blocks, prompt tokens)
        self.pinned: dict[str, tuple[list[int], int]] = {}

    # ---- the step ---------------------------------------------------------------------------------------------
    def computed(self, sched: SchedulerOutput) -> None:
        """The forward wrote the KV of every scheduled chunk: advance the sequences, register full blocks."""
        for item in sched.scheduled:
            seq = item.seq
            if item.num_tokens == 1 + item.num_draft and seq.num_output_tokens > item.num_draft:  # a decode step
                seq.num_verified_tokens += item.num_tokens
                seq.num_kv_growth_tokens += 1
            # Speculative candidates' KV is not committed here: verification decides (spec_decode/decoder.py).
            seq.num_computed_tokens += item.num_tokens - item.num_draft
            self.block_manager.mark_computed(seq)
            self.block_manager.release_out_of_window(seq)  # all layers windowed: what no later token will read

    def commit(self, seq: Sequence, token_id: int, prefill_only: bool = False) -> str | None:
        """Append one sampled token; finish the sequence when its output, the context or prefill-only ends it.
        Returns the finish reason, or None while it keeps decoding."""
        seq.token_ids.append(token_id)
        delta, reason = seq.output.step(token_id, seq.sampling)
        seq.new_text += delta
        seq.new_token_ids.append(token_id)
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
            seq.new_text += seq.output.finish(reason)
        elif reason is None and prefill_only:
            reason = "prefill"
        if reason is not None:
            seq.finish_reason = reason
            self.finish(seq, S.FINISHED, prefill_only)
        elif seq.state == S.PREFILLING:
            seq.set_state(S.DECODING)
        return reason

    def fork(self, parent: Sequence, child: Sequence, join: bool = True) -> None:
        """A new branch shares the parent's blocks (copy-on-write) and, with `join`, enters the batch where the
        parent is (at its first sample). The decode side of a handoff forks before committing the first tokens
        and lets `commit_prefilled` decide who joins."""
        for st in (S.QUEUED, S.RUNNABLE, S.PREFILLING):
            child.set_state(st)
        self.block_manager.fork(parent, child)
        if join:
            self.scheduler.running.append(child)

    # ---- termination ------------------------------------------------------------------------------------------
    def finish(self, seq: Sequence, state: S, prefill_only: bool = False) -> None:
        """End one sequence (idempotent): leave the batch and give its blocks back, except a prefill-only
        request's prompt blocks, which stay pinned until the decode side has pulled them."""
        if seq.finished:
            return
        seq.set_state(state)
        self.scheduler.remove(seq)
        if prefill_only and state == S.FINISHED and seq.branch == 0:
            self.pinned[seq.request_id] = (list(seq.block_table), seq.num_prompt_tokens)
            seq.block_table = []
        else:
            self.block_manager.free(seq)
        if seq.host_table:
            self.block_manager.free_host(seq)

    def pinned_kv(self, request_id: str) -> tuple[list[int], int]:
        return self.pinned[request_id]

    def release_pinned(self, request_id: str) -> None:
        """The decode side has the prompt's KV (or never will): unpin. Idempotent."""
        blocks, _ = self.pinned.pop(request_id, ([], 0))
        for b in reversed(blocks):
            if b != HOLE:  # released before the window (every layer windowed): not pinned, not pulled
                self.block_manager.release_block(b)

    def num_pinned_blocks(self) -> int:
        return sum(b != HOLE for blocks, _ in self.pinned.values() for b in blocks)

    # ---- the decode side of a handoff -------------------------------------------------------------------------
    def allocate_prefilled(self, seq: Sequence, reuse: bool = True) -> int | None:
        """Blocks for a prompt prefilled elsewhere: returns how many leading blocks the local prefix cache
        already holds (not to be transferred), or None when the blocks cannot be had now. The lookup and the
        allocation are one step, so a hit counted here is held (referenced) until the request ends: a prefix
        evicted before this point is simply no hit, and its blocks are pulled. `reuse=False`: no lookup, every
        block is fresh and pulled."""
        bm = self.block_manager
        hits = bm.lookup(seq) if reuse else []
        # Every layer windowed: the first decode (at the prompt's length) reads only the last window, so the blocks
        # before it are neither allocated nor pulled (the prefill side released the same ones).
        skip = bm.blocks_before_window(seq.num_prompt_tokens)
        if skip >= len(hits) and skip:
            hits = []  # all of them before the window
            bm.skip_leading_blocks(seq, skip)
        n = seq.num_prompt_tokens - max(len(hits), skip) * bm.block_size
        if not bm.can_allocate(seq, n, hits):
            bm.skip_leading_blocks(seq, 0)
            return None
        bm.allocate(seq, n, hits)
        bm.release_out_of_window(seq, seq.num_prompt_tokens)  # hits before the window go back to the cache
        seq.set_state(S.RUNNABLE)
        seq.set_state(S.PREFILLING)  # prefilling remotely: the blocks are being filled by a transfer
        return len(hits)

    def commit_prefilled(self, seqs: list[Sequence], first_token_ids: list[int]) -> list[str | None]:
        """The transferred blocks (allocated for `seqs[0]`) hold the prompt's KV: the other branches `seqs[1:]`
        (new sequences of the same request) fork from it, sharing those blocks copy-on-write; each branch commits
        its own first token (sampled on the prefill side) and joins the decode batch unless that token already
        ends it. Returns each branch's finish reason or None."""
        parent = seqs[0]
        parent.num_computed_tokens = parent.num_prompt_tokens
        self.block_manager.mark_computed(parent)
        for child in seqs[1:]:
            self.fork(parent, child, join=False)
        reasons = []
        for seq, tok in zip(seqs, first_token_ids, strict=True):
            reason = self.commit(seq, tok)
            if reason is None:
                self.scheduler.running.append(seq)
            reasons.append(reason)
        return reasons
