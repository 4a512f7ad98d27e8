"""greedy-{llama,qwen2,qwen3_moe}-{fp32,bf16}: the engine's greedy tokens on the device equal transformers'."""
from __future__ import annotations

import random
from pathlib import Path

from bench.gpu_checks import harness
from bench.gpu_checks.checkpoints import write_checkpoint
from bench.gpu_checks.harness import ENGINE, HF, Line, Skip, importable, need_cuda

# bf16 greedy: two implementations sum in different orders and round differently, so where HF's top two logits are
# within a few bf16 ulps the choice may flip (the CPU tests apply the same rule: tests/engine/test_cpu_isa.py).
# Tokens must be equal up to the first difference, and there HF's own margin for its token over ours must be a
# near-tie. fp32 must match exactly. 6 ulps of the largest logit: the CPU smoke runs (bf16 AMX engine vs HF bf16)
# saw margins up to 3, and a GPU sums in yet other orders (split contexts, tensor-core tiles). In fp32, these
# checkpoints' top two logits are 0.23 apart at the median step and 0.08 at the first quartile, the largest logit
# ~2.9 (a bf16 ulp there is 0.0156): 6 ulps (0.094) is a tie, and a token from a broken kernel lands far lower.
TIE_ULPS = 6


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at magnitude x (8 significant bits)."""
    import math
    return 2.0 ** (math.floor(math.log2(max(x, 2.0 ** -126))) - 7)


def check_greedy(tmp: Path, arch: str, dtype_name: str) -> Line:
    need_cuda()
    why = importable(*ENGINE, *HF)
    if why:
        raise Skip(why)
    import torch
    import transformers as tf

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    dtype = getattr(torch, dtype_name)
    ckpt = write_checkpoint(tmp / f"{arch}-{dtype_name}", arch, dtype)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 17, 64, 130, 1, 300)]
    n_new = 24
    eng = Engine.from_pretrained(ckpt, EngineConfig(device=harness.DEVICE, num_gpu_blocks=256, max_num_batched_tokens=128))
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(harness.DEVICE).eval()
    same_seqs = same_toks = at_ties = 0
    worst = 0.0  # the largest margin, in bf16 ulps, by which HF preferred its token where the two differ
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=harness.DEVICE), max_new_tokens=n_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        ours = o.outputs[0].token_ids
        i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        same_seqs += i is None
        same_toks += len(ref) if i is None else i
        if i is not None and dtype != torch.float32:
            with torch.no_grad():
                logits = hf(torch.tensor([p + ref[:i]], device=harness.DEVICE)).logits[0, -1].float()
            ulps = float(logits[ref[i]] - logits[ours[i]]) / bf16_ulp(float(logits.abs().max()))
            worst = max(worst, ulps)
            at_ties += ulps <= TIE_ULPS
    replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0  # decode steps served by graphs
    if dtype == torch.float32:
        ok, target, tie_note = same_seqs == len(prompts), "all equal", ""
    else:
        ok = same_seqs + at_ties == len(prompts)
        target = f"equal, or first difference a near-tie (<= {TIE_ULPS} bf16 ulps in HF's logits)"
        tie_note = "" if same_seqs == len(prompts) else \
            f", {at_ties} differ at a near-tie (largest margin {worst:.1f} ulps)"
    if harness.DEVICE == "cuda":  # the decode steps must have come from the CUDA graphs for this line to check them
        ok, target = ok and replays > 0, target + ", CUDA graphs replayed"
    kernels = type(eng.runner.attention_ops).__name__
    return Line(f"greedy-{arch}-{dtype_name}",
                f"{same_seqs}/{len(prompts)} sequences equal{tie_note}, {same_toks}/{len(prompts) * n_new} tokens "
                f"before the first difference (attention {kernels}, {replays} graph replays)",
                target, "PASS" if ok else "FAIL")
