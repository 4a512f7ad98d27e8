"""A many-token step's routed experts on the CPU, grouped (engine/moe.py's path past NATIVE_MAX_TOKENS).

The (token, expert) pairs are sorted by expert once; each hit expert's rows are gathered into one buffer (one
index_select for all experts), then per expert one GEMM for gate/up and one for down over its rows (torch.mm into
slices of shared buffers: oneDNN, AMX where the CPU has it, for bf16), SwiGLU once over the whole buffer
(silu_and_mul), and the routing-weighted sum in one native pass (csrc/moe_combine.cpp).

Each expert's row count is padded up to a bucket (`bucket`). oneDNN builds (JIT-compiles) a GEMM primitive per
shape and caches it: at unpadded counts nearly every expert of every step has a row count not seen before, and
the build (~2 ms on the Intel model 207) cost 5x the GEMM itself: 210 GFLOP/s against 1.1-1.3 TFLOP/s once built
(bf16, 768 x 768 weight, ~400-600 rows, 1 thread; docs/engine.md, "Sparse MoE on the CPU"). Buckets of 1/8 of an
octave keep the shapes few (~8 an octave, for every step) at <= 12.5% padding. The padding rows repeat row 0's
token: finite, and never read back (each output row depends on its own input row only).
"""
from __future__ import annotations

from itertools import accumulate

import torch

MIN_BUCKET = 16
# Tokens one pass takes at most; longer steps go in slices of this many (a token's output does not depend on the
# others'). Its buffers hold ~3 rows of H and 2 of I per (token, expert) pair: ~90 MB at 2048 tokens, top 8 and the
# bench model's bf16 sizes, freed when the layer returns.
MAX_TOKENS = 2048


def bucket(rows: int) -> int:
    """`rows` rounded up to a multiple of 1/8 of its power-of-two octave (at least MIN_BUCKET)."""
    if rows <= MIN_BUCKET:
        return MIN_BUCKET
    step = max(MIN_BUCKET, 1 << ((rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def plan(chosen: torch.Tensor, first: int, held: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(src [P]: each padded row's token, pos [T, k]: each pair's row or -1 where the expert is not held here,
    segments [(expert, start, end)] of the hit experts' rows) for experts first .. first + held - 1."""
    t, k = chosen.shape
    key = chosen.flatten() - first
    key = torch.where((key >= 0) & (key < held), key, held)  # not held: sorted last, dropped
    counts = torch.bincount(key, minlength=held + 1)[:held].tolist()
    pairs = sum(counts)
    order = torch.argsort(key, stable=True)[:pairs]  # by expert, tokens in order within each
    sizes = [bucket(c) if c else 0 for c in counts]
    pad_start, cnt_start = [0, *accumulate(sizes)], [0, *accumulate(counts)]
    expert = key[order]
    dest = (torch.tensor(pad_start[:-1])[expert] - torch.tensor(cnt_start[:-1])[expert]
            + torch.arange(pairs))
    src = torch.zeros(pad_start[-1], dtype=torch.long)
    src[dest] = order // k
    pos = torch.full((t * k,), -1, dtype=torch.long)
    pos[order] = dest
    segments = [(e, pad_start[e], pad_start[e + 1]) for e in range(held) if counts[e]]
    return src, pos.view(t, k), segments


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, first: int, ops) -> torch.Tensor:
    """sum over each row's chosen experts held here of weight * down(silu(gate) * up): x [T, H] contiguous CPU,
    weights and chosen [T, k], w13 [E, 2I, H] and w2 [E, H, I] plain (x's dtype), `ops` the native kernels."""
    if x.shape[0] > MAX_TOKENS:
        return torch.cat([grouped_experts(x[i:i + MAX_TOKENS], weights[i:i + MAX_TOKENS], chosen[i:i + MAX_TOKENS],
                                          w13, w2, first, ops) for i in range(0, x.shape[0], MAX_TOKENS)])
    src, pos, segments = plan(chosen, first, w13.shape[0])
    out = torch.empty_like(x)
    if not segments:
        return out.zero_()
    xs = x.index_select(0, src)
    gate_up = x.new_empty(xs.shape[0], w13.shape[1])
    for e, a, b in segments:
        torch.mm(xs[a:b], w13[e].t(), out=gate_up[a:b])
    act = x.new_empty(xs.shape[0], w2.shape[2])
    ops.silu_and_mul(act, gate_up)
    y = x.new_empty(xs.shape[0], x.shape[1])
    for e, a, b in segments:
        torch.mm(act[a:b], w2[e].t(), out=y[a:b])
    ops.moe_combine(out, y, pos, weights.float().contiguous())
    return out
