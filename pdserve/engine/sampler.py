"""Minimal sampler (greedy, temperature, top-k, top-p, seed); the full spec §3 pipeline replaces it."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams


class SamplingState:
    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                 eos_token_ids: list[int], grammar=None, branch_index: int = 0):
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.output_token_ids: list[int] = []
        self.cumulative_logprob = 0.0
        self.grammar = grammar
        self.grammar_terminated = False
        self.generator = torch.Generator()
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator.manual_seed(seed + branch_index)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleResult]:
        out = []
        logp_all = torch.log_softmax(logits, dim=-1)
        for row, st in zip(logits, states):
            p = st.params
            if p.temperature == 0.0:
                tok = int(torch.argmax(row))  # first maximum: lowest index wins ties
            else:
                z = row / p.temperature
                if p.top_k > 0:
                    kth = torch.topk(z, p.top_k).values[-1]
                    z = z.masked_fill(z < kth, float("-inf"))
                probs = torch.softmax(z, -1)
                if p.top_p < 1.0:
                    sp, si = probs.sort(descending=True)
                    keep = (sp.cumsum(0) - sp) < p.top_p
                    mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, si, keep)
                    probs = probs * mask
                tok = int(torch.multinomial(probs / probs.sum(), 1, generator=st.generator))
            lp = float(logp_all[len(out), tok])
            st.cumulative_logprob += lp
            st.append(tok)
            out.append(SampleResult(tok, lp, None))
        return out
