"""mixed-vs-hf: the engine's output tokens/s on a mixed workload against transformers `generate` at its best
static batch size, and the engine's host time per generated token."""
from __future__ import annotations

import gc
import random
import time
from pathlib import Path

from bench.gpu_checks import harness
from bench.gpu_checks.checkpoints import write_checkpoint
from bench.gpu_checks.harness import ENGINE, HF, Line, Skip, empty_cache, importable, need_cuda, time_calls


def check_mixed(tmp: Path, n_requests: int, hf_batches: list[int], deadline: float) -> Line:
    need_cuda()
    why = importable(*ENGINE, *HF)
    if why:
        raise Skip(why)
    import torch
    import transformers as tf

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services.procutil import freeze_startup_heap
    shape = dict(hidden=768, layers=12, heads=12, kv_heads=4, inter=2048) if harness.SHAPE == "8b" else \
        dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=256)  # --tiny: smoke runs
    ckpt = write_checkpoint(tmp / "mixed", "llama", torch.bfloat16, vocab=32000, scale=0, **shape)
    rng = random.Random(0)
    reqs = [([rng.randrange(100, 32000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
            for _ in range(n_requests)]
    useful = sum(n for _, n in reqs)
    # the pool sized from memory (kv_sizing.py), leaving half the GPU for transformers afterwards
    eng = Engine.from_pretrained(ckpt, EngineConfig(device=harness.DEVICE, max_num_seqs=256, max_num_batched_tokens=8192,
                                                    gpu_memory_utilization=0.5))
    pool = f"pool {eng.kv_cache.num_blocks} blocks ({eng.kv_cache.num_blocks * eng.kv_cache.block_bytes / 2**30:.1f} GiB)"
    # as a worker does after warm-up: no full collection over start-up objects mid-run (procutil imports only the
    # standard library, so the bare GPU host has what it needs)
    freeze_startup_heap("gpu_check mixed")
    for i, (p, n) in enumerate(reqs):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    device_calls = [0.0]  # seconds in the forward, the graph replays and the sampler (whose read-back waits)
    time_calls(eng.runner.model, "forward", device_calls)
    time_calls(eng.sampler, "sample", device_calls)
    if eng.runner.graphs is not None:
        time_calls(eng.runner.graphs, "run", device_calls)
    t = time.perf_counter()
    toks = 0
    while eng.has_unfinished():
        toks += sum(len(o.outputs[0].new_token_ids) for o in eng.step())
    elapsed = time.perf_counter() - t
    ours = toks / elapsed
    host = elapsed - device_calls[0]
    host_note = f"engine host bookkeeping {host / toks * 1e6:.1f} us/token ({100 * host / elapsed:.0f}% of its time)"
    gc.unfreeze()  # the engine's objects (its KV pool among them) must be collectable before transformers loads
    del eng
    gc.collect()
    empty_cache()
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(harness.DEVICE).eval()
    # Static batching as a server could do it: rows grouped by prompt length (known at admission; less padding).
    # Not by output length: a server does not know where a request will stop (here every request runs exactly
    # max_tokens only because EOS is ignored). Each batch runs to its longest output, as generate must.
    order = sorted(reqs, key=lambda r: len(r[0]))
    best, best_batch, tried = 0.0, 0, []
    for batch in hf_batches:
        if time.monotonic() > deadline:
            tried.append(f"b{batch} not run (time)")
            continue
        t = time.perf_counter()
        for i in range(0, len(order), batch):
            chunk = order[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=harness.DEVICE)
            mask = (torch.arange(width, device=harness.DEVICE)[None] >= torch.tensor(
                [width - len(p) for p, _ in chunk], device=harness.DEVICE)[:, None]).long()
            n = max(k for _, k in chunk)
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0)
        rate = useful / (time.perf_counter() - t)
        tried.append(f"b{batch} {rate:.0f} tok/s")
        if rate > best:
            best, best_batch = rate, batch
    if not best:
        raise Skip("no transformers batch size finished within the time budget")
    ratio = ours / best
    return Line("mixed-vs-hf", f"{n_requests} requests: engine {ours:.0f} tok/s vs transformers {best:.0f} tok/s "
                f"at batch {best_batch} ({', '.join(tried)}) = {ratio:.1f}x; {pool}; {host_note}", ">= 10x", "PASS" if ratio >= 10 else "FAIL")
