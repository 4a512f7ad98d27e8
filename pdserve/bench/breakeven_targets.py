"""The break-even study's targets (the break-even with the link as an axis), each computed from the
measured cells and stated as met / not met with its numbers:

1. TTFT overhead of disaggregation over a link <= the link's time for the request's KV + 5 ms. Overhead = the
   disaggregated run's TTFT p50 minus the colocated run's, in the lightest-load cell of each (prompt, output)
   pair (both ran the same seeded schedule), so queueing is not counted as overhead. The transfer time is the
   KV bytes each request moved (measured: `pdserve_kv_transfer_bytes_total` / pulls) over the link's rate.
2. `auto` goodput >= 0.95 x the better of colocated and disaggregated (same link), in every cell. A cell where
   both are 0 is met (nothing to lose); a miss whose SLO counts are within the two-proportion noise band of
   `breakeven.within_noise` says so.
3. No request on an unlabelled fallback: every answered request names its path (`x-pdserve-path`), so a fallback
   is always visible; the count of labelled fallbacks is reported beside it (from the header and from the
   gateway's `pdserve_requests_by_path_total`).
"""
from __future__ import annotations

SLACK_S = 0.005
AUTO_FRACTION = 0.95


def transfer_time_s(kv_bytes: float, rate_bps: float) -> float:
    """Seconds a link of `rate_bps` bit/s needs for `kv_bytes` bytes."""
    return kv_bytes * 8 / rate_bps


def ttft_overhead(ttft_colocated_s: float, ttft_disagg_s: float, kv_bytes: float, rate_bps: float,
                  slack_s: float = SLACK_S) -> dict:
    over = ttft_disagg_s - ttft_colocated_s
    xfer = transfer_time_s(kv_bytes, rate_bps)
    return {"overhead_s": over, "transfer_s": xfer, "budget_s": xfer + slack_s, "met": over <= xfer + slack_s}


def auto_vs_best(g_auto: float, g_colocated: float, g_disagg: float, fraction: float = AUTO_FRACTION) -> dict:
    best = max(g_colocated, g_disagg)
    return {"goodput_auto": g_auto, "best": "disagg" if g_disagg > g_colocated else "colocated",
            "goodput_best": best, "ratio": (g_auto / best) if best > 0 else None,
            "met": best <= 0 or g_auto >= fraction * best}


def fallbacks(paths_header: dict, paths_metric: dict | None, n_ok: int) -> dict:
    """`paths_header`: answered requests by the path their header named (`unlabelled`: none). The target is on
    the unlabelled ones; the answered requests the header did not reach (a count short of n_ok) count too."""
    labelled = sum(v for k, v in paths_header.items() if k != "unlabelled")
    unlabelled = max(paths_header.get("unlabelled", 0), n_ok - labelled)
    return {"n_ok": n_ok, "fallback_header": paths_header.get("fallback", 0),
            "fallback_metric": None if paths_metric is None else paths_metric.get("fallback", 0),
            "unlabelled": unlabelled, "met": unlabelled == 0}


def _k(plen, olen, rate) -> str:
    return f"{plen}x{olen}x{rate:g}"


def _kv_bytes(cells: dict, keys: list[str]) -> float | None:
    """Measured KV bytes per pull over the given cells (None where nothing was pulled)."""
    b = sum((cells[k].get("kv_transfer_bytes") or 0) for k in keys if k in cells)
    n = sum((cells[k].get("kv_transfer_count") or 0) for k in keys if k in cells)
    return b / n if n else None


def ttft_targets(results: dict, grid, link: str) -> list[dict]:
    """Target 1 for `disagg@link`, one row per (prompt, output) at its lowest rate."""
    from pdserve.lab.netns import Link
    rate_bps = Link.parse(link).rate_bps
    col = results.get("colocated", {}).get("cells", {})
    dis = results.get(f"disagg@{link}", {}).get("cells", {})
    rows = []
    for plen, olen in sorted({(p, o) for p, o, _ in grid}):
        keys = [_k(plen, olen, r) for r in sorted(r for p, o, r in grid if (p, o) == (plen, olen))]
        k = next((x for x in keys if x in col and x in dis), None)
        kv = _kv_bytes(dis, keys)
        if k is None or not rate_bps or kv is None or None in (col[k]["ttft_p50_s"], dis[k]["ttft_p50_s"]):
            continue
        t = ttft_overhead(col[k]["ttft_p50_s"], dis[k]["ttft_p50_s"], kv, rate_bps)
        rows.append({"link": link, "cell": k, "kv_bytes_per_request": kv,
                     "kv_transfer_measured_s": dis[k].get("kv_transfer_mean_s"), **t})
    return rows


