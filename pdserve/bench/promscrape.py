"""Read pdserve's Prometheus endpoints before/after a load point -> mean per-stage times.

The fallback breakdown: when the responses carry `usage.stage_times` (pdserve's extension) the runner reports
per-request distributions instead (`bench/stages.py`). From histogram sum/count deltas we only get means over
the load point, not per-request distributions.
"""
from __future__ import annotations

import re
import urllib.request

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')

STAGE_METRICS = ("pdserve_ttft_seconds", "pdserve_e2e_seconds", "pdserve_itl_seconds", "pdserve_queue_time_seconds",
                 "pdserve_prefill_time_seconds", "pdserve_kv_transfer_seconds")


READY = "pdserve_worker_ready_seconds"


def _pages(urls: list[str], timeout: float):
    """The /metrics text of each endpoint that answers; one that is gone just contributes nothing."""
    for u in urls:
        try:
            with urllib.request.urlopen(u, timeout=timeout) as r:
                text = r.read().decode()
        except Exception:  # noqa: BLE001
            continue
        yield text


def worker_ready(urls: list[str], timeout: float = 5.0) -> dict[str, float]:
    """The servers' own cold start (spec §1.5): `pdserve_worker_ready_seconds` per phase (load, warmup, ready),
    the slowest worker's; {} when no endpoint exports it."""
    out: dict[str, float] = {}
    for text in _pages(urls, timeout):
        for line in text.splitlines():
            m = _LINE.match(line)
            if m and m.group(1) == READY:
                phase = re.search(r'phase="([^"]*)"', m.group(2) or "")
                if phase:
                    out[phase.group(1)] = max(out.get(phase.group(1), 0.0), float(m.group(3)))
    return out


def scrape(urls: list[str], timeout: float = 5.0) -> dict[str, float]:
    """Sum every `<metric>_sum`/`_count` (and plain counters) over all endpoints, keyed 'name{labels}'."""
    out: dict[str, float] = {}
    for text in _pages(urls, timeout):
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            m = _LINE.match(line)
            if not m:
                continue
            name, labels, val = m.group(1), m.group(2) or "", m.group(3)
            if not (name.endswith("_sum") or name.endswith("_count") or name.endswith("_total")):
                continue
            try:
                out[name + labels] = out.get(name + labels, 0.0) + float(val)
            except ValueError:
                pass
    return out


def _agg(d: dict[str, float], base: str, label_filter: str = "") -> tuple[float, float]:
    s = sum(v for k, v in d.items() if k.startswith(base + "_sum") and label_filter in k)
    c = sum(v for k, v in d.items() if k.startswith(base + "_count") and label_filter in k)
    return s, c


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean seconds per stage over the interval (None where the interval saw no observation)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(base, lf=""):
        s, c = _agg(delta, base, lf)
        return (s / c if c > 0 else None), int(c)

    res: dict = {}
    for key, base, lf in (("gateway_ttft", "pdserve_ttft_seconds", ""), ("gateway_e2e", "pdserve_e2e_seconds", ""),
                          ("gateway_itl", "pdserve_itl_seconds", ""),
                          ("queue_prefill_worker", "pdserve_queue_time_seconds", 'role="prefill"'),
                          ("queue_both_worker", "pdserve_queue_time_seconds", 'role="both"'),
                          ("prefill_prefill_worker", "pdserve_prefill_time_seconds", 'role="prefill"'),
                          ("prefill_both_worker", "pdserve_prefill_time_seconds", 'role="both"'),
                          ("kv_transfer", "pdserve_kv_transfer_seconds", "")):
        m, c = mean(base, lf)
        res[key + "_mean_s"] = m
        res[key + "_count"] = c
    b = sum(v for k, v in delta.items() if k.startswith("pdserve_kv_transfer_bytes_total"))
    res["kv_transfer_bytes"] = b
    res["requests_by_path"] = by_path(delta)
    return res


def by_path(delta: dict[str, float]) -> dict[str, int]:
    """`pdserve_requests_by_path_total` over the interval, summed over reasons: {path: sub-requests}."""
    out: dict[str, int] = {}
    for k, v in delta.items():
        if k.startswith("pdserve_requests_by_path_total{") and v:
            m = re.search(r'path="([^"]*)"', k)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + int(round(v))
    return out


def breakdown(stages: dict, client_ttft_mean: float | None) -> dict | None:
    """Mean TTFT split into stages + mean decode time; None when the endpoints expose nothing. In disaggregated
    mode the gateway's first chunk comes from the decode worker after the KV pull, so transfer is inside TTFT."""
    gt, ge = stages.get("gateway_ttft_mean_s"), stages.get("gateway_e2e_mean_s")
    if gt is None:
        return None
    q = stages.get("queue_prefill_worker_mean_s") or stages.get("queue_both_worker_mean_s") or 0.0
    p = stages.get("prefill_prefill_worker_mean_s") or stages.get("prefill_both_worker_mean_s") or 0.0
    x = stages.get("kv_transfer_mean_s") or 0.0
    out = {"client_to_gateway_s": (client_ttft_mean - gt) if client_ttft_mean is not None else None,
           "queue_s": q, "prefill_s": p, "kv_transfer_s": x,
           "route_rpc_other_s": max(0.0, gt - q - p - x),
           "decode_s": (ge - gt) if ge is not None else None}
    return out
