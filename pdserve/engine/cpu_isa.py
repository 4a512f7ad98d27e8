"""What the CPU does natively, detected once, and the compute dtype `dtype=auto` picks from it.

The choice is a pure function of the CPU's feature flags and the checkpoint's dtype (`choose_dtype`), so each
ISA profile is unit-tested without that CPU. bf16 GEMMs are native only with AVX512-BF16 (`vdpbf16ps`) or AMX;
elsewhere oneDNN/ATen emulate them by widening every tile, ~3x slower than fp32 (an AVX2 EPYC
prefilled 107 tok/s in bf16 vs 554 in fp32). So a half-precision checkpoint is computed in fp32 there, and
kept in bf16 where bf16 is native (half the bytes for the bandwidth-bound decode GEMVs). fp16 checkpoints are
computed in fp32 on every CPU: torch has no packed fp16 linear on CPU (AMX-FP16 included, as of torch 2.13).

`PDSERVE_CPU_ISA=avx2|avx512|avx512_bf16|amx` caps what is used (never raises it above what the CPU has): the
dtype choice, and the native kernels' compile target (kernels.py), so the AVX2 paths can be tested on an
AVX-512 machine.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import env_knobs

if TYPE_CHECKING:  # torch is imported where it is used: kernels.cache_key reads the level without loading it
    import torch

# ISA levels, lowest first; each implies those before it (as x86-64 microarchitecture levels do in practice).
LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
_REQUIRES = {  # /proc/cpuinfo flags each level needs
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}
ISA_ENV = "PDSERVE_CPU_ISA"


def level_from_flags(flags: frozenset[str] | set[str]) -> str:
    """The highest level whose flags (and every lower level's) are all present."""
    level = "scalar"
    for name in LEVELS[1:]:
        if not all(f in flags for f in _REQUIRES[name]):
            break
        level = name
    return level


def cap_level(level: str, cap: str | None) -> str:
    """`level` lowered to `cap` (an env override); an unknown cap is an error naming the choices."""
    if not cap:
        return level
    if cap not in LEVELS:
        raise ValueError(f"{ISA_ENV}={cap!r} is not one of {', '.join(LEVELS)}")
    return LEVELS[min(LEVELS.index(level), LEVELS.index(cap))]


def native_bf16(level: str) -> bool:
    return LEVELS.index(level) >= LEVELS.index("avx512_bf16")


def choose_dtype(level: str, checkpoint_dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The compute (and weight storage) dtype of `dtype=auto`: the checkpoint's on an accelerator; on a CPU the
    checkpoint's bf16 only where bf16 is native, else fp32 (fp16 is never native for torch's CPU GEMMs)."""
    import torch
    if not device.startswith("cpu"):
        return checkpoint_dtype
    if checkpoint_dtype == torch.bfloat16 and native_bf16(level):
        return torch.bfloat16
    return torch.float32


def _cpuinfo(field: str) -> str | None:
    """The first core's `field` from /proc/cpuinfo, None where the file or the field is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    import platform
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), "" where it is missing."""
    return _cpuinfo("vendor_id") or ""


FP32_PACK_ENV = "PDSERVE_FP32_PACK"  # "1" / "0": force / forbid oneDNN-prepacked fp32 projections


def pack_fp32(vendor: str, env: str | None = None) -> bool:
    """Whether fp32 projections go through oneDNN's prepacked linear instead of `F.linear` (MKL's sgemm).

    MKL dispatches its fast GEMM paths by CPU vendor; oneDNN's JIT kernels by ISA. Measured on an AMD EPYC (Zen 3,
    AVX2, 2 threads; the bench model's projections + lm_head): prepacked 8.1 / 12.7 / 22.4 / 123 ms at 1 / 8 / 32 /
    256 rows against `F.linear`'s 11.7 / 34.5 / 59.2 / 193 ms. On an Intel Sapphire Rapids prepacked fp32 was not
    faster at batch 1 (docs/engine.md), so Intel CPUs keep MKL."""
    if env in ("0", "1"):
        return env == "1"
    return vendor != "GenuineIntel"


def _torch_level() -> str:
    """Where /proc/cpuinfo is missing (not Linux): torch's own dispatch capability."""
    import torch
    cap = torch.backends.cpu.get_cpu_capability()  # DEFAULT | AVX2 | AVX512 | ...
    return {"AVX2": "avx2", "AVX512": "avx512"}.get(cap, "scalar")


@functools.lru_cache(maxsize=1)
def detected_level() -> str:
    """This CPU's level (under PDSERVE_CPU_ISA's cap); read once per process."""
    flags = cpu_flags()
    level = level_from_flags(flags) if flags else _torch_level()
    return cap_level(level, env_knobs.get(ISA_ENV).strip().lower() or None)


@dataclass(frozen=True)
class EngineInfo:
    """What one engine runs on: logged once at start and exported as pdserve_engine_info."""
    isa: str  # a LEVELS name, or the accelerator ("cuda")
    dtype: str  # compute dtype: float32 | bfloat16 | float16
    kernels: str  # native | triton | torch
    checkpoint_dtype: str
    chosen_by: str  # auto | --dtype
    weights: str = ""  # how the projections are held: int8 | bfloat16 | float32 ... ("" = the compute dtype)
    linear: str = ""  # the projections' GEMM: onednn (prepacked) | onednn+gemv (one-row steps: the native GEMV) | torch

    def line(self) -> str:
        how = "dtype=auto" if self.chosen_by == "auto" else "--dtype"
        return (f"engine: isa={self.isa} dtype={self.dtype} ({how}; checkpoint {self.checkpoint_dtype}) "
                f"weights={self.weights or self.dtype} kernels={self.kernels}"
                + (f" linear={self.linear}" if self.linear else ""))
