"""The engine's host bookkeeping per generated token: step time outside the model's forward and the sampler.

    python bench/host_overhead.py [--requests 512] [--threads 1] [--output-len N] [--logprobs K] [--profile]

bench/gpu_checks/mixed.py's workload (prompts of 32-512 tokens, 16-256 output tokens, up to 256 sequences a step)
on a model so small (2 layers, hidden 64, vocabulary 1024) that the forward is cheap, so what is left is the
Python around it: scheduling, the step's input tensors, the output processors (detokenizer, stops), the
RequestOutputs. On a GPU that part does not shrink with the device: at B sequences a step it costs B times the
figure here, and bounds the engine at 1 / (figure) tokens per second whatever the GPU does (docs/engine.md,
"Host overhead"). --output-len gives every request that many tokens (and the prompts 32 tokens), to see whether
the per-token figure grows with the length of the answer; --logprobs asks K top logprobs of every token.
--profile adds a cProfile listing.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=None, help="every request's length (default: 16-256)")
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import torch

    from bench.gpu_checks.checkpoints import write_checkpoint
    from bench.gpu_checks.harness import time_calls
    from pdserve.engine.cpu_isa import cpu_model, detected_level
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services.procutil import freeze_startup_heap
    torch.set_num_threads(args.threads)
    vocab = 1024
    ckpt = write_checkpoint(Path(tempfile.mkdtemp()) / "m", "llama", torch.float32, vocab=vocab, scale=0, hidden=64,
                            layers=2, heads=4, kv_heads=2, inter=128)
    rng = random.Random(0)
    fixed = args.output_len
    reqs = [([rng.randrange(100, vocab) for _ in range(32 if fixed else rng.randint(32, 512))],
             fixed or rng.randint(16, 256)) for _ in range(args.requests)]
    eng = Engine.from_pretrained(ckpt, EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                                    num_gpu_blocks=40000, num_threads=args.threads))
    # as a worker does after its warm-up (services/procutil.py): else a full collection walks the start-up heap
    # mid-run, one 0.2-0.27 s pause here, which a serving engine does not pay
    freeze_startup_heap("host_overhead")
    forward, sampler = [0.0], [0.0]
    time_calls(eng.runner.model, "forward", forward)
    time_calls(eng.sampler, "sample", sampler)
    for i, (p, n) in enumerate(reqs):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                  logprobs=args.logprobs))
    prof = cProfile.Profile() if args.profile else None
    steps = toks = 0
    t = time.perf_counter()
    if prof:
        prof.enable()
    while eng.has_unfinished():
        toks += sum(len(o.outputs[0].new_token_ids) for o in eng.step())
        steps += 1
    if prof:
        prof.disable()
    elapsed = time.perf_counter() - t
    host = elapsed - forward[0] - sampler[0]
    print(f"CPU: {cpu_model()} ({detected_level()}), {args.threads} thread(s); torch {torch.__version__}")
    print(f"{args.requests} requests, {steps} steps, {toks} tokens in {elapsed:.2f} s: "
          f"forward {forward[0]:.2f} s, sampler {sampler[0]:.2f} s, host bookkeeping {host:.2f} s = "
          f"{host / toks * 1e6:.1f} us/token "
          f"({host / steps * 1e3:.2f} ms/step, {100 * host / elapsed:.0f}% of the time)"
          + (" [under cProfile: inflated]" if prof else ""))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
