"""EngineStatsExporter (services/metrics/worker.py): the engine's cumulative totals become Prometheus counters
incremented by what grew since the last snapshot, and its instantaneous values become gauges."""
from __future__ import annotations

from pdserve.engine.kv_offload import TierStats
from pdserve.engine.spec_decode.decoder import SpecStats
from pdserve.engine.stats import EngineStats
from pdserve.services.metrics import worker as M


def _value(name: str, **labels) -> float:
    return M.WORKER.get_sample_value(name, labels) or 0.0


COUNTERS = ("pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_hits_total",
            "pdserve_spec_verify_steps_total", "pdserve_spec_proposed_tokens_total",
            "pdserve_spec_accepted_tokens_total", "pdserve_spec_emitted_tokens_total")


def test_counters_grow_by_the_engine_totals_and_gauges_follow():
    exp = M.EngineStatsExporter(["DECODING"])
    before = {n: _value(n) for n in COUNTERS}
    host0 = _value("pdserve_kv_tier_hit_tokens_total", tier="host")
    dev0 = _value("pdserve_kv_tier_hit_tokens_total", tier="device")
    moved0 = _value("pdserve_kv_offload_bytes_total", direction="host_to_device")

    def snap(q, h, steps, proposed, accepted, emitted, host_hits):
        return EngineStats(kv_blocks_in_use=3, kv_blocks_total=12, states={"DECODING": 2},
                           prefix_queried_tokens=q, prefix_hit_tokens=h,
                           spec=SpecStats(steps, proposed, accepted, emitted),
                           tier=TierStats(host_blocks_in_use=1, host_blocks_total=8, disk_blocks_in_use=0,
                                          disk_blocks_total=0, recalls=0, recalls_in_flight=0, recall_seconds=(),
                                          bytes_moved={"host_to_device": 4096 * host_hits},
                                          hit_tokens={"host": host_hits}))

    exp.update(snap(100, 40, 5, 20, 12, 17, 8))
    exp.update(snap(100, 40, 5, 20, 12, 17, 8))  # unchanged: nothing added
    exp.update(snap(160, 64, 9, 36, 20, 29, 16))
    exp.update(snap(150, 60, 9, 36, 20, 29, 16))  # a total that went down (not a real engine's): never negative
    grown = {n: _value(n) - before[n] for n in COUNTERS}
    assert grown == dict(zip(COUNTERS, (160, 64, 9, 36, 20, 29)))
    assert _value("pdserve_kv_tier_hit_tokens_total", tier="host") - host0 == 16
    assert _value("pdserve_kv_tier_hit_tokens_total", tier="device") - dev0 == 64 - 16
    assert _value("pdserve_kv_offload_bytes_total", direction="host_to_device") - moved0 == 4096 * 16
    assert _value("pdserve_kv_usage_fraction") == 3 / 12 and _value("pdserve_requests_in_state", state="DECODING") == 2
    assert _value("pdserve_spec_acceptance_rate") == 20 / 36
    assert _value("pdserve_spec_mean_accepted_length") == 29 / 9


def test_expert_tokens_sum_over_layers_and_imbalance_is_the_worst_layer():
    exp = M.EngineStatsExporter([])
    before = [_value("pdserve_moe_expert_tokens_total", expert=str(e)) for e in range(4)]
    exp.update(EngineStats(expert_tokens=[[3, 1, 0, 0], [1, 1, 1, 1]]))
    exp.update(EngineStats(expert_tokens=[[5, 1, 1, 1], [2, 2, 2, 2]]))
    grown = [_value("pdserve_moe_expert_tokens_total", expert=str(e)) - before[e] for e in range(4)]
    assert grown == [7, 3, 3, 3]
    assert _value("pdserve_moe_expert_imbalance") == 5 * 4 / 8  # layer 0: busiest 5, mean 2
