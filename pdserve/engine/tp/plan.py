"""One step's work in a form every rank can execute: what rank 0 broadcasts to the others.

A plan carries only what the forward needs (the chunk's token ids, where it starts, the block table over the
context after the step, which rows want logits) plus the KV block operations the scheduler did since the last
plan (copy-on-write copies, swaps), in order: every rank's pool holds its heads for the same block ids, so the
other ranks replay them before the forward. Sequences, sampling state and the block manager stay on rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PlanItem:
    tokens: list[int]  # token ids computed this step
    first: int  # position of tokens[0] (tokens already computed before this step)
    block_table: list[int]  # blocks covering positions [0, first + len(tokens))
    samples: bool  # its last row is sampled
    prompt_logits: bool  # every row of the chunk wants logits (prompt logprobs)


@dataclass
class KvOp:
    kind: str  # "copy" (device -> device), "swap_out" (device -> host), "swap_in" (host -> device)
    pairs: list[tuple[int, int]]


@dataclass
class StepPlan:
    items: list[PlanItem]
    kv_ops: list[KvOp] = field(default_factory=list)


def plan_of(batch, prompt_logits: set[int], block_size: int) -> StepPlan:
    """The plan of a scheduler tick (`batch`: scheduler.ScheduledSeq; `prompt_logits`: indexes into it)."""
    items = []
    for i, item in enumerate(batch):
        seq, n = item.seq, item.num_tokens
        first = seq.num_computed_tokens
        # A plan lives for one step: it is turned into tensors (and, with TP, pickled for the other ranks) before
        # the scheduler touches a sequence again. So a block table that is exactly the step's is shared, not
        # copied (a saving within noise: docs/engine.md, "Host overhead"). The token slice is a copy.
        table, nb = seq.block_table, -(-(first + n) // block_size)
        items.append(PlanItem(seq.token_ids[first:first + n], first, table if len(table) == nb else table[:nb],
                              item.samples, i in prompt_logits))
    return StepPlan(items)
