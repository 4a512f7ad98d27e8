"""The transport self-test a decode worker runs when it first meets a prefill peer: real NIXL READs of the peer's
pool into a registered scratch buffer, timed. One block (after a first one that may set up the connection) gives
the latency of a READ (post to completion); a larger READ, sized from it to take about `target_s` (at least
MIN_BYTES where that takes under a second, at most `max_bytes`), gives the bandwidth. Its
figures feed the router's transfer cost (the decode worker's `kv_bytes_per_s`, services/load_meter.py) before
enough real pulls have been measured, and the per-pair probe gauges.

The bytes read are whatever the peer's blocks hold (they are discarded): no lease, no notification, nothing on
the peer changes. A READ that fails or times out is no measurement; the worker's pulls go on as before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.agent import KVAgent
from pdserve.kv_transfer.layout import KVRegion
from pdserve.kv_transfer.tp_plan import descs

MAX_BYTES = 4 << 20  # enough for a bandwidth on 10 Gbit/s links and up, little on slow ones (sized by target_s)
MIN_BYTES = 1 << 20  # so one READ's fixed cost does not pass for the link's rate (unless that would take > 1 s)
TARGET_S = 0.25


@dataclass(frozen=True)
class LinkProbe:
    latency_s: float    # one block's READ, post to completion
    bytes_per_s: float  # the larger READ's bytes over its time
    nbytes: int         # bytes of the larger READ


def probe_link(agent: KVAgent, region: KVRegion, timeout_s: float = 5.0, target_s: float = TARGET_S,
               max_bytes: int = MAX_BYTES) -> LinkProbe:
    """Time a 1-block READ and a larger one from the peer's pool; raises what KVAgent.read_descs raises."""
    lay = region.layout
    block = lay.block_bytes or agent.block_bytes
    _timed_read(agent, region, 1, block, timeout_s)  # the first READ of a pair may still set up its connection
    t1 = _timed_read(agent, region, 1, block, timeout_s)
    rough = block / t1  # a floor: one block's time is mostly the READ's fixed cost
    want = min(max_bytes, max(rough * target_s, min(MIN_BYTES, rough * 1.0)))
    n = max(2, min(region.num_blocks, int(want // block)))
    tn = _timed_read(agent, region, n, block, timeout_s)
    return LinkProbe(latency_s=t1, bytes_per_s=n * block / tn, nbytes=n * block)


def _timed_read(agent: KVAgent, region: KVRegion, n: int, block: int, timeout_s: float) -> float:
    lay = region.layout
    with agent.staging((n * block,), torch.uint8) as stage:
        local = descs(lay, stage.data_ptr(), list(range(n)), 0, lay.num_kv_heads, agent.device_id, True)
        remote = descs(lay, region.base_addr, list(range(n)), 0, lay.num_kv_heads, region.device_id, True)
        t0 = time.perf_counter()
        agent.read_descs([(region, local, remote)], b"", timeout_s)
        return max(time.perf_counter() - t0, 1e-9)
