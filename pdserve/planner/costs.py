"""The simulator's cost model, fed with the workers' live measurements where they exist.

Every worker measures itself online (services/load_meter.py) and heartbeats the numbers in its LoadReport
(the registry, signed): prefill workers their prompt throughput (uncached tokens/s), decode workers their decode
step at the current batch and what one more sequence adds, decode workers their KV pull bandwidth and hand-off
overhead. They map onto `LinearCostModel` (step = a + b*prefill_tokens + c*decode_seqs + d*sum_context):
b = 1 / prefill tokens per s, c = per-sequence decode cost, a = decode step - c x the batch it was measured at,
link bandwidth and hand-off from the decode side. A field nobody measured yet (no traffic since start) keeps the
base model's value: `--costs FILE` (a `pdserve sim profile`), else LinearCostModel's defaults. Medians over the
workers of a pool (one slow outlier does not move the plan).

`CostSmoother` steadies them over time: each field is the median of its last `window` intervals' values (a single
slow step lifts a worker's averages for about one heartbeat: one interval out of five, which the median drops),
and the value the sizing uses moves only when that median is more than `deadband` away from it, so a steady
deployment keeps one cost model - and the sizing its memo.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace
from dataclasses import fields as dc_fields

from pdserve.services.registry import WorkerRecord
from pdserve.sim.costmodel import LinearCostModel


@dataclass(frozen=True)
class LiveCosts:
    model: LinearCostModel
    num_blocks: int             # KV blocks per replica
    max_num_seqs: int
    live: tuple[str, ...]       # which fields came from measurements


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x > 0]
    return statistics.median(xs) if xs else None


def live_costs(workers: list[WorkerRecord], base: LinearCostModel, num_blocks: int = 4096,
               max_num_seqs: int = 256) -> LiveCosts:
    pre = [w.load for w in workers if w.role in ("prefill", "both")]
    dec = [w.load for w in workers if w.role in ("decode", "both")]
    fields, live = {}, []
    rate = _med([ld.prefill_tokens_per_s for ld in pre])
    if rate:
        fields["b"] = 1.0 / rate
        live.append("b")
    per_seq = _med([ld.decode_step_per_seq_s for ld in dec])
    if per_seq is not None:
        fields["c"] = per_seq
        live.append("c")
    step0 = _med([ld.decode_step_s - (per_seq or 0.0) * ld.num_running for ld in dec if ld.decode_step_s > 0])
    if step0 is not None:  # a per-sequence slope fitted over a narrow batch range can exceed the step: keep a > 0
        fields["a"] = max(step0, 0.1 * min(ld.decode_step_s for ld in dec if ld.decode_step_s > 0))
        live.append("a")
    bw = _med([ld.kv_bytes_per_s for ld in dec])
    if bw:
        fields["link_bytes_per_s"] = bw
        live.append("link_bytes_per_s")
    ho = _med([ld.handoff_overhead_s for ld in dec])
    if ho is not None:
        fields["handoff_s"] = ho
        live.append("handoff_s")
    blocks = _med([float(w.load.kv_blocks_total or w.capacity_blocks) for w in workers])
    seqs = _med([float(w.load.max_num_seqs) for w in workers])
    return LiveCosts(replace(base, **fields), int(blocks) if blocks else num_blocks,
                     int(seqs) if seqs else max_num_seqs, tuple(live))


class CostSmoother:
    """Window median + dead band over the live cost fields (see the module's docstring)."""

    def __init__(self, window: int = 5, deadband: float = 0.1):
        self.window, self.deadband = window, deadband
        self.hist: dict[str, deque[float]] = {}
        self.used: dict[str, float] = {}

    def smooth(self, lc: LiveCosts) -> LiveCosts:
        out = {}
        for f in dc_fields(lc.model):
            v = getattr(lc.model, f.name)
            if f.name not in lc.live or not isinstance(v, float):
                continue
            h = self.hist.setdefault(f.name, deque(maxlen=self.window))
            h.append(v)
            m = statistics.median(h)
            old = self.used.get(f.name)
            if old is None or abs(m - old) > self.deadband * abs(old):
                self.used[f.name] = old = m
            out[f.name] = old
        return replace(lc, model=replace(lc.model, **out))
