"""Prompt-lookup (n-gram) proposer: no second model. The candidates are what followed the latest earlier
occurrence of the sequence's last n tokens (n from NGRAM_MAX down to NGRAM_MIN), in the prompt or the output.

A proposal is a point mass q (the proposer is deterministic), so verification reduces to "sample the target at
each position and keep going while it equals the candidate" (verify.py): accepting d with probability p(d) and
otherwise drawing from norm(max(0, p - q)) = p without d is exactly one draw from p compared with d.

Per sequence an index maps each n-gram to the end of its latest occurrence; it is extended with the tokens
appended since the last call (O(new tokens) per step, not a rescan of the context).
"""
from __future__ import annotations

from pdserve.engine.sequence import Sequence

NGRAM_MAX = 4
NGRAM_MIN = 2  # a single-token match predicts too little: it mostly buys a rejected verification


class _Index:
    __slots__ = ("ends", "upto")

    def __init__(self):
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.upto = 0  # n-grams ending at positions < upto are indexed


class NgramProposer:
    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._index: dict[int, _Index] = {}  # seq_id -> index

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[list[int], None]]:
        """Up to ks[i] candidates for each sequence (possibly none); q is a point mass (None)."""
        return [(self._one(seq, k), None) for seq, k in zip(seqs, ks)]

    def _one(self, seq: Sequence, k: int) -> list[int]:
        toks = seq.token_ids
        L = len(toks)
        idx = self._index.get(seq.seq_id)
        if idx is None:
            idx = self._index[seq.seq_id] = _Index()
        # Index every n-gram ending before the last position (the suffix itself must not match itself).
        for end in range(max(idx.upto, 1), L):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                idx.ends[tuple(toks[end - n:end])] = end
        idx.upto = max(idx.upto, L)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            end = idx.ends.get(tuple(toks[L - n:]))
            if end is not None:
                return list(toks[end:end + k])
        return []

    def forget(self, live_seq_ids: set[int]) -> None:
        for sid in [s for s in self._index if s not in live_seq_ids]:
            del self._index[sid]
