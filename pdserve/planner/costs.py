"""The simulator's cost model, fed with the workers' live measurements where they exist.

Every worker measures itself online (services/load_meter.py) and heartbeats the numbers in its LoadReport
(the registry, signed): prefill workers their prompt throughput (uncached tokens/s), decode workers their decode
step at the current batch and what one more sequence adds, decode workers their KV pull bandwidth and hand-off
overhead. They map onto `LinearCostModel` (step = a + b*prefill_tokens + c*decode_seqs + d*sum_context):
b = 1 / prefill tokens per s, c = per-sequence decode cost, a = decode step - c x the batch it was measured at,
link bandwidth and hand-off from the decode side. A field nobody measured yet (no traffic since start) keeps the
base model's value: `--costs FILE` (a `pdserve sim profile`), else LinearCostModel's defaults. Medians over the
workers of a pool (one slow outlier does not move the plan).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

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
    if step0 is not None:
        fields["a"] = step0
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
