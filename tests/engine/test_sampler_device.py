"""The sampler's device contract (spec §3 pipeline on the logits' device): nothing is read back to the
host inside the pipeline, the step's results cross in one copy, per-request generators draw on the device, and the
CPU stream of a seeded request is the plain MT19937 stream of its branch seed (what migration replay and the prefill
hand-off count on: one uniform per sampled token)."""
from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pdserve.engine.sampler import Sampler, SamplingState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sampling_state import branch_seed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

# Every tensor API that moves data to the host or waits for it (a data-dependent output shape does on CUDA).
_READS = {"tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "nonzero",
          "masked_select", "unique", "argwhere"}


class HostReads(TorchFunctionMode):
    """Counts calls that read a tensor back to the host, by name (boolean-mask indexing counted as 'bool_index')."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _READS:
            self.calls.append(name)
        elif name == "to" and any(str(a).startswith("cpu") for a in list(args[1:]) + list(kwargs.values())):
            self.calls.append("to(cpu)")
        elif name in ("__getitem__", "__setitem__") and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx):
                self.calls.append("bool_index")
        return func(*args, **kwargs)


def mixed_batch(V: int, device) -> tuple[torch.Tensor, list[SamplingState]]:
    """Every branch of the pipeline in one batch: greedy, temperature only, each filter, penalties, bias, allowed
    ids, bad words, min_tokens, both logprobs modes, and a dead end."""
    cfgs = [
        dict(temperature=0.0), dict(temperature=0.0, logprobs=3, logprobs_mode="processed"), dict(),
        dict(temperature=0.7, logprobs=2), dict(top_k=5), dict(top_p=0.8, logprobs=4, logprobs_mode="processed"),
        dict(min_p=0.1), dict(typical_p=0.7, temperature=1.3), dict(repetition_penalty=1.4, top_p=0.95),
        dict(frequency_penalty=0.5, presence_penalty=0.2), dict(logit_bias={3: 5.0, 8: -3.0}),
        dict(allowed_token_ids=[1, 2, 3, 4], logprobs=1), dict(min_tokens=4, no_repeat_ngram_size=2),
        dict(allowed_token_ids=[2], min_tokens=3, logprobs=2, logprobs_mode="processed"),  # dead end
    ]
    states = [SamplingState(SamplingParams(seed=10 + i, **c), [1, 2, 3, 1, 2], V, [2], device=device,
                            bad_words_ids=[[7]] if i == 9 else None) for i, c in enumerate(cfgs)]
    logits = torch.randn(len(cfgs), V, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
    return logits, states


@pytest.mark.parametrize("device", DEVICES)
def test_pipeline_reads_nothing_back_and_step_reads_once(device):
    V = 1000  # below the CPU candidate-set threshold: one sort pass, no escalation read
    smp = Sampler(V)
    logits, states = mixed_batch(V, device)
    with HostReads() as reads:
        d = smp.sample_on_device(logits, states)
    assert reads.calls == []
    for t in (d.tokens, d.dead, d.raw_chosen, d.chosen_lp, d.top_vals, d.top_ids):
        assert t.device == logits.device
    with HostReads() as reads:
        results = smp.finish(d, states)
    assert reads.calls == ["tolist"]  # the one batched copy
    assert results[-1].token_id == 2 and states[-1].dead_end  # the dead end resolved on the device
    assert results[-1].logprob == -math.inf and [t for t, _ in results[-1].top_logprobs] == [0, 1]
    assert not any(s.dead_end for s in states[:-1])
    assert states[11].output_token_ids[0] in (1, 2, 3, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_pipeline_never_synchronises():
    V = 32000
    logits, states = mixed_batch(V, "cuda")
    smp = Sampler(V)
    smp.sample_on_device(logits, states)  # warm-up: lazy CUDA initialisation may synchronise
    torch.cuda.set_sync_debug_mode("error")
    try:
        d = smp.sample_on_device(logits, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    smp.finish(d, states)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_generator_replays_with_one_draw_per_token():
    """A seeded request on CUDA: skipping k draws (migration replay, prefill hand-off) continues the stream."""
    V = 500
    z = torch.randn(1, V, device="cuda")
    mk = lambda: SamplingState(SamplingParams(seed=42, top_p=0.9), [], V, [], device="cuda")  # noqa: E731
    a = mk()
    toks = [Sampler(V).sample(z, [a])[0].token_id for _ in range(6)]
    b = mk()
    for t in toks[:3]:
        Sampler.skip_draw(b)
        b.append(t)
    assert [Sampler(V).sample(z, [b])[0].token_id for _ in range(3)] == toks[3:]


def test_cpu_stream_is_the_branch_seeds_mt19937_stream():
    """Independent reference: draw k of branch b of seed s is the k-th float64 of torch.Generator().manual_seed(
    branch_seed(s, b)), inverted through the float64 CDF of softmax(z / T) (temperature-only rows) -- the stream a
    seeded request had before the pipeline moved to the device, and that replay reproduces."""
    V, T, seed = 50, 0.8, 1234
    g = torch.Generator().manual_seed(5)
    steps = [torch.randn(1, V, generator=g) * 2 for _ in range(8)]
    ref_gens = [torch.Generator().manual_seed(branch_seed(seed, b)) for b in range(2)]
    base = SamplingState(SamplingParams(seed=seed, temperature=T, n=2), [], V, [])
    states = [base.fork(0), base.fork(1)]
    smp = Sampler(V)
    for z in steps:
        got = [r.token_id for r in smp.sample(torch.cat([z, z]), states)]
        zz = z[0].double().tolist()
        m = max(zz)
        w = [math.exp((x - m) / T) for x in zz]
        want = []
        for rg in ref_gens:
            u = float(torch.rand((), generator=rg, dtype=torch.float64)) * sum(w)
            acc, pick = 0.0, V - 1
            for i, x in enumerate(w):
                acc += x
                if acc > u:
                    pick = i
                    break
            want.append(pick)
        assert got == want


def test_host_generators_with_device_logits_draw_the_same():
    """States made without a device (host generators) still sample logits on any device: the draws are moved over
    in one copy and the stream is the same as for host logits."""
    V = 300
    z = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    mk = lambda: [SamplingState(SamplingParams(seed=i, top_k=20, top_p=0.9), [], V, []) for i in range(4)]  # noqa: E731
    host = [r.token_id for r in Sampler(V).sample(z, mk())]
    moved = [r.token_id for r in Sampler(V).sample(z.to(dev), mk())]
    assert host == moved
