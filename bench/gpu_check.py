"""The one GPU check: correctness and speed of the CUDA path on a single GPU, one table.

    bash scripts/gpu_check.sh [--dry-run] [--budget-s 450]

Lines (each PASS / FAIL / skipped: <why> / error: <what>):
- greedy-{llama,qwen2,qwen3_moe}-{fp32,bf16}: greedy tokens of the engine on CUDA equal transformers' on CUDA (tiny
  random checkpoints written here; qwen3_moe: 8 experts, top 2, so the sparse layers and the router run on the
  device); in bf16 a sequence may differ from a near-tie on (TIE_ULPS).
- decode-8b-b{1,64}: one decode forward of a random Llama-3-8B-shaped bf16 model (CUDA graph replay) at batch 1
  and 64, 1024-token contexts, against the HBM bound = (weight + KV bytes read) / device copy bandwidth, where
  the bandwidth is bytes read + written per second by a device-to-device copy. Targets <= 1.3x and <= 2x.
- mixed-vs-hf: bench/engine_throughput.py's mixed workload scaled to 512 requests on a ~124M random Llama (bf16):
  engine output tokens/s vs transformers `generate` at its best static batch size (rows grouped by prompt length;
  each batch runs to its longest output). Target >= 10x. Also printed: the engine's host time per generated token
  (step time outside the model's forward and the sampler), which bounds its rate where the GPU work is small.
- nixl-vram: NIXL READ of KV blocks from a second process's VRAM pool into this one's (one GPU: UCX cuda_ipc)
  vs a device copy of the same bytes.
- sampler-device: the spec §3 sampling pipeline on the GPU: no synchronisation inside it (CUDA sync debug mode
  "error"), the same support sets as the CPU for the same logits, and ms per step at batch 64 x 128k vocabulary
  against copying the logits to the host for the CPU sampler.

Nothing here needs the network. Anything not importable turns its lines into "skipped: <why>"; --dry-run skips
everything (what CI runs, to keep this script runnable).
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_checks import harness  # noqa: E402 (after the sys.path line above)
from bench.gpu_checks.decode import check_decode  # noqa: E402
from bench.gpu_checks.greedy import check_greedy  # noqa: E402
from bench.gpu_checks.harness import Line, Skip, Stopped, empty_cache, importable  # noqa: E402
from bench.gpu_checks.mixed import check_mixed  # noqa: E402
from bench.gpu_checks.nixl import check_nixl  # noqa: E402
from bench.gpu_checks.sampler import check_sampler  # noqa: E402


def plan(args, tmp: Path, deadline: float):
    box: dict = {}
    for arch in ("llama", "qwen2", "qwen3_moe"):
        for dt in ("float32", "bfloat16"):
            yield f"greedy-{arch}-{dt}", 20, (lambda a=arch, d=dt: check_greedy(tmp, a, d))
    yield f"decode-{harness.SHAPE}-b1", 120, lambda: check_decode(box, 1, 1.3)
    yield f"decode-{harness.SHAPE}-b64", 20, lambda: check_decode(box, 64, 2.0)

    def free_8b():
        box.clear()
        empty_cache()
    yield None, 0, free_8b
    yield "mixed-vs-hf", 150, lambda: check_mixed(tmp, args.requests, args.hf_batch, deadline - 10)
    yield "nixl-vram", 30, check_nixl
    yield "sampler-device", 20, check_sampler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="skip every check (prints the table of reasons)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting checks after this long")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--hf-batch", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run of the script itself (with --tiny and few --requests); no target applies")
    ap.add_argument("--tiny", action="store_true", help="a small model for the decode lines (smoke runs)")
    ap.add_argument("--only", default="", help="comma-separated name prefixes of the checks to run (default: all)")
    args = ap.parse_args()
    harness.DEVICE, harness.SHAPE = args.device, "tiny" if args.tiny else "8b"
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    lines: list[Line] = []
    stopped = False

    def on_term(*_):  # `timeout` in gpu_check.sh: end the running check, still print the table
        raise Stopped()
    signal.signal(signal.SIGTERM, on_term)
    torch_why = importable("torch")
    head = f"pdserve GPU check: {'dry run' if args.dry_run else 'torch missing' if torch_why else ''}"
    if not args.dry_run and not torch_why:
        import torch
        head += f"torch {torch.__version__}"
        if torch.cuda.is_available():
            head += f", {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
        t_why = importable("triton")
        head += ", " + (t_why or f"triton {importlib.import_module('triton').__version__}")
    print(head, flush=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        for name, min_s, fn in plan(args, Path(tmp), deadline):
            if name is None:
                if not args.dry_run and not torch_why and any(ln.check.startswith("decode") for ln in lines):
                    fn()
                continue
            if args.only and not name.startswith(tuple(args.only.split(","))):
                lines.append(Line(name, verdict="skipped: not in --only"))
            elif args.dry_run or stopped:
                lines.append(Line(name, verdict="skipped: " + ("dry run" if args.dry_run else "stopped (SIGTERM)")))
            elif torch_why:
                lines.append(Line(name, verdict=f"skipped: {torch_why}"))
            elif time.monotonic() + min_s > deadline:
                lines.append(Line(name, verdict=f"skipped: time budget ({args.budget_s:g} s) spent"))
            else:
                t = time.monotonic()
                try:
                    line = fn()
                except Stopped:
                    stopped = True
                    line = Line(name, verdict="error: stopped by SIGTERM (the hard time limit) while running")
                except Skip as e:
                    line = Line(name, verdict=f"skipped: {e}")
                except Exception as e:  # one broken check must not hide the others' lines
                    traceback.print_exc()
                    line = Line(name, verdict=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                line.result += f" [{time.monotonic() - t:.0f} s]" if line.result else ""
                lines.append(line)
            print(f"  {lines[-1].check}: {lines[-1].verdict}", file=sys.stderr, flush=True)
    w = max(len(ln.check) for ln in lines)
    print(f"\n{'check'.ljust(w)} | verdict | target | result")
    for ln in lines:
        print(f"{ln.check.ljust(w)} | {ln.verdict} | {ln.target or '-'} | {ln.result or '-'}")
    print(f"total {time.monotonic() - t0:.0f} s")
    return 1 if any(ln.verdict == "FAIL" or ln.verdict.startswith("error") for ln in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
