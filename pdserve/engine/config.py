"""Model configuration read from a checkpoint's config.json, and the engine's own knobs."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.architectures import MOE_ARCHITECTURES
from pdserve.engine.checkpoint import max_position_embeddings, need_int, read_config
from pdserve.engine.errors import CheckpointError
from pdserve.engine.sched_policy import SCHEDULING_POLICIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    checkpoint_dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: each head of q and k RMS-normalised (one weight over head_dim) before RoPE
    # Sparse MoE (engine/moe.py): the layers whose MLP is `num_experts` routed SwiGLU experts of
    # `moe_intermediate_size`, `num_experts_per_tok` chosen per token; the other layers keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False  # the chosen experts' softmax weights renormalised to sum to 1
    # Qwen3-MoE rounds the routing weights to the activations' dtype before scaling the experts' outputs; Mixtral
    # scales in fp32 and rounds the product (the two differ in bf16 only).
    round_router_weights: bool = False
    # gpt-oss: the router has a bias and takes the top k of its logits before a softmax over those k (in the
    # activations' dtype); experts carry biases and the clamped gate `(up + 1) * gate * sigmoid(alpha * gate)`.
    moe_kind: str = "swiglu"  # swiglu | gpt_oss
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss: one learned logit per query head joins each softmax's denominator (the "sink"), and `layer_windows`
    # gives each layer its own window (None: full attention); empty: every layer uses `sliding_window`.
    attention_sinks: bool = False
    layer_windows: tuple[int | None, ...] = ()
    # DeepSeek-V3: shared experts (`n_shared_experts` x moe_intermediate_size, always on) beside the routed ones,
    # chosen by sigmoid scores plus a correction bias within the best `topk_group` of `n_group` groups.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # KV layout kind: "mha" (per-head K and V) or "mla" (DeepSeek's latent attention, engine/mla.py). For "mla" the
    # pool's num_kv_heads is 1 and head_dim is half of kv_lora_rank + qk_rope_head_dim: a token's K|V pair of one
    # layer holds its compressed latent and its rotated shared key, nothing per head.
    kv_layout: str = "mha"
    q_lora_rank: int = 0  # 0: q projected directly
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dimensions come as interleaved pairs (DeepSeek)
    rope_dim: int = 0  # the rotated dimensions per head; 0: head_dim

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path, cfg, arch = read_config(model_dir)

        def need(name: str) -> int:
            return need_int(path, cfg, name)

        try:
            hidden = need("hidden_size")
            heads = need("num_attention_heads")
            # transformers >= 5 nests rope settings under rope_parameters; older files use rope_theta/rope_scaling.
            rope = dict(cfg.get("rope_parameters") or {})
            scaling = cfg.get("rope_scaling") or None
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
            if rope_type and rope_type != "default":
                scaling = {**(scaling or {}), **rope, "rope_type": rope_type}
            else:
                scaling = None
            sliding = cfg.get("sliding_window")
            if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
                sliding = None
            windows = _layer_windows(path, cfg, arch, sliding)
            if windows:
                sliding = None  # per layer instead (layer_windows)
            partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
            if partial != 1.0:  # Phi-4-mini's 0.75: RoPE on part of each head, which the kernels do not take
                raise CheckpointError(f"{path}: partial_rotary_factor={partial} is not supported (RoPE over the whole "
                                      f"head only)")
            if arch.startswith("Qwen3") and sliding:  # windows on the layers past max_window_layers only
                raise CheckpointError(f"{path}: use_sliding_window is not supported for {arch} (per-layer windows)")
            dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
            gen = _generation_config(model_dir)
            eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
            eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
            base = dict(
                architecture=arch,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=max_position_embeddings(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                checkpoint_dtype=DTYPES.get(str(dtype_name), torch.float32),
                eos_token_ids=[int(e) for e in eos_ids],
                bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
                qk_norm=arch.startswith("Qwen3"),
                attention_sinks=arch == "GptOssForCausalLM",
                layer_windows=windows,
            )
            return cls(**{**base, **_moe_fields(path, cfg, arch), **_mla_fields(path, cfg, arch)})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: missing or invalid field {e}") from e

    def fingerprint(self, weights_digest: str, kv_dtype: torch.dtype) -> str:
        """Everything that makes KV of one deployment reusable by another (spec §4.3)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(json.dumps(
            [self.architecture, self.num_layers, self.num_kv_heads, self.head_dim, self.rope_theta,
             self.rope_scaling, str(kv_dtype), weights_digest], sort_keys=True, default=str).encode())
        return h.hexdigest()


