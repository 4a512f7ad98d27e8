"""Speculative decoding inside the engine's tick (spec §5.1 step 3, §7, Q16): propose, verify, roll back.

Per tick, before scheduling, `propose` gives each eligible decoding sequence up to k candidates
(`seq.draft_token_ids`). The scheduler counts them in the tick's token budget and allocates their KV (dropping
them, never preempting anyone, when blocks or budget run short). `begin` appends the scheduled candidates to the
sequence so the target forwards [x, d_1 .. d_k] in one pass over the paged KV with logits at every position;
`finish` removes them again, verifies (verify.py), commits the accepted tokens plus one bonus / residual token,
and rolls the rejected candidates' KV back: the computed-token count covers x and the accepted candidates only,
blocks past it are released (exact refcounts), and a full block is registered in the prefix cache only once the
candidates in it are accepted, so no hash is ever taken over an unverified token.

Accounting (Q16), per sequence and summed into the usage record: `num_verified_tokens` = positions the target
forwarded in decode steps (1 per plain step, k + 1 per speculative step); `num_accepted_tokens` = candidates
accepted; `num_kv_growth_tokens` = positions whose KV stayed committed (verified minus rolled back). The output
tokens of a speculative step are accepted + 1: the bonus / residual token is an ordinary generated, emitted and
billed token.

Not speculated (plain decode for that sequence, documented in docs/engine.md): guided decoding (the grammar
matcher would have to be rolled back token by token), beam search (it scores every beam's full distribution), recompute chunks after preemption, the last token of
max_tokens / the context.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.outputs import SampleResult
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.flags import METHODS  # noqa: F401 (re-export)
from pdserve.engine.spec_decode.verify import verify


@dataclass
class SpecStats:
    steps: int = 0  # verification passes
    proposed: int = 0  # candidates verified
    accepted: int = 0  # candidates accepted
    emitted: int = 0  # tokens committed by verification passes (accepted + bonus / residual, up to a stop)
    rolled_back: int = 0  # KV positions written but not kept: rejected candidates (and any past a stop)

    def snapshot(self) -> SpecStats:
        """A copy: the counters keep moving on the engine thread."""
        return replace(self)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification pass (accepted candidates + the bonus / residual token)."""
        return self.emitted / self.steps if self.steps else 0.0


MAX_BACKOFF = 16  # plain decode steps a sequence sits out at most after a fruitless verification with one candidate


@dataclass
class _Pace:
    """Candidates to propose for one sequence: halved after a step that accepted none, doubled after one that
    accepted all (1..k); at one candidate, a miss sits out 1, 2, 4 .. MAX_BACKOFF steps of plain decode. Text where
    lookups keep missing thus pays for a verification pass now and then, not for k + 1 positions every step."""
    cap: int
    skip: int = 0
    backoff: int = 0

    def update(self, accepted: int, proposed: int, k: int) -> None:
        if accepted == 0 and self.cap > 1:
            self.cap //= 2
        elif accepted == 0:
            self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))
            self.skip = self.backoff
        else:
            self.backoff = 0
            if accepted == proposed:
                self.cap = min(k, 2 * self.cap)


class SpecDecoder:
    def __init__(self, proposer, num_tokens: int, sampler: Sampler, core, max_model_len: int):
        self.proposer = proposer
        self.k = num_tokens
        self.sampler = sampler
        self.core = core
        self.bm = core.block_manager
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._probs: dict[int, list | None] = {}  # seq_id -> the draft's q_j of its candidates (None: point mass)
        self._pace: dict[int, _Pace] = {}  # seq_id -> its adaptive candidate count

    def _budget(self, seq: Sequence) -> int:
        """Candidates worth proposing: none where speculation does not apply, else at most k, and never more than
        the output or the context has room for (a step commits up to candidates + 1 tokens)."""
        if seq.state != S.DECODING or seq.paused or seq.num_tokens - seq.num_computed_tokens != 1:
            return 0
        st = seq.sampling
        if st.grammar is not None or st.params.guided is not None or st.params.beam:
            return 0  # a grammar cannot roll back token by token; beam search chooses its own tokens
        pace = self._pace.setdefault(seq.seq_id, _Pace(self.k))
        if pace.skip > 0:
            pace.skip -= 1
            return 0
        k = min(pace.cap, self.max_model_len - seq.num_tokens - 1)
        if st.params.max_tokens is not None:
            k = min(k, st.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, k)

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            seq.draft_token_ids = []
        seqs, ks = [], []
        for seq in running:
            k = self._budget(seq)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        self._probs.clear()
        live = {s.seq_id for s in running}
        self.proposer.forget(live)
        for sid in [s for s in self._pace if s not in live]:
            del self._pace[sid]
        if not seqs:
            return
        for seq, (drafts, probs) in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.draft_token_ids = list(drafts)
            self._probs[seq.seq_id] = probs

    def begin(self, sched: SchedulerOutput) -> set[int]:
        """Append the scheduled candidates for the forward; returns the indices of the verifying items."""
        verifying = set()
        for i, item in enumerate(sched.scheduled):
            if item.num_draft:
                item.seq.token_ids.extend(item.seq.draft_token_ids[:item.num_draft])
                verifying.add(i)
        return verifying

    def finish(self, item: ScheduledSeq, logits, prefill_only: bool) -> list[SampleResult]:
        """Verify one sequence's candidates against its k + 1 logits rows, commit, roll back."""
        seq, k = item.seq, item.num_draft
        drafts = seq.draft_token_ids[:k]
        del seq.token_ids[len(seq.token_ids) - k:]  # back to the committed tokens
        seq.draft_token_ids = []
        probs = self._probs.pop(seq.seq_id, None)
        committed_before = [0]

        def commit(tok: int):
            # Every token committed before this one is an accepted candidate whose KV the forward wrote: it counts
            # (and its full block is registered) before the commit, which may end the sequence and free its blocks,
            # exactly as plain decoding has the KV of every committed token but the last one.
            if committed_before[0]:
                seq.num_computed_tokens += 1
                self.bm.mark_computed(seq)
            committed_before[0] += 1
            return self.core.commit(seq, tok, prefill_only)

        accepted, committed, results = verify(
            self.sampler, seq.sampling, logits, drafts, probs[:k] if probs is not None else None, commit)
        st = self.stats
        st.steps += 1
        st.proposed += k
        st.accepted += accepted
        st.emitted += committed
        st.rolled_back += k + 1 - committed  # written, not kept: rejected (or past a stop, freed with the sequence)
        self._pace.setdefault(seq.seq_id, _Pace(self.k)).update(accepted, k, self.k)
        seq.num_accepted_tokens += accepted
        seq.num_kv_growth_tokens += committed - 1  # x was counted when the forward was computed
        if not seq.finished:
            # KV of x and the accepted candidates stays (counted in `commit`); the rejected candidates' positions
            # are rolled back: the blocks past the committed KV are released.
            keep = self.bm.blocks_needed(seq.num_computed_tokens)
            for b in reversed(seq.block_table[keep:]):
                self.bm.release_block(b)
            del seq.block_table[keep:]
        return results