def auto_targets(results: dict, grid, link: str | None) -> list[dict]:
    """Target 2 for `auto[@link]` against colocated and `disagg[@link]`, every cell all three measured."""
    suffix = f"@{link}" if link else ""
    col = results.get("colocated", {}).get("cells", {})
    dis = results.get(f"disagg{suffix}", {}).get("cells", {})
    aut = results.get(f"auto{suffix}", {}).get("cells", {})
    from pdserve.bench.breakeven import within_noise
    rows = []
    for plen, olen, rate in grid:
        k = _k(plen, olen, rate)
        if not (k in col and k in dis and k in aut):
            continue
        t = auto_vs_best(aut[k]["goodput_req_per_s"], col[k]["goodput_req_per_s"], dis[k]["goodput_req_per_s"])
        best = col[k] if t["best"] == "colocated" else dis[k]
        t["within_noise"] = within_noise(aut[k]["n_slo"], best["n_slo"], aut[k]["n"])
        rows.append({"link": link or "same host", "cell": k, **t})
    return rows


def fallback_targets(results: dict) -> list[dict]:
    """Target 3 over every measured cell of every mode that has a prefill pool (disagg*, auto*)."""
    rows = []
    for mode, res in results.items():
        if not mode.startswith(("disagg", "auto")):
            continue
        for k, c in res.get("cells", {}).items():
            if c.get("paths_header") is None:
                continue
            rows.append({"mode": mode, "cell": k, **fallbacks(c["paths_header"], c.get("paths_metric"), c["n_ok"])})
    return rows


def summary(results: dict, grid, links: list[str]) -> dict:
    t1 = [r for link in links for r in ttft_targets(results, grid, link)]
    t2 = [r for link in (links or [None]) for r in auto_targets(results, grid, link)]
    t3 = fallback_targets(results)

    def verdict(rows):
        return None if not rows else all(r["met"] for r in rows)
    return {"ttft_overhead": {"rows": t1, "met": verdict([r for r in t1 if r["link"] == "10gbit"] or t1)},
            "auto_goodput": {"rows": t2, "met": verdict(t2)},
            "unlabelled_fallback": {"rows": t3, "met": verdict(t3)}}


def lines(s: dict) -> list[str]:
    """One line per target row, stating met / not met with the numbers."""
    out = []
    for r in s["ttft_overhead"]["rows"]:
        out.append(f"TTFT overhead over {r['link']} at {r['cell']}: {r['overhead_s'] * 1e3:.1f} ms vs budget "
                   f"{r['budget_s'] * 1e3:.1f} ms (transfer {r['transfer_s'] * 1e3:.2f} ms of "
                   f"{r['kv_bytes_per_request'] / 1e6:.2f} MB + 5 ms): {'MET' if r['met'] else 'NOT MET'}")
    for r in s["auto_goodput"]["rows"]:
        ratio = "n/a (both 0)" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        out.append(f"auto goodput, {r['link']}, {r['cell']}: {r['goodput_auto']:.2f} vs best ({r['best']}) "
                   f"{r['goodput_best']:.2f} req/s = {ratio}: {'MET' if r['met'] else 'NOT MET'}"
                   f"{'' if r['met'] else (' (within noise)' if r['within_noise'] else ' (beyond noise)')}")
    for r in s["unlabelled_fallback"]["rows"]:
        out.append(f"paths, {r['mode']} {r['cell']}: of {r['n_ok']} answered, {r['unlabelled']} unlabelled, "
                   f"{r['fallback_header']} labelled "
                   f"fallback (metric: {r['fallback_metric']}): {'MET' if r['met'] else 'NOT MET'}")
    return out