def _layer_windows(path: Path, cfg: dict, arch: str, sliding) -> tuple[int | None, ...]:
    """gpt-oss's `layer_types`: "sliding_attention" layers see the last `sliding_window` keys, the others all."""
    if arch != "GptOssForCausalLM":
        return ()
    layers = need_int(path, cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{path}: layer_types must name {layers} layers, each sliding_attention or "
                              f"full_attention (got {types!r})")
    if "sliding_attention" in types and not sliding:
        raise CheckpointError(f"{path}: sliding_attention layers need a sliding_window")
    return tuple(int(sliding) if t == "sliding_attention" else None for t in types)


def _mla_fields(path: Path, cfg: dict, arch: str) -> dict:
    """DeepSeek-V3's latent attention: the pool's shape (one latent per token, split over the K|V pair) and the
    projections' dimensions. Multi-token-prediction layers (`num_nextn_predict_layers`, stored past the last
    decoder layer) are not loaded, as transformers does not load them."""
    if arch != "DeepseekV3ForCausalLM":
        return {}
    rank, rope = need_int(path, cfg, "kv_lora_rank"), need_int(path, cfg, "qk_rope_head_dim")
    if (rank + rope) % 2:
        raise CheckpointError(f"{path}: kv_lora_rank + qk_rope_head_dim must be even (the latent fills a K|V pair)")
    return dict(kv_layout="mla", num_kv_heads=1, head_dim=(rank + rope) // 2, q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                kv_lora_rank=rank, qk_nope_head_dim=need_int(path, cfg, "qk_nope_head_dim"), qk_rope_head_dim=rope,
                v_head_dim=need_int(path, cfg, "v_head_dim"), rope_interleave=bool(cfg.get("rope_interleave", True)),
                rope_dim=rope, qkv_bias=False, o_bias=bool(cfg.get("attention_bias", False)))


