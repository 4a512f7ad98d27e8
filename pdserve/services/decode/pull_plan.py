"""Which of a prompt's blocks the decode side pulls: the ones its own prefix cache does not already hold.

The decode engine allocates the prompt's blocks and looks up its prefix cache in one step
(`EngineCore.allocate_prefilled`): the first `cached` blocks of its block table already hold the prompt's first
`cached * block_size` tokens (the next turn of a chat finds the last turn there). The prefill worker's handle lists
its blocks for the same tokens in the same order, so block i there is block i here: the pull is the tail
`[cached, need)` of both lists, `need` the blocks the prompt fills. A hit never covers the block holding the last
prompt token (block_manager.lookup), so at least one block always moves.

A model whose every layer is windowed releases, on both sides, the leading blocks before the window of the first
decode (block_manager.release_out_of_window): their ids are -1 (HOLE) in both lists and they are not pulled. A hole
on the prefill side where this side holds a block would mean the two disagree on the window: refused.
"""
from __future__ import annotations

from dataclasses import dataclass

HOLE = -1  # block_manager.HOLE (a released block), repeated here: this module imports nothing of the engine


@dataclass(frozen=True)
class PullPlan:
    src: list[int]  # the prefill worker's block ids to read
    dst: list[int]  # this worker's block ids they land in, pairwise
    reused: int  # leading blocks this worker's prefix cache supplied, not pulled


def pull_plan(src_blocks: list[int], dst_blocks: list[int], cached: int, num_tokens: int,
              block_size: int) -> PullPlan:
    need = -(-num_tokens // block_size)
    if not 0 <= cached <= need or len(src_blocks) < need or len(dst_blocks) < need:
        raise ValueError(f"bad pull: {cached} cached of {need} blocks, {len(src_blocks)} source and "
                         f"{len(dst_blocks)} destination blocks")
    pairs = [(s, d) for s, d in zip(src_blocks[cached:need], dst_blocks[cached:need]) if d != HOLE]
    if any(s == HOLE for s, _ in pairs):
        raise ValueError("bad pull: the prefill worker released a block this worker needs (different windows?)")
    return PullPlan([s for s, _ in pairs], [d for _, d in pairs], cached)
