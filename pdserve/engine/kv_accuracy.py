"""How far a quantized KV pool moves the model's output from an unquantized one (bench/kv_quant.py, the tests).

Greedy agreement: the share of positions where both engines pick the same token over N prompts x M tokens
(positions after a first divergence count as they fall, so one early flip costs the rest of that row).
Log-likelihood: the reference engine's greedy continuation scored teacher-forced by both engines, prefilled in
chunks of `chunk` tokens so every query after the first chunk reads its keys back from the pool (a prompt
computed in one step attends to its fresh K/V and would hide the quantization).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVAccuracy:
    agreement: float  # share of identical greedy tokens
    mean_ll_diff: float  # mean |logprob_quantized - logprob_reference| per scored token (nats)
    mean_ll_ref: float  # mean log-likelihood per token under the reference KV (nats)
    mean_ll_quant: float
    tokens: int  # greedy tokens compared


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def engine_for(model, kv_cache_dtype: str, chunk: int, **kw):
    from pdserve.engine.engine import Engine
    return Engine.from_pretrained(model, EngineConfig(
        kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=chunk, enable_prefix_caching=False, **kw))


def greedy(engine, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in engine.generate(batch, p)]


def scored(engine, seqs: list[list[int]], skip: int) -> list[float]:
    """Log-probability of each token of `seqs` after the first `skip` (teacher-forced, prompt_logprobs)."""
    p = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = []
    for o, s in zip(engine.generate(seqs, p), seqs):
        for tok, r in zip(s[skip:], o.prompt_logprobs[skip:]):  # SampleResult of each prompt token
            assert r.token_id == tok, (r.token_id, tok)
            out.append(r.logprob)
    return out


def measure(ref, quant, batch: list[list[int]], max_tokens: int) -> KVAccuracy:
    """`ref` and `quant`: engines on the same weights, the second with the quantized pool."""
    a, b = greedy(ref, batch, max_tokens), greedy(quant, batch, max_tokens)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    seqs = [p + r for p, r in zip(batch, a)]
    skip = len(batch[0])
    lr, lq = scored(ref, seqs, skip), scored(quant, seqs, skip)
    diff = sum(abs(x - y) for x, y in zip(lr, lq)) / len(lr)
    return KVAccuracy(same / total, diff, sum(lr) / len(lr), sum(lq) / len(lq), total)


def finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))
