"""Sparse MoE speed: pdserve's native MoE kernel against its Python expert loop, llama.cpp and transformers, one run.

    python bench/moe_speed.py [--threads N] [--rounds 40] [--requests 16] [--mixed-rounds 3]

The model is a random Qwen3-MoE made with transformers' config class (sizes printed; ~100M parameters active a
token of ~290M), saved in bf16. Batch-1 decode after a 256-token prompt, the steps interleaved round after round
(one step of each engine, then one llama.cpp token) so load from other processes falls on each alike; medians.
Engines: `native MoE` (engine/moe.py's kernel, csrc/moe_experts.cpp, called from the decoder stack in one native
call per step), `Python layers` (the same kernel from the Python layer loop: PDSERVE_DECODER_STACK=0) and `Python
loop` (PDSERVE_NATIVE_MOE=0: experts one by one in Python), all dtype=auto. llama.cpp (llama-cpp-python + gguf, optional) runs a bf16 GGUF written
here from the same weights (arch qwen3moe: experts stacked as ffn_{gate,up,down}_exps, router ffn_gate_inp,
q/k norms; Qwen3's rotate-half rope is llama.cpp's NEOX rope, so q/k are not permuted). Then the mixed workload
(bench/engine_throughput.py's, fewer requests and shorter outputs to fit a 2-core box): pdserve, pdserve with
prefill chunks' experts on the Python loop (PDSERVE_GROUPED_MOE=0) and transformers' generate (length-sorted static
batches), one after another for --mixed-rounds rounds; medians. Prints the CPU's model name and flags (lscpu); figures hold
for that CPU only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.engine_throughput import run_engine, run_hf, set_threads  # noqa: E402
from bench.quantization import env  # noqa: E402
from pdserve.engine.decoder_stack import STACK_ENV  # noqa: E402
from pdserve.engine.moe import GROUPED_MOE_ENV, NATIVE_MOE_ENV  # noqa: E402

SIZES = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, moe_intermediate_size=384, intermediate_size=2048, num_experts=32, num_experts_per_tok=8,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048,
             tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)
ENGINES = {"pdserve, native MoE": {}, "pdserve, Python layers": {STACK_ENV: "0"},
           "pdserve, Python loop": {NATIVE_MOE_ENV: "0"}}


def build_model(out: Path) -> Path:
    cfg = tf.Qwen3MoeConfig(**SIZES)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    threads = torch.get_num_threads()
    from tests.conftest import make_tokenizer  # its import sets torch to 1 thread (for the tests): undone here
    torch.set_num_threads(threads)
    make_tokenizer(out)
    total = sum(p.numel() for p in model.parameters())
    h, e, k, i, n = (SIZES[x] for x in ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                         "num_hidden_layers"))
    active = total - n * (e - k) * 3 * h * i
    print(f"model: random Qwen3-MoE {json.dumps(SIZES)}")
    print(f"parameters: {total / 1e6:.0f}M total, {active / 1e6:.0f}M active a token "
          f"({(active - SIZES['vocab_size'] * h) / 1e6:.0f}M without the input embedding), saved in bfloat16")
    return out


def describe_cpu() -> None:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in info.splitlines():
        if line.startswith(("Model name", "Flags", "CPU(s):")):
            print("lscpu " + " ".join(line.split()))
    from pdserve.engine import cpu_isa
    print(f"level: {cpu_isa.detected_level()}")


def write_gguf(model_dir: Path, out: Path) -> Path:
    """The checkpoint as a bf16 qwen3moe GGUF (norms f32), as llama.cpp's converter lays it out."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    e = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers >= 5 saves the latter
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 10000.0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(e)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    vocab = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}

    def put(name: str, t) -> None:
        if t.ndim == 1:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
        else:
            qt = gguf.GGMLQuantizationType.BF16
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), qt), raw_dtype=qt)

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        get = lambda k: f.get_tensor(k).float().numpy()  # noqa: E731
        put("token_embd.weight", get("model.embed_tokens.weight"))
        put("output_norm.weight", get("model.norm.weight"))
        put("output.weight", get("lm_head.weight"))
        for i in range(n):
            p = f"model.layers.{i}."
            for hf, gg in per_layer.items():
                put(f"blk.{i}.{gg}.weight", get(p + hf + ".weight"))
            for proj, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                put(f"blk.{i}.{gg}.weight", np.stack([get(f"{p}mlp.experts.{x}.{proj}.weight") for x in range(e)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def engine_step(model_dir: Path, ctx: int, rounds: int):
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=1,
                                                         enable_prefix_caching=False))
    eng.add_request("0", [100 + j % 3000 for j in range(ctx)],
                    SamplingParams(temperature=0, max_tokens=rounds + 8, ignore_eos=True))
    while any(s.is_prefill for r in eng.requests.values() for s in r.seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    stacked = sum(layer.moe.stacked is not None for layer in eng.runner.model.layers if layer.moe is not None)
    stacks = eng.runner.model.stacks
    print(f"  {eng.info.line()}; layers on the native MoE kernel: {stacked}; "
          f"decoder stack: {'on' if stacks is not None and stacks.enabled else 'off'}")
    return eng.step


def llama_cpp_step(model_dir: Path, d: Path, ctx: int, rounds: int):
    import llama_cpp
    import numpy as np
    path = write_gguf(model_dir, d / "model-bf16.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx + rounds + 16, n_batch=512,
                          n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                          logits_all=False, verbose=False)
    llm.eval([100 + j % 3000 for j in range(ctx)])
    n_vocab = llm.n_vocab()

    def step() -> None:  # one token: greedy from the last position's logits, then eval it
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        llm.eval([int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))])
    return step


