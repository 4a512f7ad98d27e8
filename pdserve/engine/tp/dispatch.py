"""Expert parallelism by all-to-all: each (token, expert) row goes only to the rank that holds the expert.

Every rank of the group runs the same step (rank 0 broadcasts the plan), so before a sparse layer every rank holds
every token's hidden row. The layer splits the step's T tokens into N contiguous slices of ceil(T / N) rows
(`token_slice`); rank r owns slice r:

1. it routes only its slice (the router runs once per token over the group, not N times);
2. it counts its (token, expert) rows per expert and the group all-gathers the counts ([N, E] integers): from them
   every rank knows how many rows it sends to and receives from every other rank, and every rank's `routed`
   counter sees every token (the expert-load metric stays whole on rank 0);
3. each token's hidden row goes once to each rank holding one or more of its experts (one row per (token, owner)
   pair, not per (token, expert): with top 8 of 256 experts over 8 ranks a token reaches ~5.3 ranks at uniform
   routing, not 8), followed by k (expert, routing weight) slots, in one all-to-all (`all_to_all_single`
   semantics, gloo on CPU, NCCL on CUDA);
4. the owner computes each (token, expert) row's output (moe.py: the native kernel or the loop; rows grouped by
   source, then expert), scales it by its weight and adds a token's terms in expert order into one partial row
   per pair;
5. a second all-to-all sends the partial rows back, and the source adds each token's partials in owner order:
   the same terms, in the same order and rounding, as the loop path's.

The layer then all-gathers the slices (decoder layer, model.py). What this moves per rank and step, against the
all-reduce combine, is in docs/engine.md ("Expert parallelism").
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def uses_all_to_all(dispatch: str, ranks: int, top_k: int, replicated_attention: bool) -> bool:
    """`--expert-dispatch`'s choice; `auto` takes all-to-all only where it moves fewer bytes per rank and step than
    the all-reduce combine, whatever the routing (docs/engine.md, "Expert parallelism"): a token travels to d <=
    min(k, N) ranks; with the attention tensor parallel, all-reduce 4(N-1)/N against at most (N-1)/N (2 + 2d/N)
    rows of hidden, so k < N; with it replicated, 2(N-1)/N against (N-1)/N (1 + 2d/N), so 2k < N. Where they may
    tie or all-to-all may move more, the all-reduce's fewer collectives win."""
    if dispatch != "auto":
        return dispatch == "all_to_all"
    return 2 * top_k < ranks if replicated_attention else top_k < ranks


def token_slice(t: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first, end, rows per slice) of rank `rank`'s share of a step's `t` tokens: contiguous slices of
    ceil(t / size) rows, the last ones short or empty."""
    per = -(-t // size)
    lo = min(t, rank * per)
    return lo, min(t, lo + per), per


class ExpertDispatch:
    """One sparse layer's dispatch and combine over the group `comm` (tp/comm.py); `experts`: those held here."""

    def __init__(self, comm, num_experts: int, experts: range):
        if num_experts % comm.size or len(experts) != num_experts // comm.size:
            raise ValueError(f"{num_experts} experts cannot be split whole over {comm.size} ranks")
        self.comm, self.num_experts, self.experts = comm, num_experts, experts

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [t, H]: this rank's tokens; weights, chosen [t, k]: their routing. `compute(rows, local_ids)` returns
        each row's expert output (local_ids: the expert's index among those held here). Returns the combined
        [t, H] output and the all-gathered counts per expert ([E], every rank's tokens)."""
        n, k, t, e = self.comm.size, chosen.shape[1], max(1, x.shape[0]), self.num_experts
        ids = chosen.flatten()
        owner = ids // len(self.experts)
        # one row per (owner, token) pair, however many of the token's experts the owner holds; pairs numbered by
        # owner, then token
        pairs, pair_of = torch.unique(owner * t + torch.arange(ids.numel(), device=x.device) // k, sorted=True,
                                      return_inverse=True)
        pair_token = pairs % t
        pairs_out = torch.bincount(pairs // t, minlength=n)
        both = self.comm.all_gather(torch.cat([torch.bincount(ids, minlength=e), pairs_out]).view(1, -1))
        counts, pair_counts = both[:, :e], both[:, e:]  # [source, expert], [source, owner]
        me = self.comm.rank
        send, recv = pair_counts[me].tolist(), pair_counts[:, me].tolist()
        # each pair's row: the token's hidden row, then k slots of (expert or -1, weight) in expert order, as bytes
        slot = torch.argsort(pair_of * e + ids)  # (pair, expert) rows; a token's experts are distinct
        ps = pair_of[slot]
        per_pair = torch.bincount(ps, minlength=pairs.numel())
        place = torch.arange(ids.numel(), device=x.device) - (torch.cumsum(per_pair, 0) - per_pair)[ps]
        meta = torch.full((pairs.numel(), 2, k), -1.0, dtype=torch.float64, device=x.device)
        meta[ps, 0, place] = ids[slot].double()
        meta[ps, 1, place] = weights.flatten()[slot].double()
        row = x.shape[1] * x.element_size()
        got = self.comm.all_to_all(torch.cat([x[pair_token].view(torch.uint8),
                                              meta.view(-1, 2 * k).view(torch.uint8)], 1), send, recv)
        hidden = got[:, :row].contiguous().view(x.dtype)
        meta = got[:, row:].contiguous().view(torch.float64).view(-1, 2, k)
        # the (pair, expert) rows in the order a source sorts them: by source, then expert, then token
        pair, j = torch.where(meta[:, 0] >= 0)
        expert = meta[pair, 0, j].long()
        src = torch.repeat_interleave(torch.arange(n, device=x.device), pair_counts[:, me])
        by = torch.argsort((src[pair] * e + expert) * max(1, hidden.shape[0]) + pair)
        pair, j, expert = pair[by], j[by], expert[by]
        out_rows = compute(hidden[pair], expert - self.experts.start)
        # each token's terms added in expert order, here and then across owners at the source: the same sums, in
        # the same order and rounding, as adding every (token, expert) row at the source
        partial = torch.zeros_like(hidden)
        partial.index_add_(0, pair, (out_rows * meta[pair, 1, j, None].to(weights.dtype)).to(x.dtype))
        back = self.comm.all_to_all(partial, recv, send)
        out = torch.zeros_like(x)
        out.index_add_(0, pair_token, back)
        return out, counts.sum(0)
