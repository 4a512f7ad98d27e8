"""One engine request: its sequences (the branches, or the beams of a beam search) and lifecycle fields, and what
follows from them alone: whether it is finished, which branches it returns, the state it ends in."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine import beam as beams
from pdserve.engine.outputs import FirstToken, RequestTimes, UsageRecord
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sampling_state import select_best
from pdserve.engine.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str
    seqs: list[Sequence]
    times: RequestTimes
    prefill_only: bool = False
    reclaimed: bool = False
    state: S = S.QUEUED
    prompt_logprobs: list | None = None
    deadline: float | None = None  # unix time; past it the request ends TIMED_OUT from any live state
    # decode side: unix time by which a remote prefill's KV must have arrived (commit_prefilled), else FAILED
    transfer_deadline: float | None = None
    first_tokens: list[FirstToken] = field(default_factory=list)  # decode side: sampled by the prefill worker
    paused_since: float | None = None  # backpressured since (unix time)
    beam: beams.BeamState | None = None  # beam search (params.beam_width): the beams live in `seqs`

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.reclaimed or self.beam.done
        if self.reclaimed:
            return True
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, asked several times per token
            return seqs[0].finished and self.params.num_branches <= 1
        return all(s.finished for s in seqs) and len(seqs) >= self.params.num_branches

    def token_counts(self) -> tuple[int, int, int, int]:
        """Generated, verified, accepted and KV-kept tokens over every branch (a RequestOutput's counts)."""
        seqs = self.seqs
        if len(seqs) == 1:  # one branch (most requests): asked for every request every step
            s = seqs[0]
            return s.num_output_tokens, s.num_verified_tokens, s.num_accepted_tokens, s.num_kv_growth_tokens
        return (sum(s.num_output_tokens for s in seqs), sum(s.num_verified_tokens for s in seqs),
                sum(s.num_accepted_tokens for s in seqs), sum(s.num_kv_growth_tokens for s in seqs))

    def hides_branches(self) -> bool:
        """best_of > n: the caller sees only the winners, at the end. Not on a prefill worker handing the branches
        over (every branch's first token goes to the decode side, which makes the choice)."""
        p = self.params
        if p.best_of is None or p.best_of == p.n:
            return False
        return not (self.prefill_only and any(s.finish_reason == "prefill" for s in self.seqs))

    def chosen(self) -> list[Sequence]:
        """With best_of > n, only the n branches of highest cumulative logprob are returned (once finished)."""
        if not self.hides_branches():
            return self.seqs
        if not self.finished:
            return []
        return [self.seqs[i] for i in select_best([s.sampling for s in self.seqs], self.params.n)]

    def terminal_state(self) -> S:
        """The state it ends in: FINISHED for a beam search that ran to its end (its pruned beams end CANCELLED on
        the way); otherwise FAILED, CANCELLED or TIMED_OUT if any branch ended so (in that order), else FINISHED."""
        if self.beam is not None and self.beam.done:
            return S.FINISHED
        states = [s.state for s in self.seqs]
        for st in (S.FAILED, S.CANCELLED, S.TIMED_OUT):
            if st in states:
                return st
        return S.FINISHED

    def usage_record(self) -> UsageRecord:
        """Its accounting, once it has ended (`state` is terminal)."""
        seqs = self.seqs
        chosen = self.chosen() or seqs
        generated = sum(s.output.num_generated for s in seqs)
        emitted = sum(s.output.num_emitted for s in seqs)
        committed = sum(len(s.output_token_ids) for s in chosen)
        reasons = tuple(s.finish_reason for s in chosen)
        if self.beam is not None:
            generated, emitted, committed, reasons = beams.usage(self.beam, self.params.n, self.state == S.FINISHED)
        return UsageRecord(
            request_id=self.request_id, namespace=self.namespace, state=self.state.value,
            prompt_tokens=len(self.prompt_token_ids), cached_tokens=seqs[0].num_cached_tokens,
            generated_tokens=generated, emitted_tokens=emitted, committed_tokens=committed, finish_reasons=reasons,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            verified_tokens=sum(s.num_verified_tokens for s in seqs),
            accepted_tokens=sum(s.num_accepted_tokens for s in seqs),
            kv_growth_tokens=sum(s.num_kv_growth_tokens for s in seqs), deadline=self.deadline, times=self.times)
