"""Cost model: predicted TTFT and completion time of a request on a candidate placement (docs/routing.md).

    local (prefill on the worker that decodes, a `both` or `decode` worker w):
        ttft  = queue(w) + overhead(w) + uncached(w) / rate(w) + recall(w)
        cost  = ttft + out * step(w) * kv_pressure(w) + interference(w)
    disaggregated (prefill worker p, decode worker d):
        ttft  = queue(p) + overhead(p) + uncached(p) / rate(p) + recall(p) + bytes(p->d) / bandwidth(d) + handoff(d)
        cost  = ttft + out * step(d) * kv_pressure(d)

- recall(w): the part of w's prefix hit held in its host / disk KV tier (engine/kv_offload.py) is copied back,
  not recomputed: recall = min(host_blocks * block_bytes / host_bw + disk_blocks * block_bytes / disk_bw,
  offloaded_tokens / rate(w)). So a host-tier hit is priced between a device hit (0) and a miss (the compute),
  never above a miss. uncached(w) counts neither device nor offloaded hits; the compute-based terms
  (interference, work) see only uncached tokens (a recall is a copy, not compute the batch waits for).

- queue(w): prompt tokens already admitted but not computed (from the load report, plus what this router
  placed there since that report) / rate(w).
- rate, overhead: the worker's measured prefill line (LoadMeter); step: measured decode step time at the current
  batch plus the measured per-sequence increment for the one we add; bandwidth/handoff: measured on the decode
  worker's KV pulls. Priors apply only until a worker has measured something.
- kv_pressure: a decode slows down (preemption, waiting for blocks) as its worker's KV fills; above `kv_knee`
  the factor grows linearly, and a request whose blocks do not fit now waits about one decode of a request.
- interference(w) = weight * (uncached / rate(w)) * (sequences decoding on w): a local prefill's compute is
  added to the steps every sequence decoding there waits for (spec §6.3: why disaggregation exists).
- work = work_weight * uncached / rate: the compute itself is capacity that later arrivals queue behind (and
  the blocks it writes evict cached ones). Without it the policy is myopic: it spreads a chat over workers to
  save a few ms now and loses the cache hits later (measured in the simulator: docs/routing.md).
The router minimises cost = e2e + interference + work - this request's completion time plus the delay it
imposes on others - so a long prompt on a busy decode worker is disaggregated, a short one is not.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import median

from pdserve.services.registry import WorkerRecord


@dataclass
class Priors:
    """Used for a field a worker has not measured yet (0 in its report). Deliberately conservative."""
    prefill_tokens_per_s: float = 2000.0
    prefill_overhead_s: float = 0.01
    decode_step_s: float = 0.02
    decode_step_per_seq_s: float = 0.0005
    kv_bytes_per_s: float = 1e9
    handoff_overhead_s: float = 0.005
    host_recall_bytes_per_s: float = 5e9   # host tier -> device pool (a memcpy / pinned H2D copy)
    disk_recall_bytes_per_s: float = 5e8   # disk tier -> device pool (a file read + copy)
    block_bytes: int = 0  # 0: from the worker's layout


def peer_priors(pri: Priors, rec: WorkerRecord, records: list[WorkerRecord]) -> Priors:
    """The priors for `rec`, filled from its measured peers (same role, model layout and TP degree) where they have
    measured a rate `rec` has not: a replica the planner or an operator just added is assumed to perform like its
    pool, not like the conservative static prior. Under that prior a new decode worker at light load would look
    several times slower than its measured peers, never be chosen, and so never measure itself. The decode step
    prior is the fastest peer step (a peer's step is measured at its batch, so this is at most its base step)."""
    peers = [r.load for r in records if r.worker_id != rec.worker_id and r.role == rec.role
             and r.layout.fingerprint == rec.layout.fingerprint
             and r.load.tensor_parallel_size == rec.load.tensor_parallel_size]
    if not peers:
        return pri
    got: dict[str, float] = {}
    steps = [p.decode_step_s for p in peers if p.decode_step_s > 0]
    if steps:
        got["decode_step_s"] = min(steps)
    for name in ("decode_step_per_seq_s", "prefill_tokens_per_s", "kv_bytes_per_s", "handoff_overhead_s"):
        vals = [getattr(p, name) for p in peers if getattr(p, name) > 0]
        if vals:
            got[name] = median(vals)
    overheads = [p.prefill_overhead_s for p in peers if p.prefill_tokens_per_s > 0]
    if overheads:
        got["prefill_overhead_s"] = median(overheads)
    return replace(pri, **got) if got else pri


@dataclass
class CostParams:
    priors: Priors = field(default_factory=Priors)
    default_out_tokens: int = 64    # when the request does not say max_tokens
    max_out_tokens: int = 1024      # cap on the prediction (a huge max_tokens is rarely generated in full)
    interference_weight: float = 1.0
    work_weight: float = 1.0        # price of the prefill compute itself (capacity later arrivals queue behind)
    kv_knee: float = 0.8
    disagg_margin_s: float = 0.0    # extra gain required before disaggregating (on top of transfer + handoff)
    # a local prefill may stall the streams decoding on its worker for at most this many of their steps (with what
    # is already queued there) while a disaggregated placement exists; 0: no limit (docs/routing.md, "Stall cap")
    local_stall_steps: float = 4.0
    local_stall_yield: float = 1.0  # ... unless the pair's KV pull alone takes longer than this x the summed stall
    tie_rel: float = 0.01           # candidates within 1% ...
    tie_abs_s: float = 0.001        # ... + 1 ms of the best are "near-equal": picked at random


@dataclass
class Inflight:
    """What this router placed on a worker since its last load report (reports lag a burst)."""
    prefill_tokens: int = 0
    seqs: int = 0
    blocks: int = 0


@dataclass
class WorkerCost:
    """One worker's rates with priors filled in (also what admission reads: view.py)."""
    rec: WorkerRecord
    rate: float
    overhead: float
    step: float
    step_per_seq: float
    bw: float
    handoff: float
    pending_tokens: int
    running: int
    kv_total: int
    kv_used: int
    block_size: int
    block_bytes: int

    @classmethod
    def of(cls, rec: WorkerRecord, pri: Priors, extra: Inflight | None = None,
           now: float | None = None) -> "WorkerCost":
        ld = rec.load
        ex = extra or Inflight()
        lay = rec.layout

        def m(v: float, prior: float) -> float:
            return v if v > 0 else prior

        total = ld.kv_blocks_total or rec.capacity_blocks or 1
        running = ld.num_running + ld.num_waiting
        per_seq = m(ld.decode_step_per_seq_s, pri.decode_step_per_seq_s)
        # the measured step is at the reported batch; unmeasured: the prior grown by the batch. Sequences this
        # router added since the report grow it further.
        step = ld.decode_step_s or (pri.decode_step_s + per_seq * running)
        step += per_seq * ex.seqs
        rate = m(ld.prefill_tokens_per_s, pri.prefill_tokens_per_s)
        # The report is up to a heartbeat old: the worker kept computing since, at its measured rate. Without
        # this, a worker that just reported a burst looks busy long after it drained it.
        pending = ld.pending_prefill_tokens + ex.prefill_tokens
        seen = ld.report_time or rec.updated or 0.0
        if now is not None and seen > 0:
            pending = max(0, pending - int(rate * min(10.0, max(0.0, now - seen))))
        return cls(rec=rec, rate=rate,
                   overhead=ld.prefill_overhead_s if ld.prefill_tokens_per_s > 0 else pri.prefill_overhead_s,
                   step=step, step_per_seq=per_seq,
                   bw=m(ld.kv_bytes_per_s, pri.kv_bytes_per_s), handoff=m(ld.handoff_overhead_s, pri.handoff_overhead_s),
                   pending_tokens=pending,
                   running=running + ex.seqs,
                   kv_total=max(total, 1), kv_used=ld.kv_blocks_in_use + ex.blocks,
                   block_size=lay.block_size or 16,
                   block_bytes=pri.block_bytes or replica_block_bytes(lay))

    @property
    def queue_s(self) -> float:
        return self.pending_tokens / self.rate

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_used / self.kv_total)

    @property
    def kv_free_blocks(self) -> int:
        return max(0, self.kv_total - self.kv_used)

    def prefill_s(self, uncached: int) -> float:
        return self.overhead + max(0, uncached) / self.rate

    def decode_s(self, out_tokens: int, need_blocks: int, knee: float) -> float:
        step = self.step + self.step_per_seq  # the batch grows by this request
        u = self.kv_usage
        factor = 1.0 + (max(0.0, u - knee) / max(1e-6, 1.0 - knee))
        wait = 0.0
        if need_blocks > self.kv_free_blocks:  # must wait for blocks (or preempt someone)
            wait = out_tokens * step
        return out_tokens * step * factor + wait