def _moe_fields(path: Path, cfg: dict, arch: str) -> dict:
    """The MoE fields of ModelConfig for a sparse architecture, read as transformers' config classes read them."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # Qwen3MoeConfig saves `num_experts` (older files) or `num_local_experts` (transformers >= 5), Mixtral the latter
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    layers = need_int(path, cfg, "num_hidden_layers")
    if arch == "GptOssForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=need_int(path, cfg, "num_experts_per_tok"),
                    moe_intermediate_size=need_int(path, cfg, "intermediate_size"), moe_layers=tuple(range(layers)),
                    moe_kind="gpt_oss", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    if arch == "DeepseekV3ForCausalLM":  # DeepseekV3DecoderLayer: dense below first_k_dense_replace
        first = int(cfg.get("first_k_dense_replace") or 0)
        return dict(num_experts=int(cfg.get("n_routed_experts") or experts),
                    num_experts_per_tok=need_int(path, cfg, "num_experts_per_tok"),
                    moe_intermediate_size=need_int(path, cfg, "moe_intermediate_size"),
                    moe_layers=tuple(range(first, layers)), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    moe_kind="deepseek", n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    n_shared_experts=int(cfg.get("n_shared_experts") or 0))
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=need_int(path, cfg, "num_experts_per_tok"),
                    moe_intermediate_size=need_int(path, cfg, "intermediate_size"), moe_layers=tuple(range(layers)),
                    norm_topk_prob=True)
    # Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, on every decoder_sparse_step-th layer
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=need_int(path, cfg, "num_experts_per_tok"),
                moe_intermediate_size=need_int(path, cfg, "moe_intermediate_size"), moe_layers=sparse,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), round_router_weights=True)


def _generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from e


PREEMPTION_MODES = ("recompute", "swap")  # spec §4.4: both free device blocks (descheduling alone would not)
POLICIES = tuple(SCHEDULING_POLICIES)
BATCHING = ("continuous", "static")


@dataclass
class EngineConfig:
    """Engine knobs. The KV pool: `num_gpu_blocks`, else `kv_cache_bytes`, else on CUDA what
    `gpu_memory_utilization` of the device leaves after weights and activations (kv_sizing.py), on CPU 256 MiB."""

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_cpu_blocks: int = 0  # host swap space in blocks; 0 disables swapping
    swap_space: float = 0.0  # host swap space in GiB (--swap-space), sized into blocks when num_cpu_blocks is 0
    # Host KV tier (kv_offload.py): bytes of host memory keeping prefix-cache blocks evicted from the device pool,
    # recalled on a prefix hit instead of recomputed; 0 disables it. With `kv_offload_dir`, the host tier's LRU
    # victims spill to files there, up to `kv_offload_disk_bytes` (default 4x kv_offload_bytes).
    kv_offload_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Decode side of a disaggregated request: True pulls every prompt block from the prefill worker even where this
    # worker's prefix cache holds a prefix (the next turn of a chat); for comparison (docs/kv_transfer.md)
    no_decode_prefix_reuse: bool = False
    policy: str = "fcfs"  # fcfs | decode-priority | prefill-priority | priority | shortest-predicted-first
    # priority / shortest-predicted-first: a queued request older than this goes first regardless (no starvation)
    starvation_age_s: float = 10.0
    # Backpressure (spec §1.4): a request with this many undelivered outputs stops getting decode steps
    # (BACKPRESSURED) until its consumer drains to half; still full after `backpressure_preempt_s` -> preempted.
    max_buffered_outputs: int = 64
    backpressure_preempt_s: float = 5.0
    preemption_mode: str = "recompute"  # recompute | swap
    # Weight-only quantization of the projections and lm_head (engine/quant.py): none | int8.
    quantization: str = "none"
    # continuous: iteration-level refill (spec §5.3); static: a batch formed on an idle tick runs until all its
    # members finish, no request joins it mid-way (§5.2) -- the baseline D04 compares against
    batching: str = "continuous"
    # KV pool storage (kv_quant.py): auto = the compute dtype | fp8_e4m3 (one byte per element, no scales).
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"  # auto (the fastest for this device and checkpoint: cpu_isa.py) | float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    # Intra-op threads for this engine's process (None: torch's default, all cores). Several workers on one
    # host must split the cores: oversubscribed OpenMP threads turn every op into a ~5 ms scheduling wait.
    num_threads: int | None = None
    # Decode attention by the compiled in-place kernel (engine/kernels.py) where it builds; False: torch only.
    native_kernels: bool = True
    # Attention kernels (model_runner.ATTENTION_BACKENDS): auto = compiled CPU kernels on CPU, Triton on CUDA.
    attention: str = "auto"
    # CUDA graphs for decode steps of up to max_num_seqs sequences (CUDA with the Triton kernels only).
    cuda_graphs: bool = True
    # Fault injection for tests and drills: every step that runs a forward first sleeps this long (a slow or
    # stalled device), e.g. to show that heartbeats do not wait for the engine thread. 0 in production.
    fault_step_delay_s: float = 0.0
    # Batch-invariant steps (batch_invariant.py): every row of a step is computed by the same kernels in the same
    # reduction order whatever the batch size, chunking or prefix-cache hit (docs/engine.md, Deterministic mode).
    deterministic: bool = False
    # Ranks of tensor parallelism inside this engine (engine/tp/): one process each, rank 0 schedules.
    tensor_parallel_size: int = 1
    # Expert parallelism: a mixture-of-experts model's routed experts split whole over the ranks; 1,
    # tensor_parallel_size (attention stays tensor parallel), or any degree at tensor_parallel_size 1 (the rest of
    # the model replicated on every rank, `ranks` processes).
    expert_parallel_size: int = 1
    # How a sparse layer reaches experts held by other ranks (docs/engine.md, "Expert parallelism"): all_to_all =
    # each rank routes its slice of the tokens and sends each row only to its expert's owner (tp/dispatch.py);
    # all_reduce = every rank computes its experts' share of every token and an all-reduce sums the shares.
    expert_dispatch: str = "auto"
    # Speculative decoding (spec_decode/): None | ngram (prompt lookup) | draft (`draft_model`, same tokenizer);
    # up to `num_speculative_tokens` candidates verified per decode step.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None

    @property
    def ranks(self) -> int:
        """Processes of this engine: the tensor-parallel ranks, or the expert-parallel ones at TP 1."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def replicated_attention(self) -> bool:
        """Expert parallelism without tensor parallelism: everything but the experts whole on every rank."""
        return self.tensor_parallel_size == 1 and self.expert_parallel_size > 1

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r} (one of {', '.join(POLICIES)})")
        if self.batching not in BATCHING:
            raise ValueError(f"unknown batching mode {self.batching!r} (continuous, static)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption mode {self.preemption_mode!r}")
        if self.num_cpu_blocks < 0 or not self.swap_space >= 0:
            raise ValueError(f"num_cpu_blocks and swap_space must be >= 0, got {self.num_cpu_blocks} and "
                             f"{self.swap_space}")
        if self.preemption_mode == "swap" and self.num_cpu_blocks <= 0 and self.swap_space <= 0:
            raise ValueError("preemption_mode='swap' needs host swap space: set swap_space (--swap-space GiB) "
                             "or num_cpu_blocks")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_offload_bytes < 0 or (self.kv_offload_disk_bytes is not None and self.kv_offload_disk_bytes < 0):
            raise ValueError("kv_offload_bytes and kv_offload_disk_bytes must not be negative")
        if self.kv_offload_dir and not self.kv_offload_bytes:
            raise ValueError("kv_offload_dir needs kv_offload_bytes > 0 (the disk tier spills from the host tier)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.attention not in ("auto", "native", "triton", "torch"):
            raise ValueError(f"unknown attention backend {self.attention!r} (auto, native, triton, torch)")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"unknown quantization {self.quantization!r} (none, int8)")
        if self.quantization != "none" and not self.device.startswith("cpu"):
            raise ValueError(f"quantization={self.quantization!r} runs on CPU only (device {self.device!r})")
        if self.quantization != "none" and self.ranks > 1:  # the other ranks load unquantized
            raise ValueError(f"quantization={self.quantization!r} is not supported with tensor_parallel_size or "
                             f"expert_parallel_size > 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel_size < 1 or (self.expert_parallel_size not in (1, self.tensor_parallel_size)
                                             and self.tensor_parallel_size != 1):
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} must be 1, tensor_parallel_size="
                             f"{self.tensor_parallel_size} (experts split over the tensor-parallel ranks) or any "
                             f"degree with tensor_parallel_size=1 (attention replicated on every rank)")
        if self.expert_dispatch not in ("auto", "all_to_all", "all_reduce"):
            raise ValueError(f"unknown expert_dispatch {self.expert_dispatch!r} (auto, all_to_all, all_reduce)")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.speculative!r} (ngram, draft)")
        if self.speculative and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if self.deterministic and self.speculative:
            raise ValueError("deterministic mode does not support speculative decoding (its verify steps are "
                             "not covered by the batch-invariant path)")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative='draft' needs a draft model (--draft-model DIR)")
        from pdserve.engine.kv_quant import KV_CACHE_DTYPES
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})")
        if self.kv_cache_dtype != "auto" and self.ranks > 1:  # the other ranks size their own pools
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with tensor_parallel_size or "
                             f"expert_parallel_size > 1")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
