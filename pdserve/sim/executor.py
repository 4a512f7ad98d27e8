"""A simulated replica: the engine's REAL `Scheduler` and `BlockManager` (bookkeeping only, `kv=None`) stepped
by a cost model instead of a model forward.

`SimReplica` mirrors `Engine.step` without tensors: `begin_step` calls `Scheduler.schedule()` and asks the cost
model how long the batch takes; `end_step` applies what `Engine.step` applies after its forward, in the same
order - `num_computed_tokens += n`, `BlockManager.mark_computed`, one synthetic token appended to every
sequence whose chunk reached its end, state moves through `Sequence.set_state` (the real transition table),
finishing on `max_tokens` / context length, and the reclaim (`Scheduler.remove`, `BlockManager.free`, or pinning
the prompt blocks on a prefill-only replica). The disaggregation hooks mirror `Engine.add_prefilled_request` /
`commit_prefilled` / `release_pinned`. Requests are single-branch (n = 1) with `ignore_eos`: output length is
the workload's.

Calls made while a step is in flight are deferred to the step boundary, as the real worker's `host.run` runs
them on the engine thread between steps.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.sim.costmodel import StepShape

_seq_ids = itertools.count()


@dataclass
class SimRequest:
    rid: str
    arrival: float
    prompt: list[int]
    output_len: int
    namespace: str = ""
    idx: int = 0
    # filled by the simulation
    emits: list[float] = field(default_factory=list)
    state: str = ""
    mode: str = ""
    prefill_replica: str = ""
    decode_replica: str = ""
    cached_tokens: int = 0
    transfer_s: float = 0.0
    num_preemptions: int = 0
    error: str = ""  # why it did not finish (admission or validation), as the client would be told


@dataclass
class StepEvent:
    req: SimRequest
    kind: str  # token (emitted to the client) | prefilled (first token sampled on a prefill-only replica) | finished


class SimReplica:
    def __init__(self, name: str, role: str, cfg: EngineConfig, num_blocks: int, cost, fingerprint: str = "sim",
                 max_model_len: int | None = None, vocab_size: int = 32000):
        cfg.validate()
        self.name = name
        self.role = role  # both | prefill | decode
        self.cfg = cfg
        self.cost = cost
        self.bm = BlockManager(num_blocks, cfg.block_size, fingerprint, cfg.enable_prefix_caching,
                               cfg.num_cpu_blocks, kv=None)
        self.scheduler = Scheduler(cfg, self.bm)
        self.max_model_len = max_model_len or 1 << 62
        self.vocab_size = vocab_size
        self.reqs: dict[str, tuple[SimRequest, Sequence, bool]] = {}  # rid -> (request, seq, prefill_only)
        self.remote_pending: dict[str, tuple[SimRequest, Sequence]] = {}
        self.pinned: dict[str, list[int]] = {}
        self.busy_until: float | None = None
        self.deferred: list = []
        self.num_steps = 0
        self.busy_s = 0.0
        self.rejected = 0

    # ---- admission (mirrors Engine.validate_request for what the sim can hit) ----------------------------------
    def fits(self, req: SimRequest) -> bool:
        n = len(req.prompt)
        if n >= self.max_model_len:
            return False
        if not self.cfg.enable_chunked_prefill and n > self.cfg.max_num_batched_tokens:
            return False
        return self.bm.blocks_needed(n + 1) <= self.bm.num_blocks

    def _new_seq(self, req: SimRequest) -> Sequence:
        seq = Sequence(next(_seq_ids), req.rid, req.prompt, req.namespace, 0, req.arrival)
        seq.set_state(S.QUEUED)
        return seq

    def add(self, req: SimRequest, prefill_only: bool = False) -> None:
        seq = self._new_seq(req)
        self.reqs[req.rid] = (req, seq, prefill_only)
        self.scheduler.add(seq)

    # ---- the step ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.busy_until is not None

    def begin_step(self, now: float) -> tuple[SchedulerOutput, float] | None:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return None
        dt = self.cost.step_time(StepShape.of_scheduled(out.scheduled))
        self.num_steps += 1
        self.busy_s += dt
        self.busy_until = now + dt
        return out, dt

    def _token(self, seq: Sequence) -> int:
        # synthetic, distinct per sequence and position (prefix caching hashes token ids)
        return (seq.seq_id * 7919 + seq.num_output_tokens * 104729) % (self.vocab_size - 3) + 3

    def end_step(self, out: SchedulerOutput, now: float) -> list[StepEvent]:
        """What Engine.step does after the forward, with a synthetic sampled token."""
        self.busy_until = None
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.bm.mark_computed(item.seq)
        events: list[StepEvent] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.num_computed_tokens != seq.num_tokens:  # chunk did not reach the end: no logits row sampled
                continue
            req, _, prefill_only = self.reqs[seq.request_id]
            if seq.num_output_tokens == 0:
                req.cached_tokens = seq.num_cached_tokens
            seq.token_ids.append(self._token(seq))
            reason = None
            if seq.num_output_tokens >= req.output_len:
                reason = "length"
            elif seq.num_tokens >= self.max_model_len:
                reason = "length"
            elif prefill_only:
                reason = "prefill"
            events.append(StepEvent(req, "prefilled" if prefill_only else "token"))
            if reason is not None:
                seq.finish_reason = reason
                self._finish(req, seq, prefill_only)
                if not prefill_only:
                    events.append(StepEvent(req, "finished"))
            elif seq.state == S.PREFILLING:
                seq.set_state(S.DECODING)
        for seq in out.preempted:
            self.reqs[seq.request_id][0].num_preemptions += 1
        self._run_deferred()
        return events

    def _finish(self, req: SimRequest, seq: Sequence, prefill_only: bool) -> None:
        """Engine._finish_seq + _reclaim for one branch."""
        seq.set_state(S.FINISHED)
        self.scheduler.remove(seq)
        if prefill_only:
            self.pinned[req.rid] = list(seq.block_table)
            seq.block_table = []
        else:
            self.bm.free(seq)
        if seq.host_table:
            self.bm.free_host(seq)
        self.reqs.pop(req.rid, None)
        req.state = S.FINISHED.value

    # ---- deferral to step boundaries --------------------------------------------------------------------------
    def call(self, fn, *args) -> None:
        if self.busy:
            self.deferred.append((fn, args))
        else:
            fn(*args)

    def _run_deferred(self) -> None:
        ops, self.deferred = self.deferred, []
        for fn, args in ops:
            fn(*args)

    # ---- disaggregation hooks ---------------------------------------------------------------------------------
    def release_pinned(self, rid: str) -> None:
        for b in reversed(self.pinned.pop(rid, [])):
            self.bm.release_block(b)

    def add_prefilled(self, req: SimRequest) -> int | None:
        """Engine.add_prefilled_request: blocks for a prompt prefilled elsewhere. Returns the number of prompt
        tokens the local prefix cache already holds (not transferred), or None when blocks are short now."""
        seq = self._new_seq(req)
        hits = self.bm.lookup(seq)
        n = len(req.prompt) - len(hits) * self.bm.block_size
        if not self.bm.can_allocate(seq, n, hits):
            return None
        self.bm.allocate(seq, n, hits)
        seq.set_state(S.RUNNABLE)
        seq.set_state(S.PREFILLING)
        self.remote_pending[req.rid] = (req, seq)
        return len(hits) * self.bm.block_size

    def commit_prefilled(self, req: SimRequest, first_token: int = 3) -> bool:
        """Engine.commit_prefilled: the prompt's KV is here; append the first token and join the decode batch.
        Returns True when the request finished right away (output length 1)."""
        req_, seq = self.remote_pending.pop(req.rid)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.mark_computed(seq)
        seq.token_ids.append(first_token)
        if seq.num_output_tokens >= req.output_len or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            self.reqs[req.rid] = (req, seq, False)
            self._finish(req, seq, False)
            return True
        seq.set_state(S.DECODING)
        self.reqs[req.rid] = (req, seq, False)
        self.scheduler.running.append(seq)
        return False

    # ---- load, as a worker reports it ---------------------------------------------------------------------------
    def load(self):
        """The LoadReport a real worker would heartbeat (services/worker.py), from the simulated state."""
        from pdserve.services.pb import common_pb2
        sch = self.scheduler
        return common_pb2.LoadReport(num_running=len(sch.running),
                                     num_waiting=len(sch.waiting) + len(self.remote_pending),
                                     kv_blocks_in_use=self.bm.blocks_in_use, kv_blocks_total=self.bm.num_blocks,
                                     max_num_seqs=self.cfg.max_num_seqs)
