"""The CUDA kernels compile for the GPUs they target (sm_90: H100/H200, sm_80: A100) without a GPU: Triton's
NVIDIA backend lowers them through TTIR, TTGIR, LLVM IR and PTX to a cubin with its bundled ptxas. The interpreter
tests (test_triton_attention.py) check what the kernels compute; this checks that the compiled path, which the
interpreter does not exercise (typing of loop bounds and masks, bf16 dots on tensor cores), builds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
if not PTXAS.exists():
    pytest.skip(f"Triton's NVIDIA backend has no ptxas here ({PTXAS})", allow_module_level=True)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    # one process per architecture, side by side: each compile is single-threaded (~1 s), so on 2 cores the
    # 18 of them take half the time they take in one process (17 s cold on 2 cores; warm, Triton's cache serves)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/engine/triton_compile_probe.py"), str(arch)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for arch in (90, 80)]
    out = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            assert p.returncode == 0, stderr[-3000:]
            out.update((r["name"], r) for r in map(json.loads, stdout.splitlines()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_every_kernel_variant_compiles_to_a_cubin(results):
    # per arch: decode x2 dtypes x2 splits (the split one with sinks) + merge x2 + prefill x3 + MLA decode x2
    assert len(results) == 2 * (2 * 3 + 3 + 2)
    failed = {n: r["error"] for n, r in results.items() if "error" in r}
    assert not failed, failed
    assert all(r["cubin_bytes"] > 0 for r in results.values())


def test_bf16_dots_use_tensor_cores(results):
    bf16 = [r for n, r in results.items() if "bf16" in n and not n.startswith("merge")]
    assert bf16 and all(r["mma"] for r in bf16)
