"""Engine, part: how requests end. Terminal paths (finished, cancelled, timed out, failed) all go through
`_reclaim`, which is idempotent: blocks are released by refcount, the batch slot is left, and exactly one usage
record is written (docs/spec-map.md, §1.7). Deadlines and backpressure end or pause requests from here too.
Usage counts: `generated` = tokens sampled by the model (all branches); `emitted` = tokens whose text reached
the caller's stream; `committed` = tokens in the returned choices (what is billed: best_of drops the losers).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

from pdserve.engine.request import Request
from pdserve.engine.request_state import RequestState as S

log = logging.getLogger("pdserve.engine")
usage_log = logging.getLogger("pdserve.usage")


class EngineReclaim:
    """Deadlines, backpressure and termination of `Engine` (engine.py), which sets the attributes used here."""

    # ---- deadlines and backpressure ----------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Deadlines: any live request past its deadline ends TIMED_OUT (queued, preempted, swapped, running or
        backpressured alike: the client has stopped waiting). Requests whose KV is being pulled (remote_pending)
        are left to their transfer deadline (`expire_transfers`): their blocks may still be written by NIXL. Also:
        a request backpressured for longer than `backpressure_preempt_s` gives its KV back (preempted, §1.4)."""
        self.expire_transfers(now)
        for req in list(self.requests.values()):
            if req.deadline is not None and now >= req.deadline and not req.reclaimed:
                self.abort(req.request_id, "TIMED_OUT")
            elif req.paused_since is not None and now - req.paused_since > self.config.backpressure_preempt_s:
                for seq in req.seqs:
                    if seq.state == S.BACKPRESSURED:
                        self.scheduler.preempt(seq)

    def expire_transfers(self, now: float) -> None:
        """A remote prefill whose KV never arrived (the decode side neither committed nor failed it by its
        transfer deadline) ends FAILED and frees its blocks: nothing else would ever free them. The deadline lies
        past the decode service's own READ timeout, so a READ still writing into them has given up by then."""
        for req in list(self.remote_pending.values()):
            if req.transfer_deadline is not None and now >= req.transfer_deadline:
                log.warning("request %s: KV transfer never completed; freeing its blocks", req.request_id)
                self.abort(req.request_id, "FAILED")

    def set_paused(self, request_id: str, paused: bool) -> bool:
        """Backpressure on/off for a request (its consumer's buffer is full / drained). Returns whether it
        exists. Paused sequences keep their KV but get no ticks; running ones show BACKPRESSURED."""
        req = self.requests.get(request_id)
        if req is None or req.reclaimed or (req.paused_since is not None) == paused:
            return req is not None
        req.paused_since = time.time() if paused else None
        for seq in req.seqs:
            if seq.finished:
                continue
            seq.paused = paused
            if paused and seq.state == S.DECODING:
                seq.set_state(S.BACKPRESSURED)
            elif not paused and seq.state == S.BACKPRESSURED:
                seq.set_state(S.DECODING)
        return True

    # ---- termination: one idempotent reclaim ------------------------------------------------------------------
    def _reclaim(self, req: Request, state: S) -> None:
        if req.reclaimed:
            return
        for seq in req.seqs:
            self.core.finish(seq, state, req.prefill_only)
        req.reclaimed = True
        self.requests.pop(req.request_id, None)
        self.remote_pending.pop(req.request_id, None)
        final = req.terminal_state()
        req.state = final
        req.times = req.times.finished_at(time.time())
        self.terminal_counts[final.value] = self.terminal_counts.get(final.value, 0) + 1
        record = req.usage_record()
        self.usage_records.append(record)
        if usage_log.isEnabledFor(logging.INFO):
            usage_log.info(json.dumps(asdict(record)))

    def abort(self, request_id: str, state: str = "CANCELLED") -> None:
        """Cancel, time out or fail a request now; a no-op for unknown or already finished requests."""
        target = S[state]
        if target not in (S.CANCELLED, S.TIMED_OUT, S.FAILED):
            raise ValueError(f"abort state must be CANCELLED, TIMED_OUT or FAILED, not {state}")
        req = self.requests.get(request_id) or self.remote_pending.get(request_id)
        if req is None or req.reclaimed:
            return
        for seq in req.seqs:
            if not seq.finished and seq.finish_reason is None:
                seq.finish_reason = "timeout" if target == S.TIMED_OUT else "abort"
        self._reclaim(req, target)
        self._pending_outputs.append(self._output(req))
