"""Seam to `pdserve bench`: the simulator consumes bench's workload specs and trace reader and reports through
bench's metric math (one implementation; no copies here)."""
from __future__ import annotations

from pdserve.bench.metrics import SLO, ClientRecord, summarize  # noqa: F401
from pdserve.bench.workload import LengthDist, RequestSpec, load_trace, synthetic  # noqa: F401

BENCH = True


def make_workload(n: int, rate: float, prompt_len, output_len, seed: int = 0, process: str = "poisson",
                  vocab: int | None = None) -> list:
    """Synthetic open-loop workload with token-id prompts (what the simulator consumes)."""
    specs = synthetic(n, rate, LengthDist.parse(prompt_len), LengthDist.parse(output_len), seed=seed,
                      process=process)
    return specs
