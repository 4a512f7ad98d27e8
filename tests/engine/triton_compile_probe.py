"""Compile the CUDA kernels for given GPU architectures without a GPU and print one JSON line per variant.

Run in a process of its own (tests/engine/test_triton_compile.py): Triton's JIT must not be in interpreter mode,
which the test session turns on for the other Triton tests. `triton_compile_probe.py 90` compiles sm_90's only
(the test runs one process per architecture, side by side)."""
from __future__ import annotations

import json
import sys

import triton
import triton.compiler as tc
from triton.backends.compiler import GPUTarget

from pdserve.engine import triton_attention as ta


def build(fn, types: dict, consts: dict, arch: int):
    sig = {n: "constexpr" if n in consts else types.get(n, "i64") for n in fn.arg_names}  # strides: i64
    src = tc.ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))


def variants(archs=(90, 80)):
    for arch in archs:
        for dt in ("bf16", "fp32"):
            for splits in (1, 8):
                yield (f"decode-sm{arch}-{dt}-splits{splits}", ta._decode_kernel, dict(
                    Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", Out=f"*{dt}", Rows="*i64", Tables="*i64", Lens="*i64",
                    PartAcc="*fp32", PartML="*fp32", Sinks=f"*{dt}", scale="fp32", window="i32"), dict(
                    GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=32, SPLITS=splits,
                    PRECISION="ieee", UPCAST=False, HAS_SINK=splits == 8), arch)  # gpt-oss's sinks: split
            yield (f"merge-sm{arch}-{dt}", ta._merge_kernel, dict(Out=f"*{dt}", Rows="*i64", PartAcc="*fp32",
                                                                   PartML="*fp32"),
                   dict(HEAD_DIM=128, BLOCK_D=128, SPLITS=8), arch)
        for dt, hd in (("bf16", 128), ("fp32", 64), ("bf16", 96)):
            yield (f"prefill-sm{arch}-{dt}-d{hd}", ta._prefill_kernel, dict(
                Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", Out=f"*{dt}", Starts="*i64", QLens="*i64", Lens="*i64",
                Tables="*i64", Sinks=f"*{dt}", scale="fp32", window="i32"), dict(
                GROUP=4, HEAD_DIM=hd, BLOCK_D=1 << (hd - 1).bit_length(), BLOCK_SIZE=16, BLOCK_M=32, BLOCK_N=32,
                PRECISION="ieee", UPCAST=False, HAS_SINK=hd == 64), arch)  # gpt-oss: head_dim 64 with sinks
        for dt in ("bf16", "fp32"):  # DeepSeek-V3's latent entry: 512 + 64 = two halves of 288
            yield (f"mla-decode-sm{arch}-{dt}", ta._mla_decode_kernel, dict(
                Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", Out="*fp32", Tables="*i64", Lens="*i64", scale="fp32"), dict(
                HEADS=128, BLOCK_H=16, HALF=288, BLOCK_D=512, BLOCK_SIZE=16, BLOCK_N=32, PRECISION="ieee",
                UPCAST=False), arch)


if __name__ == "__main__":  # args: the architectures (default both)
    for name, fn, types, consts, arch in variants(tuple(map(int, sys.argv[1:])) or (90, 80)):
        try:
            k = build(fn, types, consts, arch)
            print(json.dumps({"name": name, "cubin_bytes": len(k.asm["cubin"]), "mma": "mma" in k.asm["ptx"]}))
        except Exception as e:  # reported per variant; the test names it
            print(json.dumps({"name": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}))
        sys.stdout.flush()
