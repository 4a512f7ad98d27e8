"""Engine throughput vs `transformers.generate`, same model, same threads, one run; decode step vs bandwidth bound.

    python bench/engine_throughput.py [--requests 64] [--hf-batch 8,16] [--hf-dtypes float32,bfloat16] [--quick]

Prints the CPU (model name, the ISA flags that matter, the level cpu_isa.py detects) and the dtype `dtype=auto`
chose, then: output tokens/s of the engine (`auto`) and of HF generate at each batch size and dtype (the best is
the baseline), their ratio; batch-1 decode tokens/s of both (HF: the better dtype); the prefill time of one
256-token prompt on both; the decode step time at batch 1 and 32 against the bound (weights + KV bytes read
per step / measured memory-copy bandwidth); batch-1 decode with `--quantization int8` against the unquantized
figure; and, when llama-cpp-python + gguf are installed (optional), llama.cpp on the same shapes in bf16
(bench/llama_cpp_anchor.py). The model is a random-weight Llama of ~124M parameters saved in
bfloat16, as real checkpoints are (random weights: every request runs to its max_tokens, which is what we time).
Figures hold for the CPU printed, not in general.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.sim.costmodel import measure_copy_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/llama_cpp_anchor.py, the optional anchor row


def build_model(out: Path, quick: bool) -> Path:
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=768 if not quick else 256, intermediate_size=2048 if not quick else 688,
                         num_hidden_layers=12 if not quick else 4, num_attention_heads=12 if not quick else 4,
                         num_key_value_heads=4 if not quick else 2, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import make_tokenizer
    make_tokenizer(out)
    return out


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 32000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)]


def run_engine(model_dir: Path, reqs) -> tuple[float, int]:
    eng = Engine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=2 << 30, max_num_seqs=64,
                                                         max_num_batched_tokens=2048))
    print(eng.info.line())  # the dtype, weight storage and GEMM path `auto` chose on this CPU
    for i, (p, n) in enumerate(reqs):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t = time.perf_counter()
    toks = 0
    while eng.has_unfinished():
        for o in eng.step():
            toks += len(o.outputs[0].new_token_ids)
    return time.perf_counter() - t, toks


def run_hf(model_dir: Path, reqs, batch: int, dtype: torch.dtype) -> tuple[float, int]:
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # Sort by prompt length so each padded batch wastes little: the most favourable static batching.
    order = sorted(reqs, key=lambda r: len(r[0]))
    t = time.perf_counter()
    toks = 0
    for i in range(0, len(order), batch):
        chunk = order[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        max_new = max(n for _, n in chunk)  # static batch: runs until its longest member is done
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=0)
        toks += sum(n for _, n in chunk)  # useful tokens only
    return time.perf_counter() - t, toks


def copy_bandwidth() -> float:
    # Bytes a torch copy moves per second (as bench/kv_transfer.py reports it): the decode step's bound is the bytes
    # it reads / this; 256 MB so the copy runs from DRAM, not the caches.
    return measure_copy_bandwidth(256 << 20)


def decode_step(model_dir: Path, batch: int, ctx: int = 256, **engine_kw) -> tuple[float, int]:
    """(median decode step seconds, bytes a step reads: weights + KV); engine_kw: e.g. quantization="int8"."""
    eng = Engine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=1 << 30, max_num_seqs=batch,
                                                         enable_prefix_caching=False, **engine_kw))
    for i in range(batch):
        eng.add_request(str(i), [100 + (i + j) % 3000 for j in range(ctx)],
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while any(s.is_prefill for r in eng.requests.values() for s in r.seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    weight_bytes = eng.runner.model.weight_bytes_read(batch)
    kv_bytes = batch * (ctx + 30) * eng.kv_cache.block_bytes // eng.kv_cache.block_size
    return sorted(times)[len(times) // 2], weight_bytes + kv_bytes


def hf_single(model_dir: Path, dtype: torch.dtype, ctx: int = 256, new: int = 32) -> tuple[float, float]:
    """HF batch 1: (prefill seconds of a ctx-token prompt, decode tokens/s after it), each the best of 3."""
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor([[100 + j % 3000 for j in range(ctx)]])

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t
    gen(2)  # warm-up
    pre = min(gen(1) for _ in range(3))
    full = min(gen(new + 1) for _ in range(3))
    return pre, new / max(full - pre, 1e-9)


def engine_prefill(model_dir: Path, ctx: int = 256, **engine_kw) -> float:
    """Seconds of the one step that prefills a ctx-token prompt (prefix cache off), the best of 3."""
    eng = Engine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=1 << 30, enable_prefix_caching=False,
                                                         max_num_batched_tokens=2048, **engine_kw))
    best = float("inf")
    for r in range(4):  # the first is a warm-up
        eng.add_request(f"p{r}", [100 + j % 3000 for j in range(ctx)],
                        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        if r:
            best = min(best, time.perf_counter() - t)
    return best


def set_threads(threads: int | None) -> None:
    """The torch thread count for every engine of the run (all cores when None); prints it and the kernels."""
    if threads:
        torch.set_num_threads(threads)
    print(f"threads: {torch.get_num_threads()}")
    from pdserve.engine.kernels import native_unavailable_reason
    print(f"native CPU kernels: {native_unavailable_reason() or 'built (engine/kernels.py)'}")


def describe_cpu(model_dir: Path) -> None:
    from pdserve.engine import cpu_isa
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.engine import auto_dtype
    flags = cpu_isa.cpu_flags()
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")
             if f in flags]
    ckpt = ModelConfig.from_dir(model_dir).checkpoint_dtype
    print(f"cpu: {cpu_isa.cpu_model()} ({cpu_isa.cpu_vendor() or 'vendor unknown'}); flags: {' '.join(shown) or '-'}; level: {cpu_isa.detected_level()}")
    print(f"dtype=auto on this CPU: {str(auto_dtype(ckpt, 'cpu')).removeprefix('torch.')} "
          f"(checkpoint {str(ckpt).removeprefix('torch.')})")
    # an AVX2 stand-in on a wider CPU caps torch's libraries too (docs/engine.md, "An AVX2 stand-in")
    caps = [f"{v}={os.environ[v]}" for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
            if os.environ.get(v)]
    print(f"torch's kernels: {torch.backends.cpu.get_cpu_capability()}"
          + (f" (capped: {' '.join(caps)})" if caps else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", default="8,16")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers dtypes; the best is the baseline")
    ap.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: all)")
    args = ap.parse_args()
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(Path(d), args.quick)
        n_params = sum(p.numel() for p in tf.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        print(f"model: random Llama, {n_params / 1e6:.0f}M parameters, saved in bfloat16")
        describe_cpu(model_dir)
        from pdserve.engine.config import DTYPES
        hf_dtypes = [DTYPES[x] for x in args.hf_dtypes.split(",")]
        reqs = workload(args.requests)
        e_t, e_tok = run_engine(model_dir, reqs)
        print(f"pdserve engine (auto): {e_tok} output tokens in {e_t:.1f}s = {e_tok / e_t:.1f} tok/s")
        best = 0.0
        for dt in hf_dtypes:
            for b in [int(x) for x in args.hf_batch.split(",")]:
                h_t, h_tok = run_hf(model_dir, reqs, b, dt)
                print(f"transformers generate ({str(dt).removeprefix('torch.')}, batch {b}, length-sorted): "
                      f"{h_tok / h_t:.1f} tok/s")
                best = max(best, h_tok / h_t)
        print(f"mixed workload: ratio engine / best transformers: {e_tok / e_t / best:.2f}x")
        hf1 = {dt: hf_single(model_dir, dt) for dt in hf_dtypes}
        e_pre = engine_prefill(model_dir)
        hf_pre = min(p for p, _ in hf1.values())
        print(f"prefill of one 256-token prompt: pdserve {256 / e_pre:.0f} tok/s, best transformers "
              f"{256 / hf_pre:.0f} tok/s ({hf_pre / e_pre:.2f}x); transformers per dtype: "
              + ", ".join(f"{str(dt).removeprefix('torch.')} {256 / p:.0f}" for dt, (p, _) in hf1.items()))
        hf_dec = max(d for _, d in hf1.values())
        bw = copy_bandwidth()
        print(f"memory copy bandwidth: {bw / 1e9:.1f} GB/s copied (256 MB torch copy)")
        for b in (1, 32):
            step, nbytes = decode_step(model_dir, b)
            bound = nbytes / bw
            print(f"decode step batch {b}: {step * 1e3:.1f} ms; bound {bound * 1e3:.1f} ms "
                  f"({nbytes / 1e6:.0f} MB read); ratio {step / bound:.2f}x")
            if b == 1:
                print(f"batch-1 decode: pdserve {1 / step:.1f} tok/s, best transformers {hf_dec:.1f} tok/s "
                      f"({1 / step / hf_dec:.2f}x); transformers per dtype: "
                      + ", ".join(f"{str(dt).removeprefix('torch.')} {d:.1f}" for dt, (_, d) in hf1.items()))
                auto_step = step
        q_step, q_bytes = decode_step(model_dir, 1, quantization="int8")
        print(f"batch-1 decode, --quantization int8: {1 / q_step:.1f} tok/s = {auto_step / q_step:.2f}x the "
              f"unquantized auto figure (target >= 1.6x); bound {q_bytes / bw * 1e3:.1f} ms "
              f"({q_bytes / 1e6:.0f} MB); ratio {q_step / (q_bytes / bw):.2f}x")
        import llama_cpp_anchor
        why = llama_cpp_anchor.unavailable()
        if why:
            print(f"llama.cpp anchor: not measured ({why})")
        else:
            dec, pre = llama_cpp_anchor.measure(model_dir, torch.get_num_threads())
            print(f"llama.cpp (llama-cpp-python, bf16 GGUF, same shapes and threads): batch-1 decode {dec:.1f} "
                  f"tok/s (pdserve auto {1 / auto_step / dec:.2f}x of it; target >= 0.8x), prefill of 256 "
                  f"tokens {pre:.0f} tok/s")


if __name__ == "__main__":
    main()
