"""The cost of deterministic mode (`--deterministic`): engine throughput with and without it, side by side.

    python bench/deterministic.py [--model builtin] [--requests 16] [--rounds 2] [--threads N] [--tiles 16,32]

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
    """The model name with its family and model numbers (a VM's name can be as bare as "AMD EPYC")."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


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
    """Batch-1 decode tokens/s: the steps after the one that prefilled the prompt, timed alone."""
    eng.add_request(f"d{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    eng.step()  # the prefill and the first token
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tiles", default="", help="also deterministic engines at these row tiles (comma-separated; "
                                                "the shipped one is batch_invariant.ROW_TILE)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model
    if model == "builtin":
        from pdserve.builtin import builtin_model_dir
        model = builtin_model_dir()
    # no prefix caching: each round must compute the same prompts again
    from pdserve.engine import batch_invariant
    shipped = batch_invariant.ROW_TILE
    tiles = [shipped] + [int(t) for t in a.tiles.split(",") if t and int(t) != shipped]
    engines = {"default": Engine.from_pretrained(model, EngineConfig(max_num_seqs=a.requests,
                                                                     enable_prefix_caching=False))}
    for t in tiles:
        batch_invariant.ROW_TILE = t
        name = "deterministic" if t == shipped else f"det. tile {t}"
        engines[name] = Engine.from_pretrained(model, EngineConfig(max_num_seqs=a.requests, deterministic=True,
                                                                   enable_prefix_caching=False))
    batch_invariant.ROW_TILE = shipped
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
    d = best["default"]
    names = list(engines)
    print(f"{'':36}" + "".join(f"{n:>16}" for n in names) + "  (ratio to default)")
    rows = (("tput", f"{a.requests} concurrent greedy, out tok/s", 1.0), ("prefill", "prefill of 128 tokens, ms", 1e3),
            ("decode", "batch-1 decode, tok/s", 1.0))
    for key, label, scale in rows:
        cells = "".join(f"{best[n][key] * scale:9.1f} ({best[n][key] / d[key]:4.2f})" for n in names)
        print(f"{label:36}{cells}")

if __name__ == "__main__":
    main()
