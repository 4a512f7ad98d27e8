"""First request on a fresh engine with and without the worker's warm-up (spec §1.5), side by side.

    python bench/cold_start.py [--model builtin] [--runs 3]

Each run is a fresh process (a cold one: kernels not yet touched) that loads the engine, optionally warms it up
(engine/warmup.py, what `pdserve worker` does before it registers), then times its first request (a 64-token
prompt, 16 greedy tokens: TTFT and total) and a second identical-shape request (steady). Figures: the medians
over runs, first / steady ratios. They hold for the CPU printed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model: str, warm: bool) -> dict:
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.warmup import warm_up
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(model, EngineConfig(max_num_seqs=8))
    load = time.perf_counter() - t0
    w = warm_up(eng).seconds if warm else 0.0
    res = {"load_s": load, "warmup_s": w}
    for tag, base in (("first", 100), ("steady", 200)):
        eng.add_request(tag, [base + j for j in range(64)], SamplingParams(temperature=0, max_tokens=16,
                                                                           ignore_eos=True))
        t = time.perf_counter()
        ttft = None
        while eng.has_unfinished():
            for o in eng.step():
                if ttft is None and o.outputs and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t
        res[tag] = {"ttft_s": ttft, "total_s": time.perf_counter() - t}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", choices=["warm", "cold"])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child == "warm")))
        return
    from pdserve.engine import cpu_isa
    print(f"cpu: {cpu_isa.cpu_model()}; level: {cpu_isa.detected_level()}; model: {args.model}")
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.runs):
        for mode in ("cold", "warm"):  # alternating, so load drifts hit both alike
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", mode],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("load_s", "warmup_s")}
        f = {k: statistics.median(r["first"][k] for r in rs) for k in ("ttft_s", "total_s")}
        s = {k: statistics.median(r["steady"][k] for r in rs) for k in ("ttft_s", "total_s")}
        print(f"{mode}: load {med['load_s']:.2f}s, warm-up {med['warmup_s']:.2f}s; first request TTFT "
              f"{f['ttft_s'] * 1e3:.0f} ms / total {f['total_s'] * 1e3:.0f} ms; steady TTFT {s['ttft_s'] * 1e3:.0f} ms"
              f" / total {s['total_s'] * 1e3:.0f} ms; first/steady TTFT {f['ttft_s'] / s['ttft_s']:.2f}x")


if __name__ == "__main__":
    main()
