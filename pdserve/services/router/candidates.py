"""The cache-aware policy's first step: which placements a request may take, by mode (cache_aware.py scores them).

- local: one worker prefills and decodes: every `both` worker, and in `auto` (and `local`) every `decode` worker
  (it prefills the prompt itself; every role answers Generate - services/worker.py);
- pairs: every (prefill, decode) pair.

`colocated` uses `both` workers, or pairs when there is no `both` worker (serve rather than fail); `disagg` uses
pairs, or `both` workers when no pair is possible; `local` never pairs (a migrated request resumes on one worker:
gateway/migration.py). Decode workers with no pair possible prefill locally: the prefill pool is down or all of
it is excluded for this request - `degraded` says which, and the policy counts and logs it, never silent.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.router.cost import WorkerCost
from pdserve.services.router.placement import NoWorkers


@dataclass
class Candidates:
    local: list[WorkerCost]
    pairs: list[tuple[WorkerCost, WorkerCost]]  # (prefill, decode)
    degraded: str = ""  # "" | prefill_excluded | prefill_pool_down
    decode_pool: bool = False  # any live decode worker (the reason a local choice gives depends on it)


def candidates(mode: str, live: list[WorkerCost], had_prefill: bool, n_excluded: int) -> Candidates:
    """`live`: the workers not excluded; `had_prefill`: whether any prefill worker is up, excluded or not."""
    pre = [c for c in live if c.rec.role == "prefill"]
    dec = [c for c in live if c.rec.role == "decode"]
    both = [c for c in live if c.rec.role == "both"]
    if not (pre or dec or both):
        raise NoWorkers(f"no live workers (prefill=0, decode=0, both=0; excluded {n_excluded})")
    local, pairs = _by_mode(mode, pre, dec, both)
    if not pairs and not local and dec:
        local = dec  # decode workers exist but no pair is possible: the prefill pool is down
    degraded = ""
    if dec and not pre and any(x in local for x in dec):
        degraded = "prefill_excluded" if had_prefill else "prefill_pool_down"
    if not pairs and not local:
        raise NoWorkers(f"no placement (prefill={len(pre)}, decode={len(dec)}, both={len(both)}, mode={mode})")
    return Candidates(local, pairs, degraded, bool(dec))


def _by_mode(mode: str, pre: list[WorkerCost], dec: list[WorkerCost],
             both: list[WorkerCost]) -> tuple[list[WorkerCost], list[tuple[WorkerCost, WorkerCost]]]:
    pairs = [(p, d) for p in pre for d in dec]
    if mode == "colocated":
        return both, ([] if both else pairs)
    if mode == "local":
        return both + dec, []
    if mode == "disagg":
        return (both if not pairs else []), pairs
    return both + dec, pairs  # auto
