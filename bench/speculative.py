"""Speculative decoding: batch-1 decode tokens/s with and without, side by side in one run.

    python bench/speculative.py [--tokens 160] [--k 8] [--repeats 3] [--threads 1] [--draft DIR]

Workloads on the built-in model (pdserve/builtin): a repetitive one (JSON / code / table continuations the model
goes on repeating, where prompt lookup hits), greedy; non-repetitive prompts (held-out fortunes the model never
saw), greedy (the tiny model still falls into loops of its own, which prompt lookup also finds); and the same
prompts sampled at T = 0.8 (seeded), where the text does not repeat and lookup rarely hits: the overhead case. For each: the decode rate (tokens after the first / time from the first to the last token) of plain decoding
and of `--speculative ngram` (and `draft` with --draft), alternating runs, median of --repeats; the ratio; the
acceptance rate and the mean tokens per verification step. Outputs are checked equal to plain decoding in float32
(the n-gram proposer is a point mass, so verification draws one uniform per committed token, as plain sampling
does: seeded sampled outputs match too). Prints the CPU. Figures hold for the CPU printed and its load at the time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams

REPETITIVE = [
    "".join(f'{{"id": {i % 3}, "name": "user", "tags": ["a", "b"], "ok": true}},\n' for i in range(8)),
    "def f(x):\n    return x + 1\n\n" * 6,
    "| name | value | unit |\n|------|-------|------|\n" + "| a | 1 | kg |\n" * 8,
]
NON_REPETITIVE = [
    "Intel CPUs are not defective, they just act that way.",
    "Never underestimate the bandwidth of a station wagon full of tapes.",
    "Just close your eyes, tap your heels together three times, and think to yourself",
]


# CPU time of this process (one torch thread): other processes' load on a shared machine does not enter it, where
# wall time would swing by 2-4x between runs. --wall uses wall time instead.
CLOCK = time.process_time


def truncated_builtin(layers: int, out: Path) -> Path:
    """The built-in checkpoint keeping its first `layers` decoder layers (+ embeddings, final norm, LM head): a
    smaller checkpoint with the same tokenizer, as a draft model (layer-skipping self-speculation)."""
    from safetensors.torch import load_file, save_file

    from pdserve.engine.checkpoint import resolve_model_dir
    src = resolve_model_dir("builtin")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    keep = {k: v for k, v in load_file(src / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors")
    return out


def describe_cpu() -> str:
    from pdserve.engine import cpu_isa
    flags = cpu_isa.cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"cpu: {cpu_isa.cpu_model()}; flags: {' '.join(shown) or '-'}; threads: {torch.get_num_threads()}"


def decode_run(eng: Engine, prompt: list[int], n: int, temperature: float = 0.0) -> tuple[list[int], float]:
    """(output tokens, seconds from the first token to the last) of one batch-1 request."""
    eng.add_request(f"b{time.monotonic_ns()}", prompt, SamplingParams(temperature=temperature, max_tokens=n,
                                                                      ignore_eos=True, seed=7))
    first = last = None
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            now = CLOCK()
            if o.outputs[0].token_ids and first is None:
                first = now
            last = now
            if o.finished:
                out = o.outputs[0].token_ids
    return out, last - first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=8, help="--num-speculative-tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", help="also a draft-model run with this checkpoint")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="also a draft-model run with the built-in model cut to its first N layers (same tokenizer)")
    ap.add_argument("--dtype", default="float32",
                    help="float32 (default): greedy outputs must match exactly; bfloat16: the verification pass's "
                         "multi-token kernels round differently from single-token decode, so near-ties may flip")
    ap.add_argument("--wall", action="store_true", help="time by wall clock instead of process CPU time")
    args = ap.parse_args()
    if args.wall:
        global CLOCK
        CLOCK = time.perf_counter
    torch.set_num_threads(args.threads)
    print(describe_cpu() + f"; clock: {'wall' if args.wall else 'process CPU time'}")
    base = dict(enable_prefix_caching=False, num_threads=args.threads, dtype=args.dtype)
    # One engine per method; "plain" runs on the ngram engine with its SpecDecoder detached (engine.spec = None is
    # the engine's no-speculation path): both sides share weights and KV pool memory, so the ratio is speculation
    # alone (two engine instances differ by several % from where their tensors landed).
    engines = {"ngram": Engine.from_pretrained("builtin", EngineConfig(**base, speculative="ngram",
                                                                       num_speculative_tokens=args.k))}
    if args.draft_layers:
        args.draft = str(truncated_builtin(args.draft_layers, Path(tempfile.mkdtemp())))
    if args.draft:
        engines["draft"] = Engine.from_pretrained("builtin", EngineConfig(
            **base, speculative="draft", num_speculative_tokens=args.k, draft_model=args.draft))
    decoders = {key: eng.spec for key, eng in engines.items()}
    engines = {"plain": engines["ngram"], **engines}
    tok = engines["plain"].tokenizer
    print(f"model: builtin ({engines['plain'].info.line()}); batch 1, {args.tokens} tokens, k={args.k}")
    for name, texts, temp in (("repetitive (greedy)", REPETITIVE, 0.0),
                              ("non-repetitive prompts (greedy)", NON_REPETITIVE, 0.0),
                              ("non-repetitive prompts, sampled T=0.8 (seeded)", NON_REPETITIVE, 0.8)):
        prompts = [tok.encode(t) for t in texts]
        for key, eng in engines.items():  # warm-up (kernels, allocator)
            eng.spec = decoders.get(key)
            decode_run(eng, prompts[0], 8)
        rates: dict[str, list[float]] = {k: [] for k in engines}
        differ = 0
        before = {k: d.stats.snapshot() for k, d in decoders.items()}
        for _ in range(args.repeats):
            for p in prompts:
                outs = {}
                for key, eng in engines.items():
                    eng.spec = decoders.get(key)
                    toks, secs = decode_run(eng, p, args.tokens, temp)
                    outs[key] = toks
                    rates[key].append((len(toks) - 1) / secs)
                # greedy, and n-gram (point mass: one uniform per token) at any T, must reproduce plain decoding;
                # a draft at T > 0 consumes its own uniforms (accept test, residual draw): same law, other draws
                same = all(o == outs["plain"] for k, o in outs.items() if temp == 0 or k != "draft")
                assert same or args.dtype != "float32", "speculative output differs from plain"
                differ += not same
        plain = statistics.median(rates["plain"])
        print(f"{name}: plain {plain:.1f} tok/s" + (f" ({differ} outputs differ from plain)" if differ else ""))
        for key, dec in decoders.items():
            now, was = dec.stats.snapshot(), before[key]
            prop = now.proposed - was.proposed
            acc = now.accepted - was.accepted
            steps = now.steps - was.steps
            emitted = now.emitted - was.emitted
            r = statistics.median(rates[key])
            print(f"  {key}: {r:.1f} tok/s = {r / plain:.2f}x plain; acceptance {acc / max(prop, 1):.2f} "
                  f"({acc}/{prop}); {emitted / max(steps, 1):.2f} tokens per verification step")


if __name__ == "__main__":
    main()
