"""Whether a pool can give one worker to the other pool now, by what its workers measure (the switch's source test).

A role switch moves a worker from pool B to a pool A that must grow (switching.py). Shrinking B by a drain rests
on the simulator's capacities, and guard rule 5 holds it while those are stale or not yet checked against the
counts in place (guard_rails.py). A switch is different: no capacity leaves the deployment, it is undone by the
reverse switch in a second, and the alternative - starting a worker while B idles - costs a start. So the source
side of a switch rests on what B's workers measure at the current load, not on fresh capacities:

- the demand: the window's largest rate (the rate a shrink must hold for: predictor.py) x this interval's lengths
  (the lengths move first in a load shift; the window's means lag it);
- one replica's capacity at that load, measured: a prefill replica's prompt throughput (uncached tokens/s, its
  LoadReport) at `PREFILL_UTIL`; a decode replica's sequences within the TPOT SLO on its measured step line
  (step = a + c x batch: a = the step at an empty batch, c = what one more sequence adds), within its sequence
  slots; and the KV blocks the pool's sequences hold now;
- B gives a worker when the replicas this needs (x headroom) are at most B's count - 1, B's own SLO component is
  met as measured this interval, B stays >= its minimum (>= 1 while serving traffic), no replica of B is starting,
  B did not change within the cooldown (a switch back waits as a shrink does), and the model's own count for B -
  the shrink count, on the last capacities even while newer ones are computed or unchecked - is at most B's count
  - 1 too, unless those capacities were computed for lengths `SHIFT` x off this interval's (a load shift the
  model has not caught up with: then only the measurement describes the load) or none were computed yet. The model's condition keeps its
  hysteresis (grow and shrink counts 25% apart: loop.py) between a switch and the grow that would undo it at a
  steady load: the measured figures lack what the correction factors add (front end, host noise, batching
  dynamics), and a pool the corrected model grew must not be taken back on them alone. Nothing measured yet (no
  traffic since start): no switch on priors.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from pdserve.services.registry import WorkerRecord

# A prefill replica counts as full at this share of its measured throughput: prompts arrive at random, and at a
# utilisation u one waits about u / (2 (1 - u)) prefills for the one ahead (M/D/1), half a prefill at 0.5, so the
# TTFT stays within ~1.5 unloaded prefills. The headroom (1.2) comes on top.
PREFILL_UTIL = 0.5
# One interval's mean prompt (or output) this many times off the lengths the capacities were computed for is a load
# shift, not noise: the lengths of a few requests drawn around a mean (the simulator's +-50%) rarely move their mean
# by a third, and the capacities follow the window's means at ~5% resolution (sizing.py).
SHIFT = 2.0


@dataclass(frozen=True)
class PoolLoad:
    """What a pool's serving workers measured (their LoadReports, medians of per-worker figures, sums of counts)."""
    serving: int
    running: int = 0                    # sequences running now, all workers
    kv_in_use: int = 0                  # KV blocks in use now, all workers
    kv_per_replica: int = 0             # KV blocks one replica holds (median)
    max_num_seqs: int = 0               # sequence slots of one replica (median)
    prefill_tokens_per_s: float = 0.0   # one replica's measured prompt throughput (median; 0: not measured)
    decode_step0_s: float = 0.0         # one replica's decode step at an empty batch (median; 0: not measured)
    decode_step_per_seq_s: float = 0.0  # what one more sequence adds to a step (median)


def _med(xs) -> float:
    xs = [x for x in xs if x > 0]
    return statistics.median(xs) if xs else 0.0


def _step0(ld) -> float:
    """A worker's decode step at an empty batch: the intercept of its step line; where the line came out flat (no
    positive slope in its samples: then it reports no intercept, services/load_meter.py) its step at the current
    batch, which is at least that."""
    return ld.decode_step0_s if ld.decode_step0_s > 0 else ld.decode_step_s


def pool_loads(workers: list[WorkerRecord]) -> dict[str, PoolLoad]:
    out = {}
    for pool in ("prefill", "decode"):
        ld = [w.load for w in workers if w.role == pool]
        out[pool] = PoolLoad(len(ld), sum(x.num_running for x in ld), sum(x.kv_blocks_in_use for x in ld),
                             int(_med([x.kv_blocks_total for x in ld])), int(_med([x.max_num_seqs for x in ld])),
                             _med([x.prefill_tokens_per_s for x in ld]), _med([_step0(x) for x in ld]),
                             _med([x.decode_step_per_seq_s for x in ld]))
    return out


