"""Weight-only storage narrower than the compute dtype: int8 (`--quantization int8`) and bf16 computed in fp32.

A batch-1 decode step is the projection weights' bytes read (docs/engine.md, "Batch-1 decode"); storing them in
fewer bytes is the only way left to make it faster. Two forms, one module (`WeightOnlyLinear`):
- **int8**: per-output-channel symmetric, `w ≈ scale[n] * q[n, k]` with `scale[n] = max_k |w[n, k]| / 127` and
  `q = round(w / scale)` in [-127, 127] (no zero point; -128 unused so the grid is symmetric). Every projection
  (q/k/v, o, gate/up, down) and `lm_head` are quantized: `lm_head` is ~22% of the bench model's decode bytes and
  per-row int8 is what llama.cpp's q8_0 and torchao's int8 weight-only also do with it. The token embedding stays
  in the compute dtype: a step gathers one row of it per token, so its size costs no step time.
- **bf16 storage, fp32 compute** (opt-in: `PDSERVE_BF16_WEIGHTS=1` with `dtype=auto`): a bf16 checkpoint on a
  CPU without native bf16 is computed in fp32 with its projections held in bf16 (`choose_weight_storage`): bf16
  GEMMs are emulated there, but a GEMV that widens bf16 to fp32 in registers reads half of fp32's bytes. Not the
  default: with every layer capped to AVX2 batch-1 decode measured 1.46-1.69x fp32 but the mixed workload 0.82x,
  as every step of more than GEMV_MAX_ROWS rows pays a widening pass (docs/engine.md, "Weights held narrower than
  the compute dtype").

Rows ≤ GEMV_MAX_ROWS (decode batches) run the native `weight_gemv` kernel (csrc/weight_gemv.cpp): the weight is
read once, widened in registers, fp32 accumulation. Larger batches (prefill chunks, compute-bound) widen the
weight to the compute dtype per call and run torch's GEMM: the widening is one extra pass over the weights per
call, small next to a GEMM of many rows, and the model is still held once, narrow. Without the native module
the small-batch path is torch's `_weight_int8pack_mm` for bf16 activations, else the per-call widening (slower
than not quantizing at all: logged once, at load).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import env_knobs

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8")
BF16_WEIGHTS_ENV = "PDSERVE_BF16_WEIGHTS"  # "1": dtype=auto holds a bf16 checkpoint's projections in bf16 (above)
# Up to this many rows (by activation dtype) the native GEMV beats widening the weight per call and running torch's
# GEMM. Measured on the 124M bench model's projections, 2 threads: fp32 activations under the AVX2 cap, native vs
# widen+GEMM, int8 weights 78 vs 95 ms at 32 rows and 153 vs 131 ms at 64; bf16-held 82 vs 96 and 163 vs 136.
# bf16 activations (AMX), int8 weights: 33 vs 50 ms at 16 rows, 97 vs 55 ms at 32 (the widened bf16 GEMM runs on
# AMX tiles; the GEMV's fp32 FMAs do not).
GEMV_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16}
# DualLinear's GEMV rows: against oneDNN's prepacked fp32 linear on an AMD EPYC (Zen 3, AVX2, 2 threads; the bench
# model's projections + lm_head) the bf16 GEMV took 3.8 / 7.2 / 15.4 / 30.1 ms at 1 / 8 / 16 / 32 rows, the GEMM
# 8.1 / 12.7 / 17.2 / 22.4 ms.
DUAL_GEMV_MAX_ROWS = 16
QMAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [n, k] int8, scale [n] fp32) with weight ≈ scale[:, None] * q.
    The scale is computed from the weight as given (fp32 math); an all-zero row gets scale 1 (q = 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None].to(torch.float32)).to(dtype)


class WeightOnlyLinear(nn.Module):
    """y = x @ W.T + b with W held as int8 + per-row scale, or as bf16 for fp32 activations.

    `weight` and `scales` are buffers, not parameters: the engine reads the compute dtype from the model's first
    parameter (the embedding), and nothing here is trained."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.native_ops = None  # the compiled CPU kernels (LlamaModel.use_native_ops)
        self._scales_bf16: torch.Tensor | None = None  # for torch's int8 kernel, which wants x's dtype

    @classmethod
    def int8(cls, linear: nn.Linear) -> "WeightOnlyLinear":
        q, s = quantize_int8(linear.weight)
        return cls(q, s, None if linear.bias is None else linear.bias.detach().clone())

    @classmethod
    def bf16(cls, linear: nn.Linear) -> "WeightOnlyLinear":
        return cls(linear.weight.detach().to(torch.bfloat16).contiguous(), None,
                   None if linear.bias is None else linear.bias.detach().clone())

    @property
    def kind(self) -> str:
        return "int8" if self.weight.dtype == torch.int8 else "bfloat16"

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (scale folded in): the large-batch path, and the tests' reference."""
        if self.scales is None:
            return self.weight.to(dtype)
        return dequantize_int8(self.weight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS.get(x.dtype, 0)  # both small paths want fp32/bf16
        if small and self.native_ops is not None and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16):
            out = x.new_empty(x.shape[0], self.out_features)
            self.native_ops.weight_gemv(out, x, self.weight, self.scales)
        elif (small and self.scales is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"
              and self.in_features % 16 == 0):  # torch 2.13's kernel returns NaN for other K (K = 100, 257 seen)
            if self._scales_bf16 is None:
                self._scales_bf16 = self.scales.to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, self._scales_bf16)
        elif self.scales is None:
            out = F.linear(x, self.weight.to(x.dtype))
        else:  # int8 is exact in bf16 and fp32: widen, multiply, then scale each output column once (in fp32)
            out = F.linear(x, self.weight.to(x.dtype))
            out = out * self.scales if out.dtype == torch.float32 else (out.float() * self.scales).to(out.dtype)
        if self.bias is not None:
            out += self.bias
        return out


