"""One interval's decision: what was seen, forecast and simulated, what each pool was told, and why.

`observed_*_p90` is the last interval's (the measured-violation rule acts on it); `compared_*_p90` the observation
the model is set against: pooled over the last `compared_intervals` intervals served by the same counts (up to 3);
`simulated_*_p90` the simulator's p90 for those counts at that observation's rate and the window's lengths, raw;
`correction_*` the factor the sizing applied (observed / simulated, smoothed: correction.py), so `simulated x
correction` is what the corrected model predicts for the pools in place, to compare with `compared_*_p90`.

Each decision is exported (services/metrics/planner.py), logged as one line with its reason, and stored in Redis for
`pdserve status` (signed; the keys and the record's form: services/planner_record.py).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from pdserve.planner.guard_rails import PoolVerdict
from pdserve.services.metrics import planner as M

log = logging.getLogger("pdserve.planner")


@dataclass
class Decision:
    time: float                          # unix
    dry_run: bool
    connector: str
    observed_rate: float
    forecast_rate: float
    hold_rate: float
    trend: float
    prompt_mean: float
    output_mean: float
    prefix_hit: float
    queued: float                        # requests waiting (gateway admission + engine queues) at the scrape
    slo_ttft: float
    slo_tpot: float
    observed_ttft_p90: float | None
    observed_tpot_p90: float | None
    simulated_ttft_p90: float | None
    simulated_tpot_p90: float | None
    feasible: bool
    note: str
    pools: list[PoolVerdict] = field(default_factory=list)
    applied: bool = False
    correction_ttft: float = 1.0         # observed / simulated, smoothed, as applied to the sizing
    correction_tpot: float = 1.0
    prefill_capacity: float | None = None   # req/s one replica meets its (corrected) SLO component at
    decode_capacity: float | None = None
    model_stale: bool = False            # sized on the last capacities while the current ones are computed
    observed_requests: float = 0.0       # requests finished in the compared observation (what its p90s are over)
    compared_ttft_p90: float | None = None
    compared_tpot_p90: float | None = None
    compared_intervals: int = 1
    correction_checked: int = 0          # intervals the correction learned from at the counts in place
    decide_s: float | None = None        # the interval's step up to the decision (scrape, simulate, size)

    @property
    def corrected_ttft_p90(self) -> float | None:
        return None if self.simulated_ttft_p90 is None else self.simulated_ttft_p90 * self.correction_ttft

    @property
    def corrected_tpot_p90(self) -> float | None:
        return None if self.simulated_tpot_p90 is None else self.simulated_tpot_p90 * self.correction_tpot

    @property
    def changed(self) -> bool:
        return any(p.action != "hold" for p in self.pools)

    def to_json(self) -> dict:
        d = asdict(self)
        d["corrected_ttft_p90"], d["corrected_tpot_p90"] = self.corrected_ttft_p90, self.corrected_tpot_p90
        d["pools"] = [{**asdict(p), "action": p.action} for p in self.pools]
        return d

    def line(self) -> str:
        def ms(x):
            return "-" if x is None else f"{x * 1000:.0f} ms"

        def margin(slo, x):
            return "" if x is None else f" (margin {(slo - x) * 1000:+.0f} ms)"

        def sim(x, k, seen):  # the correction is stated even with nothing simulated (no arrivals, a pool empty)
            return (f"- (nothing to simulate) x correction {k:.2f}" if x is None else
                    f"{ms(x)} x correction {k:.2f} = {ms(x * k)} vs {ms(seen)} observed")

        cap = ("" if self.decode_capacity is None else
               f"; one replica serves {self.prefill_capacity:.3g} (prefill) / {self.decode_capacity:.3g} (decode) "
               f"req/s in corrected simulation" + (" (last capacities: the current ones are being computed)"
                                                    if self.model_stale else ""))
        took = "" if self.decide_s is None else f"; decided in {self.decide_s:.2f} s"

        pools = ", ".join(f"{p.pool} {p.current}->{p.desired} [{p.action}: {p.reason}]" for p in self.pools)
        return (f"planner{' (dry run)' if self.dry_run else ''}: {pools}; load {self.observed_rate:.2f} req/s "
                f"observed, {self.forecast_rate:.2f} forecast (trend {self.trend:+.2f}/interval, window max "
                f"{self.hold_rate:.2f}), prompt {self.prompt_mean:.0f} tok, output {self.output_mean:.0f} tok, "
                f"prefix hit {self.prefix_hit:.0%}, {self.queued:.0f} queued; TTFT SLO {ms(self.slo_ttft)}: p90 "
                f"observed {ms(self.observed_ttft_p90)}{margin(self.slo_ttft, self.observed_ttft_p90)}, simulated "
                f"{sim(self.simulated_ttft_p90, self.correction_ttft, self.compared_ttft_p90)}; TPOT SLO {ms(self.slo_tpot)}: p90 observed "
                f"{ms(self.observed_tpot_p90)}{margin(self.slo_tpot, self.observed_tpot_p90)}, simulated "
                f"{sim(self.simulated_tpot_p90, self.correction_tpot, self.compared_tpot_p90)} (at the current counts, "
                f"{self.observed_requests:.0f} requests over {self.compared_intervals} interval(s); correction checked in {self.correction_checked} intervals at "
                f"these counts){cap}{took}"
                + ("" if self.feasible else f"; INFEASIBLE: {self.note}"))

    def export(self) -> None:
        for p in self.pools:
            M.DECISIONS.labels(p.pool, p.action).inc()
            M.DESIRED.labels(p.pool).set(p.desired)
            M.CURRENT.labels(p.pool).set(p.current)
        M.RATE.labels("observed").set(self.observed_rate)
        M.RATE.labels("forecast").set(self.forecast_rate)
        M.RATE.labels("window_max").set(self.hold_rate)
        for slo, target, obs, sim, k in (
                ("ttft", self.slo_ttft, self.observed_ttft_p90, self.simulated_ttft_p90, self.correction_ttft),
                ("tpot", self.slo_tpot, self.observed_tpot_p90, self.simulated_tpot_p90, self.correction_tpot)):
            for source, x in (("observed", obs), ("simulated", sim), ("corrected", None if sim is None else sim * k)):
                if x is not None:
                    M.SLO_MARGIN.labels(slo, source).set(target - x)
            M.CORRECTION.labels(slo).set(k)
        M.FEASIBLE.set(1 if self.feasible else 0)
        M.DRY_RUN.set(1 if self.dry_run else 0)

