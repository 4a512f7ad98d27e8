"""Deterministic mode (EngineConfig.deterministic, `--deterministic`): every row of a step is computed by the same
kernels in the same reduction order whatever else the step holds.

Without it a row's result depends on its batch mates: the projections pick their kernel by the step's row count
(the native GEMV up to a few rows, oneDNN's or torch's GEMM above, each GEMM blocking its reduction by the shape),
a prompt's attention runs through SDPA or the prefill kernel whose key blocking depends on the chunk, and small
all-decode steps run as one fused decoder call. Any of these changes the float rounding of a row, and a greedy
argmax that is nearly tied then flips. The mode fixes the shape each kernel sees:

- projections, the MoE router and the LM head (`RowTiled`, `in_tiles`): the rows go through the wrapped module in tiles of exactly
  ROW_TILE rows, the last one padded with zeros, so the kernel and its blocking are chosen for one shape only,
  and a row's output does not depend on the rows beside it (tests/engine/test_batch_invariant.py checks each
  backend row by row);
- attention: every query row, prompt or decode, is a single-query attention over its own context read from the
  pool by the decode kernel (model_runner: prefill tokens become decode rows of context position + 1), so a
  prompt token's keys are reduced in the same order whether it was computed alone, in a chunk, or after a
  prefix-cache hit; the torch fallback attends each row alone over a width fixed by its context length;
- the fused decoder stack and CUDA graphs are off (their shapes follow the batch);
- sampling runs row by row (each row its own one-row batch: the same reductions over the vocabulary).
- norms: the native kernel for every input, strided views (Qwen3's q/k heads) copied first; the torch kernel
  would otherwise serve them except at one row, where the view is contiguous and the native kernel takes it.
Rotary embedding, SwiGLU and residuals are per row already (no reduction across rows).
"""
from __future__ import annotations

import torch
from torch import nn

# Rows per projection call. 1 would make every call a GEMV (the same kernel for every row by construction) but
# reads the weights once per prompt token; 8 was the best of 1, 2, 4, 8, 16, 32 on the concurrent workload of
# bench/deterministic.py (AMD EPYC Zen 4, runs under load; quiet: 0.37-0.42x the default, 1 gave 0.23x) and was checked
# row-invariant on every backend the engine uses (tests/engine/test_batch_invariant.py).
ROW_TILE = 8


class RowTiled(nn.Module):
    """A projection called on fixed-size row tiles: `inner` only ever sees [ROW_TILE, in] inputs."""

    def __init__(self, inner: nn.Module, tile: int):
        super().__init__()
        self.inner = inner
        self.tile = tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_tiles(self.inner, x, self.tile)


def in_tiles(fn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """fn over x's rows in tiles of exactly `tile` rows (the last padded with zeros), concatenated."""
    rows = x.shape[0]
    if rows == 0:  # a step that samples nothing: no tile to fill
        return fn(x)
    padded = -(-rows // tile) * tile
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])
    x = x.contiguous()
    outs = [fn(x[i:i + tile]) for i in range(0, padded, tile)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:rows]


def is_projection(m: nn.Module) -> bool:
    from pdserve.engine.quant import DualLinear, WeightOnlyLinear
    return isinstance(m, (nn.Linear, WeightOnlyLinear, DualLinear))


def tile_projections(model: nn.Module, tile: int | None = None) -> int:
    """Wrap every projection of `model` (attention, MLP, experts, LM head) in RowTiled, tile the MoE routers, and
    put the norms on one kernel, in place; return how many projections were wrapped.
    After the weights have taken their final form (quantized, packed): the wrapper calls whatever is there."""
    tile = tile or ROW_TILE  # read at the call: bench/deterministic.py compares tile sizes
    # DualLinear's own gemv/gemm halves are left alone: the DualLinear around them is wrapped
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if is_projection(child) and not is_projection(parent) and not isinstance(parent, RowTiled)]
    for parent, name, child in targets:
        setattr(parent, name, RowTiled(child, tile))
    from pdserve.engine.model import RMSNorm
    from pdserve.engine.moe import SparseMoE
    for m in model.modules():
        if isinstance(m, SparseMoE):  # its router is a bare weight, not a projection module
            m.row_tile = tile
        if isinstance(m, RMSNorm):  # one kernel whatever the row count (RMSNorm.contiguous_first)
            m.contiguous_first = True
    return len(targets)
