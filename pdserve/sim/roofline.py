"""Roofline step-time BOUND for a named GPU and model (spec §2.3: a bound, not a latency prediction).

    step_time >= max(FLOPs / (peak_flops * tp), bytes / (hbm_bw * tp))

FLOPs  = 2 * linear_params * tokens                   (every batched token through every linear layer)
       + 2 * hidden * vocab * samples                 (LM head, only rows that sample)
       + 4 * layers * heads * head_dim * attn_pairs   (QK^T and PV, 2 FLOPs per multiply-add each)
bytes  = weight_bytes                                 (every linear weight read once per step; embedding
                                                       lookups read a few rows and are not counted)
       + kv_bytes_per_token * (sum_context - tokens)  (cached KV read once per sequence per step)
       + kv_bytes_per_token * tokens                  (new KV written)
kv_bytes_per_token = 2 * layers * kv_heads * head_dim * kv_bytes_per_element

Weight bytes and KV bytes are counted apart: the weights at `bytes_per_param` (bf16: 2), the KV at its own
element size (`--kv-cache-dtype`: auto = the weights' dtype, fp8_e4m3 = 1 byte), so a quantized KV cache halves
the KV term, the KV transfer time and the bytes per block without touching the weight term.

With tp > 1 the engine's sharding rules apply (engine/tp/shard.py, spec D08): a degree the heads cannot be
split by is refused, and with fewer KV heads than ranks each rank holds (and reads) one replicated KV head, so
the replica's KV per token is 2 * layers * max(kv_heads, tp) * head_dim * bytes. Each rank reads its share of
the weights and its own KV heads; the step is bounded per rank.

Left out on purpose, each of which only makes real steps slower: activation traffic, kernel launch and
scheduling overhead, imperfect overlap of compute and memory, TP collectives (communicated for free here),
attention kernel inefficiency at long context. KV transfer between replicas
is bytes / link bandwidth (plus nothing): also a bound.

Model numbers are those of the published config.json files; GPU numbers are vendor peak dense BF16 and HBM
bandwidth (SXM parts), NVLink per direction, InfiniBand one NIC per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.tp.shard import check_tp
from pdserve.sim.costmodel import StepShape


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float       # dense BF16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction
    ib_bytes_per_s: float      # one NIC per GPU


GPUS = {
    "H100": GPU("H100", 989e12, 3.35e12, 80e9, 450e9, 50e9),    # H100 SXM5: 989 TF bf16 dense, HBM3 3.35 TB/s, NVLink4 900 GB/s bidir, NDR 400 Gb/s
    "H200": GPU("H200", 989e12, 4.8e12, 141e9, 450e9, 50e9),    # H200 SXM: same compute as H100, HBM3e 4.8 TB/s, 141 GB
    "A100": GPU("A100", 312e12, 2.039e12, 80e9, 300e9, 25e9),   # A100 SXM 80GB: 312 TF bf16 dense, HBM2e 2.039 TB/s, NVLink3 600 GB/s bidir, HDR 200 Gb/s
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    bytes_per_param: int = 2  # bf16
    kv_bytes_per_element: int = 0  # 0: bytes_per_param (the engine's --kv-cache-dtype auto); fp8_e4m3: 1

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate  # q, k, v, o, gate/up/down

    @property
    def linear_params(self) -> int:
        """Weights every token goes through: all layers' linear weights (LM head counted separately)."""
        return self.layers * self.layer_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Linear weights + embedding + LM head (norms and biases, < 0.01%, left out)."""
        return self.linear_params + self.embedding_params * (1 if self.tied else 2)

    @property
    def weight_bytes_read_per_step(self) -> int:
        return (self.linear_params + self.embedding_params) * self.bytes_per_param  # layers + LM head

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.bytes_per_param

    @property
    def kv_element_bytes(self) -> int:
        return self.kv_bytes_per_element or self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_element_bytes

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> "ModelSpec":
        """This model with its KV stored as `--kv-cache-dtype` stores it (engine/kv_quant.py)."""
        sizes = {"auto": 0, "fp8_e4m3": 1}
        if kv_cache_dtype not in sizes:
            raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; known: {', '.join(sizes)}")
        return replace(self, kv_bytes_per_element=sizes[kv_cache_dtype])


MODELS = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ModelSpec("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": ModelSpec("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256),
    # Qwen/Qwen2.5-7B config.json (tie_word_embeddings false)
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064),
}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def min_tp(model: ModelSpec, gpu: GPU, mem_util: float = 0.9, kv_share: float = 0.1) -> int:
    """Smallest power-of-two tensor-parallel degree whose memory holds the weights with at least `kv_share` of the
    usable memory left for KV."""
    tp = 1
    while model.weight_bytes > (1 - kv_share) * mem_util * gpu.memory_bytes * tp:
        tp *= 2
        if tp > 64:
            raise ValueError(f"{model.name} does not fit on 64 x {gpu.name}")
    return tp


@dataclass
class RooflineCostModel:
    """Same interface as LinearCostModel: step_time(shape), transfer_time(tokens). A lower bound."""
    model: ModelSpec
    gpu: GPU
    tp: int = 1
    link: str = "ib"  # ib | nvlink: what carries KV between prefill and decode replicas
    mem_util: float = 0.9

    kind = "roofline"

    def __post_init__(self):
        m = self.model
        check_tp(m.heads, m.kv_heads, m.intermediate, self.tp)  # the engine's rule: CheckpointError names the shapes

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.kv_heads // self.tp)  # replicated when kv_heads < tp

    @property
    def kv_bytes_per_token_per_rank(self) -> int:
        m = self.model
        return 2 * m.layers * self.kv_heads_per_rank * m.head_dim * m.kv_element_bytes

    def flops(self, s: StepShape) -> float:
        m = self.model
        return (2.0 * m.linear_params * s.tokens + 2.0 * m.hidden * m.vocab * s.samples
                + 4.0 * m.layers * m.heads * m.head_dim * s.attn_pairs)

    def bytes(self, s: StepShape) -> float:
        """Bytes the whole replica moves: every rank's weight share and its KV heads (replicas included)."""
        return float(self.model.weight_bytes_read_per_step + self.kv_bytes(s))

    def kv_bytes(self, s: StepShape) -> float:
        """The KV part of `bytes`, at the KV's own element size: (ctx-T) read + T written."""
        return float(self.kv_bytes_per_token_per_rank * self.tp * s.sum_context)

    def compute_s(self, s: StepShape) -> float:
        return self.flops(s) / (self.gpu.peak_flops * self.tp)

    def memory_s(self, s: StepShape) -> float:
        return self.bytes(s) / (self.gpu.hbm_bytes_per_s * self.tp)

    def step_time(self, s: StepShape) -> float:
        return max(self.compute_s(s), self.memory_s(s))

    @property
    def link_bytes_per_s(self) -> float:
        return self.gpu.nvlink_bytes_per_s if self.link == "nvlink" else self.gpu.ib_bytes_per_s

    def transfer_time(self, num_tokens: int) -> float:
        return num_tokens * self.model.kv_bytes_per_token / self.link_bytes_per_s

    def wake_time(self, idle_s: float) -> float:
        return 0.0  # a lower bound: no cost of waking from idle

    def kv_blocks(self, block_size: int) -> int:
        """The replica's blocks: every rank holds the same block ids, each with its KV heads (the engine's pool)."""
        free = self.mem_util * self.gpu.memory_bytes - self.model.weight_bytes / self.tp
        return max(0, int(free // (self.kv_bytes_per_token_per_rank * block_size)))

    def ridge_point(self) -> float:
        """FLOP per byte where the two roofs meet (spec §2.3)."""
        return self.gpu.peak_flops / self.gpu.hbm_bytes_per_s

    def describe(self) -> dict:
        m = self.model
        return {"kind": "roofline (lower bound, not a prediction)", "gpu": self.gpu.name, "model": m.name,
                "tp": self.tp, "params": m.total_params, "weight_bytes": m.weight_bytes,
                "kv_bytes_per_token": m.kv_bytes_per_token, "kv_bytes_per_element": m.kv_element_bytes,
                "link": self.link,
                "link_bytes_per_s": self.link_bytes_per_s, "ridge_flop_per_byte": self.ridge_point()}
