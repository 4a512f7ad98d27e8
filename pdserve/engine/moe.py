"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral, computed as transformers computes it.

A router scores every expert per token; the softmax (fp32) of those scores picks the top k, whose weights are
renormalised to sum to 1 where the model says so (`norm_topk_prob`; always for Mixtral). Each expert is a SwiGLU
MLP (fused gate/up, then down) and a token's output is the weighted sum of its k experts' outputs.

Cost: the experts run one after another, each over the rows that chose it (a gather, two GEMMs, a scatter-add),
so a step pays one Python iteration and two small GEMMs per expert hit, and a decode step of a few tokens reads
only the experts those tokens chose. That is correct and simple, not fast: a grouped GEMM over all experts in one
native call is what a fast path would add. All experts live in this process (no expert parallelism).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import take

# How each architecture names a sparse layer's block, its router and its experts' gate, up and down projections.
CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
}


class SparseMoE(nn.Module):
    native_ops = None  # the compiled CPU kernels (silu(gate) * up), set by LlamaModel.use_native_ops
    row_tile: int | None = None  # deterministic mode: the router's GEMM in fixed row tiles (batch_invariant.py)

    def __init__(self, cfg: ModelConfig, linear: type[nn.Linear]):
        """`linear`: the model's projection class, so packing and weight-only quantization reach the experts."""
        super().__init__()
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.round_router_weights = cfg.round_router_weights
        # A plain weight, not a `linear`: quantizing the router would change which experts tokens reach.
        self.router = nn.Parameter(torch.empty(cfg.num_experts, h))
        self.gate_up = nn.ModuleList(linear(h, 2 * inter, bias=False) for _ in range(cfg.num_experts))
        self.down = nn.ModuleList(linear(inter, h, bias=False) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pdserve.engine.model import swiglu
        if self.row_tile:
            from pdserve.engine.batch_invariant import in_tiles
            scores = in_tiles(lambda t: F.linear(t, self.router), x, self.row_tile)
        else:
            scores = F.linear(x, self.router)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_router_weights:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        hits = torch.bincount(chosen.flatten(), minlength=len(self.gate_up))
        for e in hits.nonzero().flatten().tolist():
            rows, slot = torch.where(chosen == e)
            y = self.down[e](swiglu(self.gate_up[e](x[rows]), self.native_ops))
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out

    def load(self, tensors: dict[str, torch.Tensor], layer: str, arch: str, put) -> None:
        """Copy layer `layer`'s ("model.layers.{i}.") router and experts in, fusing each expert's gate and up."""
        block, router, gate, up, down = CHECKPOINT_NAMES[arch]
        p = f"{layer}{block}."
        h = self.router.shape[1]
        inter = self.down[0].in_features
        put(self.router, take(tensors, f"{p}{router}.weight", tuple(self.router.shape)))
        for e, (gate_up, down_proj) in enumerate(zip(self.gate_up, self.down)):
            g = take(tensors, f"{p}experts.{e}.{gate}.weight", (inter, h))
            u = take(tensors, f"{p}experts.{e}.{up}.weight", (inter, h))
            put(gate_up.weight, torch.cat([g, u]))
            put(down_proj.weight, take(tensors, f"{p}experts.{e}.{down}.weight", (h, inter)))
