"""A decode worker's pull of a prefill worker's KV, at any pair of TP degrees.

`read_for_rank` is one local pool's part: plan its head slices (tp_plan.py) over the peer's pools, then one
batched READ per peer pool (or the prepped whole-block READ when both sides hold the same heads).

Staging. A slice that is a whole remote pool but part of the local one (prefill TP > decode TP: the production
shape, wide prefill, narrow decode) is read one descriptor per block into a registered scratch tensor and then
copied into the pool's head range on the device (`index_copy_`): the same bytes move, but per-row descriptors
cost ~10x more per byte than whole blocks between two processes here (docs/kv_transfer.md, bench/kv_transfer_tp.py).
A slice that is part of the remote pool (prefill TP < decode TP) keeps per-row descriptors: staging it would read
heads this rank does not hold. `PDSERVE_KV_TP_STAGING` chooses: `exact` (the default: stage only what moves no
extra bytes), `always` (stage every partial slice, reading the remote pool's other heads too: on one host,
where a descriptor costs a syscall, that is still faster; over a network it multiplies the bytes on the wire by
decode TP / prefill TP), `off` (per-row descriptors throughout). `KvPuller` is
the worker's: rank 0 sends every other rank its part over the side channel (tp_ranks.py), reads its own, and
waits for all of them before it answers, success or not, so no READ is still writing into blocks the caller
may free.

The lease's NIXL notification (the prefill side frees its blocks on it) is attached only when the whole pull
is one READ: with several, the first to finish would free blocks the others are still reading. Multi-READ
pulls are released by the decode side's ReleaseKV call, sent after every READ finished.
"""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from pdserve import env_knobs
from pdserve.kv_transfer.agent import KVAgent
from pdserve.kv_transfer.layout import KVRegion
from pdserve.kv_transfer.tp_plan import descs, plan_reads, whole


def read_for_rank(agent: KVAgent, regions: list[KVRegion], src: list[int], dst: list[int], notif: bytes = b"",
                  timeout_s: float = 30.0) -> int:
    """Pull this pool's heads of blocks `src` (every pool of the peer: `regions`, rank order) into `dst`; return
    bytes moved. Raises KVLayoutMismatch (incompatible peer), KVTransferError, ValueError (bad block ids)."""
    if len(src) != len(dst):
        raise ValueError("remote and local block lists differ in length")
    if not src:
        return 0
    local = agent.layout
    slices = plan_reads(local, [r.layout for r in regions])
    if max(dst) >= agent.num_blocks or min(dst) < 0 or min(src) < 0 or \
            any(max(src) >= regions[s.remote].num_blocks for s in slices):
        raise ValueError("block id out of range")
    if len(slices) == 1 and whole(slices[0], local, regions[slices[0].remote].layout):
        return agent.read_blocks(regions[slices[0].remote], src, dst, notif, timeout_s)
    mode = staging_mode()
    staged = [s for s in slices if agent.kv.dim() == 6 and not whole(s, local, regions[s.remote].layout) and
              (mode == "always" or (mode == "exact" and s.count == regions[s.remote].layout.num_kv_heads))]
    if not staged:
        return _read(agent, regions, slices, [], None, src, dst, notif, timeout_s)
    # one scratch tensor: [slice][block] of the remote pools' whole blocks (a TP group's pools are all one size)
    heads, lay = regions[staged[0].remote].layout.num_kv_heads, local
    with agent.staging((len(staged), len(src), lay.num_layers, 2, lay.block_size, heads, lay.head_dim),
                       agent.kv.dtype) as stage:
        return _read(agent, regions, slices, staged, stage, src, dst, notif, timeout_s)


def _read(agent: KVAgent, regions: list[KVRegion], slices: list, staged: list, stage, src: list[int],
          dst: list[int], notif: bytes, timeout_s: float) -> int:
    local = agent.layout
    per_peer: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for s in slices:
        r = regions[s.remote]
        lo, re_ = per_peer.setdefault(s.remote, ([], []))
        if s in staged:
            base = stage[staged.index(s)].data_ptr()
            lo.append(descs(r.layout, base, list(range(len(src))), 0, r.layout.num_kv_heads, agent.device_id, True))
            re_.append(descs(r.layout, r.base_addr, src, 0, r.layout.num_kv_heads, r.device_id, True))
            continue
        w = whole(s, local, r.layout)
        lo.append(descs(local, agent.kv.data_ptr(), dst, s.local_head, s.count, agent.device_id, w))
        re_.append(descs(r.layout, r.base_addr, src, s.remote_head, s.count, r.device_id, w))
    reads = [(regions[i], np.concatenate(lo), np.concatenate(re_)) for i, (lo, re_) in sorted(per_peer.items())]
    moved = agent.read_descs(reads, notif if len(reads) == 1 else b"", timeout_s)
    if staged:
        idx = torch.tensor(dst, dtype=torch.long, device=agent.kv.device)
        for k, s in enumerate(staged):  # the remote pool's heads, into their range of ours
            agent.kv.narrow(4, s.local_head, s.count).index_copy_(0, idx, stage[k].narrow(4, s.remote_head, s.count))
        if agent.kv.device.type == "cuda":  # in place before the caller commits, and before the kept staging
            torch.cuda.current_stream(agent.kv.device).synchronize()  # buffer is written by the next pull
    return moved


def staging_mode() -> str:
    """`exact` | `always` | `off` (PDSERVE_KV_TP_STAGING; 0/false/no mean off)."""
    v = env_knobs.get("PDSERVE_KV_TP_STAGING").lower()
    if v in ("0", "false", "no", "off"):
        return "off"
    return "always" if v == "always" else "exact"


class KvPuller:
    def __init__(self, agent: KVAgent, ranks=None):
        """`ranks`: tp_ranks.RankAgents of this worker's other TP ranks (None without tensor parallelism)."""
        self.agent = agent
        self.ranks = ranks

    def single_read(self, regions: list[KVRegion]) -> bool:
        """The whole pull is one READ (so the lease's notification may ride on it)."""
        if self.ranks is not None:
            return False
        return len({s.remote for s in plan_reads(self.agent.layout, [r.layout for r in regions])}) == 1

    def read(self, regions: list[KVRegion], src: list[int], dst: list[int], notif: bytes = b"",
             timeout_s: float = 30.0) -> int:
        """Every local rank pulls its heads; returns the bytes moved by all; raises the first failure after all
        of them ended."""
        others: list[Future] = self.ranks.read(regions, src, dst, timeout_s) if self.ranks is not None else []
        n, failure = 0, None
        try:
            n = read_for_rank(self.agent, regions, src, dst, notif if self.single_read(regions) else b"", timeout_s)
        except BaseException as e:
            failure = e
        for fut in others:  # each ends by its own READ timeout; the side channel fails them if a rank is gone
            try:
                n += self.ranks.result(fut, timeout_s)
            except BaseException as e:
                failure = failure or e
        if failure is not None:
            raise failure
        return n

    def forget_remote(self, agent_name: str) -> None:
        self.agent.forget_remote(agent_name)
        if self.ranks is not None:
            self.ranks.forget_remote(agent_name)
