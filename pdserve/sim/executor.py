"""A simulated replica: the engine's own step bookkeeping (`EngineCore` over the real `Scheduler` and
`BlockManager`, `kv=None`) stepped by a cost model instead of a model forward.

`begin_step` calls `Scheduler.schedule()` and asks the cost model how long the batch takes; `end_step` does what
`Engine.step` does after its forward, through the same `EngineCore` calls: `computed` (advance, register
blocks), then `commit` of one token (from `token_source`, synthetic by default) for every sequence whose chunk
reached its end, which finishes it on its output length / the context limit and pins a prefill-only
request's prompt blocks. The disaggregation hooks are `EngineCore.allocate_prefilled` / `commit_prefilled` /
`release_pinned`, as in `Engine`. Requests are single-branch (n = 1) with `ignore_eos`: output length is the
workload's (`FixedLength` stands in for the engine's `OutputProcessor`).

Calls made while a step is in flight are deferred to the step boundary, as the real worker's `host.run` runs
them on the engine thread between steps.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
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
    best_cached_tokens: int = 0  # the longest prefix any replica held when it was placed (if tracked)
    transfer_s: float = 0.0
    prefilled_at: float | None = None  # disagg: when its prefill ended (the decode side then allocates, pulls, commits)
    num_preemptions: int = 0
    error: str = ""  # why it did not finish (admission or validation), as the client would be told


class FixedLength:
    """The sequence's stop rule in the simulator (the engine's `OutputProcessor` with `ignore_eos`, no stop
    strings): "length" once the workload's output length is reached; no text."""

    def __init__(self, output_len: int):
        self.output_len = output_len
        self.num_generated = 0

    def step(self, token_id: int, sampling) -> tuple[str, str | None]:
        self.num_generated += 1
        return "", ("length" if self.num_generated >= self.output_len else None)

    def finish(self, reason: str) -> str:
        return ""


@dataclass
class StepEvent:
    req: SimRequest
    kind: str  # token (emitted to the client) | prefilled (first token sampled on a prefill-only replica) | finished


