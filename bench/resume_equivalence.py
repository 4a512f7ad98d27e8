"""Why a few migrated greedy streams in `bench/chaos.py` differ from a re-run: resume is exact, recompute is not
bit-equal to decode.

For random-token prompts (as the fault matrix sends) on one engine, per prompt: the uninterrupted greedy run
(`full`); a resume after k of its tokens (`Engine.add_request(resume_token_ids=full[:k])`, what a migrated stream
runs, engine/resume.py); and a plain request whose prompt is prompt + full[:k] (`ext`: recompute without any resume
machinery). Prints how often each pair differs. resume == ext every time says the resume path adds nothing of its
own; ext != full says prefilling the first k output tokens again (one batched forward) gives KV that differs in
float rounding from the KV their decode steps wrote, enough to flip a near-tied argmax later on.

    python bench/resume_equivalence.py [--prompts 30] [--model builtin]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    model = a.model
    if model == "builtin":
        from pdserve.builtin import builtin_model_dir
        model = str(builtin_model_dir())
    eng = Engine.from_pretrained(model, EngineConfig(num_gpu_blocks=512, num_threads=1))

    def run(rid: str, prompt: list[int], n: int, resume: list[int] | None = None) -> list[int]:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0),
                        resume_token_ids=resume)
        out = None
        while eng.has_unfinished():
            for o in eng.step() or []:
                if o.request_id == rid and o.finished:
                    out = o
        return list(out.outputs[0].token_ids)

    rng = random.Random(0)
    n, diff = 0, {"resume != full": 0, "ext != full": 0, "resume != ext": 0}
    for t in range(a.prompts):
        prompt = [rng.randrange(20, 250) for _ in range(40)]
        full = run(f"f{t}", prompt, a.tokens)
        k = rng.randrange(2, a.tokens - 8)
        res = run(f"r{t}", prompt, a.tokens, resume=full[:k])
        res = res if len(res) == a.tokens else full[:k] + res
        ext = full[:k] + run(f"e{t}", prompt + full[:k], a.tokens - k)
        n += 1
        diff["resume != full"] += res != full
        diff["ext != full"] += ext != full
        diff["resume != ext"] += res != ext
    print(f"model {a.model}, {n} random-token prompts of 40, {a.tokens} greedy tokens, cut at a random k; "
          f"{eng.info.line()}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for k, v in diff.items():
        print(f"{k}: {v} of {n}")


if __name__ == "__main__":
    main()