@dataclass(frozen=True)
class Demand:
    """This interval's load on the pools: the rate a shrink must hold for, this interval's lengths and latency."""
    rate: float
    prompt: float               # tokens, uncached (prefix hits taken off)
    output: float
    tpot_p90: float | None      # observed


def needed(pool: str, load: PoolLoad, d: Demand, slo_tpot: float, headroom: float) -> tuple[int | None, str]:
    """(replicas the measured load needs, the figures) - None: not measured, or one replica cannot serve it."""
    if pool == "prefill":
        if load.prefill_tokens_per_s <= 0:
            return None, "prefill throughput not measured yet"
        demand = d.rate * d.prompt
        n = math.ceil(demand * headroom / (load.prefill_tokens_per_s * PREFILL_UTIL) - 1e-9)
        return max(1, n), (f"{d.rate:.2f} req/s x {d.prompt:.0f} prompt tok = {demand:.0f} tok/s, one replica "
                           f"{load.prefill_tokens_per_s:.0f} tok/s measured at {PREFILL_UTIL:.0%}")
    if load.decode_step0_s <= 0:
        return None, "decode step not measured yet"
    per_seq = load.decode_step_per_seq_s
    fit = math.inf if per_seq <= 0 else math.floor((slo_tpot - load.decode_step0_s) / per_seq)
    seats = min(fit, load.max_num_seqs or math.inf)
    if seats < 1:
        return None, f"one replica's measured step {load.decode_step0_s * 1000:.0f} ms misses the TPOT SLO"
    # Little's law with the p90 TPOT (>= the mean: it overstates the sequences held), or the sequences running now
    # where more (a stream longer than the interval finishes in none)
    little = d.rate * d.output * (d.tpot_p90 or 0.0)
    seqs = max(little, float(load.running))
    n_seq = math.ceil(seqs * headroom / seats - 1e-9)
    n_kv = math.ceil(load.kv_in_use * headroom / load.kv_per_replica - 1e-9) if load.kv_per_replica else 0
    return max(1, n_seq, n_kv), (f"{seqs:.1f} sequences held ({d.rate:.2f} req/s x {d.output:.0f} tok x TPOT p90 "
                                 f"{(d.tpot_p90 or 0) * 1000:.0f} ms, {load.running} running), one replica "
                                 f"{seats if seats != math.inf else 'any number'} within the TPOT SLO; KV "
                                 f"{load.kv_in_use} blocks in use")


def shifted(computed_for: tuple[float, float] | None, d: Demand) -> bool:
    """The capacities were computed for lengths more than `SHIFT` x off this interval's: a load shift the model has
    not caught up with (its sweep for the new lengths outlasts intervals on a small CPU)."""
    if computed_for is None:
        return False
    return any(max(a, b) > SHIFT * min(a, b) for a, b in zip(computed_for, (d.prompt, d.output)))


@dataclass(frozen=True)
class Source:
    """The pool's state the rule reads besides its load (the guard's and the connector's)."""
    current: int
    minimum: int
    starting: int
    since_change_s: float
    cooldown_s: float
    violated: bool              # its SLO component broken as measured this interval
    traffic: bool
    model: int | None = 0       # its count for the window's largest rate on the last capacities (stale or not);
                                # None: those were computed for other lengths (shifted(): the model lags the shift)
    model_note: str = ""


def can_give(pool: str, src: Source, load: PoolLoad | None, d: Demand, slo_tpot: float,
             headroom: float) -> tuple[bool, str]:
    """(pool can give one worker now, why) - the module's rule."""
    floor = max(src.minimum, 1) if src.traffic else src.minimum
    if src.current - 1 < floor:
        return False, f"{pool} at its minimum {floor}"
    if src.starting:
        return False, f"{src.starting} {pool} replica(s) still starting"
    if src.since_change_s < src.cooldown_s:
        return False, f"{pool} changed {src.since_change_s:.0f} s ago (cooldown {src.cooldown_s:.0f} s)"
    if src.violated:
        return False, f"{pool}'s own SLO component is violated"
    if src.model is not None and src.model > src.current - 1:
        return False, f"the model needs {src.model} {pool}{src.model_note}"
    if load is None or load.serving < src.current:
        return False, f"{pool} not all serving"
    n, figures = needed(pool, load, d, slo_tpot, headroom)
    if n is None:
        return False, figures
    if n > src.current - 1:
        return False, f"{pool} measured load needs {n} of {src.current} ({figures})"
    note = src.model_note if src.model is None else f"; the model needs {src.model}{src.model_note}"
    return True, f"measured load needs {n} of {src.current} {pool} ({figures}){note}"
