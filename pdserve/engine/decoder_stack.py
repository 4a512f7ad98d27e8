"""Every decoder layer of a small all-decode step in one native call (csrc/decoder_stack.cpp).

A decode step of a few sequences is a few hundred small operations: per layer two norms, four projections, rope,
the KV write, attention, SwiGLU and two residual adds, each dispatched from Python. The kernels themselves are
native already; what the stack removes is the Python between them (~2.8 ms of an 18 ms batch-1 step on a 2-core
AMD EPYC Zen 3, docs/engine.md) and the GIL held through it. It runs the same kernels in the same order, so its
output equals the Python loop's bit for bit (tests/engine/test_decoder_stack.py).

Each projection runs as its module's forward would at the step's row count (`projection_plan`): the native GEMV
(int8 / bf16 weights, the plain copies of packed projections, DualLinear's bf16 half), oneDNN's prepacked linear,
or torch's linear. Where some projection has no such form at that size (int8 beyond the GEMV's rows widens the
weight per call), the step keeps the Python loop. Plans are built once per row count and cached.

The stack computes the plain Llama layer, Qwen3's q/k norms, and sparse MoE layers with a softmax top-k router
(Qwen3-MoE, Mixtral) whose experts a step of its size would run on the native MoE kernel (moe.py): the native
router with its expert-load count (moe_route) and the experts' kernel (moe_experts, both csrc/moe_experts.cpp), as
SparseMoE.forward's native path calls them. A model with any layer
it does not compute (attention sinks, latent attention, DeepSeek's or gpt-oss's experts: `DecoderLayer.stackable`)
keeps the Python loop for every step, where each layer still runs the same per-op native kernels (norms, rope,
SwiGLU, attention) and torch for the rest; so do steps too large for the MoE kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import env_knobs
from pdserve.engine.attention import AttentionMetadata

STACK_ENV = "PDSERVE_DECODER_STACK"  # "0": always the Python layer loop (comparisons, debugging)
# Steps of up to this many rows use the stack: past it the Python per layer is a small share of a step's GEMMs.
MAX_ROWS = 64
GEMV, PACKED, DENSE = 0, 1, 2  # csrc/decoder_stack.cpp's Kind


@dataclass(frozen=True)
class Projection:
    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None


def projection_plan(m: torch.nn.Module, rows: int, dtype: torch.dtype) -> Projection | None:
    """How `m` computes `rows` contiguous rows of `dtype`, mirroring its forward; None where that is not one of the
    three native forms."""
    from pdserve.engine.model import Linear
    from pdserve.engine.quant import DUAL_GEMV_MAX_ROWS, GEMV_COPY_MAX_ROWS, GEMV_MAX_ROWS, DualLinear, WeightOnlyLinear
    if isinstance(m, DualLinear):
        if m.gemv.native_ops is not None and rows <= DUAL_GEMV_MAX_ROWS and dtype == torch.float32:
            return Projection(GEMV, m.gemv.weight, None, m.gemv.bias)
        return projection_plan(m.gemm, rows, dtype)
    if isinstance(m, WeightOnlyLinear):
        if m.native_ops is not None and rows <= GEMV_MAX_ROWS.get(dtype, 0) and dtype in (torch.float32,
                                                                                           torch.bfloat16):
            return Projection(GEMV, m.weight, m.scales, m.bias)
        return None
    if isinstance(m, Linear):
        if m.packed is None:
            return Projection(DENSE, m.weight, None, m.bias) if m.weight.dtype == dtype else None
        if m.gemv_weight is not None and m.native_ops is not None and rows <= GEMV_COPY_MAX_ROWS \
                and dtype == m.gemv_weight.dtype:
            return Projection(GEMV, m.gemv_weight, None, m.bias)
        return Projection(PACKED, m.packed, None, m.bias)
    return None


class DecoderStacks:
    """The model's layers as native stacks, one per step row count (built on first use), or None where a step of
    that size keeps the Python loop."""

    def __init__(self, model, native_ops):
        self.model = model
        self.native_ops = native_ops
        self.enabled = (native_ops is not None and hasattr(native_ops, "DecoderStack") and model.comm is None
                        and all(layer.stackable for layer in model.layers) and env_knobs.enabled(STACK_ENV))
        self._by_rows: dict[int, object] = {}

    def applies(self, meta: AttentionMetadata, rows: int, kv: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether this step is one the stack runs: every row a single-token decode through the native kernel, KV
        pool and activations of one dtype, on the CPU."""
        nd = meta.native_decode
        return (self.enabled and rows <= MAX_ROWS and nd is not None and meta.native_prefill is None
                and not meta.prefills and meta.native_ops is self.native_ops and nd.rows.numel() == rows
                and kv.dtype == x.dtype and x.device.type == "cpu")

    def get(self, rows: int, dtype: torch.dtype):
        if rows not in self._by_rows:
            self._by_rows[rows] = self._build(rows, dtype)
        return self._by_rows[rows]

    def _build(self, rows: int, dtype: torch.dtype):
        norms, plans, widths = [], [], []
        empty = torch.empty(0)
        for layer in self.model.layers:
            norms += [layer.input_norm.weight, layer.post_norm.weight]
            if layer.q_norm is not None:
                norms += [layer.q_norm.weight, layer.k_norm.weight]
            mlp = (layer.gate_up, layer.down) if layer.moe is None else ()
            if layer.moe is not None and not (layer.moe.takes_native(rows, dtype) and layer.moe.routes_native(dtype)):
                return None
            plans += [projection_plan(m, rows, dtype) for m in (layer.qkv, layer.o, *mlp)]
            plans += [Projection(DENSE, empty, None, None)] * (2 - len(mlp))  # sparse: set_moe below
            widths += [out_features(m) for m in (layer.qkv, layer.o, *mlp)] + [0] * (2 - len(mlp))
        if any(p is None for p in plans) or any(n.dtype != dtype for n in norms):
            return None
        first = self.model.layers[0]
        stack = self.native_ops.DecoderStack(
            [n.detach() for layer in self.model.layers for n in (layer.input_norm.weight, layer.post_norm.weight)],
            [p.kind for p in plans], [p.weight.detach() for p in plans],
            [empty if p.scales is None else p.scales for p in plans],
            [empty if p.bias is None else p.bias.detach() for p in plans], widths,
            first.num_heads, first.num_kv_heads, self.model.cfg.head_dim, first.input_norm.eps)
        for i, layer in enumerate(self.model.layers):
            if layer.q_norm is not None:
                stack.set_qk_norm(i, layer.q_norm.weight.detach(), layer.k_norm.weight.detach())
            if layer.moe is not None:
                moe = layer.moe
                w13, s13, w2, s2 = moe.stacked
                stack.set_moe(i, moe.router.detach(), moe.routed, w13, empty if s13 is None else s13, w2,
                              empty if s2 is None else s2, moe.experts.start, moe.top_k, bool(moe.norm_topk_prob),
                              bool(moe.round_router_weights))
        return stack


def out_features(m: torch.nn.Module) -> int:
    from pdserve.engine.quant import DualLinear
    return m.gemv.out_features if isinstance(m, DualLinear) else m.out_features
