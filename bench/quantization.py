"""Weight-only int8 and bf16-stored weights: batch-1 decode speed, prefill cost, and quality, in one run.

    python bench/quantization.py [--threads 1] [--quick] [--skip-quality]
    PDSERVE_CPU_ISA=avx2 python bench/quantization.py    # the AVX2 CPU case (bf16-stored weights under `auto`)

Speed, on bench/engine_throughput.py's random ~124M Llama saved in bf16: batch-1 decode tokens/s (median step at
256 tokens of context) and the prefill of one 256-token prompt, for `dtype=auto` unquantized, `--quantization
int8`, `--dtype float32` (fp32 weights throughout), and on a CPU without native bf16 (where `auto` computes in
fp32 and holds the projections in bf16 and in fp32, reading the bf16 copy at batch 1) `bf16-held`: `auto` with
PDSERVE_BF16_WEIGHTS=1, the projections held in bf16 alone and widened to fp32 in the GEMV (prefill widens per
call). Decode steps of all engines are interleaved (load from other processes falls on each alike). Target: int8
batch-1 decode >= 1.6x the unquantized `auto` figure.

Quality, on the built-in demo model (pdserve/builtin/model) and its 64 held-out fortunes (heldout.txt, never
trained on): perplexity of `<s>fortune</s>` per record with transformers in fp32, unquantized vs every nn.Linear
(projections and lm_head) replaced by its int8 dequantization (engine/quant.py's quantize_int8) — the same
weights the engine's int8 path holds; and the engine's own greedy continuations (int8 vs unquantized, 32 tokens
after each record's first 16 tokens): how many are identical and the mean common-prefix length.
Prints the CPU model and flags; figures hold for that CPU only.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine_throughput import build_model, describe_cpu, set_threads  # noqa: E402
from pdserve.engine.quant import BF16_WEIGHTS_ENV  # noqa: E402

BF16_ROW = "bf16-held"  # dtype=auto with PDSERVE_BF16_WEIGHTS=1: projections in bf16, computed in fp32


@contextlib.contextmanager
def env(name: str, value: str | None):
    """Environment variable `name` set to `value` (None: unset) while an engine loads, then as it was."""
    old = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if old is not None:
            os.environ[name] = old


def bf16_weights(on: bool):
    """PDSERVE_BF16_WEIGHTS=1 while an engine loads (bf16-held projections under dtype=auto, quant.py)."""
    return env(BF16_WEIGHTS_ENV, "1" if on else None)


def interleaved_decode(model_dir: Path, configs: dict[str, dict], ctx: int = 256, rounds: int = 40) -> dict:
    """Median batch-1 decode step seconds per config, the engines' steps interleaved (A, B, C, A, B, C, ...) so
    that load from other processes on a shared machine falls on every config alike."""
    import time

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    engines = {}
    for name, kw in configs.items():
        with bf16_weights(name == BF16_ROW):
            eng = Engine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=1,
                                                                 enable_prefix_caching=False, **kw))
        eng.add_request("0", [100 + j % 3000 for j in range(ctx)],
                        SamplingParams(temperature=0, max_tokens=rounds + 8, ignore_eos=True))
        while any(s.is_prefill for r in eng.requests.values() for s in r.seqs):
            eng.step()
        for _ in range(3):
            eng.step()
        engines[name] = eng
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            t = time.perf_counter()
            eng.step()
            times[name].append(time.perf_counter() - t)
    return {name: (sorted(ts)[len(ts) // 2], engines[name].info) for name, ts in times.items()}


def interleaved_prefill(model_dir: Path, configs: dict[str, dict], ctx: int = 256, rounds: int = 6) -> dict:
    """Median seconds of the step that prefills one ctx-token prompt (prefix cache off), engines interleaved."""
    import time

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    engines = {}
    for name, kw in configs.items():
        with bf16_weights(name == BF16_ROW):
            engines[name] = Engine.from_pretrained(model_dir, EngineConfig(
                kv_cache_bytes=64 << 20, enable_prefix_caching=False, max_num_batched_tokens=2048, **kw))
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds + 1):  # the first round is a warm-up
        for name, eng in engines.items():
            eng.add_request(f"p{r}", [100 + j % 3000 for j in range(ctx)],
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            if r:
                times[name].append(time.perf_counter() - t)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def perplexities(model_dir: Path) -> tuple[float, float, int]:
    """(ppl unquantized, ppl int8, tokens scored) over the held-out records, transformers fp32."""
    import transformers as tf
    from tokenizers import Tokenizer
    from torch import nn

    from pdserve.builtin.train import read_heldout
    from pdserve.engine.quant import dequantize_int8, quantize_int8
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = read_heldout(model_dir / "heldout.txt")

    def nll(model) -> tuple[float, int]:
        total, count = 0.0, 0
        with torch.no_grad():
            for text in texts:
                ids = tok.encode("<s>" + text + "</s>", add_special_tokens=False).ids[:1024]
                x = torch.tensor([ids])
                logits = model(input_ids=x).logits.float()
                total += torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
                count += len(ids) - 1
        return total, count

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base, n = nll(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                q, s = quantize_int8(m.weight)
                m.weight.copy_(dequantize_int8(q, s))
    quant, _ = nll(model)
    return math.exp(base / n), math.exp(quant / n), n


def greedy_agreement(model_dir: Path, prompt_len: int = 16, new: int = 32) -> tuple[int, int, float]:
    """(identical continuations, records, mean common prefix) of the engine's greedy output, int8 vs not."""
    from pdserve.builtin.train import read_heldout
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    outs = {}
    for q in ("none", "int8"):
        eng = Engine.from_pretrained(model_dir, EngineConfig(quantization=q, kv_cache_bytes=64 << 20))
        prompts = [eng.tokenizer.encode(t)[:prompt_len] for t in read_heldout(model_dir / "heldout.txt")]
        outs[q] = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
    same, prefix = 0, 0
    for a, b in zip(outs["none"], outs["int8"]):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same += k == len(a)
        prefix += k
    return same, len(outs["none"]), prefix / len(outs["none"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(Path(d), args.quick)
        describe_cpu(model_dir)
        rows = {"auto": {}, "int8": {"quantization": "int8"}, "float32": {"dtype": "float32"}}
        from pdserve.engine.config import ModelConfig
        from pdserve.engine.engine import auto_dtype
        ckpt = ModelConfig.from_dir(model_dir).checkpoint_dtype
        if ckpt == torch.bfloat16 and auto_dtype(ckpt, "cpu") == torch.float32:  # a CPU without native bf16
            rows[BF16_ROW] = {}
        steps = interleaved_decode(model_dir, rows)
        prefill = interleaved_prefill(model_dir, rows)
        tps = {}
        for name, kw in rows.items():
            step, info = steps[name]
            pre = prefill[name]
            tps[name] = 1 / step
            print(f"{name:8s} (dtype {info.dtype}, weights {info.weights}): batch-1 decode {1 / step:6.1f} tok/s "
                  f"({step * 1e3:.1f} ms/step, median of 40 interleaved steps); prefill of 256 tokens "
                  f"{256 / pre:.0f} tok/s (median of 6, interleaved)")
        print(f"batch-1 decode: int8 / auto = {tps['int8'] / tps['auto']:.2f}x (target >= 1.6x)"
              + (f"; bf16-held / float32 = {tps[BF16_ROW] / tps['float32']:.2f}x" if BF16_ROW in tps else ""))
    if not args.skip_quality:
        from pdserve.builtin import builtin_model_dir
        bdir = Path(builtin_model_dir())
        p0, p1, n = perplexities(bdir)
        print(f"built-in model, held-out perplexity ({n} tokens, transformers fp32): unquantized {p0:.3f}, "
              f"int8 {p1:.3f} ({(p1 / p0 - 1) * 100:+.2f}%)")
        same, total, prefix = greedy_agreement(bdir)
        print(f"built-in model, engine greedy (32 tokens after 16 held-out tokens): int8 identical to unquantized "
              f"on {same}/{total} records; mean common prefix {prefix:.1f} tokens")


if __name__ == "__main__":
    main()
