"""`pdserve generate`: run the engine offline on one prompt."""
from __future__ import annotations

import argparse
import json
import sys
import time

from pdserve.cli_args import positive_int
from pdserve.engine.spec_decode.flags import add_spec_flags, spec_config


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text offline with the engine (no services)")
    p.add_argument("--model", default="builtin", help="checkpoint directory, or 'builtin' (the demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantization", default="none", choices=["none", "int8"],
                   help="weight-only int8 projections and lm_head (CPU; docs/engine.md, Weight-only int8)")
    p.add_argument("--kv-offload-bytes", type=int, default=0,
                   help="host KV tier bytes: evicted prefix blocks are recalled instead of recomputed (0: off)")
    p.add_argument("--kv-offload-dir", default=None, help="disk KV tier directory (spills from the host tier)")
    p.add_argument("--kv-offload-disk-bytes", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="ranks of tensor parallelism (one process each)")
    p.add_argument("--beam-width", type=int, default=None,
                   help="beam search with this many beams (transformers' semantics, docs/engine.md)")
    p.add_argument("--n", type=int, default=1, help="completions to print (with --beam-width: the n best beams)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam score = sum of logprobs / length ** this")
    p.add_argument("--early-stopping", choices=["true", "false", "never"], default="false",
                   help="beam search stop rule, as transformers defines it")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="engine batching mode (static: the baseline, docs/engine.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    add_spec_flags(p)
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.errors import CheckpointError, RequestRejected
    from pdserve.engine.sampling_params import SamplingParams

    t0 = time.time()
    try:
        engine = Engine.from_pretrained(args.model, EngineConfig(
            dtype=args.dtype, device=args.device, quantization=args.quantization, kv_offload_bytes=args.kv_offload_bytes,
            kv_offload_dir=args.kv_offload_dir, kv_offload_disk_bytes=args.kv_offload_disk_bytes,
            tensor_parallel_size=args.tensor_parallel_size, batching=args.batching, **spec_config(args)))
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load_s = time.time() - t0
    if getattr(args, "verbose", False):  # what `dtype=auto` chose on this CPU, and which kernels run
        print(engine.info.line(), file=sys.stderr)
    prompt = args.prompt
    if args.chat:
        try:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        except ValueError as e:  # no template, or one that refuses this conversation: one line, no traceback
            print(f"error: {e}", file=sys.stderr)
            return 2
    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, n=args.n, beam_width=args.beam_width,
                            length_penalty=args.length_penalty, early_stopping=early)
    try:
        out = engine.generate([prompt], params)[0]
    except (ValueError, RequestRejected) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    c = out.outputs[0]
    t = out.times
    ttft = (t.first_token or t.finished) - t.arrival
    total = t.finished - t.arrival
    if args.json:
        print(json.dumps({
            "choices": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                         "cumulative_logprob": o.cumulative_logprob} for o in out.outputs],
            "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(c.token_ids),
            "timings": {"load_s": round(load_s, 4), "ttft_s": round(ttft, 4), "total_s": round(total, 4),
                        "tpot_s": round((total - ttft) / (len(c.token_ids) - 1), 5) if len(c.token_ids) > 1 else None},
        }))
    else:
        for o in out.outputs:
            print(o.text)
    return 0
