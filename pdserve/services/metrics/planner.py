"""The planner's families (docs/planner.md): every decision, its inputs and its margins."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

PLANNER = CollectorRegistry(auto_describe=True)

DECISIONS = Counter("pdserve_planner_decisions_total", "Planner decisions per pool (action: up | down | hold)",
                    ["pool", "action"], registry=PLANNER)
DESIRED = Gauge("pdserve_planner_desired_replicas", "Replicas the last decision asked for", ["pool"],
                registry=PLANNER)
CURRENT = Gauge("pdserve_planner_current_replicas", "Replicas the connector reported before the last decision",
                ["pool"], registry=PLANNER)
MODEL = Gauge("pdserve_planner_model_replicas", "Replicas the simulator found needed for the forecast rate "
              "(before the guard rails)", ["pool"], registry=PLANNER)
RATE = Gauge("pdserve_planner_rate_req_per_s", "Request rate: observed in the last interval, forecast for the next, "
             "and the window's largest (what a shrink must hold for)", ["kind"], registry=PLANNER)
SLO_MARGIN = Gauge("pdserve_planner_slo_margin_seconds", "SLO minus p90 (negative: violated), as observed in the "
                   "last interval, as simulated for the counts in place (raw), and as corrected (simulated x "
                   "correction)", ["slo", "source"], registry=PLANNER)
CORRECTION = Gauge("pdserve_planner_correction", "Observed / simulated p90 at the counts in place, smoothed, as "
                   "applied to the sizing", ["slo"], registry=PLANNER)
STEP_SECONDS = Gauge("pdserve_planner_step_seconds", "The last interval's step (scrape to stored decision)",
                     registry=PLANNER)
OVERRUNS = Counter("pdserve_planner_overruns_total", "Intervals whose step took longer than the interval",
                   registry=PLANNER)
FEASIBLE = Gauge("pdserve_planner_feasible", "1 when the chosen counts meet the SLOs in simulation", registry=PLANNER)
DRY_RUN = Gauge("pdserve_planner_dry_run", "1 when decisions are only logged and exported", registry=PLANNER)
ERRORS = Counter("pdserve_planner_errors_total", "Planner intervals that failed (scrape, sizing or connector)",
                 ["stage"], registry=PLANNER)
