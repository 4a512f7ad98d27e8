"""Expert parallelism on the CPU at hand: all-to-all dispatch against the all-reduce combine, bytes and step time.

    python bench/ep_dispatch.py [--threads 1] [--prompt 256] [--batch 8] [--steps 8]

One random-weight Qwen3-MoE (float32, sizes printed), one run, five engines: one rank, and EP 2 at TP 2 and at
TP 1, each by all-to-all (engine/tp/dispatch.py) and by the all-reduce combine. The same prefill step (one prompt)
and decode steps (--batch sequences). Per step, the bytes rank 0 moves, by collective, beside the uniform-routing
expectation (docs/engine.md, "Expert parallelism"); the step times as ratios to the one-rank engine's (this CPU
only, its model and load average printed).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

SIZES = dict(vocab_size=4000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, moe_intermediate_size=256, intermediate_size=1024, num_experts=16, num_experts_per_tok=2,
             norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False)
COUNTERS = ("bytes_reduced", "bytes_reduce_scattered", "bytes_all_to_all", "bytes_all_gathered")
RUNS = {"1 rank": dict(),
        "TP2 EP2 all-to-all": dict(tensor_parallel_size=2, expert_parallel_size=2, expert_dispatch="all_to_all"),
        "TP2 EP2 all-reduce": dict(tensor_parallel_size=2, expert_parallel_size=2, expert_dispatch="all_reduce"),
        "TP1 EP2 all-to-all": dict(expert_parallel_size=2, expert_dispatch="all_to_all"),
        "TP1 EP2 all-reduce": dict(expert_parallel_size=2, expert_dispatch="all_reduce")}


def build(out: Path) -> Path:
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SIZES)).save_pretrained(out, safe_serialization=True)
    from tests.conftest import make_tokenizer
    make_tokenizer(out)
    return out


def measure(model: Path, kw: dict, args) -> dict:
    eng = Engine.from_pretrained(model, EngineConfig(dtype="float32", num_threads=args.threads,
                                                     kv_cache_bytes=64 << 20, max_num_batched_tokens=4096,
                                                     enable_prefix_caching=False, **kw))
    comm = eng.tp_group.comm if eng.tp_group else None

    def step(prompts, n):
        before = {c: getattr(comm, c) for c in COUNTERS} if comm else {}
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        dt = time.perf_counter() - t0
        return dt, {c: getattr(comm, c) - before[c] for c in COUNTERS} if comm else {}
    try:
        prompt = [list(range(10, 10 + args.prompt))]
        step(prompt, 1)  # warm-up
        pre = [step(prompt, 1) for _ in range(3)]
        batch = [[7 + i, 8, 9] for i in range(args.batch)]
        one = step(batch, 1)  # the prompts alone, then with the decode steps
        dec = step(batch, args.steps + 1)
        decode_s = (dec[0] - one[0]) / args.steps
        decode_b = {c: (dec[1][c] - one[1][c]) // args.steps for c in dec[1]}
        return {"prefill_s": statistics.median(t for t, _ in pre), "prefill_b": pre[0][1], "decode_s": decode_s,
                "decode_b": decode_b}
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    cpu = [ln for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
           if ln.startswith(("Model name", "CPU family", "Model:"))]
    print("; ".join(" ".join(ln.split()) for ln in cpu), "| load average", os.getloadavg())
    print("model:", SIZES)
    h, k, layers = SIZES["hidden_size"], SIZES["num_experts_per_tok"], SIZES["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as d:
        model = build(Path(d) / "m")
        res = {name: measure(model, kw, args) for name, kw in RUNS.items()}
    base = res["1 rank"]
    for name, r in res.items():
        print(f"{name:20s} prefill {r['prefill_s'] / base['prefill_s']:.2f}x  decode {r['decode_s'] / base['decode_s']:.2f}x"
              f" of 1 rank | bytes rank 0 sent per prefill step {r['prefill_b']} per decode step {r['decode_b']}")
    e = SIZES["num_experts"]
    # a token's k distinct experts all on its own rank (half of the e): C(e/2, k) / C(e, k)
    local = math.comb(e // 2, k) / math.comb(e, k)
    for t, what in ((args.prompt, "prefill"), (args.batch, "decode")):
        per = -(-t // 2)
        print(f"{what} T={t}, uniform routing, per MoE layer x {layers}: all-to-all hidden rows expected "
              f"{2 * per * (1 - local):.0f} out and back (x {h * 4} B, + {16 * k} B of routing going out; "
              f"{2 * per * k / 2:.0f} if sent per (token, expert)), all-gather {per} rows, reduce-scatter (TP 2) {2 * per} rows "
              f"handed; all-reduce combine {t} rows handed")
    print("load average after", os.getloadavg())


if __name__ == "__main__":
    main()
