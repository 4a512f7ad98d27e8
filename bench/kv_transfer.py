"""NIXL KV block transfer throughput vs a plain torch copy of the same bytes.

    PYTHONPATH=. python bench/kv_transfer.py [--block-kib 128] [--device cpu] [--procs]

For each size (1..64 MB of blocks) one batched READ (one descriptor per block, prepped dlists) pulls a
scattered set of blocks; the baseline copies the same bytes with `dst.copy_(src)` (contiguous, the best case
for torch). `--procs` puts the source tensor in a second process (what the workers do).
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


def _layout(block_bytes: int) -> dict:
    return dict(fingerprint="bench", block_size=16, dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1,
                block_bytes=block_bytes)


def _owner(conn, num_blocks: int, block_bytes: int, device: str):
    kv = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    a = KVAgent("bench-src", kv, _layout(block_bytes))
    a.start_pump()  # the owner must progress UCX for remote READs to complete
    conn.send(a.region())
    conn.recv()


def _time(fn, reps: int) -> float:
    fn()  # warm-up (connection setup, page faults)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-kib", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--procs", action="store_true", help="source tensor in a second process")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--progress-thread", action="store_true", help="initiator uses NIXL's (busy) progress thread")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    bb = args.block_kib * 1024
    max_mb = 64
    nb = (max_mb << 20) // bb * 2  # room for scattered picks
    dst = torch.zeros((nb, bb), dtype=torch.uint8, device=args.device)
    local = KVAgent("bench-dst", dst, _layout(bb), progress_thread=args.progress_thread)
    proc = None
    if args.procs:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_owner, args=(child, nb, bb, args.device), daemon=True)
        proc.start()
        region = parent.recv()
        src_t = torch.randint(0, 255, (nb, bb), dtype=torch.uint8, device=args.device)  # for the torch baseline
    else:
        src_t = torch.randint(0, 255, (nb, bb), dtype=torch.uint8, device=args.device)
        src_agent = KVAgent("bench-src", src_t, _layout(bb))  # keep a reference: the agent owns the registration
        src_agent.start_pump()
        region = src_agent.region()
    where = "2 processes" if args.procs else "1 process, 2 agents"
    print(f"NIXL READ vs torch copy, {args.device}, block {args.block_kib} KiB, {where}")
    print(f"{'MB':>4} {'blocks':>6} {'nixl GB/s':>10} {'torch GB/s':>11} {'ratio':>6}")
    for mb in (1, 2, 4, 8, 16, 32, 64):
        k = (mb << 20) // bb
        perm = torch.randperm(nb)
        rb, lb = perm[:k].tolist(), perm[k:2 * k].tolist()  # scattered blocks on both sides
        nbytes = k * bb
        t_nixl = _time(lambda: local.read_blocks(region, rb, lb), args.reps)
        s, d = src_t[:k], dst[:k]
        t_copy = _time(lambda: d.copy_(s), args.reps)
        g1, g2 = nbytes / t_nixl / 1e9, nbytes / t_copy / 1e9
        print(f"{mb:>4} {k:>6} {g1:>10.2f} {g2:>11.2f} {g1 / g2:>6.2f}")
    if proc:
        parent.send("stop")
        proc.join(5)


if __name__ == "__main__":
    main()
