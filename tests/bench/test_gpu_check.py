"""scripts/gpu_check.sh stays runnable where no GPU is: every line of its one table says why it was skipped."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["greedy-llama-float32", "greedy-llama-bfloat16", "greedy-qwen2-float32", "greedy-qwen2-bfloat16",
          "greedy-qwen3_moe-float32", "greedy-qwen3_moe-bfloat16", "decode-8b-b1", "decode-8b-b64", "mixed-vs-hf", "nixl-vram", "sampler-device"]


def run(*args: str) -> tuple[int, list[list[str]]]:
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), *args], capture_output=True, text=True,
                       env=env, timeout=120)
    out = p.stdout.splitlines()
    head = out.index(next(ln for ln in out if ln.startswith("check ")))
    rows = [[c.strip() for c in ln.split("|")] for ln in out[head + 1:] if "|" in ln]
    return p.returncode, rows


def test_dry_run_prints_every_line_skipped():
    rc, rows = run("--dry-run")
    assert rc == 0
    assert [r[0] for r in rows] == CHECKS
    assert all(r[1] == "skipped: dry run" for r in rows)


def test_without_a_gpu_every_line_says_why():
    import torch
    if torch.cuda.is_available():
        import pytest
        pytest.skip("a GPU is here: the real run is scripts/gpu_check.sh itself")
    rc, rows = run()
    assert rc == 0
    assert [r[0] for r in rows] == CHECKS
    assert all(r[1].startswith("skipped: no CUDA device (torch ") for r in rows), rows


def test_bf16_ulp_is_the_spacing_of_bf16_values():
    """The greedy lines' near-tie rule counts margins in bf16 ulps: the spacing torch itself gives."""
    import torch

    from bench.gpu_checks.greedy import bf16_ulp
    for x in (1.0, 1.5, 3.0, 0.3, 100.0, 7.9, 2.0 ** -20):
        b = torch.tensor(x, dtype=torch.bfloat16)
        spacing = float(torch.nextafter(b, torch.tensor(float("inf"), dtype=torch.bfloat16)) - b)
        assert bf16_ulp(float(b)) == spacing, x