class SimReplica:
    def __init__(self, name: str, role: str, cfg: EngineConfig, num_blocks: int, cost, fingerprint: str = "sim",
                 max_model_len: int | None = None, vocab_size: int = 32000, token_source=None):
        cfg.validate()
        self.name = name
        self.role = role  # both | prefill | decode
        self.cfg = cfg
        self.cost = cost
        self.bm = BlockManager(num_blocks, cfg.block_size, fingerprint, cfg.enable_prefix_caching,
                               cfg.num_cpu_blocks, kv=None)
        self.scheduler = Scheduler(cfg, self.bm)
        self.max_model_len = max_model_len or 1 << 62
        self.core = EngineCore(self.scheduler, self.bm, self.max_model_len)
        self.vocab_size = vocab_size
        # the "sampled" token of a sequence: seq -> token id (default: synthetic, distinct per sequence/position)
        self.token_source = token_source or self._token
        self.reqs: dict[str, tuple[SimRequest, Sequence, bool]] = {}  # rid -> (request, seq, prefill_only)
        self.remote_pending: dict[str, tuple[SimRequest, Sequence]] = {}
        self.busy_until: float | None = None
        self.idle_since = float("-inf")  # when the last step ended: a step after a long idle gap costs more
        self.deferred: list = []
        self.num_steps = 0
        self.busy_s = 0.0
        self.placed = 0  # requests the router placed here (as prefill side, or colocated)

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
        seq.output = FixedLength(req.output_len)
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
        dt = self.cost.step_time(StepShape.of_scheduled(out.scheduled)) + self.cost.wake_time(now - self.idle_since)
        self.num_steps += 1
        self.busy_s += dt
        self.busy_until = now + dt
        return out, dt

    def _token(self, seq: Sequence) -> int:
        # synthetic, distinct per sequence and position (prefix caching hashes token ids)
        return (seq.seq_id * 7919 + seq.num_output_tokens * 104729) % (self.vocab_size - 3) + 3

    def end_step(self, out: SchedulerOutput, now: float) -> list[StepEvent]:
        """What Engine.step does after the forward, with `token_source`'s token for the sampled one."""
        self.busy_until = None
        self.idle_since = now
        self.core.computed(out)
        events: list[StepEvent] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.num_computed_tokens != seq.num_tokens:  # chunk did not reach the end: no logits row sampled
                continue
            req, _, prefill_only = self.reqs[seq.request_id]
            if seq.num_output_tokens == 0:
                req.cached_tokens = seq.num_cached_tokens
            reason = self.core.commit(seq, self.token_source(seq), prefill_only)
            events.append(StepEvent(req, "prefilled" if prefill_only else "token"))
            if reason is not None:
                self._finished(req)
                if not prefill_only:
                    events.append(StepEvent(req, "finished"))
        for seq in out.preempted:
            self.reqs[seq.request_id][0].num_preemptions += 1
        self._run_deferred()
        return events

    def _finished(self, req: SimRequest) -> None:
        """The request's one sequence finished (EngineCore has freed or pinned its blocks)."""
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
        self.core.release_pinned(rid)

    def add_prefilled(self, req: SimRequest) -> int | None:
        """Engine.add_prefilled_request: blocks for a prompt prefilled elsewhere. Returns the number of prompt
        tokens the local prefix cache already holds (not transferred), or None when blocks are short now."""
        seq = self._new_seq(req)
        hits = self.core.allocate_prefilled(seq)
        if hits is None:
            return None
        self.remote_pending[req.rid] = (req, seq)
        return hits * self.bm.block_size

    # ---- a role switch's handoff (sim/role_switch.py) ---------------------------------------------------------
    def hand_off(self) -> list[tuple[SimRequest, list[int]]]:
        """The streams a switching worker hands to the gateway's migration now: every decoding request whose first
        token reached the client (the real worker ends a stream after a message it sent), aborted here, its blocks
        freed. Returns (request, the output tokens the client has) for each."""
        out = []
        for rid, (req, seq, prefill_only) in list(self.reqs.items()):
            if prefill_only or not req.emits or seq.finished:
                continue
            self.core.finish(seq, S.CANCELLED)
            del self.reqs[rid]
            out.append((req, list(seq.token_ids[len(req.prompt):])))  # a resumed one's prompt holds earlier output
        return out

    def add_resumed(self, req: SimRequest, sent: list[int], now: float) -> None:
        """The gateway's resumed request (engine/resume.py): prompt + the tokens the client has, prefilled here
        (no KV comes with it), then the rest of the output."""
        seq = Sequence(next(_seq_ids), req.rid, req.prompt + sent, req.namespace, 0, now)
        seq.output = FixedLength(req.output_len - len(sent))
        seq.set_state(S.QUEUED)
        self.reqs[req.rid] = (req, seq, False)
        self.scheduler.add(seq)

    def commit_prefilled(self, req: SimRequest, first_token: int = 3) -> bool:
        """Engine.commit_prefilled: the prompt's KV is here; commit the first token and join the decode batch.
        Returns True when the request finished right away (output length 1)."""
        _, seq = self.remote_pending.pop(req.rid)
        self.reqs[req.rid] = (req, seq, False)
        if self.core.commit_prefilled([seq], [first_token])[0] is not None:
            self._finished(req)
            return True
        return False

    # ---- what a router could know -------------------------------------------------------------------------------
    def cached_prefix(self, prompt: list[int], namespace: str = "") -> int:
        """Prompt tokens this replica's prefix cache holds now (the scheduler's own lookup; a pure read)."""
        return len(self.bm.lookup(Sequence(-1, "", prompt, namespace))) * self.bm.block_size

    def outstanding(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self.scheduler.swapped)

    # ---- load, as a worker reports it ---------------------------------------------------------------------------
    def load(self):
        """The LoadReport a real worker would heartbeat (services/worker.py), from the simulated state."""
        from pdserve.services.pb import common_pb2
        sch = self.scheduler
        return common_pb2.LoadReport(num_running=len(sch.running),
                                     num_waiting=len(sch.waiting) + len(self.remote_pending),
                                     kv_blocks_in_use=self.bm.blocks_in_use, kv_blocks_total=self.bm.num_blocks,
                                     max_num_seqs=self.cfg.max_num_seqs)
