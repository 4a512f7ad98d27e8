"""The cost of deterministic mode (`--deterministic`): engine throughput with and without it, side by side.

    python bench/deterministic.py [--model builtin] [--requests 16] [--rounds 2] [--threads N]

One process, the same model, threads and workload for both configurations, run alternately (default,
deterministic, default, ...) so that load drifting on a shared machine hits both alike; the best round of each
is reported. Figures: output tokens/s of a batch of concurrent greedy requests (prefill + decode), the prefill
time of one prompt alone, and batch-1 decode tokens/s, each with their ratio deterministic / default. Prints the
CPU; figures hold for that CPU, not in general.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(32, 160))], rng.randint(24, 64))
            for _ in range(n)]


def throughput(eng: Engine, reqs) -> float:
    """Output tokens/s of all `reqs` submitted at once."""
    for i, (p, n) in enumerate(reqs):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return sum(n for _, n in reqs) / (time.perf_counter() - t0)


def prefill_s(eng: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t0


def decode_tps(eng: Engine, prompt: list[int], n: int = 32) -> float:
    """Batch-1 decode tokens/s (the prefill's time measured alone and taken off)."""
    pre = prefill_s(eng, prompt)
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    return n / max(1e-9, time.perf_counter() - t0 - pre)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model
    if model == "builtin":
        from pdserve.builtin import builtin_model_dir
        model = builtin_model_dir()
    # no prefix caching: each round must compute the same prompts again
    engines = {name: Engine.from_pretrained(model, EngineConfig(max_num_seqs=a.requests, enable_prefix_caching=False,
                                                                deterministic=det))
               for name, det in (("default", False), ("deterministic", True))}
    first = engines["default"]
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads); model {a.model}")
    print(first.info.line())
    reqs = workload(a.requests, first.model_config.vocab_size)
    prompt = reqs[0][0][:128] + [11] * max(0, 128 - len(reqs[0][0]))
    best: dict[str, dict[str, float]] = {n: {"tput": 0.0, "prefill": float("inf"), "decode": 0.0} for n in engines}
    for r in range(a.rounds):
        for name, eng in engines.items():
            b = best[name]
            b["tput"] = max(b["tput"], throughput(eng, reqs))
            b["prefill"] = min(b["prefill"], prefill_s(eng, prompt))
            b["decode"] = max(b["decode"], decode_tps(eng, prompt))
            print(f"  round {r + 1} {name}: done", flush=True)
    d, x = best["default"], best["deterministic"]
    print(f"{'':34}{'default':>12}{'deterministic':>15}{'ratio':>8}")
    print(f"{f'{a.requests} concurrent greedy, output tok/s':34}{d['tput']:12.1f}{x['tput']:15.1f}"
          f"{x['tput'] / d['tput']:8.2f}")
    print(f"{'prefill of 128 tokens, ms':34}{d['prefill'] * 1e3:12.1f}{x['prefill'] * 1e3:15.1f}"
          f"{x['prefill'] / d['prefill']:8.2f}")
    print(f"{'batch-1 decode, tok/s':34}{d['decode']:12.1f}{x['decode']:15.1f}{x['decode'] / d['decode']:8.2f}")


if __name__ == "__main__":
    main()
