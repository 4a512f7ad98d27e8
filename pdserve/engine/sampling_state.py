"""Per-sequence (per-branch) sampling state: RNG, generated tokens, penalty counts, grammar.

Which tokens the counts include (spec §3.2 asks us to say so):
  * repetition_penalty: prompt + output tokens (as Hugging Face does);
  * frequency_penalty / presence_penalty: output tokens only (OpenAI meaning);
  * no_repeat_ngram_size: n-grams over prompt + output (as Hugging Face does);
  * bad words / banned sequences: matched against the generated (output) suffix only.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar import GrammarState

_GOLDEN = 0x9E3779B97F4A7C15  # spreads branch seeds apart so branch i of seed s != branch 0 of seed s+i


def branch_seed(seed: int, branch_index: int) -> int:
    """Seed of branch `branch_index`; branch 0 uses the request seed itself (n=1 and n>1 agree on it)."""
    return (seed + branch_index * _GOLDEN) % (1 << 64)


class _TokenCounts:
    """Distinct token ids with counts, kept as growable tensors so the sampler can gather them
    for a whole batch without a Python loop over the tokens of each sequence."""

    def __init__(self, ids: list[int]):
        uniq, cnt = torch.unique(torch.tensor(ids, dtype=torch.long), return_counts=True)
        cap = max(16, 2 * len(uniq))
        self._ids = torch.zeros(cap, dtype=torch.long)
        self._cnt = torch.zeros(cap, dtype=torch.float32)
        self.n = len(uniq)
        self._ids[: self.n] = uniq
        self._cnt[: self.n] = cnt.float()
        self._pos = {int(t): i for i, t in enumerate(uniq.tolist())}

    def add(self, tid: int) -> None:
        pos = self._pos.get(tid)
        if pos is not None:
            self._cnt[pos] += 1
            return
        if self.n == len(self._ids):
            self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
            self._cnt = torch.cat([self._cnt, torch.zeros_like(self._cnt)])
        self._ids[self.n] = tid
        self._cnt[self.n] = 1.0
        self._pos[tid] = self.n
        self.n += 1

    def ids(self) -> Tensor:
        return self._ids[: self.n]

    def counts(self) -> Tensor:
        return self._cnt[: self.n]

    def copy(self) -> "_TokenCounts":
        c = _TokenCounts([])
        c._ids, c._cnt, c.n, c._pos = self._ids.clone(), self._cnt.clone(), self.n, dict(self._pos)
        return c


class SamplingState:
    """Everything the sampler needs to remember about one sequence between steps.

    `bad_words_ids` (keyword, optional) are the token sequences banned by `params.bad_words`;
    the engine computes them once per request with `bad_words_to_ids(params.bad_words, tokenizer)`.
    `device` (keyword): where the request's generator lives, the logits' device, so that its draws are made there
    and never cross to the device per row. A seed gives the same stream on every worker of one device type (one
    draw per sampled token, which migration replay and the prefill hand-off count on); CPU (MT19937) and CUDA
    (Philox) generators give different streams for the same seed.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        vocab_size: int,
        eos_token_ids: list[int],
        grammar: "GrammarState | None" = None,
        branch_index: int = 0,
        *,
        bad_words_ids: list[list[int]] | None = None,
        device: torch.device | str = "cpu",
    ):
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.grammar = grammar
        self.branch_index = branch_index
        self.bad_words_ids = [list(s) for s in (bad_words_ids or []) if s]
        self.generator = _generator(params.seed, branch_index, torch.device(device))
        self.output_token_ids: list[int] = []
        self.cumulative_logprob: float = 0.0  # sum of raw model log-probs of the sampled tokens
        self.grammar_terminated = False
        self.dead_end = False  # a step found no legal token (see Sampler docs)

        p = params
        self.rep_counts = _TokenCounts(self.prompt_token_ids) if p.repetition_penalty != 1.0 else None
        self.out_counts = _TokenCounts([]) if (p.frequency_penalty or p.presence_penalty) else None
        self._ngrams: dict[tuple[int, ...], set[int]] | None = None
        if p.no_repeat_ngram_size > 0:
            self._ngrams = {}
            hist = self.prompt_token_ids
            for end in range(p.no_repeat_ngram_size, len(hist) + 1):
                self._add_ngram(hist[end - p.no_repeat_ngram_size : end])
        self.allowed_mask: Tensor | None = None
        self._allowed_mask_dev: Tensor | None = None  # a copy on the logits' device, made on first use there
        if p.allowed_token_ids is not None:
            self.allowed_mask = torch.zeros(vocab_size, dtype=torch.bool)
            self.allowed_mask[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = True
        self.bias_ids = torch.tensor([int(t) for t in p.logit_bias], dtype=torch.long)
        self.bias_vals = torch.tensor([float(v) for v in p.logit_bias.values()], dtype=torch.float32)

    # -- per-step constraint queries -------------------------------------------------------------
    @property
    def needs_logit_edit(self) -> bool:
        p = self.params
        return bool(
            self.rep_counts is not None or self.out_counts is not None or self._ngrams is not None
            or self.allowed_mask is not None or self.bias_ids.numel() or self.bad_words_ids
            or self.grammar is not None or len(self.output_token_ids) < p.min_tokens
        )

    def allowed_mask_on(self, device: torch.device) -> Tensor:
        """`allowed_mask` on `device` (copied once per request, not once per step)."""
        if self.allowed_mask.device == device:
            return self.allowed_mask
        if self._allowed_mask_dev is None or self._allowed_mask_dev.device != device:
            self._allowed_mask_dev = self.allowed_mask.to(device)
        return self._allowed_mask_dev

    def banned_tokens(self) -> list[int]:
        """Tokens illegal at this step because of the generated suffix / history (hard constraints)."""
        p, out = self.params, self.output_token_ids
        banned: list[int] = []
        for seq in self.bad_words_ids:
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and out[len(out) - len(seq) + 1 :] == seq[:-1]):
                banned.append(seq[-1])
        if self._ngrams is not None:
            n = p.no_repeat_ngram_size
            hist = self.prompt_token_ids + out if n > 1 else []
            banned.extend(self._ngrams.get(tuple(hist[len(hist) - n + 1 :]) if n > 1 else (), ()))
        if len(out) < p.min_tokens:  # min_tokens: EOS / stop tokens may not be sampled yet
            banned.extend(p.stop_token_ids)
            if not p.ignore_eos:
                banned.extend(self.eos_token_ids)
        return banned

    def _add_ngram(self, gram: list[int]) -> None:
        self._ngrams.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    # -- updates ---------------------------------------------------------------------------------
    def append(self, token_id: int) -> None:
        """Record a sampled token (the sampler calls this) and advance the grammar."""
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if self.rep_counts is not None:
            self.rep_counts.add(token_id)
        if self.out_counts is not None:
            self.out_counts.add(token_id)
        if self._ngrams is not None:
            n = self.params.no_repeat_ngram_size
            hist = self.prompt_token_ids[-n:] + self.output_token_ids[-n:]
            if len(hist) >= n:
                self._add_ngram(hist[-n:])
        if self.grammar is not None and not self.grammar_terminated and not self.dead_end:
            if not self.grammar.accept_token(token_id):
                self.dead_end = True  # cannot happen for a token the mask allowed
            self.grammar_terminated = self.grammar.is_terminated()

    def fork(self, branch_index: int) -> "SamplingState":
        """A new branch of the same request: same prompt and history so far, its own RNG stream
        (seeded from (seed, branch_index)), and a forked grammar matcher. The engine forks at the
        prompt (before the first token) and shares the prompt KV copy-on-write (spec Q24)."""
        s = object.__new__(SamplingState)
        s.__dict__.update(self.__dict__)
        s.branch_index = branch_index
        s.generator = _generator(self.params.seed, branch_index, self.generator.device)
        s.output_token_ids = list(self.output_token_ids)
        s.rep_counts = self.rep_counts.copy() if self.rep_counts is not None else None
        s.out_counts = self.out_counts.copy() if self.out_counts is not None else None
        s._ngrams = {k: set(v) for k, v in self._ngrams.items()} if self._ngrams is not None else None
        s.grammar = self.grammar.fork() if self.grammar is not None else None
        return s


def _generator(seed: int | None, branch_index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is not None:
        g.manual_seed(branch_seed(seed, branch_index))
    else:  # unseeded: fresh OS entropy, never the process-global RNG stream (spec §1.6)
        g.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return g


def bad_words_to_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Token sequences for `bad_words`: each word is banned both as-is and with a leading space,
    because byte-level BPE tokenises ' word' (mid-sentence) differently from 'word'."""
    seqs: list[list[int]] = []
    for word in bad_words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def select_best(states: list[SamplingState], n: int, length_normalize: bool = False) -> list[int]:
    """Indices of the best `n` of `best_of` branches, by cumulative raw log-probability
    (sum over generated tokens; `length_normalize` divides by the number of tokens, which removes
    the sum's preference for short outputs). Ties go to the lower branch index."""

    def score(i: int) -> float:
        s = states[i]
        lp = s.cumulative_logprob
        return lp / max(1, len(s.output_token_ids)) if length_normalize else lp

    order = sorted(range(len(states)), key=lambda i: (-score(i), states[i].branch_index))
    return order[:n]
