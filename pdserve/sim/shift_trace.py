"""The phase-shift workload of the role-switch measurement: short chat prompts, then long prompts, then chat again.

One definition, seeded, so every run (static splits, colocated, switching; the simulator and `pdserve up`) replays
the same requests: Poisson arrivals within each phase, lengths uniform within each phase's ranges, prompts of
their own first block of random token ids (a block's hash chains its parent's, so no two requests share a cached
block and the prefix cache cannot blur the phases; the rest is a run of ids, cheap at thousands of requests).
Rates are per worker and scale with the cluster (`workers`), so 4 and 64 workers see the same per-worker load.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.sim.workload import RequestSpec


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate_per_worker: float          # req/s per worker
    prompt: tuple[int, int]         # uniform, inclusive
    output: tuple[int, int]


# Sized for a worker of the built-in model on one CPU thread (a `pdserve sim profile` of it: a 768-token prompt's
# prefill ~0.25 s, a decode step of 32 sequences ~11 ms): a chat request is mostly decode work, a long prompt
# mostly prefill work, so the best split swings from decode-heavy to prefill-heavy and back.
CHAT = Phase("chat", 30.0, 12.0, (32, 128), (64, 192))
LONG = Phase("long", 30.0, 2.0, (512, 1024), (8, 24))
SIM_PHASES = (CHAT, LONG, CHAT)

# `--trace heavy`: the same kinds of request, heavier and longer, sized for the profile of the built-in model
# measured on the Intel model 207 (docs/planner.md, "Switching at 64 workers": a 768-token prefill ~0.13 s). Each
# phase alone keeps about 65-70% of the workers busy, but the long phase's prefill work (~0.68 of all workers) and
# the chat phase's decode work (~0.52) add up to more than all of them: no static split serves both phases, where
# on `shift` (SIM_PHASES) a split of 64 workers serves every request and the ratio to it is capped at ~1.0.
HEAVY_CHAT = Phase("chat", 60.0, 30.0, (32, 128), (64, 192))
HEAVY_LONG = Phase("long", 60.0, 5.0, (512, 1024), (8, 24))
HEAVY_PHASES = (HEAVY_CHAT, HEAVY_LONG, HEAVY_CHAT)
TRACES = {"shift": SIM_PHASES, "heavy": HEAVY_PHASES}


def shift_trace(workers: int, phases=SIM_PHASES, seed: int = 0, vocab: int = 32000,
                time_scale: float = 1.0) -> list[RequestSpec]:
    """The requests of the trace for a cluster of `workers` (token-id prompts), arrivals in seconds from 0.
    `time_scale` shortens every phase (same rates), for a short run."""
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for ph in phases:
        rate, end = ph.rate_per_worker * workers, t0 + ph.duration_s * time_scale
        t = t0 + rng.expovariate(rate)
        while t < end:
            n, m = rng.randint(*ph.prompt), rng.randint(*ph.output)
            head = [rng.randrange(3, vocab) for _ in range(min(n, 16))]
            prompt = head + list(range(3, 3 + n - len(head)))
            out.append(RequestSpec(len(out), t, prompt, n, m))
            t += rng.expovariate(rate)
        t0 = end
    return out


def phase_bounds(phases=SIM_PHASES, time_scale: float = 1.0) -> list[tuple[str, float, float]]:
    out, t0 = [], 0.0
    for ph in phases:
        out.append((ph.name, t0, t0 + ph.duration_s * time_scale))
        t0 += ph.duration_s * time_scale
    return out
