"""Batch-1 decode, pdserve against llama.cpp, their steps interleaved: one pdserve step per engine, then one
llama.cpp token, round after round, so that load from other processes on a shared machine falls on each alike, and
both sides report the same statistic (the median of `--rounds`).

    python bench/batch1_vs_llama_cpp.py [--threads N] [--rounds 60]

Engines: `auto` (dtype=auto, as served), `auto, Python layers` (the same with PDSERVE_DECODER_STACK=0: the
decoder layers run one Python call at a time instead of as one native call; engine/decoder_stack.py) and `auto,
oneDNN M=1` (with PDSERVE_BATCH1_GEMV=0: one-row steps through oneDNN's packed linear instead of the native GEMV;
quant.keep_batch1_gemv), plus `--quantization int8`. The model is bench/engine_throughput.py's random ~124M Llama
saved in bf16, one sequence after a 256-token prompt; llama.cpp (llama-cpp-python, optional) runs a bf16 GGUF
written from it (bench/llama_cpp_anchor.py), same threads. Prints the CPU model and flags; figures hold for that
CPU only.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.engine_throughput import build_model, describe_cpu, set_threads  # noqa: E402
from bench.quantization import env  # noqa: E402
from pdserve.engine.decoder_stack import STACK_ENV  # noqa: E402
from pdserve.engine.quant import BATCH1_GEMV_ENV  # noqa: E402

CONFIGS = {"auto": ({}, {}), "auto, Python layers": ({}, {STACK_ENV: "0"}),
           "auto, oneDNN M=1": ({}, {BATCH1_GEMV_ENV: "0"}), "int8": ({"quantization": "int8"}, {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="threads for both sides (default: all)")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    set_threads(args.threads)
    import llama_cpp_anchor

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    ctx = 256
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(Path(d), False)
        describe_cpu(model_dir)
        steps: dict[str, callable] = {}
        for name, (kw, variables) in CONFIGS.items():
            with contextlib.ExitStack() as scope:
                for var, value in variables.items():
                    scope.enter_context(env(var, value))
                eng = Engine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=1,
                                                                     enable_prefix_caching=False, **kw))
            print(f"{name}: {eng.info.line()}")
            eng.add_request("0", [100 + j % 3000 for j in range(ctx)],
                            SamplingParams(temperature=0, max_tokens=args.rounds + 8, ignore_eos=True))
            while any(s.is_prefill for r in eng.requests.values() for s in r.seqs):
                eng.step()
            for _ in range(3):
                eng.step()
            steps[name] = eng.step
        why = llama_cpp_anchor.unavailable()
        if why:
            print(f"llama.cpp: not measured ({why})")
        else:
            import llama_cpp
            import numpy as np
            path = llama_cpp_anchor.write_gguf(model_dir, Path(d) / "model-bf16.gguf")
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx + args.rounds + 16, n_batch=512,
                                  n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                                  logits_all=False, verbose=False)
            llm.eval([100 + j % 3000 for j in range(ctx)])
            n_vocab = llm.n_vocab()
            last = [0]

            def llama_token() -> None:  # one token: eval, then greedy from the last position's logits
                ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
                last[0] = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))
                llm.eval([last[0]])
            steps["llama.cpp (bf16 GGUF)"] = llama_token
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
        med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        ref = med.get("llama.cpp (bf16 GGUF)")
        print(f"batch-1 decode, median of {args.rounds} interleaved steps, {torch.get_num_threads()} threads:")
        for name, s in med.items():
            vs = f" = {ref / s:.2f}x llama.cpp" if ref and not name.startswith("llama") else ""
            print(f"  {name:24s} {s * 1e3:6.2f} ms  {1 / s:6.1f} tok/s{vs}")


if __name__ == "__main__":
    main()
