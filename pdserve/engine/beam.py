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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sequence import Sequence


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
