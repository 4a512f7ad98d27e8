"""Host KV tier: TTFT of a 2,000-token prompt whose prefix was evicted to host memory vs recomputing it.

    PYTHONPATH=. python bench/kv_offload.py [--model DIR] [--tokens 2000] [--reps 3] [--device cpu|cuda]

One engine, side by side, alternating per repetition (so load drifts hit both alike):

- host:      prompt P runs once (its blocks are cached), then the device pool evicts every cached block (each
             one is saved into the host tier, engine/kv_offload.py); P again: its TTFT (arrival -> first token)
             includes the asynchronous recall of the prefix and the prefill of the last, partial block.
- recompute: the same with prompt Q, except that Q's blocks are then dropped from the host tier too: Q again is
             what a worker without the tier does, a full prefill.

Eviction is forced by taking every free block of the pool through the block manager (the allocation path a
filler prompt takes, which saves each evicted cached block into the tier), not by running filler prompts: their
prefill would cost minutes on a small CPU and is not what is measured. Prompts are random token ids, distinct
per repetition. Without --model, a random-weight Llama (GPT-2-small-like shape, 12 layers, hidden 768, 4 KV
heads of 64) is written to a temp dir with transformers; the tokenizer is the built-in model's.
Target: host-tier TTFT <= 0.3 x recompute TTFT.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.services.router.prefix_index import chain_hashes  # noqa: E402

BUILTIN = Path(__file__).resolve().parent.parent / "pdserve" / "builtin" / "model"
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def random_llama(out: Path, layers: int, hidden: int, max_pos: int) -> Path:
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                         head_dim=64, max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / f, out / f)
    return out


def ttft(eng: Engine, prompt: list[int]) -> float:
    out = eng.generate([prompt], ONE)[0]
    return out.times.first_token - out.times.arrival


def evict_all(eng: Engine) -> None:
    bm = eng.block_manager
    taken = [bm._take() for _ in range(bm.num_free)]  # every cached block is evicted: saved to the tier
    for b in taken:
        bm.release_block(b)


def describe_cpu() -> None:
    from pdserve.engine import cpu_isa
    flags = cpu_isa.cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    print(f"cpu: {cpu_isa.cpu_model()}; flags: {' '.join(shown) or '-'}; cores: {torch.get_num_threads()} "
          f"torch threads")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: a random-weight Llama written to a temp dir)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-offload-dir", help="also measure the disk tier (host tier of 1 block: all on disk)")
    args = ap.parse_args()
    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="pdserve-bench-kv-")
        model = random_llama(Path(tmp), args.layers, args.hidden, max(2048, args.tokens + 64))
    if args.device == "cpu":
        describe_cpu()
    else:
        print(f"device: {torch.cuda.get_device_name()}; host cpu: ", end="")
        describe_cpu()
    bs = 16
    blocks = -(-(args.tokens + 1) // bs) + 8
    cfg = dict(block_size=bs, num_gpu_blocks=blocks, max_num_batched_tokens=max(2048, args.tokens + 16),
               device=args.device, dtype="bfloat16")
    eng = Engine.from_pretrained(model, EngineConfig(**cfg))  # probe the block size
    block_bytes = eng.kv_cache.block_bytes
    host_bytes = 4 * blocks * block_bytes
    disk = dict(kv_offload_bytes=host_bytes)
    if args.kv_offload_dir:
        disk = dict(kv_offload_bytes=block_bytes, kv_offload_dir=args.kv_offload_dir,
                    kv_offload_disk_bytes=host_bytes)
    del eng
    eng = Engine.from_pretrained(model, EngineConfig(**cfg, **disk))
    print(f"engine: {eng.info.line()}; KV block {block_bytes} B; pool {blocks} blocks; "
          f"{'disk tier at ' + args.kv_offload_dir if args.kv_offload_dir else f'host tier {host_bytes >> 20} MiB'}")
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    ttft(eng, [rng.randrange(3, vocab) for _ in range(64)])  # warm-up: kernels, allocator
    tier = "disk" if args.kv_offload_dir else "host"
    res: dict[str, list[float]] = {tier: [], "recompute": []}
    for rep in range(args.reps):
        for kind in ((tier, "recompute") if rep % 2 == 0 else ("recompute", tier)):
            p = [rng.randrange(3, vocab) for _ in range(args.tokens)]
            ttft(eng, p)
            evict_all(eng)
            hashes = chain_hashes(p, bs, eng.fingerprint, "")
            assert all(eng.kv_offload.tier_of(h) in ("host", "disk") for h in hashes), "the prefix is not offloaded"
            if kind == "recompute":
                for h in hashes:
                    eng.kv_offload.discard(h)
            before = sum(eng.kv_offload.hit_tokens.values())
            res[kind].append(ttft(eng, p))
            got = sum(eng.kv_offload.hit_tokens.values()) - before
            assert got == (len(hashes) * bs if kind == tier else 0), (kind, got)
        print(f"rep {rep}: {tier} {res[tier][-1] * 1e3:.1f} ms, recompute {res['recompute'][-1] * 1e3:.1f} ms")
    a, b = statistics.median(res[tier]), statistics.median(res["recompute"])
    rec = eng.stats().tier.recall_seconds
    print(f"median TTFT, {args.tokens}-token prompt: {tier}-tier hit {a * 1e3:.1f} ms, recompute {b * 1e3:.1f} ms; "
          f"ratio {a / b:.3f} (target <= 0.3); recall alone: median {statistics.median(rec) * 1e3:.1f} ms "
          f"for {len(hashes)} blocks ({len(hashes) * block_bytes / 2**20:.1f} MiB)")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
