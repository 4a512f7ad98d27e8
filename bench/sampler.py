"""Sampler time per step at batch 64: every filter on vs plain softmax + multinomial.

Usage: python bench/sampler.py [--threads N] [--iters N]
Prints ms/step for each configuration and the ratio to the plain baseline (target <= 2x).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pdserve.engine.sampler import Sampler, SamplingState  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402


def timeit(fn, iters: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B = args.batch
    configs = {
        "all filters (top_k=50,top_p=0.9,min_p=0.05,typical_p=0.95,T=0.8)": dict(
            top_k=50, top_p=0.9, min_p=0.05, typical_p=0.95, temperature=0.8),
        "top_p/min_p/typical_p, no top_k": dict(top_p=0.9, min_p=0.05, typical_p=0.95, temperature=0.8),
        "temperature only": dict(temperature=0.8),
    }
    for V in (32_000, 128_256):
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3
        g = torch.Generator().manual_seed(1)
        base = timeit(lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g), args.iters)
        print(f"V={V:>6} B={B} threads={args.threads}: plain softmax+multinomial {base:7.2f} ms/step")
        sampler = Sampler(V)
        for name, kw in configs.items():
            # fresh states each call would include setup cost; states persist as in decode
            states = [SamplingState(SamplingParams(seed=i, max_tokens=None, **kw), [], V, [0]) for i in range(B)]
            ms = timeit(lambda: sampler.sample(logits, states), args.iters)
            print(f"    {name:<68} {ms:7.2f} ms/step  ratio {ms / base:4.2f}x")


if __name__ == "__main__":
    main()
