"""Warm-up before a worker says it is ready (spec §1.5: cold start is not steady-state TTFT).

The first forward at a shape pays one-off costs: loading the native kernels' code pages and the oneDNN / GEMM
primitives picked for that shape on CPU; on CUDA, Triton autotuning and compilation per shape, allocator growth
(the CUDA graphs themselves are captured while the engine is built). A worker that registers first hands those
costs to its first users. `warm_up` runs, before registration, one prefill and one decode forward at each batch
size the engine will typically see -- the CUDA graph capture sizes (1, 2, 4, 8, 16, ...) up to max_num_seqs, fewer
when the KV pool is small -- plus one sampler call, on throwaway sequences outside the scheduler: no request,
no usage record, no state counts, no prefix-cache entries or statistics, and every block goes back to the pool.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.cuda_graphs import capture_sizes
from pdserve.engine.sampler import SamplingState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence

PROMPT_TOKENS = 16  # a short prompt: the point is the kernels at these batch shapes, not long-context work


@dataclass
class WarmupReport:
    batch_sizes: list[int] = field(default_factory=list)
    forwards: int = 0
    seconds: float = 0.0


def batch_sizes(engine, largest: int | None = None) -> list[int]:
    """The decode batch sizes to warm: the CUDA graph capture sizes up to max_num_seqs, as many as the pool
    holds (each sequence needs the blocks of PROMPT_TOKENS + 1 tokens)."""
    bm = engine.block_manager
    fits = bm.num_free // bm.blocks_needed(PROMPT_TOKENS + 1)
    top = min(engine.config.max_num_seqs, largest or engine.config.max_num_seqs, fits)
    return [b for b in capture_sizes(top) if b <= top]


def warm_up(engine, largest: int | None = None) -> WarmupReport:
    """`largest` (default: 32 on CUDA, the graph shapes that matter; 8 on CPU, where a shape costs little
    beyond its first touch of the kernels and a worker's start-up should stay short)."""
    if largest is None:
        largest = 32 if engine.runner.device.type == "cuda" else 8
    t0 = time.perf_counter()
    report = WarmupReport(batch_sizes(engine, largest))
    bm, vocab = engine.block_manager, engine.model_config.vocab_size
    for b in report.batch_sizes:
        seqs = []
        try:
            for i in range(b):
                seq = Sequence(-1 - i, f"warmup-{i}", [(7 * i + j) % vocab for j in range(PROMPT_TOKENS)])
                seq.num_prompt_lookups = 1  # not a prompt: leave the prefix-cache hit statistics alone
                bm.allocate(seq, PROMPT_TOKENS + 1)
                seqs.append(seq)
            # prefill at batch b (chunks of the budget), then one decode step at batch b
            batch = [ScheduledSeq(s, PROMPT_TOKENS) for s in seqs]
            step = max(1, engine.config.max_num_batched_tokens // PROMPT_TOKENS)
            for k in range(0, b, step):
                logits, _ = engine.runner.execute(batch[k:k + step])
                report.forwards += 1
            for s in seqs:
                s.num_computed_tokens = PROMPT_TOKENS
                s.token_ids.append(int(logits[-1].argmax()))
            logits, _ = engine.runner.execute([ScheduledSeq(s, 1) for s in seqs])
            report.forwards += 1
        finally:
            for s in seqs:
                bm.free(s)  # never marked computed: nothing entered the prefix cache
    if report.batch_sizes:  # the sampler's native path too (greedy and a seeded draw)
        params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9, seed=0)]
        states = [SamplingState(p, [1], vocab, [], None, 0) for p in params]
        engine.sampler.sample(logits[:1].expand(2, -1).contiguous().cpu(), states)
    engine.runner.model.reset_expert_tokens()  # not requests: leave the expert load statistics alone
    report.seconds = time.perf_counter() - t0
    return report
