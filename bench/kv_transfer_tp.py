"""KV pull between pools of different TP degrees: descriptors per READ, bytes and time (kv_transfer/tp_plan.py).

    PYTHONPATH=. python bench/kv_transfer_tp.py [--layers 16] [--kv-heads 8] [--head-dim 128] [--blocks 32]

`PDSERVE_KV_TP_STAGING=exact|always|off` picks the path for partial slices (tp_pull.py).

A second process holds the prefill side's pools (one NIXL agent per rank, as a TP prefill worker's ranks do);
this process plays each decode rank in turn (a decode worker's ranks read at the same time, from their own
processes; here one after the other, so the figure per rank is uncontended). Per (prefill TP, decode TP) pair:
the READs one decode rank issues, their descriptors, the bytes it moves, the median time and GB/s, and whether
the pulled pool equals the reference slice. Equal shards use one descriptor per block (the prepped path);
unequal shards one per (block, layer, K/V, token) row, `heads` long: the row count is what costs.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdserve.engine.cpu_isa import cpu_flags, cpu_model  # noqa: E402
from pdserve.engine.tp.shard import kv_head_range  # noqa: E402
from pdserve.kv_transfer.agent import KVAgent  # noqa: E402
from pdserve.kv_transfer.layout import KVLayout  # noqa: E402
from pdserve.kv_transfer.tp_plan import plan_reads, whole  # noqa: E402
from pdserve.kv_transfer.tp_pull import read_for_rank, staging_mode  # noqa: E402

BS = 16
DTYPE = torch.bfloat16


def layout(a, tp: int, rank: int) -> KVLayout:
    h = kv_head_range(a.kv_heads, rank, tp)
    return KVLayout("bench-tp", BS, "bfloat16", a.layers, len(h), a.head_dim,
                    a.layers * 2 * BS * len(h) * a.head_dim * 2, tp, rank, h.start, a.kv_heads)


def full_kv(a) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn((a.pool_blocks, a.layers, 2, BS, a.kv_heads, a.head_dim), generator=g).to(DTYPE)


def _owner(conn, a, tp: int):
    full = full_kv(a)
    agents = []
    for r in range(tp):
        h = kv_head_range(a.kv_heads, r, tp)
        agents.append(KVAgent(f"bench-pre{tp}-r{r}", full[:, :, :, :, h.start:h.stop].contiguous(), layout(a, tp, r)))
        agents[-1].start_pump()
    conn.send([x.region() for x in agents])
    conn.recv()
    for x in agents:
        x.close()


def cpu_line() -> str:
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
    return f"{cpu_model()}; flags {flags}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=32, help="blocks pulled per READ")
    ap.add_argument("--pool-blocks", type=int, default=96)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pairs", default="1:1,1:2,2:1,2:2")
    a = ap.parse_args()
    print(f"CPU: {cpu_line()}, {torch.get_num_threads()} torch threads")
    print(f"layout: {a.layers} layers, {a.kv_heads} KV heads x {a.head_dim}, block {BS} tokens, bf16; "
          f"{a.blocks} blocks pulled of {a.pool_blocks}")
    full = full_kv(a)
    src = list(range(0, 2 * a.blocks, 2))
    dst = list(range(a.pool_blocks - a.blocks, a.pool_blocks))
    ctx = mp.get_context("spawn")
    print(f"staging: {staging_mode()}")
    print("| P TP -> D TP | decode rank | READs | path | descriptors | MiB read | median ms | GB/s | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    owners = {}
    for pair in a.pairs.split(","):
        p, d = (int(x) for x in pair.split(":"))
        if p not in owners:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_owner, args=(child, a, p), daemon=True)
            proc.start()
            owners[p] = (proc, parent, parent.recv())
        regions = owners[p][2]
        for j in range(d):
            lay = layout(a, d, j)
            pool = torch.zeros((a.pool_blocks, a.layers, 2, BS, lay.num_kv_heads, a.head_dim), dtype=DTYPE)
            agent = KVAgent(f"bench-dec{p}{d}-r{j}", pool, lay)
            slices = plan_reads(lay, [r.layout for r in regions])
            rows, mode = a.layers * 2 * BS, staging_mode()
            paths, ndesc = set(), 0
            for s in slices:
                rl = regions[s.remote].layout
                if whole(s, lay, rl):
                    paths.add("block")
                elif mode == "always" or (mode == "exact" and s.count == rl.num_kv_heads):
                    paths.add("staged")
                else:
                    paths.add("rows")
                ndesc += len(src) * (rows if "rows" in paths and not whole(s, lay, rl) and
                                     not (mode == "always" or (mode == "exact" and s.count == rl.num_kv_heads)) else 1)
            times = []
            for i in range(a.reps + 1):
                t = time.perf_counter()
                n = read_for_rank(agent, regions, src, dst, timeout_s=60)
                if i:
                    times.append(time.perf_counter() - t)
            h = lay.heads
            ok = torch.equal(pool[dst], full[src][:, :, :, :, h.start:h.stop])
            med = statistics.median(times)
            print(f"| {p} -> {d} | {j} | {len({s.remote for s in slices})} | {'+'.join(sorted(paths))} | {ndesc} | "
                  f"{n / 2**20:.1f} | "
                  f"{med * 1e3:.2f} | {n / med / 1e9:.2f} | {ok} |")
            agent.close()
    for proc, conn, _ in owners.values():
        conn.send("stop")
        proc.join(10)


if __name__ == "__main__":
    main()
