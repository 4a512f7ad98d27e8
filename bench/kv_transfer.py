"""NIXL KV block transfer throughput vs a plain torch copy of the same bytes.

    PYTHONPATH=. python bench/kv_transfer.py [--procs] [--cache warm,cold] [--no-huge-pages] [--block-kib 128]

For each size (1..64 MB of blocks) one batched READ (one descriptor per block, prepped dlists) pulls a
scattered set of blocks; the baseline copies the same number of bytes with `dst.copy_(src)` (contiguous, the
best case for torch, 1 torch thread). `--procs` puts the source tensor in a second process (what the workers
do). Both sides get the same treatment:

- memory: every tensor involved (NIXL's source and destination pools, torch's source and destination) is backed
  by the same kind of pages: transparent huge pages as `KVAgent` sets up by default, or 4 KiB pages with
  `--no-huge-pages` (then the agents do not collapse either).
- cache: `warm` repeats the same blocks / the same slices, so from the second repetition both sides find src
  and dst in the L3 (up to its size: 32 MB here); `cold` rotates each side through disjoint block sets / slices
  so that ~3x the L3 is touched between two uses of a set: both sides read and write DRAM (what a KV handoff
  sees: the prefill forward and the decode pool's free blocks evict the blocks in between). In `cold` the two
  sides alternate repetition by repetition (one process, same moment); in `warm` each side runs its repetitions
  back to back (interleaving would evict the other side's working set).
Medians of --reps repetitions after one untimed pass over every set (connection set-up, page faults).
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

from pdserve.kv_transfer.agent import KVAgent  # noqa: E402
from pdserve.kv_transfer.hugepages import use_huge_pages  # noqa: E402


def _layout(block_bytes: int) -> dict:
    return dict(fingerprint="bench", block_size=16, dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1,
                block_bytes=block_bytes)


def _l3_bytes() -> int:
    try:
        s = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(s[:-1]) << {"K": 10, "M": 20}[s[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def _owner(conn, num_blocks: int, block_bytes: int, device: str, huge: bool):
    kv = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    a = KVAgent("bench-src", kv, _layout(block_bytes), huge_pages=huge)
    a.start_pump()  # the owner must progress UCX for remote READs to complete
    conn.send(a.region())
    conn.recv()
    a.close()  # stop the pump before the agent goes: a NIXL thread outliving it aborts the process


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-kib", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--procs", action="store_true", help="source tensor in a second process")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cache", default="warm,cold", help="warm, cold or both (comma-separated)")
    ap.add_argument("--no-huge-pages", action="store_true", help="4 KiB pages everywhere (agents and baseline)")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="MB per transfer")
    ap.add_argument("--progress-thread", action="store_true", help="initiator uses NIXL's (busy) progress thread")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    huge = not args.no_huge_pages
    sizes = [int(s) for s in args.sizes.split(",")]
    bb = args.block_kib * 1024
    l3 = _l3_bytes()
    nb = max(max(sizes) << 21, 4 * l3) // bb  # room for scattered picks and for the cold rotation's sets
    dst = torch.zeros((nb, bb), dtype=torch.uint8, device=args.device)
    local = KVAgent("bench-dst", dst, _layout(bb), progress_thread=args.progress_thread, huge_pages=huge)
    proc = None
    if args.procs:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_owner, args=(child, nb, bb, args.device, huge), daemon=True)
        proc.start()
        region = parent.recv()
        src_t = torch.randint(0, 255, (nb, bb), dtype=torch.uint8, device=args.device)  # for the torch baseline
        if huge:
            use_huge_pages(src_t)  # the same pages as NIXL's source pool
    else:
        src_t = torch.randint(0, 255, (nb, bb), dtype=torch.uint8, device=args.device)
        src_agent = KVAgent("bench-src", src_t, _layout(bb), huge_pages=huge)  # keep: it owns the registration
        src_agent.start_pump()
        region = src_agent.region()
    where = "2 processes" if args.procs else "1 process, 2 agents"
    pages = "2 MiB huge pages" if huge and local.huge_page_bytes else "4 KiB pages"
    print(f"NIXL READ vs torch copy, {args.device}, block {args.block_kib} KiB, {where}, {pages}, "
          f"L3 {l3 >> 20} MB, medians of {args.reps}")
    print(f"{'MB':>4} {'blocks':>6} {'cache':>5} {'sets':>4} {'nixl GB/s':>10} {'torch GB/s':>11} {'ratio':>6}")
    for cache in args.cache.split(","):
        for mb in sizes:
            k = (mb << 20) // bb
            nbytes = k * bb
            # cold: enough disjoint sets that ~3x L3 is touched (src + dst) before a set comes round again
            sets = 1 if cache == "warm" else min(nb // k, max(2, -(-3 * l3 // (2 * nbytes)) + 1))
            rperm, lperm = torch.randperm(nb).tolist(), torch.randperm(nb).tolist()
            picks = [(rperm[i * k:(i + 1) * k], lperm[i * k:(i + 1) * k]) for i in range(sets)]  # scattered
            slices = [(src_t[i * k:(i + 1) * k], dst[((i + 1) % sets) * k:((i + 1) % sets + 1) * k])
                      for i in range(sets)]  # contiguous

            def nixl(i):
                rb, lb = picks[i % sets]
                local.read_blocks(region, rb, lb)

            def copy(i):
                s, d = slices[i % sets]
                d.copy_(s)

            for i in range(sets):  # untimed pass: connection, page faults, first touch of every set
                nixl(i)
                copy(i)
            if cache == "warm":
                tn = [_timed(lambda: nixl(0)) for _ in range(args.reps)]
                tc = [_timed(lambda: copy(0)) for _ in range(args.reps)]
            else:
                tn, tc = [], []
                for i in range(args.reps):
                    tn.append(_timed(lambda: nixl(i)))
                    tc.append(_timed(lambda: copy(i)))
            g1, g2 = nbytes / statistics.median(tn) / 1e9, nbytes / statistics.median(tc) / 1e9
            print(f"{mb:>4} {k:>6} {cache:>5} {sets:>4} {g1:>10.2f} {g2:>11.2f} {g1 / g2:>6.2f}", flush=True)
    if proc:
        parent.send("stop")
        proc.join(5)
    else:
        src_agent.close()
    local.close()


if __name__ == "__main__":
    main()
