"""Static vs continuous batching on the real engine (spec §5.2, §5.3, D04), side by side in one run.

    python bench/batching.py [--requests 48] [--max-num-seqs 8] [--repeats 2]

Same model (a random Llama saved in bfloat16), same requests, same threads; only `EngineConfig.batching` differs.
Two workloads: `mixed` output lengths (uniform 8..128 tokens: static batching keeps slots empty until the longest
member ends) and `equal` lengths (D04's counterexample: nothing to refill, the two should tie). Per mode: output
tokens/s (wall clock), engine steps (makespan in ticks), slot utilisation = output tokens / (max_num_seqs x steps),
mean ticks to first token. The ratio continuous / static is the figure; figures hold for the CPU printed.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402


def build_model(out: Path) -> Path:
    import transformers as tf

    from tests.conftest import make_tokenizer
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)
    return out


def workload(kind: str, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 32000) for _ in range(rng.randint(16, 64))],
             rng.randint(8, 128) if kind == "mixed" else 64) for _ in range(n)]


def run(engine: Engine, reqs, tag: str) -> dict:
    for i, (p, n) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps0, toks, first, tick = engine.num_steps, 0, {}, 0
    t = time.perf_counter()
    while engine.has_unfinished():
        tick += 1
        for o in engine.step():
            if o.outputs and o.outputs[0].new_token_ids:
                toks += len(o.outputs[0].new_token_ids)
                first.setdefault(o.request_id, tick)
    wall = time.perf_counter() - t
    steps = engine.num_steps - steps0
    return {"tok_s": toks / wall, "steps": steps, "util": toks / (engine.config.max_num_seqs * steps),
            "ttft_ticks": sum(first.values()) / len(first), "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per mode; the best wall time is kept")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.engine import cpu_isa
    flags = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in cpu_isa.cpu_flags()]
    print(f"cpu: {cpu_isa.cpu_model()}; flags: {' '.join(flags) or '-'}; threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(Path(d))
        engines = {m: Engine.from_pretrained(model_dir, EngineConfig(
            kv_cache_bytes=512 << 20, max_num_seqs=args.max_num_seqs, batching=m)) for m in ("static", "continuous")}
        print(f"model: random Llama (4 layers, hidden 256), dtype {engines['static'].info.dtype}; "
              f"max_num_seqs {args.max_num_seqs}; {args.requests} requests arriving at once")
        for kind in ("mixed", "equal"):
            reqs = workload(kind, args.requests)
            best: dict[str, dict] = {}
            for r in range(args.repeats):
                for m in (("static", "continuous") if r % 2 == 0 else ("continuous", "static")):
                    res = run(engines[m], reqs, f"{kind}{r}")
                    if m not in best or res["tok_s"] > best[m]["tok_s"]:
                        best[m] = res
            for m, res in best.items():
                print(f"{kind:5s} {m:10s}: {res['tok_s']:7.1f} tok/s, {res['steps']:4d} steps, "
                      f"slot utilisation {res['util']:.2f}, mean first token at tick {res['ttft_ticks']:.1f}")
            s, c = best["static"], best["continuous"]
            print(f"{kind:5s} continuous / static: {c['tok_s'] / s['tok_s']:.2f}x tok/s, "
                  f"{s['steps'] / c['steps']:.2f}x fewer steps")


if __name__ == "__main__":
    main()
