"""`python -m pdserve.engine.tp.rank ARGS`: a TP rank other than 0 (started by group.py).

It loads its shard of the weights, sizes its KV pool with the other ranks (the smallest count everywhere: the
same block ids on every rank), then runs
every step plan rank 0 broadcasts, until an empty plan (stop) or rank 0 vanishes (PR_SET_PDEATHSIG, or a failed
collective)."""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import sys

import torch

log = logging.getLogger("pdserve.engine.tp.rank")


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when rank 0 (its parent) exits, however it exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent was already gone before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    from pdserve.engine.tp.group import RankArgs
    a = RankArgs(**json.loads(argv[0]))
    die_with_parent(a.parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{a.rank} %(levelname)s %(message)s")
    from pdserve.engine.config import DTYPES, EngineConfig, ModelConfig
    from pdserve.engine.kv_cache import KVCache
    from pdserve.engine.kv_sizing import block_bytes_for, swap_blocks
    from pdserve.engine.kv_sizing import num_blocks as kv_pool_blocks
    from pdserve.engine.loader import load_state_dict
    from pdserve.engine.model import LlamaModel
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.tp.comm import TPComm
    from pdserve.engine.tp.dispatch import uses_all_to_all
    from pdserve.engine.tp.group import rank_device
    from pdserve.engine.tp.shard import shard_for

    config = EngineConfig(**a.config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = rank_device(config.device, a.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = TPComm("127.0.0.1", a.store_port, a.rank, a.size, device)
    mcfg = ModelConfig.from_dir(a.model_dir)
    dtype = DTYPES[a.dtype]
    tensors, _ = load_state_dict(a.model_dir)
    with torch.device(device):
        shard = shard_for(mcfg, a.rank, a.size, config.expert_parallel_size > 1, config.replicated_attention)
        net = LlamaModel(mcfg, shard, comm,
                         uses_all_to_all(config.expert_dispatch, config.expert_parallel_size, mcfg.num_experts_per_tok,
                                             config.replicated_attention)).to(dtype)
    net.load_hf_weights(tensors)
    del tensors
    net.eval()
    if config.native_kernels and device.type == "cpu":  # the experts for the native MoE kernel, as rank 0 stacks them
        from pdserve.engine.kernels import native_ops
        if native_ops() is not None:
            net.stack_experts()
    net.pack_weights()
    # sized like rank 0's (Engine.__init__; the CUDA profiling forward has collectives, so every rank runs it at
    # the same point), then the smallest count on every rank: the same block ids everywhere
    per_block = block_bytes_for(mcfg.num_layers, config.block_size, net.shard.num_kv_heads, mcfg.head_dim, dtype)
    num_blocks = comm.min_int(kv_pool_blocks(config, net, device, per_block))
    kv = KVCache(mcfg, num_blocks, config.block_size, dtype, str(device), swap_blocks(config, per_block), "",
                 num_kv_heads=net.shard.num_kv_heads, shard=net.shard)
    runner = ModelRunner(net, kv, native=config.native_kernels, attention=config.attention,
                         deterministic=config.deterministic)  # the same per-row path as rank 0
    if a.side_fd >= 0:  # rank 0's requests beside the steps: this pool's NIXL agent (kv_transfer/tp_ranks.py)
        import socket

        from pdserve.engine.tp.side_channel import SideChannel
        from pdserve.kv_transfer.layout import KVLayout
        from pdserve.kv_transfer.tp_ranks import RankKv
        SideChannel(socket.socket(fileno=a.side_fd), RankKv(kv.data, KVLayout.from_dict(kv.layout())).handle,
                    name=f"rank{a.rank}")
    log.info("rank %d/%d ready: heads %s, KV heads %s, %d blocks", a.rank, a.size, net.shard.heads,
             net.shard.kv_heads, num_blocks)
    # every step waits for all ranks: a full collection in one (170k tracked objects, torch's mostly) stalls the group;
    # the start-up heap is frozen as in the service processes (services/procutil.freeze_startup_heap)
    gc.collect()
    gc.freeze()
    while True:
        plan = comm.broadcast_object()
        if plan is None:
            return 0
        runner.execute_plan(plan)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