class DualLinear(nn.Module):
    """A projection held twice: in bf16 for decode-sized batches (the native GEMV reads half of fp32's bytes) and in
    the compute dtype for everything larger (torch's or oneDNN's GEMM, no widening pass). The default for a bf16
    checkpoint computed in fp32 (`choose_weight_storage`): 1.5x the weight memory of fp32 alone, batch-1 decode
    at bf16's bytes, prefill and large batches at fp32's GEMM speed."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.gemv = WeightOnlyLinear.bf16(linear)
        self.gemm = linear  # LlamaModel.pack_weights prepacks it where oneDNN's path applies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.gemv.native_ops
        if ops is not None and x.dim() == 2 and x.shape[0] <= DUAL_GEMV_MAX_ROWS and x.dtype == torch.float32 \
                and x.is_contiguous():  # the GEMV called directly, not through a second module call
            out = x.new_empty(x.shape[0], self.gemv.out_features)
            ops.weight_gemv(out, x, self.gemv.weight, None)
            return out if self.gemv.bias is None else out.add_(self.gemv.bias)
        return self.gemm(x)


def choose_weight_storage(level: str, checkpoint_dtype: torch.dtype, compute_dtype: torch.dtype,
                          device: str, native: bool, env: str | None = None) -> str:
    """The projections' storage under `dtype=auto`. Where a bf16 checkpoint is computed in fp32 on a CPU (no native
    bf16) and the native GEMV exists to read bf16: "dual" (DualLinear) by default, "bfloat16" alone with
    PDSERVE_BF16_WEIGHTS=1 (the lean form: larger batches widen per call), "same" with PDSERVE_BF16_WEIGHTS=0.
    Everywhere else "same"."""
    if (env == "0" or not device.startswith("cpu") or not native or checkpoint_dtype != torch.bfloat16
            or compute_dtype != torch.float32 or level == "scalar"):
        return "same"
    return "bfloat16" if env == "1" else "dual"


BATCH1_GEMV_ENV = "PDSERVE_BATCH1_GEMV"  # "1" / "0": force / forbid the plain copies for small-batch GEMVs
# Rows up to which packed bf16 projections with a plain copy take the native GEMV (vdpbf16ps). The 49 calls of the
# bench model's step on an AMD EPYC Zen 4, 2 threads, GEMV vs oneDNN's packed linear, two runs: 7.2-7.9 vs 9.4-9.7
# ms at 1 row, 7.9-8.2 vs 10.5 at 2, 10.4-10.5 vs 9.9-10.2 at 4 (the dot products' own work catches up), 11.8 vs
# 10.7-11.7 at 8.
GEMV_COPY_MAX_ROWS = 2


def batch1_gemv_wanted(level: str, compute_dtype: torch.dtype, device: str, native: bool,
                       env: str | None = None) -> bool:
    """Whether oneDNN-packed bf16 projections also keep their plain weight, so steps of up to GEMV_COPY_MAX_ROWS rows
    (batch-1 and -2 decode) run the native GEMV (csrc/weight_gemv.cpp: vdpbf16ps on bf16 as stored) instead of
    oneDNN's small-M linear. Measured on an AMD EPYC Zen 4 (level avx512_bf16, 2 threads; the bench model's
    projections + lm_head) at one row: 7.0-7.7 ms against 11.6-13.6 ms (1 thread: 9.6 vs 17.5). Twice the
    projections' memory, so it yields to the host's memory like dual storage (auto_weight_storage). On by default
    at levels avx512_bf16 and amx, where it was measured: on an Intel Xeon model 207 (amx, 1 thread, shared box)
    the MoE bench's batch-1 step (bench/moe_speed.py, whose attention projections and LM head these copies serve)
    was 1.20x / 1.20x llama.cpp with them against 1.04x / 1.14x without, in runs alternating with each other, and
    the attention half and LM head took 4.6 and 4.5 ms against 8.2-8.3 and 7.9-8.2 ms under another process's
    memory traffic (oneDNN's small-M linear suffered most). Below avx512_bf16 there is no vdpbf16ps."""
    if not (native and device.startswith("cpu") and compute_dtype == torch.bfloat16) or env == "0":
        return False
    return env == "1" or level in ("avx512_bf16", "amx")


def keep_batch1_gemv(model: nn.Module, level: str, compute_dtype: torch.dtype, device: str, native: bool,
                     reserve_bytes: int) -> bool:
    """batch1_gemv_wanted under PDSERVE_BATCH1_GEMV, except where the plain copies (2 bytes a projection weight)
    would not fit beside `reserve_bytes` (dual_fits): then oneDNN alone, with a warning."""
    if not batch1_gemv_wanted(level, compute_dtype, device, native, env_knobs.get(BATCH1_GEMV_ENV) or None):
        return False
    if not dual_fits(model, reserve_bytes, mem_available_bytes()):
        log.warning("not keeping plain copies of the projections for batch-1 GEMVs: they would not fit in this "
                    "host's available memory beside the KV pool")
        return False
    return True


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where it cannot be read."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def dual_fits(model: nn.Module, reserve_bytes: int, available: int | None) -> bool:
    """Whether the bf16 copies DualLinear adds (2 bytes a projection weight) fit in `available` host memory with
    `reserve_bytes` (the KV pool and the rest still to be allocated) to spare, and 10% headroom. Unknown memory:
    assume it fits."""
    extra = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    return available is None or extra + reserve_bytes <= 0.9 * available


def auto_weight_storage(model: nn.Module, level: str, checkpoint_dtype: torch.dtype, compute_dtype: torch.dtype,
                        device: str, native: bool, reserve_bytes: int) -> str:
    """`dtype=auto`'s storage (choose_weight_storage under PDSERVE_BF16_WEIGHTS), except that dual storage yields to
    fp32 alone, with a warning, where its bf16 copies would not fit beside `reserve_bytes` (dual_fits)."""
    storage = choose_weight_storage(level, checkpoint_dtype, compute_dtype, device, native,
                                    env_knobs.get(BF16_WEIGHTS_ENV) or None)
    if storage == "dual" and not dual_fits(model, reserve_bytes, mem_available_bytes()):
        log.warning("not holding bf16 copies of the projections (the faster decode GEMVs): they would not fit in "
                    "this host's available memory beside the KV pool; fp32 alone. %s=1 holds bf16 alone (less "
                    "memory, slower prefill)", BF16_WEIGHTS_ENV)
        return "same"
    return storage


def weights_label(storage: str, compute_dtype: torch.dtype) -> str:
    """How the projections are held, for EngineInfo: int8 | bfloat16 | bfloat16+float32 (dual) | the compute dtype."""
    dtype = str(compute_dtype).removeprefix("torch.")
    return {"same": dtype, "dual": "bfloat16+" + dtype}.get(storage, storage)


def convert_linears(model: nn.Module, kind: str, native_ops=None) -> int:
    """Replace every nn.Linear of `model` (projections and lm_head) by its int8 or bf16-stored form, in place;
    return how many. The widened weights are freed as each is replaced, so the peak is one layer over."""
    make = {"int8": WeightOnlyLinear.int8, "bfloat16": WeightOnlyLinear.bf16, "dual": DualLinear}[kind]
    if native_ops is None and kind == "int8":
        log.warning("int8 weights without the native kernels: small batches use torch's _weight_int8pack_mm for "
                    "bf16 activations, else the weight is widened per call (slower than not quantizing)")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        new = make(child)
        new.native_ops = native_ops
        setattr(parent, name, new)
    return len(targets)
