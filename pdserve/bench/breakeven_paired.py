"""The break-even study's TTFT overhead, measured paired: every mode's deployment up at once, the same isolated
requests sent one at a time to each in turn.

Why: the modes' cells run one deployment after another, minutes apart, and on a shared 2-core box the unloaded TTFT
drifts between them by more than the overhead being measured (one run: the colocated deployment's isolated p50
81 ms at P = 512, the disaggregated one's 122 ms twelve minutes later; the same two deployments side by side,
requests alternated, differ by 1.9 / 5.4 / -5.6 ms at P = 32 / 256 / 512). Deployments that are up but idle cost
nothing, so alternating request by request puts every mode under the same conditions. Each request goes to the
modes in a rotated order, so no mode always follows another.
"""
from __future__ import annotations

import asyncio
import statistics
import sys

from pdserve.bench import metrics as MX


async def _ttft(target, spec, slo) -> float | None:
    from pdserve.bench.runner import PointConfig, run_point
    pt = await run_point(target, [spec], PointConfig(keep_records=False), slo)
    return pt["steady"]["latency"]["ttft_s"].get("p50")


def _warm(targets: dict, a, plen: int, olen: int, slo) -> None:
    from pdserve.bench.breakeven import _specs
    for t in targets.values():
        for spec in _specs(a, plen, olen, 0.0, 2, a.seed + 200_000 + 7 * plen + 13 * olen):
            asyncio.run(_ttft(t, spec, slo))


def measure(a, modes: list[str], pairs: list[tuple[int, int]]) -> dict:
    """{mode: {"PxO": {"ttft_s": p50, "ttft_p90_s", "n", "ttfts_s"}}} over `a.isolated_requests` prompts per
    (P, O), every mode's deployment up together (started one after the other, stopped together)."""
    from pdserve.bench.breakeven import cell_specs, start_mode
    from pdserve.bench.client import Target
    slo = MX.SLO(a.slo_ttft, a.slo_tpot)
    deps: dict = {}
    try:
        for m in modes:
            deps[m] = start_mode(a, m)[0]
            print(f"paired TTFT: {m} up", file=sys.stderr, flush=True)
        targets = {m: Target(d.base_url, None, "completions", ignore_eos=True, timeout_s=60) for m, d in deps.items()}
        out: dict = {m: {} for m in modes}
        for plen, olen in pairs:
            _warm(targets, a, plen, olen, slo)
            got: dict = {m: [] for m in modes}
            for i, spec in enumerate(cell_specs(a, plen, olen, 0.0, None)):
                for m in modes[i % len(modes):] + modes[:i % len(modes)]:
                    got[m].append(asyncio.run(_ttft(targets[m], spec, slo)))
            for m, xs in got.items():
                xs = [x for x in xs if x is not None]
                out[m][f"{plen}x{olen}"] = {"ttft_s": statistics.median(xs) if xs else None, "n": len(xs),
                                            "ttft_p90_s": MX.percentile(xs, 0.9) if xs else None, "ttfts_s": xs}
        return out
    finally:
        for d in deps.values():
            d.stop()
