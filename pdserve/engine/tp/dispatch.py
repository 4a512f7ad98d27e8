"""Expert parallelism by all-to-all: each (token, expert) row goes only to the rank that holds the expert.

Every rank of the group runs the same step (rank 0 broadcasts the plan), so before a sparse layer every rank holds
every token's hidden row. The layer splits the step's T tokens into N contiguous slices of ceil(T / N) rows
(`token_slice`); rank r owns slice r:

1. it routes only its slice (the router runs once per token over the group, not N times);
2. it counts its (token, expert) rows per expert and the group all-gathers the counts ([N, E] integers): from them
   every rank knows how many rows it sends to and receives from every other rank, and every rank's `routed`
   counter sees every token (the expert-load metric stays whole on rank 0);
3. its rows, sorted by expert, go to the experts' owners in one all-to-all (`all_to_all_single` semantics,
   gloo on CPU, NCCL on CUDA); a rank receives them grouped by source rank, then by expert;
4. the owner computes each received row's expert output, unweighted (moe.py: the native kernel or the loop);
5. a second all-to-all sends the outputs back in the same order, and the source scales each by its routing
   weight and adds them per token in expert order (the loop path's order and rounding).

The layer then all-gathers the slices (decoder layer, model.py). What this moves per rank and step, against the
all-reduce combine, is in docs/engine.md ("Expert parallelism").
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def uses_all_to_all(dispatch: str, ranks: int, top_k: int, replicated_attention: bool) -> bool:
    """`--expert-dispatch`'s choice; `auto` takes all-to-all only where it moves fewer bytes per rank and step than
    the all-reduce combine (docs/engine.md, "Expert parallelism"): with the attention tensor parallel, all-reduce
    4(N-1)/N against (N-1)/N (2 + 2k/N) rows of hidden, so k < N; with it replicated, 2(N-1)/N against
    (N-1)/N (1 + 2k/N), so 2k < N. Where they tie or all-to-all moves more, the all-reduce's fewer collectives win."""
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

    def counts(self, chosen: torch.Tensor) -> torch.Tensor:
        """[N, E]: how many rows each rank's slice routes to each expert (every rank's, all-gathered)."""
        local = torch.bincount(chosen.flatten(), minlength=self.num_experts).view(1, -1)
        return self.comm.all_gather(local)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [t, H]: this rank's tokens; weights, chosen [t, k]: their routing. `compute(rows, local_ids)` returns
        each row's expert output (local_ids: the expert's index among those held here). Returns the combined
        [t, H] output and the all-gathered counts per expert ([E], every rank's tokens)."""
        n, k = self.comm.size, chosen.shape[1]
        ids = chosen.flatten()
        order = torch.argsort(ids, stable=True)  # by expert, so by owner rank; stable: token order within one
        token = order // k
        counts = self.counts(chosen)
        per_rank = counts.view(n, n, -1).sum(-1)  # [source, owner] rows
        send, recv = per_rank[self.comm.rank].tolist(), per_rank[:, self.comm.rank].tolist()
        got = self.comm.all_to_all(x[token], send, recv)
        mine = counts[:, self.experts.start:self.experts.stop]  # [source, local expert]: rows, in arrival order
        local = torch.arange(len(self.experts), device=x.device).repeat(n).repeat_interleave(mine.flatten())
        back = self.comm.all_to_all(compute(got, local), recv, send)
        out = torch.zeros_like(x)
        out.index_add_(0, token, (back * weights.flatten()[order, None]).to(x.dtype))
        return out, counts.sum(0)
