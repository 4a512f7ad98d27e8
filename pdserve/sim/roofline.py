"""Roofline step-time BOUND for a named GPU and model (spec §2.3: a bound, not a latency prediction).

    step_time >= max(FLOPs / (peak_flops * tp), bytes / (hbm_bw * tp), a2a_bytes / (nvlink_bw * tp))

FLOPs  = 2 * active_linear_params * tokens            (every batched token through the linear weights it uses: all
                                                       of a dense model's, an MoE token's top-k and shared experts)
       + 2 * hidden * vocab * samples                 (LM head, only rows that sample)
       + per layer, attn_pairs * FLOPs per pair       (QK^T and PV, 2 FLOPs per multiply-add: 4 * heads * head_dim;
                                                       MLA prefill over expanded heads, decode over the latent;
                                                       a windowed layer's pairs capped at window per query)
bytes  = weight bytes the step's tokens reach         (every non-expert weight once; of an MoE layer's routed
                                                       experts the expected number hit, E * (1 - (1 - k/E)^T) for
                                                       T tokens, not all E; embedding lookups not counted)
       + KV read (ctx - T) and written (T)            (per layer: kv values per token per layer x positions, a
                                                       windowed layer's at most window per sequence)
a2a    = tokens * a2a_bytes_per_token(ep)             (MoE with EP = TP: each token's hidden state to and from
                                                       every other rank holding one of its experts)

KV per token per layer (engine/kv_sizing.KVFootprint, spec §4.1 generalised): 2 * kv_heads * head_dim for
per-head K/V, kv_lora_rank + qk_rope_head_dim for MLA's latent, at the KV's element size. Weight bytes and KV
bytes are counted apart: the weights at `bytes_per_param` (bf16 2; DeepSeek-V3 as released fp8, 1) and routed
experts at `expert_bytes_per_param` (gpt-oss's MXFP4: 4.25 bits), the KV at its own element size
(`--kv-cache-dtype`: auto = the activations' bf16, fp8_e4m3 = 1 byte), so a quantized KV cache halves the KV
term, the KV transfer time and the bytes per block without touching the weight term. fp8 weights run their GEMMs
at the FP8 peak where the GPU has one (H100/H200), attention at BF16.

With tp > 1 the engine's sharding rules apply (engine/tp/shard.py, spec D08): a degree the heads cannot be
split by is refused, and with fewer KV heads than ranks each rank holds (and reads) one replicated KV head, so
the replica's KV per token is 2 * layers * max(kv_heads, tp) * head_dim * bytes; MLA's one latent is held by
every rank (the engine replicates it). An MoE model's experts split over the same ranks (EP = TP, the engine's
only expert parallelism). Each rank reads its share of the weights and its own KV heads; the step is bounded
per rank. KV capacity and the P/D handoff count a token in every layer (the engine's pool keeps every block for
every layer, windowed or not); the attention reads count only the window.

Left out on purpose, each of which only makes real steps slower: activation traffic, kernel launch and
scheduling overhead, imperfect overlap of compute, memory and communication, TP collectives (communicated for
free here), attention kernel inefficiency at long context, expert load imbalance (routing is taken uniform).
KV transfer between replicas is bytes / link bandwidth (plus nothing): also a bound.

Model numbers are those of the published config.json files; GPU numbers are vendor peak dense BF16 / FP8 and HBM
bandwidth (SXM parts), NVLink per direction, InfiniBand one NIC per GPU.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from pdserve.engine.kv_sizing import KVFootprint
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
    fp8_flops: float = 0.0     # dense FP8 FLOP/s (0: none; fp8 weights then run at the BF16 peak)
    gpus_per_node: int = 8     # NVLink domain (HGX); ranks beyond it talk over InfiniBand


GPUS = {
    "H100": GPU("H100", 989e12, 3.35e12, 80e9, 450e9, 50e9, 1979e12),    # H100 SXM5: 989 TF bf16 dense, HBM3 3.35 TB/s, NVLink4 900 GB/s bidir, NDR 400 Gb/s
    "H200": GPU("H200", 989e12, 4.8e12, 141e9, 450e9, 50e9, 1979e12),    # H200 SXM: same compute as H100, HBM3e 4.8 TB/s, 141 GB
    "A100": GPU("A100", 312e12, 2.039e12, 80e9, 300e9, 25e9),   # A100 SXM 80GB: 312 TF bf16 dense, HBM2e 2.039 TB/s, NVLink3 600 GB/s bidir, HDR 200 Gb/s
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    intermediate: int        # the dense MLP's (dense layers only, for an MoE model)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    bytes_per_param: float = 2  # bf16; DeepSeek-V3's release: fp8 (1)
    kv_bytes_per_element: int = 0  # 0: compute_bytes (the engine's --kv-cache-dtype auto); fp8_e4m3: 1
    compute_bytes: int = 2  # activations (bf16), also with narrower weights
    # Mixture of experts (engine/moe.py): the last `moe_layers` layers hold `experts` routed SwiGLU experts of
    # `moe_intermediate` (gate, up, down) and `shared_experts` always-on ones; a token takes `experts_per_tok`.
    experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0
    shared_experts: int = 0
    expert_bytes_per_param: float = 0  # 0: bytes_per_param; gpt-oss's MXFP4 experts: 4.25 bits = 0.53125
    # Latent attention (engine/mla.py): kv_lora_rank > 0. q_lora_rank 0: q projected directly.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding windows: each layer's (None: full attention); empty: every layer full.
    layer_windows: tuple = ()

    # ---- parameters ------------------------------------------------------------------------------------------
    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @functools.cached_property
    def attn_params(self) -> int:
        """One layer's attention projections."""
        h = self.hidden
        if self.mla:  # q (direct or through q_lora_rank), kv_a (latent + rope key), kv_b (nope keys + values), o
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.heads * qk if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank * self.heads * qk
            return (q + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                    + self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
                    + self.heads * self.v_head_dim * h)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h  # q, k, v, o

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # gate, up, down

    @property
    def layer_params(self) -> int:
        """A dense layer: attention + gate/up/down."""
        return self.attn_params + 3 * self.hidden * self.intermediate

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def routed_params(self) -> int:
        """Every routed expert of every sparse layer."""
        return self.moe_layers * self.experts * self.expert_params

    def _linear(self, experts_per_layer: float) -> float:
        """Linear weights of all layers when `experts_per_layer` routed experts count in each sparse layer."""
        sparse = self.moe_layers * ((experts_per_layer + self.shared_experts) * self.expert_params
                                    + self.experts * self.hidden)  # + the router
        return self.layers * self.attn_params + self.dense_layers * 3 * self.hidden * self.intermediate + sparse

    @functools.cached_property
    def linear_params(self) -> int:
        """All layers' linear weights, every expert included (LM head counted separately)."""
        return int(self._linear(self.experts))

    @functools.cached_property
    def active_linear_params(self) -> int:
        """The linear weights one token goes through: its experts_per_tok routed experts per sparse layer."""
        return int(self._linear(self.experts_per_tok))

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Linear weights + embedding + LM head (norms and biases, < 0.01%, left out)."""
        return self.linear_params + self.embedding_params * (1 if self.tied else 2)

    @property
    def active_params(self) -> int:
        """Parameters a token is multiplied through: active linear weights + LM head (the embedding is a lookup),
        as the model cards count them (DeepSeek-V3 "37B activated", gpt-oss-120b 5.13B)."""
        return self.active_linear_params + self.embedding_params

    @property
    def expert_element_bytes(self) -> float:
        return self.expert_bytes_per_param or self.bytes_per_param

    def _bytes(self, linear_params: float, routed: float) -> float:
        """Linear weights at their sizes, routed experts at expert_element_bytes."""
        return (linear_params - routed) * self.bytes_per_param + routed * self.expert_element_bytes

    def experts_hit(self, tokens: int) -> float:
        """Expected distinct routed experts of one sparse layer that `tokens` tokens reach, each taking
        experts_per_tok of `experts` uniformly and independently: E * (1 - (1 - k/E)^B). Uniform is the
        load-balanced routing the routers are trained towards; correlated tokens (one sequence's prefill) hit
        fewer, so weight bytes from this are an upper estimate of the experts read, exact at B = 1 (k experts)."""
        if not self.experts:
            return 0.0
        e, k = self.experts, self.experts_per_tok
        return e * -math.expm1(tokens * math.log1p(-k / e)) if k < e else float(e)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weights a step of `tokens` tokens streams from HBM: everything but the routed experts (attention, dense
        MLPs, shared experts, routers), the experts those tokens hit, and the LM head."""
        if not self.experts:
            return self._fixed_bytes
        return self._fixed_bytes + self.moe_layers * self.experts_hit(tokens) * self.expert_params \
            * self.expert_element_bytes

    @functools.cached_property
    def _fixed_bytes(self) -> float:
        """Every weight a step reads whatever its tokens: all but the routed experts, and the LM head."""
        return self._linear(0) * self.bytes_per_param + self.embedding_params * self.bytes_per_param

    @property
    def weight_bytes_read_per_step(self) -> float:
        """Every linear weight and the LM head: a dense model's per-step weight traffic (an MoE's upper bound)."""
        return self._bytes(self.linear_params, self.routed_params) + self.embedding_params * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self._bytes(self.linear_params, self.routed_params) \
            + self.embedding_params * (1 if self.tied else 2) * self.bytes_per_param

    # ---- KV -------------------------------------------------------------------------------------------------
    @property
    def kv_element_bytes(self) -> float:
        return self.kv_bytes_per_element or self.compute_bytes

    @functools.cached_property
    def kv(self) -> KVFootprint:
        """Spec §4.1's KV per token, per layer: the latent for MLA, the window for windowed layers."""
        if self.mla:
            return KVFootprint.mla(self.layers, self.kv_lora_rank, self.qk_rope_head_dim, self.kv_element_bytes)
        return KVFootprint.mha(self.layers, self.kv_heads, self.head_dim, self.kv_element_bytes, self.layer_windows)

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of one token in every layer (what the engine's pool holds and a P/D handoff moves)."""
        return self.kv.bytes_per_token

    @property
    def pool_kv_heads(self) -> int:
        return 1 if self.mla else self.kv_heads  # the engine's MLA pool: one "head" holding the latent

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> "ModelSpec":
        """This model with its KV stored as `--kv-cache-dtype` stores it (engine/kv_quant.py)."""
        sizes = {"auto": 0, "fp8_e4m3": 1}
        if kv_cache_dtype not in sizes:
            raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; known: {', '.join(sizes)}")
        return replace(self, kv_bytes_per_element=sizes[kv_cache_dtype])

    # ---- attention FLOPs and expert parallelism -------------------------------------------------------------
    def attn_flops_per_pair(self, prefill: bool) -> int:
        """FLOPs of one (query, key) pair in one layer, all heads: QK^T and PV, 2 per multiply-add. MLA's prefill
        attends over expanded per-head keys (nope + rope) and values; its decode in the absorbed form over the
        latent (kv_lora_rank + rope for QK^T, kv_lora_rank for PV), the cheaper form for each phase."""
        if not self.mla:
            return 4 * self.heads * self.head_dim
        if prefill:
            return 2 * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 2 * self.heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)

    def remote_ranks_per_token(self, ep: int) -> float:
        """Expected other ranks holding at least one of a token's experts, experts split evenly over `ep` ranks:
        (ep - 1) * (1 - C(E - E/ep, k) / C(E, k))."""
        if ep <= 1 or not self.experts:
            return 0.0
        e, k = self.experts, self.experts_per_tok
        return (ep - 1) * (1 - math.comb(e - e // ep, k) / math.comb(e, k))

    def a2a_bytes_per_token(self, ep: int) -> float:
        """Expert-parallel all-to-all bytes per token over the interconnect: in every sparse layer the token's
        hidden state is dispatched once to each other rank holding one of its experts and combined back from
        it, in the activations' dtype both ways."""
        return 2 * self.moe_layers * self.hidden * self.compute_bytes * self.remote_ranks_per_token(ep)


GPT_OSS_WINDOWS = tuple(128 if i % 2 == 0 else None for i in range(36))  # layer_types: sliding, full, ...

MODELS = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ModelSpec("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": ModelSpec("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256),
    # Qwen/Qwen2.5-7B config.json (tie_word_embeddings false)
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064),
    # deepseek-ai/DeepSeek-V3 config.json: 61 layers, the first 3 dense (first_k_dense_replace), 58 with 256 routed
    # experts (top 8) + 1 shared of 2048; MLA q_lora_rank 1536, kv_lora_rank 512, qk 128 + 64, v 128. Weights as
    # released, fp8 (1 byte); the MTP layer (num_nextn_predict_layers) is not served and not counted.
    "deepseek-v3": ModelSpec("deepseek-v3", 7168, 18432, 61, 128, 128, 128, 129280, bytes_per_param=1,
                             experts=256, experts_per_tok=8, moe_intermediate=2048, moe_layers=58,
                             shared_experts=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128),
    # openai/gpt-oss-120b config.json: 36 layers alternating a 128-token window and full attention, 64 query and
    # 8 KV heads of 64, 128 experts (top 4) of 2880 in every layer; experts MXFP4 as released (4-bit values + one
    # 8-bit scale per 32: 4.25 bits), the rest bf16.
    "gpt-oss-120b": ModelSpec("gpt-oss-120b", 2880, 2880, 36, 64, 8, 64, 201088, experts=128, experts_per_tok=4,
                              moe_intermediate=2880, moe_layers=36, expert_bytes_per_param=4.25 / 8,
                              layer_windows=GPT_OSS_WINDOWS),
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
        m = self.model  # the engine's rule: CheckpointError names the shapes; experts split over the same ranks
        check_tp(m.heads, m.pool_kv_heads, m.intermediate, self.tp, m.experts, expert_parallel=bool(m.experts))

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.pool_kv_heads // self.tp)  # replicated when kv_heads < tp (MLA's one latent)

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        m = self.model
        return m.kv_bytes_per_token / m.pool_kv_heads * self.kv_heads_per_rank

    def _attn_pairs(self, s: StepShape, window) -> tuple[int, int]:
        """(prefill, decode) (query, key) pairs of one layer; a windowed layer's at most `window` per query."""
        pp, dp = s.prefill_pairs, s.attn_pairs - s.prefill_pairs
        if window is None:
            return pp, dp
        return min(pp, window * s.prefill_tokens), min(dp, window * s.decode_seqs)

    def flops(self, s: StepShape) -> float:
        return self.linear_flops(s) + self.attn_flops(s)

    def linear_flops(self, s: StepShape) -> float:
        """Every token through its active linear weights, and the LM head for the rows that sample."""
        m = self.model
        return 2.0 * m.active_linear_params * s.tokens + 2.0 * m.hidden * m.vocab * s.samples

    def attn_flops(self, s: StepShape) -> float:
        m = self.model
        attn = 0.0
        for w, n in self._layers_by_window:
            pp, dp = self._attn_pairs(s, w)
            attn += n * (pp * m.attn_flops_per_pair(True) + dp * m.attn_flops_per_pair(False))
        return attn

    @functools.cached_property
    def _layers_by_window(self) -> tuple[tuple[int | None, int], ...]:
        windows = self.model.kv.windows
        return tuple((w, windows.count(w)) for w in dict.fromkeys(windows))

    def bytes(self, s: StepShape) -> float:
        """Bytes the whole replica moves: the weights the step's tokens reach (an MoE layer's experts hit, not all
        of them) and every rank's KV (replicas included)."""
        return float(self.model.weight_bytes_read(s.tokens) + self.kv_bytes(s))

    def kv_bytes(self, s: StepShape) -> float:
        """The KV part of `bytes`, at the KV's own element size: (ctx-T) read + T written, a windowed layer's
        window only."""
        m = self.model
        share = self.kv_heads_per_rank / m.pool_kv_heads
        return float(share * self.tp * m.kv.bytes_read(s.sum_context, s.prefill_seqs + s.decode_seqs))

    def comm_s(self, s: StepShape) -> float:
        """Expert-parallel all-to-all: every token's dispatch and combine bytes, spread over the ranks' links.
        Within a node (gpus_per_node) they cross NVLink; a replica wider than a node sends the share bound for
        the other nodes' ranks, (tp - node) / (tp - 1), over InfiniBand; the two links run at once."""
        if self.tp <= 1 or not self.model.experts:
            return 0.0
        g = self.gpu
        per_rank = s.tokens * self.model.a2a_bytes_per_token(self.tp) / self.tp
        off = max(0, self.tp - g.gpus_per_node) / (self.tp - 1)
        return max(per_rank * (1 - off) / g.nvlink_bytes_per_s, per_rank * off / g.ib_bytes_per_s)

    def compute_s(self, s: StepShape) -> float:
        """fp8 weights (1 byte) run their GEMMs at the FP8 peak where the GPU has one; attention at BF16."""
        g = self.gpu
        linear_peak = g.fp8_flops if self.model.bytes_per_param <= 1 and g.fp8_flops else g.peak_flops
        return (self.linear_flops(s) / linear_peak + self.attn_flops(s) / g.peak_flops) / self.tp

    def memory_s(self, s: StepShape) -> float:
        return self.bytes(s) / (self.gpu.hbm_bytes_per_s * self.tp)

    def step_time(self, s: StepShape) -> float:
        return max(self.compute_s(s), self.memory_s(s), self.comm_s(s))  # all three overlapped: a bound

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
                "tp": self.tp, "params": m.total_params, "active_params": m.active_params,
                "weight_bytes": m.weight_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
                "kv_bytes_per_element": m.kv_element_bytes, "ep": self.tp if m.experts else 1,
                "a2a_bytes_per_token": m.a2a_bytes_per_token(self.tp),
                "link": self.link,
                "link_bytes_per_s": self.link_bytes_per_s, "ridge_flop_per_byte": self.ridge_point()}