def batch1(model_dir: Path, d: Path, rounds: int) -> None:
    import llama_cpp_anchor
    ctx = 256
    steps = {}
    for name, variables in ENGINES.items():
        print(name)
        with contextlib.ExitStack() as scope:
            for var, value in variables.items():
                scope.enter_context(env(var, value))
            steps[name] = engine_step(model_dir, ctx, rounds)
    why = llama_cpp_anchor.unavailable()
    if why:
        print(f"llama.cpp: not measured ({why})")
    else:
        steps["llama.cpp (bf16 GGUF)"] = llama_cpp_step(model_dir, d, ctx, rounds)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    ref = med.get("llama.cpp (bf16 GGUF)")
    loop = med["pdserve, Python loop"]
    print(f"batch-1 decode after {ctx} tokens, median of {rounds} interleaved steps, {torch.get_num_threads()} threads:")
    for name, s in med.items():
        vs = f"  {ref / s:.2f}x llama.cpp" if ref and not name.startswith("llama") else ""
        vs += f"  {loop / s:.2f}x the Python loop" if name.startswith("pdserve") else ""
        print(f"  {name:24s} {s * 1e3:7.2f} ms {1 / s:7.1f} tok/s{vs}")


MIXED = {"pdserve": {}, "pdserve, expert loop": {GROUPED_MOE_ENV: "0"}}  # the latter: prefill chunks' old path


def mixed(model_dir: Path, n: int, hf_batch: int, hf_dtypes: list[str], rounds: int) -> None:
    """`rounds` rounds, each pdserve (grouped prefill experts), pdserve with the expert loop (PDSERVE_GROUPED_MOE=0)
    and transformers one after another, so load from other processes falls on all alike; medians over rounds."""
    rng = random.Random(0)
    reqs = [([rng.randrange(100, 32000) for _ in range(rng.randint(32, 256))], rng.randint(16, 64)) for _ in range(n)]
    rates, ratios = {}, []
    for r in range(rounds):
        for name, variables in MIXED.items():
            with contextlib.ExitStack() as scope:
                for var, value in variables.items():
                    scope.enter_context(env(var, value))
                e_t, e_tok = run_engine(model_dir, reqs)
            rates.setdefault(name, []).append(e_tok / e_t)
        for dt in hf_dtypes:
            h_t, h_tok = run_hf(model_dir, reqs, hf_batch, getattr(torch, dt))
            rates.setdefault(f"transformers generate ({dt}, batch {hf_batch}, length-sorted)", []).append(h_tok / h_t)
        ratios.append(rates["pdserve"][-1] / max(v[-1] for k, v in rates.items() if k.startswith("transformers")))
        print(f"round {r + 1}: " + "; ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items())
              + f"; pdserve / transformers {ratios[-1]:.2f}x")
    med = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
    best = max(v for k, v in med.items() if k.startswith("transformers"))
    print(f"mixed workload ({n} requests, prompts 32-256, outputs 16-64), medians of {rounds} rounds:")
    for k, v in med.items():
        vs = f"  {v / best:.2f}x best transformers" if k.startswith("pdserve") else ""
        print(f"  {k:60s} {v:7.1f} tok/s{vs}")
    print(f"mixed workload: pdserve / best transformers = {med['pdserve'] / best:.2f}x (medians' ratio); "
          f"median of the rounds' own ratios {sorted(ratios)[len(ratios) // 2]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--hf-dtypes", default="bfloat16", help="comma-separated; the best is the baseline")
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--mixed-rounds", type=int, default=1, help="rounds of the mixed workload, engines alternating")
    args = ap.parse_args()
    set_threads(args.threads)
    describe_cpu()
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(Path(d) / "model")
        batch1(model_dir, Path(d), args.rounds)
        if not args.skip_mixed:
            mixed(model_dir, args.requests, args.hf_batch, args.hf_dtypes.split(","), args.mixed_rounds)


if __name__ == "__main__":
    main()
