"""sampler-device: the sampling pipeline on the device: no synchronisation inside it, the CPU's support sets, and
its time per step against copying the logits to the host."""
from __future__ import annotations

from bench.gpu_checks import harness
from bench.gpu_checks.harness import Line, Skip, gpu_time, importable, need_cuda

SAMPLER_CONFIGS = [dict(temperature=0.0), dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8),
                   dict(min_p=0.1), dict(typical_p=0.7, temperature=1.3),
                   dict(top_k=12, top_p=0.9, min_p=0.05, typical_p=0.95, temperature=0.8),
                   dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, top_p=0.95)]


def check_sampler() -> Line:
    """The §3 pipeline on the device: no synchronisation inside it (CUDA's sync debug mode set to error), the same
    support sets as on CPU for the same logits (processed logprobs of a 16-token vocabulary, every config), and its
    time per step at batch 64 of a 128k vocabulary against the old path (logits copied to the host, CPU sampler)."""
    need_cuda()
    why = importable("pdserve.engine.sampler")  # xgrammar (constrained decoding) comes with it
    if why:
        raise Skip(why)
    import torch

    from pdserve.engine.sampler import Sampler, SamplingState
    from pdserve.engine.sampling_params import SamplingParams

    dev = torch.device(harness.DEVICE)

    def states(V, B, device, **extra):
        return [SamplingState(SamplingParams(seed=i, **SAMPLER_CONFIGS[i % len(SAMPLER_CONFIGS)], **extra),
                              [1, 2, 3], V, [0], device=device) for i in range(B)]

    # 1. supports: 16 tokens, all of them in the processed logprobs
    g = torch.Generator().manual_seed(0)
    mismatches, rows = 0, 0
    for _ in range(40):
        z = torch.randn(len(SAMPLER_CONFIGS), 16, generator=g) * 3
        got = [Sampler(16).sample(z.to(dev), states(16, len(z), dev, logprobs=16, logprobs_mode="processed")),
               Sampler(16).sample(z, states(16, len(z), "cpu", logprobs=16, logprobs_mode="processed"))]
        for a, b in zip(*got):
            rows += 1
            sa = {t for t, v in a.top_logprobs if v > float("-inf")}
            sb = {t for t, v in b.top_logprobs if v > float("-inf")}
            mismatches += sa != sb
    # 2. no synchronisation inside the pipeline
    V, B = 128256, 64
    logits = torch.randn(B, V, device=dev) * 3
    smp = Sampler(V)
    st = states(V, B, dev, logprobs=5)
    smp.sample(logits, st)  # warm-up (lazy initialisation, device copies of masks)
    sync_ok = "n/a on cpu"
    if harness.DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            smp.sample_on_device(logits, st)
            sync_ok = "none"
        except RuntimeError as e:
            sync_ok = f"SYNC: {str(e).splitlines()[0][:80]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # 3. time per step: on the device vs copy to the host + CPU sampler
    host_states = states(V, B, "cpu", logprobs=5)
    t_dev = gpu_time(lambda: smp.sample(logits, st), 5)
    t_host = gpu_time(lambda: smp.sample(logits.cpu(), host_states), 3, warmup=1)
    ok = mismatches == 0 and sync_ok in ("none", "n/a on cpu")
    return Line("sampler-device", f"support mismatches {mismatches}/{rows}; syncs in pipeline: {sync_ok}; B=64 "
                f"V=128k mixed configs: {t_dev * 1e3:.1f} ms on {harness.DEVICE} vs {t_host * 1e3:.1f} ms copy+CPU",
                "0 mismatches, no sync", "PASS" if ok else "FAIL")