@dataclass
class Estimate:
    kind: str               # local | disagg
    prefill: WorkerCost     # the worker that prefills
    decode: WorkerCost      # the worker that decodes (same as prefill when local)
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    interference_s: float
    transfer_s: float = 0.0
    extra_s: float = 0.0  # failure-domain, price and fairness terms (spread.py), 0 until the policy adds them
    interference_compute_s: float = 0.0  # local: the prefill compute the worker's running streams wait for

    @property
    def cost(self) -> float:
        return self.e2e_s + self.interference_s + self.extra_s


class CostModel:
    def __init__(self, params: CostParams | None = None):
        self.p = params or CostParams()

    def out_tokens(self, max_tokens: int) -> int:
        return min(max_tokens, self.p.max_out_tokens) if max_tokens > 0 else self.p.default_out_tokens

    def recall_s(self, w: WorkerCost, host_blocks: int, disk_blocks: int) -> float:
        """Copying a prefix hit back from w's host / disk KV tier: between a device hit (0) and a miss."""
        if host_blocks + disk_blocks <= 0:
            return 0.0
        pri = self.p.priors
        copy = w.block_bytes * (host_blocks / pri.host_recall_bytes_per_s
                                + disk_blocks / pri.disk_recall_bytes_per_s)
        return min(copy, (host_blocks + disk_blocks) * w.block_size / w.rate)

    def stalls_streams(self, e: Estimate) -> bool:
        """Whether a local estimate would hold the streams decoding on its worker past the stall cap: its prefill
        compute plus the prefill already queued there, against `local_stall_steps` of their decode step. The
        latency sum below prices that stall as running x compute seconds, which a long queue at the prefill pool
        outweighs; but each stall lands whole on every stream's next token, and a few of them break a TPOT SLO
        (measured: docs/bench.md, auto at P = 512, 6/s)."""
        w, cap = e.decode, self.p.local_stall_steps
        if cap <= 0 or w.running <= 0:
            return False
        return w.queue_s + e.interference_compute_s > cap * w.step

    def local(self, w: WorkerCost, n_prompt: int, cached: int, out: int, recall_s: float = 0.0) -> Estimate:
        """`cached`: prompt tokens of w's prefix hit in any tier; `recall_s`: the offloaded part's recall."""
        uncached = n_prompt - cached
        pre = w.prefill_s(uncached) + recall_s
        ttft = w.queue_s + pre
        need = -(-(n_prompt + out) // w.block_size)
        e2e = ttft + w.decode_s(out, need, self.p.kv_knee)
        # running sequences share the steps the prefill's tokens are added to: they lose its compute time (the
        # per-request overhead is latency, not compute they wait for)
        compute = max(0, uncached) / w.rate
        interf = (self.p.interference_weight * w.running + self.p.work_weight) * compute
        return Estimate("local", w, w, cached, ttft, e2e, interf, interference_compute_s=compute)

    def disagg(self, p: WorkerCost, d: WorkerCost, n_prompt: int, cached_p: int, cached_d: int,
               out: int, recall_p_s: float = 0.0) -> Estimate:
        """`cached_d`: the decode worker's device-tier hit only (its side of a handoff does not recall)."""
        # the decode worker pulls only the blocks its own prefix cache lacks (decode/service.py)
        blocks = max(0, -(-n_prompt // p.block_size) - cached_d // p.block_size)
        xfer = blocks * (p.block_bytes or d.block_bytes) / d.bw
        ttft = p.queue_s + p.prefill_s(n_prompt - cached_p) + recall_p_s + xfer + d.handoff
        need = -(-(n_prompt + out) // d.block_size)
        e2e = ttft + d.decode_s(out, need, self.p.kv_knee)
        work = self.p.work_weight * (n_prompt - cached_p) / p.rate
        return Estimate("disagg", p, d, cached_p, ttft, e2e, work, xfer)


def replica_block_bytes(lay) -> int:
    """Bytes of one block id over the whole replica: a TP worker's layout is its rank 0's pool, holding
    num_kv_heads of the model's total_kv_heads (docs/kv_transfer.md); the measured kv_bytes_per_s counts the
    bytes of every rank's READs too."""
    if lay.total_kv_heads and lay.num_kv_heads and lay.total_kv_heads != lay.num_kv_heads:
        return lay.block_bytes * lay.total_kv_heads // lay.num_kv_heads
    return lay.block_bytes
