"""KV-cache quantization (--kv-cache-dtype fp8_e4m3) side by side with the default pool, in one run:

    python bench/kv_quant.py [--threads 2] [--prompts 16] [--tokens 32]

For the built-in demo model (the CPU's `auto` dtype: bf16 on an AMX/AVX512-BF16 CPU, fp32 otherwise) and a
transformers-made tiny Llama (fp32): KV bytes per token, the tokens the default CPU budget (256 MiB) holds, batched
decode tokens/s (8 sequences, 64 new tokens each; the default pool with its native kernels, the default pool on
the torch attention path, and the fp8 pool, which runs on the torch path), and accuracy against the unquantized
pool (engine/kv_accuracy.py: greedy agreement over N prompts x M tokens, mean |log-likelihood difference| of the
reference continuation scored teacher-forced). Prompts: the built-in model's held-out fortunes (never trained on),
random ids for the tiny model. Also why fp8 and not int8: the round-trip error of the K/V the built-in model
actually wrote, as fp8 e4m3 (no scales) and as int8 with one absmax scale per (token, head) (fp16 scale: +2 bytes
per head_dim values). Prints the CPU; figures hold for that CPU and its load at the time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine_throughput import describe_cpu, set_threads  # noqa: E402
from pdserve.engine import kv_accuracy as ka  # noqa: E402
from pdserve.engine.kv_sizing import CPU_DEFAULT_KV_BYTES  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402


def decode_tps(eng, vocab: int, seqs: int = 8, new: int = 64) -> float:
    batch = ka.prompts(vocab, seqs, 32, seed=7)
    eng.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    eng.generate(batch, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    return seqs * new / (time.perf_counter() - t)


def roundtrip_errors(kv: torch.Tensor) -> dict:
    """Relative RMS error of the pool's non-zero (token, head) rows stored as fp8 e4m3 and as int8 per-row absmax."""
    rows = kv.float().reshape(-1, kv.shape[-1])
    rows = rows[rows.abs().amax(1) > 0]
    fp8 = rows.to(torch.float8_e4m3fn).float()
    scale = (rows.abs().amax(1, keepdim=True) / 127).half().float()
    int8 = (rows / scale).round().clamp(-127, 127) * scale
    rel = lambda a: float(((a - rows).norm() / rows.norm()))  # noqa: E731
    return {"rows": rows.shape[0], "fp8_e4m3": rel(fp8), "int8_per_token_head": rel(int8),
            "int8_bytes_per_value": 1 + 2 / kv.shape[-1]}


def one_model(name: str, model, batch, tokens: int, threads) -> None:
    ref = ka.engine_for(model, "auto", 16)
    quant = ka.engine_for(model, "fp8_e4m3", 16)
    torch_ref = ka.engine_for(model, "auto", 16, attention="torch")
    vocab = ref.model_config.vocab_size
    print(f"\n== {name}: compute dtype {ref.kv_cache.data.dtype}, kernels {ref.runner.kernels_name()}")
    for label, e in (("default pool", ref), ("fp8_e4m3 pool", quant)):
        per_tok = e.kv_cache.block_bytes // e.kv_cache.block_size
        fit = CPU_DEFAULT_KV_BYTES // e.kv_cache.block_bytes * e.kv_cache.block_size
        print(f"{label:>15}: {str(e.kv_cache.data.dtype).removeprefix('torch.'):>14}  {per_tok:6d} B/token  "
              f"{fit:8d} tokens in 256 MiB")
    for label, e in (("default, native kernels", ref), ("default, torch path", torch_ref),
                     ("fp8_e4m3 (torch path)", quant)):
        print(f"  decode {label:>24}: {decode_tps(e, vocab):7.1f} tok/s (8 seqs x 64 tokens)")
    acc = ka.measure(ref, quant, batch, tokens)
    print(f"  accuracy over {len(batch)} prompts x {tokens} tokens: greedy agreement {acc.agreement:.3f}, mean "
          f"|dLL| {acc.mean_ll_diff:.4f} nats/token (LL ref {acc.mean_ll_ref:.3f}, fp8 {acc.mean_ll_quant:.3f})")
    print(f"  K/V round trip (this model's written pool): {roundtrip_errors(ref.kv_cache.data)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    set_threads(a.threads)
    from pdserve.builtin import builtin_model_dir
    from pdserve.builtin.train import read_heldout
    builtin = Path(builtin_model_dir())
    describe_cpu(builtin)
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.tokenizer import Tokenizer
    tok = Tokenizer(builtin, ModelConfig.from_dir(builtin).eos_token_ids)
    batch = [tok.encode(t)[:16] for t in read_heldout(builtin / "heldout.txt")]
    batch = [b for b in batch if len(b) == 16][:a.prompts]
    one_model("built-in demo model", builtin, batch, a.tokens, a.threads)
    from tests.conftest import make_checkpoint
    tiny = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama", hidden=128, heads=4, kv_heads=2, layers=2)
    one_model("transformers tiny Llama (random weights)", tiny, ka.prompts(320, a.prompts, 16), a.tokens, a.threads)


if __name__ == "__main__":
    main()
