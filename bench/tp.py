"""Tensor parallelism on the CPU at hand: TP=1 vs TP=2 step time, and the bytes each step hands to collectives
against the analytic count.

    python bench/tp.py [--quick]

One random-weight Llama (float32), one run: the same prefill step (one prompt of --prompt tokens) and decode
steps (--batch sequences) on a TP=1 engine and a TP=2 engine (rank 1 a child process, gloo over loopback),
each rank with --threads threads. Step time ratios hold for this CPU only; on 2 shared vCPUs two ranks gain
little (each rank's GEMMs are half as big but the all-reduces are extra), which is why the ratio is reported,
not claimed. Communication per step per rank, analytic (payload handed to the collectives):
    all-reduce  (2 L + 1) T h b     (o and down of every layer, and the vocab-parallel embedding)
    gather      R ceil(V / N) 4     (the float32 logits shard of each sampled row, to rank 0)
with T tokens in the step, R sampled rows, h hidden, L layers, b the activation dtype's bytes. A ring
all-reduce puts 2 (N - 1) / N times its payload on the wire per rank.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.engine import cpu_isa  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402


def build_model(out: Path, quick: bool) -> tuple[Path, tf.LlamaConfig]:
    cfg = tf.LlamaConfig(vocab_size=8000, hidden_size=256 if quick else 512, intermediate_size=688 if quick else 1376,
                         num_hidden_layers=2 if quick else 6, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    from tests.conftest import make_tokenizer
    make_tokenizer(out)
    return out, cfg


def measure(model_dir: Path, tp: int, args) -> dict:
    eng = Engine.from_pretrained(model_dir, EngineConfig(dtype="float32", num_threads=args.threads,
                                                         tensor_parallel_size=tp, kv_cache_bytes=64 << 20,
                                                         max_num_batched_tokens=4096))
    comm = eng.runner.comm
    try:
        greedy = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
        # prefill: one prompt alone in its step
        eng.add_request("p", list(range(10, 10 + args.prompt)), SamplingParams(temperature=0, max_tokens=1))
        before = (comm.bytes_reduced, comm.bytes_gathered) if comm else (0, 0)
        t = time.perf_counter()
        eng.step()
        prefill_s = time.perf_counter() - t
        prefill_comm = (comm.bytes_reduced - before[0], comm.bytes_gathered - before[1]) if comm else (0, 0)
        while eng.has_unfinished():
            eng.step()
        # decode: a batch prefilled first, then steps of one token per sequence
        for i in range(args.batch):
            eng.add_request(f"d{i}", list(range(20 + i, 52 + i)), greedy)
        eng.step()  # the batch's prefill
        before = (comm.bytes_reduced, comm.bytes_gathered) if comm else (0, 0)
        t = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        decode_s = (time.perf_counter() - t) / args.steps
        decode_comm = ((comm.bytes_reduced - before[0]) // args.steps,
                       (comm.bytes_gathered - before[1]) // args.steps) if comm else (0, 0)
        while eng.has_unfinished():
            eng.step()
        return {"prefill_s": prefill_s, "decode_s": decode_s, "prefill_comm": prefill_comm,
                "decode_comm": decode_comm, "plan_bytes": comm.bytes_plan if comm else 0}
    finally:
        eng.close()


def analytic(cfg: tf.LlamaConfig, tokens: int, rows: int, n: int, b: int = 4) -> tuple[int, int]:
    return ((2 * cfg.num_hidden_layers + 1) * tokens * cfg.hidden_size * b, rows * -(-cfg.vocab_size // n) * 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.steps = 64, 4
    flags = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in cpu_isa.cpu_flags()]
    print(f"cpu: {cpu_isa.cpu_model()}; flags: {' '.join(flags) or '-'}; {torch.get_num_threads()} cores visible; "
          f"{args.threads} thread(s) per rank")
    with tempfile.TemporaryDirectory() as d:
        model_dir, cfg = build_model(Path(d), args.quick)
        print(f"model: L={cfg.num_hidden_layers} h={cfg.hidden_size} heads={cfg.num_attention_heads}/"
              f"{cfg.num_key_value_heads} kv, V={cfg.vocab_size}, float32")
        r1, r2 = measure(model_dir, 1, args), measure(model_dir, 2, args)
    print(f"{'step':<28}{'TP=1 ms':>10}{'TP=2 ms':>10}{'TP2/TP1':>9}")
    for name, key in ((f"prefill ({args.prompt} tokens)", "prefill_s"), (f"decode (batch {args.batch})", "decode_s")):
        print(f"{name:<28}{r1[key] * 1e3:>10.2f}{r2[key] * 1e3:>10.2f}{r2[key] / r1[key]:>9.2f}")
    print("communication per step and rank (TP=2): measured / analytic bytes")
    for name, key, tokens, rows in (("prefill", "prefill_comm", args.prompt, 1),
                                    ("decode", "decode_comm", args.batch, args.batch)):
        ar, ga = r2[key]
        ar_a, ga_a = analytic(cfg, tokens, rows, 2)
        print(f"  {name:<8} all-reduce {ar} / {ar_a} ({ar / ar_a:.3f}); gather {ga} / {ga_a} ({ga / ga_a:.3f}); "
              f"ring all-reduce wire bytes {2 * (2 - 1) / 2 * ar_a:.0f}")
    print(f"  plan broadcasts, whole run: {r2['plan_bytes']} bytes")


if __name__ == "__main__":
    main()
