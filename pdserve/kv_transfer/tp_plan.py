"""Which KV head slices a decode pool reads from which prefill pools, when the two workers run different TP degrees.

Every pool holds the same block ids for its own heads (engine/tp/shard.py: rank r of N holds heads
[r*K/N, (r+1)*K/N), or one replicated head when K < N). A local pool needs every head in `local.heads`; each
comes from a remote pool holding it. Consecutive local heads from the same remote pool form one slice. When a
head is held by several remote pools (replicated, K < remote TP), local rank r takes holder r % holders, so the
decode ranks spread their reads over the prefill ranks.

Descriptors: the pool is [block][layer][K/V][token][head][head_dim], so the heads of one token row are
contiguous but a head range is not contiguous within a block. A slice that is a whole pool on both sides (equal
shards: TP 1 -> 1, 2 -> 2, or a replicated head) is one descriptor per block; any other slice is one
descriptor per (block, layer, K/V, token) row, `count` heads long. All slices from one remote pool go in one
batched READ. (vLLM's NIXL connector avoids per-row descriptors by keeping its pools head-major, "HND", so a
head range is contiguous per (block, layer); here that would mean a different attention layout; see
docs/kv_transfer.md for the cost.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch, check_compatible


@dataclass(frozen=True)
class HeadSlice:
    remote: int  # index of the remote pool (its TP rank)
    remote_head: int  # first head, counted within the remote pool
    local_head: int  # first head, counted within the local pool
    count: int


def check_ranks(remotes: list[KVLayout]) -> None:
    """A peer's pools must be ranks 0..N-1 of one TP group covering every KV head; KVLayoutMismatch otherwise."""
    n = len(remotes)
    bad: dict[str, tuple[object, object]] = {}
    if not remotes:
        bad["tp_regions"] = ("at least one", 0)
    for i, r in enumerate(remotes):
        if r.tp_size != n:
            bad[f"tp_size (rank {i})"] = (n, r.tp_size)
        if r.tp_rank != i:
            bad[f"tp_rank (region {i})"] = (i, r.tp_rank)
        if r.heads.start < 0 or r.heads.stop > r.total_kv_heads:
            bad[f"kv_head_start (rank {i})"] = (f"heads within 0..{r.total_kv_heads}", f"{r.heads}")
    if remotes and not bad:
        held = set().union(*(set(r.heads) for r in remotes))
        if held != set(range(remotes[0].total_kv_heads)):
            bad["kv heads held"] = (f"0..{remotes[0].total_kv_heads - 1}", sorted(held))
    if bad:
        raise KVLayoutMismatch(bad)


def plan_reads(local: KVLayout, remotes: list[KVLayout]) -> list[HeadSlice]:
    """The head slices `local` reads, in local head order. Raises KVLayoutMismatch on incompatible layouts."""
    for r in remotes:
        check_compatible(local, r)
    check_ranks(remotes)
    slices: list[HeadSlice] = []
    for j, h in enumerate(local.heads):
        holders = [i for i, r in enumerate(remotes) if h in r.heads]
        src = holders[local.tp_rank % len(holders)]
        rh = h - remotes[src].kv_head_start
        last = slices[-1] if slices else None
        if last is not None and last.remote == src and last.remote_head + last.count == rh:
            slices[-1] = HeadSlice(src, last.remote_head, last.local_head, last.count + 1)
        else:
            slices.append(HeadSlice(src, rh, j, 1))
    return slices


def whole(s: HeadSlice, local: KVLayout, remote: KVLayout) -> bool:
    """The slice is both pools entirely: block-sized descriptors."""
    return s.count == local.num_kv_heads == remote.num_kv_heads


def descs(layout: KVLayout, base: int, block_ids: list[int], first_head: int, count: int, dev: int,
          whole_block: bool) -> np.ndarray:
    """NIXL descriptors (address, length, device) for heads [first_head, first_head + count) of the pool's heads
    in each of `block_ids`: one per block, or one per (block, layer, K/V, token) row."""
    blocks = np.asarray(block_ids, dtype=np.uint64) * np.uint64(layout.block_bytes) + np.uint64(base)
    if whole_block:
        addr, length = blocks, layout.block_bytes
    else:
        head_bytes = layout.row_bytes // layout.num_kv_heads
        rows = np.arange(layout.num_layers * 2 * layout.block_size, dtype=np.uint64) * np.uint64(layout.row_bytes)
        addr = (blocks[:, None] + rows[None, :] + np.uint64(first_head * head_bytes)).reshape(-1)
        length = count * head_bytes
    a = np.empty((addr.shape[0], 3), dtype=np.uint64)
    a[:, 0] = addr
    a[:, 1] = length
    a[:, 2] = dev
    return a
