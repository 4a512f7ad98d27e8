"""The break-even study's targets (the break-even with the link as an axis), each computed from the
measured cells and stated as met / not met with its numbers:

1. TTFT overhead of disaggregation over a link <= the link's time for the request's KV + 5 ms. Overhead = the
   disaggregated deployment's TTFT p50 minus the colocated one's over their isolated requests (sent one at a
   time, the same distinct prompts in both: no queueing, which is not overhead): the paired ones first (both
   deployments up together, requests alternated between them: `breakeven_paired`), else those each mode's run
   sent before its cells. Where a run has fewer than `MIN_ISOLATED` of them (results of older runs: one each)
   the lightest-load cell of each (prompt, output) pair stands in (both ran the same seeded schedule); each row
   names its basis. Where the paired requests carry stage times, the row also gives the path overhead: the same
   difference of TTFT less the engine's queue and prefill, which is the same computation in both modes (what
   differs in it between deployments is which core other work kept busy: breakeven_paired), and the verdict is
   on that; the whole TTFT's difference is kept beside it. The transfer time is the KV bytes each
   request moved (measured: `pdserve_kv_transfer_bytes_total` / pulls) over the link's rate.
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
MIN_ISOLATED = 5


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


def _isolated(col: dict, dis: dict, field: str, key: str) -> tuple[dict, dict, int]:
    """Both runs' `field` entry for `key` (`isolated_paired` or `isolated`) and the smaller of their counts."""
    ci, di = (r.get(field, {}).get(key) or {} for r in (col, dis))
    return ci, di, min(ci.get("n") or 0, di.get("n") or 0)


def _ttft_pair(col: dict, dis: dict, plen: int, olen: int, keys: list[str]):
    """(colocated TTFT p50, disaggregated TTFT p50, basis): the paired isolated requests, else each run's own,
    where both have enough of them; else the lightest-load cell both measured; None when neither is there."""
    for field, name in (("isolated_paired", "paired isolated p50"), ("isolated", "isolated p50")):
        ci, di, n = _isolated(col, dis, field, f"{plen}x{olen}")
        if n >= MIN_ISOLATED and None not in (ci.get("ttft_s"), di.get("ttft_s")):
            return ci["ttft_s"], di["ttft_s"], f"{name}, n={n}"
    cc, dc = col.get("cells", {}), dis.get("cells", {})
    k = next((x for x in keys if x in cc and x in dc), None)
    if k is None or None in (cc[k]["ttft_p50_s"], dc[k]["ttft_p50_s"]):
        return None
    return cc[k]["ttft_p50_s"], dc[k]["ttft_p50_s"], f"cell {k} p50, n={dc[k].get('n')}"


def _path_pair(col: dict, dis: dict, plen: int, olen: int):
    ci, di, n = _isolated(col, dis, "isolated_paired", f"{plen}x{olen}")
    if n < MIN_ISOLATED or None in (ci.get("path_s"), di.get("path_s")):
        return None
    return ci["path_s"], di["path_s"]


def ttft_targets(results: dict, grid, link: str) -> list[dict]:
    """Target 1 for `disagg@link`, one row per (prompt, output)."""
    from pdserve.lab.netns import Link
    rate_bps = Link.parse(link).rate_bps
    col, dis = results.get("colocated", {}), results.get(f"disagg@{link}", {})
    rows = []
    for plen, olen in sorted({(p, o) for p, o, _ in grid}):
        keys = [_k(plen, olen, r) for r in sorted(r for p, o, r in grid if (p, o) == (plen, olen))]
        kv = _kv_bytes(dis.get("cells", {}), keys)
        pair = _ttft_pair(col, dis, plen, olen, keys)
        if pair is None or not rate_bps or kv is None:
            continue
        t = ttft_overhead(pair[0], pair[1], kv, rate_bps)
        path = _path_pair(col, dis, plen, olen)
        if path is not None:  # the verdict on the path around the engine; the whole TTFT's difference kept
            p = ttft_overhead(path[0], path[1], kv, rate_bps)
            t = {**p, "ttft_overhead_s": t["overhead_s"], "path_overhead_s": p["overhead_s"]}
        mean_s = [c.get("kv_transfer_mean_s") for k, c in dis.get("cells", {}).items() if k in keys]
        rows.append({"link": link, "cell": f"{plen}x{olen}", "basis": pair[2], "kv_bytes_per_request": kv,
                     "kv_transfer_measured_s": next((m for m in mean_s if m is not None), None), **t})
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
        what = (f"path (TTFT less queue and prefill) {r['path_overhead_s'] * 1e3:.1f} ms, whole TTFT "
                f"{r['ttft_overhead_s'] * 1e3:.1f} ms," if "path_overhead_s" in r else f"{r['overhead_s'] * 1e3:.1f} ms")
        out.append(f"TTFT overhead over {r['link']} at {r['cell']} ({r.get('basis', 'cell p50')}): {what} vs budget "
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
