"""How many KV blocks the pool gets.

Precedence: `num_gpu_blocks` if set; else `kv_cache_bytes` if set; else on CUDA the memory left under
`gpu_memory_utilization` of the device after the weights and a profiling forward at `max_num_batched_tokens`
(vLLM's rule), and on CPU a fixed 256 MiB (host memory is shared with everything else on the machine and has no
per-process fraction to take).

`pool_blocks` is pure arithmetic over a `MemoryProfile` (tested on CPU, tests/engine/test_kv_sizing.py);
`profile_cuda` measures one on the device (run by scripts/gpu_check.sh).

`KVFootprint` is spec §4.1's bytes per token, `2 * layers * kv_heads * head_dim * b`, generalised per layer: a
latent-attention layer (DeepSeek's MLA) caches `kv_lora_rank + qk_rope_head_dim` values per token, and a
sliding-window layer needs only its last `window` tokens. The simulator's roofline sizes KV with it
(pdserve/sim/roofline.py).
"""
from __future__ import annotations

import functools
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
    graph_bytes: int = 0  # what the CUDA graphs hold after capture: their shared logits buffer (graph_logits_bytes)


def pool_blocks(profile: MemoryProfile, utilization: float, block_bytes: int) -> int:
    """Blocks that fit in `utilization * total` after weights, the activation peak and non-torch memory."""
    if not 0 < utilization <= 1:
        raise KVSizingError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_bytes <= 0:
        raise KVSizingError(f"block_bytes must be positive, got {block_bytes}")
    budget = int(profile.total_bytes * utilization)
    used = profile.weight_bytes + profile.activation_peak_bytes + profile.non_torch_bytes + profile.graph_bytes
    free = budget - used
    if free < block_bytes:
        gib = 1 << 30
        raise KVSizingError(
            f"no room for the KV cache: {utilization:g} x {profile.total_bytes / gib:.1f} GiB = {budget / gib:.2f} "
            f"GiB, but weights {profile.weight_bytes / gib:.2f} + activations {profile.activation_peak_bytes / gib:.2f}"
            f" + CUDA context {profile.non_torch_bytes / gib:.2f} + CUDA graphs {profile.graph_bytes / gib:.2f} GiB "
            f"leave {max(0, free) / gib:.2f} GiB, less than one block of {block_bytes} bytes; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, or use a smaller --dtype")
    return free // block_bytes


def graph_logits_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The CUDA graphs' one logits buffer (cuda_graphs.py): fp32 rows for the largest captured batch."""
    from pdserve.engine.cuda_graphs import capture_sizes
    sizes = capture_sizes(max_num_seqs)
    return (sizes[-1] if sizes else 0) * vocab_size * 4


