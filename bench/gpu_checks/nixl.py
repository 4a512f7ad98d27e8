"""nixl-vram: NIXL READ of KV blocks from a second process's VRAM pool against a device copy of the same bytes."""
from __future__ import annotations

import multiprocessing as mp
import time

from bench.gpu_checks import harness
from bench.gpu_checks.harness import Line, Skip, gpu_time, importable, need_cuda, sync


def _nixl_owner(conn, num_blocks: int, block_bytes: int, device: str) -> None:
    import torch

    from pdserve.kv_transfer.agent import KVAgent
    kv = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    agent = KVAgent("gpu-check-src", kv, _nixl_layout(block_bytes))
    agent.start_pump()
    conn.send((agent.region(), kv.sum(dtype=torch.int64).item()))
    conn.recv()
    agent.close()


def _nixl_layout(block_bytes: int) -> dict:
    return dict(fingerprint="gpu-check", block_size=16, dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1,
                block_bytes=block_bytes)


def check_nixl() -> Line:
    need_cuda()
    why = importable("pdserve.kv_transfer.agent")  # nixl_cu12 / nixl_cu13 (or an upstream `nixl`) and numpy
    if why:
        raise Skip(why)
    import torch

    from pdserve.kv_transfer.agent import KVAgent
    num_blocks, block_bytes = 256, 2 << 20  # 512 MiB of Llama-3-8B-sized blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_owner, args=(child, num_blocks, block_bytes, harness.DEVICE), daemon=True)
    proc.start()
    try:
        t_end = time.monotonic() + 120
        while not parent.poll(0.5):
            if not proc.is_alive():
                raise RuntimeError(f"the owner process exited ({proc.exitcode}) before publishing its region")
            if time.monotonic() > t_end:
                raise RuntimeError("the owner process did not publish its region within 120 s")
        region, checksum = parent.recv()
        kv = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=harness.DEVICE)
        me = KVAgent("gpu-check-dst", kv, _nixl_layout(block_bytes))
        ids = list(range(num_blocks))
        me.read_blocks(region, ids, ids)  # connection set-up
        sync()
        got = kv.sum(dtype=torch.int64).item()
        if got != checksum:
            return Line("nixl-vram", f"data mismatch: checksum {got} != {checksum}", "same bytes", "FAIL")
        t_nixl = gpu_time(lambda: me.read_blocks(region, ids, ids), reps=5, warmup=1)
        src = torch.ones_like(kv)
        t_copy = gpu_time(lambda: kv.copy_(src), reps=5)
        nbytes = num_blocks * block_bytes
        me.close()
    finally:
        parent.send("done")
        proc.join(30)
    return Line("nixl-vram", f"READ {nbytes >> 20} MiB in {num_blocks} blocks, {region.mem_type}->{me.mem_type}: {nbytes / t_nixl / 1e9:.1f} GB/s vs "
                f"device copy {nbytes / t_copy / 1e9:.1f} GB/s ({t_nixl / t_copy:.1f}x the copy's time)",
                "reported", "PASS")
