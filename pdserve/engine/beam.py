"""Beam search (spec §3.1) with transformers' semantics, over copy-on-write beams.

Each live beam is a `Sequence` in the batch. A step takes every live beam's next-token logits, and does what
`GenerationMixin._beam_search` (transformers 5) does for one prompt:
  - log_softmax (float32) + the beam's running sum; the top K = max(2, 1 + #eos) * B candidates over all beams;
  - a candidate among the first B that ends (EOS, or max_new_tokens / the context reached) becomes a finished
    hypothesis scored sum_logprobs / generated_len ** length_penalty, kept if among the B best -- unless the
    B slots are full and early_stopping is True, or the early-stop heuristic already said no improvement;
  - the B best candidates that do not end are the next running beams (raw sums, no length penalty);
  - early-stop heuristic: once B hypotheses are finished, stop when the best running sum divided by
    L ** length_penalty cannot beat the worst of them, L = the current generated length, or max_new_tokens when
    early_stopping == "never" and length_penalty > 0; early_stopping=True stops as soon as B are finished.
The result is the finished hypotheses, best first (`n` of them).

KV: a beam chosen k times continues in its own sequence plus k - 1 forks that share its blocks by refcount
(BlockManager.fork; the first write into a shared partial tail block copies it); a beam chosen by nobody is
finished at once and drops its references, so the prompt and common prefixes are held once, and the blocks go
back to the pool exactly when the last beam sharing them ends.

The engine's side (the functions after `advance`) takes its collaborators as arguments: the engine core (forks,
finishes), the scheduler (preemption), the tokenizer (the hypotheses' text).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.engine.core import EngineCore
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.tokenizer import Tokenizer


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the EOS that ended it included
    sum_logprob: float
    score: float  # sum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS / stop token) | "length"


@dataclass
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int  # the request's max_tokens, capped by the context left
    eos_ids: frozenset[int]
    running: list[Sequence] = field(default_factory=list)  # best first
    scores: list[float] = field(default_factory=list)  # running sums, aligned with `running`
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    improvable: bool = True
    done: bool = False
    num_generated: int = 0  # tokens appended to any beam (usage: "generated")
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> logits row this step

    def ready(self) -> bool:
        """Every live beam has its logits for this step (one preempted beam holds the others back)."""
        return all(s.seq_id in self.pending for s in self.running)

    def select(self, logits: torch.Tensor, gen_len: int) -> list[tuple[int, int, float]]:
        """One step over `logits` [live beams (in `running` order), vocab]: updates the finished hypotheses and
        the stop decision, returns the next running beams as (parent index, token, running sum), best first.
        `gen_len` = tokens each live beam has generated so far."""
        b = self.width
        logp = torch.log_softmax(logits.float(), dim=-1)
        vocab = logp.shape[-1]
        acc = (logp + torch.tensor(self.scores, dtype=torch.float32)[:, None]).reshape(-1)
        k = min(max(2, 1 + len(self.eos_ids)) * b, acc.numel())
        top, idx = torch.topk(acc, k)
        parents, tokens = (idx // vocab).tolist(), (idx % vocab).tolist()
        new_len = gen_len + 1
        ends = [t in self.eos_ids or new_len >= self.max_new_tokens for t in tokens]
        full = len(self.finished) == b and self.early_stopping is True
        if self.improvable and not full:
            norm = (top / (new_len ** self.length_penalty)).tolist()
            seqs = self.running
            for i in range(min(b, k)):  # only the top B candidates may finish (the rest is the running backup)
                if ends[i]:
                    toks = seqs[parents[i]].output_token_ids + [tokens[i]]
                    reason = "stop" if tokens[i] in self.eos_ids else "length"
                    self.finished.append(Hypothesis(toks, float(top[i]), norm[i], reason))
            self.finished.sort(key=lambda h: -h.score)  # stable: an earlier hypothesis wins a tie
            del self.finished[b:]
        nxt = [(parents[i], tokens[i], float(top[i])) for i in range(k) if not ends[i]][:b]
        if nxt and len(self.finished) == b:
            hyp = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else new_len
            best = float(torch.tensor(nxt[0][2], dtype=torch.float32) / (hyp ** self.length_penalty))
            self.improvable = self.improvable and best > self.finished[-1].score
        self.done = (not nxt or not self.improvable or (len(self.finished) == b and self.early_stopping is True))
        self.num_generated += len(nxt) + sum(ends[:b])
        return nxt


def advance(state: BeamState, fork: Callable[[Sequence], Sequence], finish: Callable[[Sequence], None]) -> None:
    """All live beams have logits (`state.pending`): choose the next beams and move the sequences there.
    `fork(parent)` makes a new sequence sharing parent's blocks (copy-on-write) and puts it in the batch;
    `finish(seq)` ends a sequence and drops its block references."""
    old = state.running
    logits = torch.stack([state.pending.pop(s.seq_id) for s in old])
    state.pending.clear()
    nxt = state.select(logits, old[0].num_output_tokens)
    if state.done:
        for seq in old:
            finish(seq)
        state.running, state.scores = [], []
        return
    used: set[int] = set()
    chosen: list[Sequence] = []
    for parent, _, _ in nxt:  # a parent's first use continues in place; further uses fork from it, pre-append
        chosen.append(fork(old[parent]) if parent in used else old[parent])
        used.add(parent)
    for i, seq in enumerate(old):
        if i not in used:
            finish(seq)  # pruned: its references go; blocks another beam shares stay
    for seq, (_, tok, _) in zip(chosen, nxt):
        seq.token_ids.append(tok)
        if seq.state == S.PREFILLING:
            seq.set_state(S.DECODING)
    state.running = chosen
    state.scores = [s for _, _, s in nxt]


def start(params: SamplingParams, prompt_len: int, max_model_len: int, eos_token_ids: Iterable[int],
          first: Sequence) -> BeamState:
    """The search of a new request, from its one (prompt) sequence. A hypothesis ends at EOS (unless ignore_eos),
    a stop token, max_tokens, or the end of the context."""
    left = max_model_len - prompt_len
    eos = set() if params.ignore_eos else set(eos_token_ids)
    state = BeamState(params.beam_width, params.length_penalty, params.early_stopping,
                      min(params.max_tokens or left, left), frozenset(eos | set(params.stop_token_ids)))
    state.running, state.scores = [first], [0.0]
    return state


def fork_beam(parent: Sequence, seq_id: int, core: EngineCore) -> Sequence:
    """A beam continuing `parent` in a new sequence that shares its blocks. The sampling state and output
    processor are shared, not forked: beams never sample (the search chooses the tokens) and show nothing while
    they run, so neither is written."""
    child = Sequence(seq_id, parent.request_id, parent.token_ids, parent.namespace, parent.branch,
                     parent.arrival_time)
    child.num_prompt_tokens = parent.num_prompt_tokens  # the parent's generated tokens are the child's too
    child.sampling, child.output = parent.sampling, parent.output
    core.fork(parent, child)
    return child


def step(state: BeamState, items: list[tuple[Sequence, torch.Tensor]], core: EngineCore,
         new_seq_id: Callable[[], int]) -> list[Sequence] | None:
    """This tick's logits rows of (some of) a request's beams. Once every live beam has its row the search
    advances; returns the live beams then (the request's sequences from now on), None while it waits or once
    the search is over (the request keeps its last beams)."""
    for seq, row in items:
        state.pending[seq.seq_id] = row
    if not state.ready():
        return None  # a beam left out of this tick (preempted): the others wait for it, computed
    # A beam dropped while out of the batch (preempted, swapped; its logits were in) ends CANCELLED: the guard
    # table has no FINISHED from there. The request's own terminal state comes from the search (BeamState.done).
    advance(state, lambda parent: fork_beam(parent, new_seq_id(), core),
            lambda seq: core.finish(seq, S.FINISHED if seq.state in (S.PREFILLING, S.DECODING) else S.CANCELLED))
    return list(state.running) or None


def unstall(states: Iterable[BeamState], scheduler: Scheduler) -> None:
    """Nothing could be scheduled: beams holding blocks while they wait for a preempted sibling may be what
    keeps that sibling out. Preempt them too (their logits are kept), so the group can come back together."""
    for state in states:
        idle = [s for s in state.running if s.seq_id in state.pending and s in scheduler.running]
        if idle and len(idle) < len(state.running):
            for seq in idle:
                scheduler.preempt(seq)


def output(req: Request, tokenizer: Tokenizer) -> RequestOutput:
    """Beam search shows nothing until it ends (any beam can still be overtaken), then the n best hypotheses;
    `cumulative_logprob` is the hypothesis' sum of log-probabilities (its score: that / len ** length_penalty)."""
    outs = []
    if req.finished:
        skip = req.params.skip_special_tokens
        for i, h in enumerate(req.beam.finished[:req.params.n]):
            text = tokenizer.decode(h.token_ids, skip_special_tokens=skip)
            reason = h.finish_reason if not req.reclaimed or req.state == S.FINISHED else "abort"
            outs.append(CompletionOutput(i, text, list(h.token_ids), text, list(h.token_ids), reason,
                                         cumulative_logprob=h.sum_logprob))
    state = req.terminal_state().value if req.reclaimed else req.seqs[0].state.value
    return RequestOutput(req.request_id, req.prompt_token_ids, outs, req.finished, state,
                         req.seqs[0].num_cached_tokens, req.times,
                         num_generated_tokens=req.beam.num_generated)


def usage(state: BeamState, n: int, finished: bool) -> tuple[int, int, int, tuple[str | None, ...]]:
    """A beam request's usage-record counts (generated, emitted, committed, finish reasons): generated = every
    beam's tokens; emitted = committed = the returned hypotheses (none when the search was cut short: nothing was
    shown)."""
    shown = sum(len(h.token_ids) for h in state.finished[:n]) if finished else 0
    return state.num_generated, shown, shown, tuple(h.finish_reason for h in state.finished[:n])
