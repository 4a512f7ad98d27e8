"""How many KV blocks the pool gets.

Precedence: `num_gpu_blocks` if set; else `kv_cache_bytes` if set; else on CUDA the memory left under
`gpu_memory_utilization` of the device after the weights and a profiling forward at `max_num_batched_tokens`
(vLLM's rule), and on CPU a fixed 256 MiB (host memory is shared with everything else on the machine and has no
per-process fraction to take).

`pool_blocks` is pure arithmetic over a `MemoryProfile` (tested on CPU, tests/engine/test_kv_sizing.py);
`profile_cuda` measures one on the device (run by scripts/gpu_check.sh).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionMetadata, NativePrefill, PrefillSpan

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 256 << 20


class KVSizingError(ValueError):
    """The device cannot hold the weights, the activations and at least one KV block under the budget."""


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # device memory
    weight_bytes: int  # the model's parameters and buffers
    activation_peak_bytes: int  # peak allocated above the weights during a forward at max_num_batched_tokens
    non_torch_bytes: int  # CUDA context, cuBLAS/NCCL workspaces: used on the device, not by torch's allocator


def pool_blocks(profile: MemoryProfile, utilization: float, block_bytes: int) -> int:
    """Blocks that fit in `utilization * total` after weights, the activation peak and non-torch memory."""
    if not 0 < utilization <= 1:
        raise KVSizingError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_bytes <= 0:
        raise KVSizingError(f"block_bytes must be positive, got {block_bytes}")
    budget = int(profile.total_bytes * utilization)
    used = profile.weight_bytes + profile.activation_peak_bytes + profile.non_torch_bytes
    free = budget - used
    if free < block_bytes:
        gib = 1 << 30
        raise KVSizingError(
            f"no room for the KV cache: {utilization:g} x {profile.total_bytes / gib:.1f} GiB = {budget / gib:.2f} "
            f"GiB, but weights {profile.weight_bytes / gib:.2f} + activations {profile.activation_peak_bytes / gib:.2f}"
            f" + CUDA context {profile.non_torch_bytes / gib:.2f} GiB leave {max(0, free) / gib:.2f} GiB, less than "
            f"one block of {block_bytes} bytes; raise --gpu-memory-utilization, lower --max-num-batched-tokens, or "
            f"use a smaller --dtype")
    return free // block_bytes


def block_bytes_for(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one pool block: K and V of every layer for block_size tokens (kv_cache.py's layout)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def swap_blocks(config, block_bytes: int) -> int:
    """Host swap pool blocks: `num_cpu_blocks`, else `swap_space` GiB in whole blocks (0: no swapping). Swap space
    smaller than one block is an error rather than a silent recompute."""
    if config.num_cpu_blocks:
        return config.num_cpu_blocks
    if config.swap_space <= 0:
        return 0
    blocks = int(config.swap_space * 2 ** 30) // block_bytes
    if blocks < 1:
        raise KVSizingError(f"--swap-space {config.swap_space} GiB holds no KV block of {block_bytes} bytes")
    return blocks


def num_blocks(config, model, device: torch.device, block_bytes: int) -> int:
    """The pool size for `config` (EngineConfig) with `model` loaded on `device` (see the module docstring)."""
    if config.num_gpu_blocks:
        return config.num_gpu_blocks
    if config.kv_cache_bytes is not None:
        return max(1, config.kv_cache_bytes // block_bytes)
    if device.type != "cuda":
        return max(1, CPU_DEFAULT_KV_BYTES // block_bytes)
    attention_ops = None
    if config.native_kernels and config.attention in ("auto", "triton"):  # profile the kernels the steps will run
        from pdserve.engine.model_runner import triton_attention
        attention_ops = triton_attention(device)
    profile = profile_cuda(model, device, config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                           attention_ops)
    blocks = pool_blocks(profile, config.gpu_memory_utilization, block_bytes)
    log.info("KV pool: %d blocks of %d bytes (%.2f GiB) = %.2f x %.1f GiB - weights %.2f GiB - activations %.2f "
             "GiB - non-torch %.2f GiB", blocks, block_bytes, blocks * block_bytes / 2 ** 30,
             config.gpu_memory_utilization, profile.total_bytes / 2 ** 30, profile.weight_bytes / 2 ** 30,
             profile.activation_peak_bytes / 2 ** 30, profile.non_torch_bytes / 2 ** 30)
    return blocks


@torch.inference_mode()
def profile_cuda(model, device: torch.device, num_tokens: int, num_seqs: int, block_size: int,
                 attention_ops=None) -> MemoryProfile:
    """One forward of `num_tokens` prompt tokens (logits for the last `num_seqs` rows: a step's sampled rows),
    with a scratch pool just big enough for them; its peak above the weights, less the scratch pool, is the
    activation peak the real pool must leave room for."""
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    n_blocks = -(-num_tokens // block_size)
    scratch = torch.zeros((n_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=dtype,
                          device=device)
    pos = torch.arange(num_tokens, device=device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    table = torch.arange(n_blocks, device=device)
    span = torch.tensor([0], device=device)
    meta = AttentionMetadata(
        slot_blocks=pos // block_size, slot_offsets=pos % block_size,
        prefills=[] if attention_ops else [PrefillSpan(0, num_tokens, num_tokens, table, None)], decodes=[],
        native_prefill=NativePrefill(span, span + num_tokens, span + num_tokens, table[None])
        if attention_ops else None,
        native_ops=attention_ops, sliding_window=cfg.sliding_window)
    model(ids, pos, scratch, meta, torch.arange(max(0, num_tokens - num_seqs), num_tokens, device=device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - scratch.numel() * scratch.element_size()
    del scratch, meta
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return MemoryProfile(total_bytes=total, weight_bytes=weight_bytes, activation_peak_bytes=max(0, peak),
                         non_torch_bytes=non_torch)
