"""KV-cache quantization: the pool's storage dtype and the one conversion K/V take on the way in.

`auto` keeps K/V in the compute dtype (fp32 or bf16 on CPU, cpu_isa.choose_dtype). `fp8_e4m3` stores each element
as one float8_e4m3fn byte (4 exponent bits, 3 mantissa bits, max 448) with no scales: a block stays
self-contained, so swap, the host/disk tiers and the P/D transfer copy it byte for byte as before and nothing
else travels with it. Per-element float exponents keep the relative error per value about 2^-4 whatever the
head's range, which is what int8 needs per-head (or per-token) scales for; docs/engine.md has the measured
comparison. Values beyond +-448 saturate (torch's cast turns them into NaN otherwise).
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def storage_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for `--kv-cache-dtype`."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})")


def is_quantized(dtype: torch.dtype) -> bool:
    """A pool dtype the attention kernels cannot compute in (converted to the query's dtype after the gather)."""
    return dtype == FP8


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the pool's dtype: saturated to the fp8 range first, a plain cast otherwise."""
    if dtype == FP8:
        return x.float().clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """A byte view for the row copies torch does not implement for float8 on CPU (index_copy_)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
