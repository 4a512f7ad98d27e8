"""The sparse mixture-of-experts MLP of Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3, computed as transformers
computes it.

A router scores every expert per token; the softmax (fp32) of those scores picks the top k, whose weights are
renormalised to sum to 1 where the model says so (`norm_topk_prob`; always for Mixtral). Each expert is a SwiGLU
MLP (fused gate/up, then down) and a token's output is the weighted sum of its k experts' outputs.

gpt-oss differs in three places: the router has a bias and its softmax runs over the k chosen logits only (in the
activations' dtype); every expert projection has a bias; the gate is clamped, `(up + 1) * gate * sigmoid(alpha *
gate)` with gate <= limit and |up| <= limit. Its checkpoint holds each layer's experts as stacked tensors, gate
and up interleaved column by column: they are split into the fused [gate | up] layout here at load.

DeepSeek-V3 routes by sigmoid scores in fp32 within the best groups of experts (`_route_grouped`) and adds shared
experts every token takes.

Three paths. Steps of up to NATIVE_MAX_TOKENS tokens on CPU with the native kernels run every routed expert in one
call (csrc/moe_experts.cpp: per (token, expert) pair the gate/up GEMV, silu(gate) * up, the down GEMV and the
weighted sum, all hit experts' weight rows spread over the threads at once) over the experts' weights held stacked
(`stack_experts`: [E, 2I, H] and [E, H, I], bf16 / fp32 / int8 with scales; each expert's module views its slice,
so nothing is held twice). Larger steps (prefill chunks) on those stacked weights, bf16 or fp32, run grouped
(moe_grouped.py: the pairs sorted by expert once, one GEMM per expert over its rows padded to a few shapes, one
native weighted sum). int8 experts' large steps, gpt-oss (expert biases and the clamped gate), the deterministic
mode (its tiles must not follow the row count), `PDSERVE_NATIVE_MOE=0` and `PDSERVE_GROUPED_MOE=0` take the loop:
the experts one after another, each over the rows that chose it (a gather, two GEMMs, a scatter-add). With expert
parallelism a rank holds a range of the experts (tp/shard.py) and every path computes only those: over every token
(the layer's all-reduce sums the ranks' shares) or, dispatched by all-to-all (tp/dispatch.py), over the rows other
ranks send it (`dispatched`, `_rows`: the native kernel or the loop).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import env_knobs
from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import take
from pdserve.engine.moe_grouped import grouped_experts

# How each architecture names a sparse layer's block, its router and its experts' gate, up and down projections.
CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "DeepseekV3ForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
}

# Tokens up to which a step takes the native kernel. Its GEMVs read each weight row once for all the rows that chose
# it, which pays while an expert's rows are few; past that the loop's GEMMs should win. 32 is GEMV_MAX_ROWS' fp32
# figure (quant.py), not yet tuned for experts (docs/engine.md, "Sparse MoE on the CPU").
NATIVE_MAX_TOKENS = 32
NATIVE_MOE_ENV = "PDSERVE_NATIVE_MOE"
GROUPED_MOE_ENV = "PDSERVE_GROUPED_MOE"  # "0": steps past NATIVE_MAX_TOKENS keep the loop (comparisons)


def _held(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """An expert projection's plain weight and int8 scales as the native kernel reads them, or None (packed)."""
    from pdserve.engine.quant import DualLinear, WeightOnlyLinear
    if isinstance(m, DualLinear):  # the bf16 copy is the decode one
        m = m.gemv
    if isinstance(m, WeightOnlyLinear):
        return m.weight, m.scales
    if isinstance(m, nn.Linear) and getattr(m, "packed", None) is None and m.weight.numel():
        return m.weight, None
    return None