@dataclass(frozen=True)
class KVFootprint:
    """KV values per token of each layer, each layer's window (None: full attention) and the bytes per value.

    `bytes_per_token`: a token held by every layer (spec §4.1's m_token; what this engine's pool holds per token
    while a sequence holds it: one block table serves every layer, so gpt-oss's windowed layers keep every block
    its full layers need, docs/engine.md). `bytes_held(context)`: what one sequence of `context` tokens needs when a
    windowed layer keeps only its window (the least any pool must hold)."""
    values_per_layer: tuple[int, ...]
    windows: tuple[int | None, ...]
    element_bytes: float

    @classmethod
    def mha(cls, layers: int, kv_heads: int, head_dim: int, element_bytes: float,
            windows: tuple[int | None, ...] = ()) -> "KVFootprint":
        """Per-head K and V: 2 * kv_heads * head_dim values per token per layer."""
        return cls((2 * kv_heads * head_dim,) * layers, tuple(windows) or (None,) * layers, element_bytes)

    @classmethod
    def mla(cls, layers: int, kv_lora_rank: int, qk_rope_head_dim: int, element_bytes: float) -> "KVFootprint":
        """DeepSeek's latent attention: the compressed latent plus the shared rotated key, nothing per head."""
        return cls((kv_lora_rank + qk_rope_head_dim,) * layers, (None,) * layers, element_bytes)

    @classmethod
    def of_config(cls, cfg, element_bytes: float) -> "KVFootprint":
        """From a ModelConfig (engine/config.py), whose layer windows come from `layer_types` or `sliding_window`."""
        if cfg.kv_layout == "mla":
            return cls.mla(cfg.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, element_bytes)
        windows = tuple(cfg.layer_windows) or (cfg.sliding_window,) * cfg.num_layers
        return cls.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, element_bytes, windows)

    def __post_init__(self):
        if len(self.windows) != len(self.values_per_layer):
            raise ValueError(f"{len(self.windows)} windows for {len(self.values_per_layer)} layers")

    @property
    def layers(self) -> int:
        return len(self.values_per_layer)

    @property
    def bytes_per_token(self) -> float:
        return sum(self.values_per_layer) * self.element_bytes

    @functools.cached_property
    def by_window(self) -> tuple[tuple[int | None, int], ...]:
        """(window, values per token summed over the layers with that window): the per-step sums loop over these
        (two for gpt-oss) instead of every layer (a simulation asks for them at every step)."""
        out: dict = {}
        for v, w in zip(self.values_per_layer, self.windows):
            out[w] = out.get(w, 0) + v
        return tuple(out.items())

    def bytes_held(self, context: int) -> float:
        """KV bytes of one sequence of `context` tokens, a windowed layer holding min(context, window) of them."""
        return self.element_bytes * sum(v * (context if w is None else min(context, w)) for w, v in self.by_window)

    def bytes_read(self, sum_context: int, seqs: int) -> float:
        """KV bytes a step's attention touches: every position of `sum_context` for a full layer, at most
        `window` per sequence for a windowed one (min(sum_context, seqs * window): exact when every sequence's
        context is on the same side of the window)."""
        return self.element_bytes * sum(v * (sum_context if w is None else min(sum_context, seqs * w))
                                        for w, v in self.by_window)


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
    # profile the kernels the steps will run (an MLA model prefills in torch: mla.py)
    if config.native_kernels and config.attention in ("auto", "triton") and model.cfg.kv_layout != "mla":
        from pdserve.engine.model_runner import triton_attention
        attention_ops = triton_attention(device)
    # no graphs under tensor parallelism (model_runner.py)
    graphs = graph_logits_bytes(config.max_num_seqs, model.cfg.vocab_size) \
        if config.cuda_graphs and model.comm is None else 0
    from pdserve.engine.model_runner import device_scope
    with device_scope(device):
        profile = profile_cuda(model, device, config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                               attention_ops, graph_bytes=graphs)
    blocks = pool_blocks(profile, config.gpu_memory_utilization, block_bytes)
    log.info("KV pool: %d blocks of %d bytes (%.2f GiB) = %.2f x %.1f GiB - weights %.2f GiB - activations %.2f "
             "GiB - non-torch %.2f GiB - CUDA graphs %.2f GiB", blocks, block_bytes, blocks * block_bytes / 2 ** 30,
             config.gpu_memory_utilization, profile.total_bytes / 2 ** 30, profile.weight_bytes / 2 ** 30,
             profile.activation_peak_bytes / 2 ** 30, profile.non_torch_bytes / 2 ** 30, profile.graph_bytes / 2 ** 30)
    return blocks


def heaviest_sampling(num_seqs: int, vocab_size: int, device: torch.device) -> list:
    """Sampling states for `num_seqs` rows that each run the whole pipeline (penalties, every filter, a seeded
    draw, top logprobs): the sampler's largest working set for a step, which the pool must leave room for."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sampling_state import SamplingState
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, typical_p=0.95, seed=0,
                            repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                            logprobs=min(20, vocab_size),
                            logprobs_mode="processed")
    return [SamplingState(params, [2, 3, 4], vocab_size, [], None, i, device=device) for i in range(num_seqs)]


@torch.inference_mode()
def profile_cuda(model, device: torch.device, num_tokens: int, num_seqs: int, block_size: int,
                 attention_ops=None, graph_bytes: int = 0) -> MemoryProfile:
    """The device's memory around `profiling_step`: its peak above the weights, less the scratch pool, is the
    activation peak the real pool must leave room for."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    scratch_bytes = profiling_step(model, device, num_tokens, num_seqs, block_size, attention_ops)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - scratch_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return MemoryProfile(total_bytes=total, weight_bytes=weight_bytes, activation_peak_bytes=max(0, peak),
                         non_torch_bytes=non_torch, graph_bytes=graph_bytes)


@torch.inference_mode()
def profiling_step(model, device: torch.device, num_tokens: int, num_seqs: int, block_size: int,
                   attention_ops=None) -> int:
    """The largest step the scheduler can form: one forward of `num_tokens` prompt tokens with logits for the last
    `num_seqs` rows (a step's sampled rows), over a scratch pool just big enough for them, then the sampler over
    those rows at its heaviest. Returns the scratch pool's bytes (not activations). Device-agnostic: tested on CPU."""
    from pdserve.engine.sampler import Sampler
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    n_blocks = -(-num_tokens // block_size)
    scratch = torch.zeros((n_blocks, cfg.num_layers, 2, block_size, model.shard.num_kv_heads, cfg.head_dim),
                          dtype=dtype, device=device)  # this rank's KV heads (all of them without TP)
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
    logits = model(ids, pos, scratch, meta, torch.arange(max(0, num_tokens - num_seqs), num_tokens, device=device))
    if logits is not None:  # rank 0 (the only one that samples)
        Sampler(cfg.vocab_size).sample(logits, heaviest_sampling(logits.shape[0], cfg.vocab_size, device))
    return scratch.numel() * scratch.element_size()
