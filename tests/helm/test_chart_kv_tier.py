"""Chart values of the host / disk KV tier reach each worker pool's engine through its PDSERVE_* env, parsed by
pdserve's own parser (a large byte count must not turn into a float on the way)."""
from __future__ import annotations

from pdserve.services.worker import engine_config_from_args
from tests.helm._chart import objects, parse_pdserve, pdserve_containers


def test_kv_tier_values_reach_the_worker_pools(monkeypatch):
    vals = {"mode": "disagg",
            "decode": {"kvOffloadBytes": 64 * 2**30, "kvOffloadDir": "/kvtier",
                       "kvOffloadDiskBytes": 512 * 2**30},
            "prefill": {"kvOffloadBytes": 8 * 2**30}}
    seen = {}
    for o, c in pdserve_containers(objects(vals)):
        args = parse_pdserve(c, monkeypatch)
        if args.command != "worker":
            continue
        cfg = engine_config_from_args(args)
        seen[args.role] = (cfg.kv_offload_bytes, cfg.kv_offload_dir, cfg.kv_offload_disk_bytes)
    assert seen == {"decode": (64 * 2**30, "/kvtier", 512 * 2**30), "prefill": (8 * 2**30, None, None)}
    for o, c in pdserve_containers(objects({})):  # unset: the tier is off
        args = parse_pdserve(c, monkeypatch)
        if args.command == "worker":
            assert engine_config_from_args(args).kv_offload_bytes == 0