def _stack(mods: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The modules' weights (and scales) stacked, each module then viewing its slice; None if they cannot be."""
    held = [_held(m) for m in mods]
    if any(h is None for h in held) or len({(h[0].dtype, h[1] is None) for h in held}) != 1:
        return None
    w = torch.stack([h[0].detach() for h in held])
    s = None if held[0][1] is None else torch.stack([h[1] for h in held])
    for i, (weight, scales) in enumerate(held):  # rebound in place: the old tensors are freed, the model held once
        weight.data = w[i]
        if scales is not None:
            scales.data = s[i]
    return w, s


def clamped_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation over the fused [gate | up] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoE(nn.Module):
    native_ops = None  # the compiled CPU kernels (silu(gate) * up), set by LlamaModel.use_native_ops
    row_tile: int | None = None  # deterministic mode: the router's GEMM in fixed row tiles (batch_invariant.py)

    def __init__(self, cfg: ModelConfig, linear: type[nn.Linear], experts: range | None = None, rank: int = 0,
                 dispatch=None):
        """`linear`: the model's projection class, so packing and weight-only quantization reach the experts.
        `experts`: the routed experts this rank holds (expert parallelism; default all). `dispatch`
        (tp/dispatch.ExpertDispatch): this rank routes its slice of the tokens and the rows travel to the experts'
        owners and back (`dispatched`); every rank then holds the shared experts, for its own slice. Without it
        the output is this rank's share over every token, summed by the layer's all-reduce, and the shared
        experts run on rank 0 only."""
        super().__init__()
        self.experts = experts if experts is not None else range(cfg.num_experts)
        self.dispatch = dispatch
        # Tokens routed to each expert (all experts, held here or not: the router sees every token on every rank),
        # since start: the load balance the worker exports. A scatter-add, no host sync (CUDA-graph safe).
        self.register_buffer("routed", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False)
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.round_router_weights = cfg.round_router_weights
        # A plain weight, not a `linear`: quantizing the router would change which experts tokens reach.
        self.router = nn.Parameter(torch.empty(cfg.num_experts, h))
        self.gpt_oss = cfg.moe_kind == "gpt_oss"
        self.deepseek = cfg.moe_kind == "deepseek"
        self.router_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if self.gpt_oss else None
        # DeepSeek: added to the sigmoid scores for choosing only (not to the weights); groups of experts
        self.score_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if self.deepseek else None
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts if rank == 0 or dispatch is not None else 0
        self.shared_gate_up = linear(h, 2 * shared, bias=False) if shared else None
        self.shared_down = linear(shared, h, bias=False) if shared else None
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        bias = self.gpt_oss
        self.gate_up = nn.ModuleList(linear(h, 2 * inter, bias=bias) for _ in self.experts)
        self.down = nn.ModuleList(linear(inter, h, bias=bias) for _ in self.experts)
        # (gate_up [E, 2I, H], its int8 scales, down [E, H, I], scales) for the native kernel (stack_experts)
        self.stacked: tuple | None = None

    def stack_experts(self) -> bool:
        """Hold the experts' weights stacked for the native kernel; False where it does not apply (gpt-oss, packed
        or mixed forms, PDSERVE_NATIVE_MOE=0)."""
        if self.gpt_oss or not len(self.experts) or not env_knobs.enabled(NATIVE_MOE_ENV):
            return False
        if any(_held(m) is None for m in [*self.gate_up, *self.down]):
            return False
        gate_up, down = _stack(self.gate_up), _stack(self.down)
        if gate_up is None or down is None or gate_up[0].dtype != down[0].dtype:
            return False
        self.stacked = (*gate_up, *down)
        return True

    def _native(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        w13, s13, w2, s2 = self.stacked
        out = torch.empty_like(x)
        self.native_ops.moe_experts(out, x, chosen.contiguous(), weights.float().contiguous(), w13, s13, w2, s2,
                                    self.experts.start)
        return out

    def _routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen experts) [T, k] each for the rows of `x`."""
        weight, bias, inp = self.router, self.router_bias, x
        if self.deepseek:  # its router computes in fp32 whatever the model's dtype
            weight, inp = weight.float(), x.float()
        if self.row_tile:
            from pdserve.engine.batch_invariant import in_tiles
            scores = in_tiles(lambda t: F.linear(t, weight, bias), inp, self.row_tile)
        else:
            scores = F.linear(inp, weight, bias)
        return self._route(scores, x.dtype)

    def _kernels_ready(self) -> bool:
        """Stacked experts and the native kernels, outside the deterministic mode: what both native paths need."""
        return self.stacked is not None and self.native_ops is not None and not self.row_tile

    @staticmethod
    def _cpu_rows(x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu"

    def takes_native(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a step of `rows` contiguous CPU rows runs this layer's experts on the native kernel (the decoder
        stack's check, decoder_stack.py)."""
        return self._kernels_ready() and rows <= NATIVE_MAX_TOKENS and dtype in (torch.float32, torch.bfloat16)

    def _takes_native(self, x: torch.Tensor, rows: int) -> bool:
        return self._kernels_ready() and rows <= NATIVE_MAX_TOKENS and self._cpu_rows(x)

    def _takes_grouped(self, x: torch.Tensor) -> bool:
        """Whether a step past the native kernel's size runs the experts grouped (moe_grouped.py): CPU, plain
        stacked weights of x's dtype (not int8), not the deterministic mode (its tiles must not follow the row
        count), PDSERVE_GROUPED_MOE not 0."""
        return (self._kernels_ready() and self._cpu_rows(x) and self.stacked[1] is None
                and self.stacked[0].dtype == x.dtype and env_knobs.enabled(GROUPED_MOE_ENV))

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's shared experts: one dense SwiGLU MLP every token takes."""
        from pdserve.engine.model import swiglu
        return self.shared_down(swiglu(self.shared_gate_up(x), self.native_ops))

    def routes_native(self, dtype: torch.dtype) -> bool:
        """Whether steps on the native experts' kernel route on the native router too (csrc/moe_experts.cpp's
        moe_route: the softmax top-k routers, router and activations of one dtype); the decoder stack's check too."""
        return (not self.gpt_oss and not self.deepseek and self.router_bias is None and self.router.dtype == dtype
                and dtype in (torch.float32, torch.bfloat16))

    def _route_native(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32, chosen) [T, k] each from the native router, which also counts `routed`."""
        weights = torch.empty(x.shape[0], self.top_k, dtype=torch.float32)
        chosen = torch.empty(x.shape[0], self.top_k, dtype=torch.long)
        self.native_ops.moe_route(weights, chosen, x, self.router, self.routed, bool(self.norm_topk_prob),
                                  bool(self.round_router_weights))
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_native(x, x.shape[0]) and self.routes_native(x.dtype):
            # the router, its softmax / top k / renormalisation and the load count in one native call, as the
            # decoder stack calls it (its logits equal this path's bit for bit)
            out = self._native(x, *self._route_native(x))
        else:
            weights, chosen = self._routing(x)  # [T, k] each
            ids = chosen.flatten()
            self.routed.scatter_add_(0, ids, torch.ones_like(ids))
            if self._takes_native(x, x.shape[0]):
                out = self._native(x, weights, chosen)
            elif self._takes_grouped(x):
                w13, _, w2, _ = self.stacked
                out = grouped_experts(x, weights, chosen, w13, w2, self.experts.start, self.native_ops)
            else:
                out = self._loop(x, weights, chosen)
        if self.shared_gate_up is not None:
            out = out + self._shared(x)
        return out

    def dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE output of this rank's slice `x` of a step's tokens, its rows computed by the ranks holding
        their experts (tp/dispatch.py)."""
        weights, chosen = self._routing(x)
        out, counts = self.dispatch(x, weights, chosen, self._rows)
        self.routed += counts
        if self.shared_gate_up is not None:
            out = out + self._shared(x)
        return out

    def _rows(self, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each row's output of its expert (`local`: its index among those held here), unweighted: one expert per
        row through the native kernel (weight 1) where a step of its size would take it, else expert by expert."""
        from pdserve.engine.model import swiglu
        if not x.shape[0]:
            return x
        if self._takes_native(x, -(-x.shape[0] // self.top_k)):
            ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
            return self._native(x, ones, local.view(-1, 1) + self.experts.start)
        out = torch.empty_like(x)
        for e in torch.unique(local).tolist():
            rows = torch.where(local == e)[0]
            gate_up = self.gate_up[e](x[rows])
            act = clamped_glu(gate_up, self.alpha, self.limit) if self.gpt_oss else swiglu(gate_up, self.native_ops)
            out[rows] = self.down[e](act).to(out.dtype)
        return out

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The experts one after another, each over the rows that chose it."""
        from pdserve.engine.model import swiglu
        out = torch.zeros_like(x)
        first, held = self.experts.start, len(self.experts)
        ids = chosen.flatten()
        mine = ids[(ids >= first) & (ids < first + held)] - first  # the chosen experts this rank holds
        for e in torch.bincount(mine, minlength=held).nonzero().flatten().tolist():
            rows, slot = torch.where(chosen == first + e)
            gate_up = self.gate_up[e](x[rows])
            act = clamped_glu(gate_up, self.alpha, self.limit) if self.gpt_oss else swiglu(gate_up, self.native_ops)
            y = self.down[e](act)
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out

    def _route(self, scores: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen experts) per token."""
        if self.gpt_oss:  # top k of the logits, softmax over those k in the activations' dtype
            top, chosen = scores.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), chosen
        if self.deepseek:
            return self._route_grouped(scores)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_router_weights:
            weights = weights.to(dtype)
        return weights, chosen

    def _route_grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3 (noaux_tc): sigmoid scores; the experts are split into n_group groups ranked by the sum of
        their two best bias-corrected scores; the top k experts of the best topk_group groups are chosen; their
        uncorrected scores, renormalised (norm_topk_prob) and times routed_scaling_factor, are the weights."""
        scores = logits.sigmoid()
        choice = scores + self.score_bias.float()
        t, n = choice.shape
        group_scores = choice.view(t, self.n_group, n // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, -1, n // self.n_group).reshape(t, n)
        chosen = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def load(self, tensors: dict[str, torch.Tensor], layer: str, arch: str, put) -> None:
        """Copy layer `layer`'s ("model.layers.{i}.") router and experts in, fusing each expert's gate and up."""
        if self.gpt_oss:
            self._load_stacked(tensors, f"{layer}mlp.", put)
            return
        block, router, gate, up, down = CHECKPOINT_NAMES[arch]
        p = f"{layer}{block}."
        n_all = self.router.shape[0]
        h = self.router.shape[1]
        inter = self.down[0].in_features
        put(self.router, take(tensors, f"{p}{router}.weight", tuple(self.router.shape)))
        for e, gate_up, down_proj in zip(self.experts, self.gate_up, self.down):
            g = take(tensors, f"{p}experts.{e}.{gate}.weight", (inter, h))
            u = take(tensors, f"{p}experts.{e}.{up}.weight", (inter, h))
            put(gate_up.weight, torch.cat([g, u]))
            put(down_proj.weight, take(tensors, f"{p}experts.{e}.{down}.weight", (h, inter)))
        if self.deepseek:  # router and correction kept in fp32 whatever the model's dtype, as transformers keeps them
            self.router.data = take(tensors, f"{p}{router}.weight", tuple(self.router.shape)).float()
            self.score_bias.data = take(tensors, f"{p}{router}.e_score_correction_bias", (n_all,)).float()
        if self.shared_gate_up is not None:
            shared = self.shared_down.in_features
            g = take(tensors, f"{p}shared_experts.gate_proj.weight", (shared, h))
            u = take(tensors, f"{p}shared_experts.up_proj.weight", (shared, h))
            put(self.shared_gate_up.weight, torch.cat([g, u]))
            put(self.shared_down.weight, take(tensors, f"{p}shared_experts.down_proj.weight", (h, shared)))

    def _load_stacked(self, tensors: dict[str, torch.Tensor], p: str, put) -> None:
        """gpt-oss: router weight and bias; experts as [E, h, 2I] (gate, up interleaved) and [E, I, h], biases."""
        n, h = self.router.shape
        inter = self.down[0].in_features
        put(self.router, take(tensors, f"{p}router.weight", (n, h)))
        put(self.router_bias, take(tensors, f"{p}router.bias", (n,)))
        gate_up = take(tensors, f"{p}experts.gate_up_proj", (n, h, 2 * inter))
        gate_up_bias = take(tensors, f"{p}experts.gate_up_proj_bias", (n, 2 * inter))
        down = take(tensors, f"{p}experts.down_proj", (n, inter, h))
        down_bias = take(tensors, f"{p}experts.down_proj_bias", (n, h))
        for i, e in enumerate(self.experts):
            put(self.gate_up[i].weight, torch.cat([gate_up[e][:, 0::2].t(), gate_up[e][:, 1::2].t()]))
            put(self.gate_up[i].bias, torch.cat([gate_up_bias[e][0::2], gate_up_bias[e][1::2]]))
            put(self.down[i].weight, down[e].t())
            put(self.down[i].bias, down_bias[e])
