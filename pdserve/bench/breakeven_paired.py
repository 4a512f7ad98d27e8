"""The break-even study's TTFT overhead, measured paired: every mode's deployment up at once, the same isolated
requests sent one at a time to each in turn.

Why: the modes' cells run one deployment after another, minutes apart, and on a shared 2-core box the unloaded TTFT
drifts between them by more than the overhead being measured (one run, Intel model 207 under other jobs: the
colocated deployment's isolated p50 81 ms at P = 512, the disaggregated one's 122 ms measured about a minute
later; two such deployments on one host, requests alternated between them, differed by 1.9 / 5.4 / -5.6 ms at
P = 32 / 256 / 512). Deployments that are up but idle cost
nothing, so alternating request by request puts every mode under the same conditions. Each request goes to the
modes in a rotated order, so no mode always follows another.

Each request also asks for its stage times (`return_stage_times`), so that the gateway's TTFT splits into the
engine's prefill (and queue) and the path around it (admission, routing, dispatch, the hand-back of the first
token). The prefill is the same computation in every mode, one thread on one of the same two cores; what still
differs between modes in it is which core was busier with other work at that moment (on a shared box: the same
prompts' prefill p50 77 ms on the prefill host against 114 ms on a colocated replica, requests alternated).
`path_s` = TTFT - queue - prefill is what disaggregation adds or removes around the engine.
"""
from __future__ import annotations

import functools
import statistics
import sys

from pdserve.bench import metrics as MX


@functools.cache
def _model(base_url: str) -> str:
    import httpx
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def _one(base_url: str, spec) -> dict | None:
    """One request, its gateway-side TTFT and that TTFT less queue and prefill (None: not answered)."""
    import httpx
    body = {"model": _model(base_url), "prompt": list(spec.prompt), "max_tokens": spec.output_len, "ignore_eos": True,
            "temperature": 0, "return_stage_times": True}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    if r.status_code != 200:
        return None
    d = ((r.json().get("usage") or {}).get("stage_times") or {}).get("durations") or {}
    if d.get("ttft") is None:
        return None
    return {"ttft": d["ttft"], "path": d["ttft"] - (d.get("queue") or 0) - (d.get("prefill") or 0)}


def _warm(urls: dict, a, plen: int, olen: int) -> None:
    from pdserve.bench.breakeven import _specs
    for u in urls.values():
        for spec in _specs(a, plen, olen, 0.0, 2, a.seed + 200_000 + 7 * plen + 13 * olen):
            _one(u, spec)


def _summary(got: list[dict]) -> dict:
    t, pth = [g["ttft"] for g in got], [g["path"] for g in got]
    return {"ttft_s": statistics.median(t) if t else None, "n": len(t),
            "ttft_p90_s": MX.percentile(t, 0.9) if t else None, "ttfts_s": t,
            "path_s": statistics.median(pth) if pth else None, "paths_s": pth}


def measure(a, modes: list[str], pairs: list[tuple[int, int]]) -> dict:
    """{mode: {"PxO": {"ttft_s": p50, "path_s": p50, "n", ...}}} over `a.isolated_requests` prompts per (P, O),
    every mode's deployment up together (started one after the other, stopped together); gateway-side times."""
    from pdserve.bench.breakeven import cell_specs, start_mode
    deps: dict = {}
    try:
        for m in modes:
            deps[m] = start_mode(a, m)[0]
            print(f"paired TTFT: {m} up", file=sys.stderr, flush=True)
        urls = {m: d.base_url for m, d in deps.items()}
        out: dict = {m: {} for m in modes}
        for plen, olen in pairs:
            _warm(urls, a, plen, olen)
            got: dict = {m: [] for m in modes}
            for i, spec in enumerate(cell_specs(a, plen, olen, 0.0, None)):
                for m in modes[i % len(modes):] + modes[:i % len(modes)]:
                    g = _one(urls[m], spec)
                    if g is not None:
                        got[m].append(g)
            for m, xs in got.items():
                out[m][f"{plen}x{olen}"] = _summary(xs)
        return out
    finally:
        for d in deps.values():
            d.stop()
