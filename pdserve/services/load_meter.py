"""Online measurements a worker puts in its load report; the router's cost model reads them (docs/routing.md).

Everything here is measured from what the engine actually did, smoothed with exponentially weighted moving
averages, so the router follows a worker that slows down (long contexts, a noisy neighbour, another device)
instead of trusting configured constants. Until the first sample a field is 0 and the router uses its prior.
"""
from __future__ import annotations

import threading
import time

from pdserve.services.pb import common_pb2


class Ewma:
    """Exponentially weighted mean; `alpha` is the weight of a new sample."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.value = 0.0
        self.n = 0

    def add(self, x: float) -> None:
        self.value = x if self.n == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.n += 1


class EwmaLine:
    """y ~ a + b*x by exponentially forgotten least squares: prefill time = overhead + tokens / rate.

    A plain EWMA of tokens/seconds would charge the per-request fixed cost to the rate, so short prompts would
    make long prompts look slow; fitting a line separates the two.
    """

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self.n = 0
        self.mx = self.my = self.mxx = self.mxy = 0.0

    def add(self, x: float, y: float) -> None:
        a = 1.0 if self.n == 0 else self.alpha
        self.mx += a * (x - self.mx)
        self.my += a * (y - self.my)
        self.mxx += a * (x * x - self.mxx)
        self.mxy += a * (x * y - self.mxy)
        self.n += 1

    def fit(self, through_origin: bool = True) -> tuple[float, float]:
        """(intercept, slope). With too little spread in x (or no positive slope), a line through the origin (slope
        only); `through_origin=False`: a flat line instead (intercept only), for a y that need not grow with x."""
        var = self.mxx - self.mx * self.mx
        if self.n >= 3 and var > 1e-9 * max(1.0, self.mxx):
            b = (self.mxy - self.mx * self.my) / var
            if b > 0:
                return max(0.0, self.my - b * self.mx), b
        if not through_origin:
            return self.my, 0.0
        return 0.0, (self.my / self.mx if self.mx > 0 else 0.0)


class LoadMeter:
    """Measures prefill rate, decode step time and KV link bandwidth on a worker.

    `on_step` is an AsyncEngine step listener (engine thread); `observe_transfer` is called by the
    decode side after each KV pull (event loop). A lock keeps `report` consistent across the two threads.
    """

    PENDING_REFRESH_S = 0.1  # heartbeats are ~1 s apart
    # A fresh (or restarted) worker's first decode steps run cold (page faults on the weights, first kernel calls,
    # threads spinning up, on a host busy with the restart) and last up to several times a warm step. Seeding the
    # averages with them made a restarted worker report a step several times too long, and deadline-aware
    # admission refuse requests `deadline_unreachable` for seconds (docs/reliability.md, "Fault matrix"). So the
    # first DECODE_WARMUP pure-decode steps are not measured, and nothing is reported until DECODE_REPORT_AFTER
    # have been (0 = unmeasured: the router's priors and the other workers' figures stand meanwhile).
    DECODE_WARMUP = 4
    DECODE_REPORT_AFTER = 4
    # Once measured, a step longer than this many times the average is counted as this many times: a process
    # stopped mid-step (SIGSTOP, a host stall) says nothing about its speed, while a real slowdown still moves
    # the average up by 1 + alpha x (OUTLIER_X - 1) per step.
    OUTLIER_X = 3.0
    MIN_PREFILL_TOKENS = 1  # a request whose whole prompt hit the cache says nothing about the prefill rate

    def __init__(self):
        self._lock = threading.Lock()
        self.prefill = EwmaLine()          # x = uncached prompt tokens, y = first scheduled -> first token (s)
        self.decode = EwmaLine(alpha=0.05)  # x = sequences in a pure-decode step, y = step time (s)
        self.decode_now = Ewma(alpha=0.2)   # recent decode step time at the current batch
        self.kv_bw = Ewma(alpha=0.2)        # bytes / s of KV pulls
        self.handoff = Ewma(alpha=0.2)      # hand-off seconds beyond the transfer (alloc, RPCs, commit)
        self.pending_prefill_tokens = 0
        self._pending_at = 0.0
        self._seen: set[str] = set()
        self._last_step: float | None = None
        self._decode_steps = 0  # pure-decode steps seen, warm-up included
        self._busy = False

    # ---- engine thread ---------------------------------------------------------------------------------------
    def on_step(self, engine, outputs) -> None:
        now = time.time()
        with self._lock:
            self._step_time(engine, now)
            for out in outputs:
                self._prefill_sample(out)
            # prefix lookups hash every waiting prompt: refresh a few times a second, not every step
            # (always when nothing waits: then it is cheap, and an idle worker must not keep a stale value)
            if not engine.has_waiting() or now - self._pending_at >= self.PENDING_REFRESH_S:
                self.pending_prefill_tokens = engine.pending_prefill_tokens()
                self._pending_at = now
            self._busy = engine.has_unfinished()
            self._last_step = now

    def _step_time(self, engine, now: float) -> None:
        # The interval between two step ends while the engine stayed busy is one step (plus the few commands
        # queued in between). The first step after idle has no start mark and is skipped.
        if not self._busy or self._last_step is None or not getattr(engine, "batch_sizes", None):
            return
        nseq, ntok = engine.batch_sizes[-1]
        dt = now - self._last_step
        if nseq and ntok == nseq and 0 < dt < 5.0:  # pure decode step: one token per sequence
            self.observe_decode_step(nseq, dt)

    def observe_decode_step(self, nseq: int, dt: float) -> None:
        """One pure-decode step of `nseq` sequences that took `dt` s (warm-up skipped, stalls clipped)."""
        self._decode_steps += 1
        if self._decode_steps <= self.DECODE_WARMUP:
            return
        if self.decode_now.n:
            dt = min(dt, self.OUTLIER_X * self.decode_now.value)
        self.decode.add(nseq, dt)
        self.decode_now.add(dt)

    def _prefill_sample(self, out) -> None:
        rid = out.request_id
        t = out.times
        if rid not in self._seen and t is not None:
            s, f = t.first_scheduled, t.first_token
            if s and f and f >= s:
                self._seen.add(rid)
                n_prompt = len(out.prompt_token_ids or [])
                uncached = n_prompt - int(out.num_cached_tokens or 0)
                if uncached >= self.MIN_PREFILL_TOKENS:
                    self.prefill.add(uncached, f - s)
        if out.finished:
            self._seen.discard(rid)

    # ---- event loop ------------------------------------------------------------------------------------------
    def forget(self) -> None:
        """A role switch: what the old role measured does not describe the new one (a decode worker's "prefill"
        samples are KV pickups, far slower per token than a real prefill, so the router would price it out of the
        prefill pool for good). Unmeasured again: its pool's measured peers stand for it (router/cost.py)."""
        with self._lock:
            self.prefill = EwmaLine()
            self.decode = EwmaLine(alpha=0.05)
            self.decode_now = Ewma(alpha=0.2)
            self.kv_bw = Ewma(alpha=0.2)
            self.handoff = Ewma(alpha=0.2)
            self._decode_steps = 0

    def observe_transfer(self, nbytes: int, transfer_s: float, handoff_s: float) -> None:
        with self._lock:
            if nbytes > 0 and transfer_s > 0:
                self.kv_bw.add(nbytes / transfer_s)
            self.handoff.add(max(0.0, handoff_s - transfer_s))

    def observe_probe(self, bytes_per_s: float) -> None:
        """The transport self-test's bandwidth (kv_transfer/probe.py): one sample of the link's rate, measured
        on a READ large enough that its latency does not dominate."""
        with self._lock:
            if bytes_per_s > 0:
                self.kv_bw.add(bytes_per_s)

    def report(self) -> common_pb2.LoadReport:
        """The measured fields of a load report (the worker fills in the rest)."""
        with self._lock:
            ov, slope = self.prefill.fit()
            # A decode step is mostly fixed cost (weights read once per step): a line through the origin would
            # charge all of it to the sequences, e.g. 4 ms per sequence for a 20 ms step at batch 5 where the true
            # slope is a fraction of a ms, and admission would think a few more requests double the step. A fresh
            # line (a restarted worker) finds no positive slope in noise about a third of the time: flat, then.
            d0, d1 = self.decode.fit(through_origin=False)
            warm = self.decode_now.n >= self.DECODE_REPORT_AFTER
            return common_pb2.LoadReport(
                prefill_tokens_per_s=(1.0 / slope) if slope > 0 else 0.0,
                prefill_overhead_s=ov,
                decode_step_s=self.decode_now.value if warm else 0.0,
                decode_step_per_seq_s=d1 if warm and (d0 > 0 or d1 > 0) else 0.0,
                decode_step0_s=d0 if warm and d1 > 0 else 0.0,
                pending_prefill_tokens=int(self.pending_prefill_tokens),
                kv_bytes_per_s=self.kv_bw.value,
                handoff_overhead_s=self.handoff.value,
                report_time=time.time(),
            )

