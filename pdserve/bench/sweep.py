"""Load sweep: offered rates from light load past saturation, and the knee.

A point is *broken* when any of: achieved request throughput < `sat_ratio` x the schedule's realized arrival rate (the server no longer
keeps up: queues grow for as long as the run lasts), SLO attainment < `attainment_target`, or p99 TTFT > the
TTFT SLO. The knee is the highest offered rate below the first broken point; goodput at the knee is the
single-replica goodput to size replicas with (spec Q19).
"""
from __future__ import annotations


def classify(point: dict, slo_ttft: float | None, attainment_target: float, sat_ratio: float) -> list[str]:
    s = point["steady"]
    off = point.get("offered_rate_req_per_s")
    why = []
    thr = s["throughput"]["request_throughput_req_per_s"]
    # compare with the schedule's realized rate: a short Poisson schedule can run well below the nominal rate
    real = s["throughput"].get("realized_arrival_rate_req_per_s")
    ref = real if real is not None and real == real else off
    if ref and thr == thr and thr < sat_ratio * ref:
        why.append(f"throughput {thr:.2f} < {sat_ratio:g} x realized arrival rate {ref:.2f} req/s (saturated)")
    att = s["slo"]["attainment_ratio"]
    if att == att and att < attainment_target:
        why.append(f"SLO attainment {att:.3f} < {attainment_target:g}")
    p99 = s["latency"]["ttft_s"].get("p99")
    if slo_ttft is not None and p99 is not None and p99 > slo_ttft:
        why.append(f"p99 TTFT {p99 * 1e3:.0f} ms > SLO {slo_ttft * 1e3:.0f} ms")
    if s["n_ok"] == 0:
        why.append("no request completed")
    return why


def find_knee(points: list[dict], slo_ttft: float | None, attainment_target: float = 0.9,
              sat_ratio: float = 0.9) -> dict:
    pts = sorted((p for p in points if p.get("offered_rate_req_per_s") is not None),
                 key=lambda p: p["offered_rate_req_per_s"])
    verdicts = []
    knee = broken = None
    for p in pts:
        why = classify(p, slo_ttft, attainment_target, sat_ratio)
        verdicts.append({"offered_rate_req_per_s": p["offered_rate_req_per_s"], "broken": bool(why), "why": why,
                         "goodput_req_per_s": p["steady"]["slo"]["goodput_req_per_s"]})
        if why and broken is None:
            broken = p
        if not why and broken is None:
            knee = p
    out = {"criteria": {"attainment_target": attainment_target, "saturation_ratio": sat_ratio,
                        "slo_ttft_s": slo_ttft},
           "points": verdicts,
           "knee_rate_req_per_s": knee["offered_rate_req_per_s"] if knee else None,
           "knee_goodput_req_per_s": knee["steady"]["slo"]["goodput_req_per_s"] if knee else None,
           "first_broken_rate_req_per_s": broken["offered_rate_req_per_s"] if broken else None,
           "past_saturation_reached": broken is not None}
    if knee is None and pts:
        out["note"] = "already broken at the lightest rate: sweep lower"
    elif broken is None:
        out["note"] = "never broke: sweep higher to pass saturation"
    return out


def rate_schedule(rates: list[float] | None, start: float, factor: float, max_points: int):
    """Explicit rates, or a geometric progression the caller stops one point after the first broken one."""
    if rates:
        yield from rates
        return
    r = start
    for _ in range(max_points):
        yield r
        r *= factor
