"""Chart values of the GPU pools' engine: the GPU request, KV pool sizing, batch sizes, dtype,
block size, context limit and preemption reach each worker pool's engine, parsed by pdserve's own parser and
turned into the EngineConfig the worker builds (a byte count must not turn into a float on the way)."""
from __future__ import annotations

import json

import pytest

from pdserve.services.worker import engine_config_from_args
from tests.helm._chart import FULL, by_kind, helm, objects, parse_pdserve, pdserve_containers, pod_template, render

FLAGS = ("--block-size", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-bytes",
         "--gpu-memory-utilization", "--preemption-mode", "--swap-space", "--num-gpu-blocks", "--dtype")


def worker_configs(vals, monkeypatch) -> dict[str, tuple]:
    out = {}
    for o, c in pdserve_containers(objects(vals)):
        args = parse_pdserve(c, monkeypatch)
        if args.command != "worker":
            continue
        cfg = engine_config_from_args(args)
        cfg.validate()
        res = c["resources"]
        out[args.role] = (cfg, res["requests"].get("nvidia.com/gpu"), res["limits"].get("nvidia.com/gpu"), c["args"])
    return out


def test_gpu_pool_values_reach_the_engine(monkeypatch):
    vals = {"mode": "disagg",
            "workers": {"dtype": "bfloat16", "blockSize": 32, "maxModelLen": 32768},
            "prefill": {"gpus": 2, "maxNumSeqs": 16, "maxNumBatchedTokens": 16384, "gpuMemoryUtilization": 0.85},
            "decode": {"gpus": 1, "maxNumSeqs": 256, "maxNumBatchedTokens": 512, "kvCacheBytes": 60 * 2**30 + 1,
                       "preemptionMode": "swap", "swapSpace": 16}}
    seen = worker_configs(vals, monkeypatch)
    pre, pre_req, pre_lim, _ = seen["prefill"]
    dec, dec_req, dec_lim, _ = seen["decode"]
    assert (pre_req, pre_lim, dec_req, dec_lim) == (2, 2, 1, 1)
    for cfg in (pre, dec):  # shared by both pools: their KV layouts must agree for NIXL
        assert (cfg.dtype, cfg.block_size, cfg.max_model_len, cfg.device) == ("bfloat16", 32, 32768, "cuda")
    assert (pre.max_num_seqs, pre.max_num_batched_tokens, pre.gpu_memory_utilization, pre.kv_cache_bytes) == \
        (16, 16384, 0.85, None)
    assert (pre.preemption_mode, pre.swap_space) == ("recompute", 0.0)
    assert (dec.max_num_seqs, dec.max_num_batched_tokens, dec.kv_cache_bytes) == (256, 512, 60 * 2**30 + 1)
    assert (dec.preemption_mode, dec.swap_space, dec.gpu_memory_utilization) == ("swap", 16.0, 0.9)


def test_colocated_pool_and_fractional_swap_space(monkeypatch):
    vals = {"mode": "colocated", "worker": {"gpus": 4, "preemptionMode": "swap", "swapSpace": 0.5,
                                            "gpuMemoryUtilization": 0.95}}
    cfg, req, lim, _ = worker_configs(vals, monkeypatch)["both"]
    assert (req, lim, cfg.preemption_mode, cfg.swap_space, cfg.gpu_memory_utilization) == (4, 4, "swap", 0.5, 0.95)


def test_defaults_leave_the_engine_defaults(monkeypatch):
    """Unset values pass no flag: the engine's own defaults (KV pool from 0.9 of the GPU, block 16, ...) apply."""
    seen = worker_configs({}, monkeypatch)
    for role, (cfg, req, lim, args) in seen.items():
        assert not [a for a in args if a in FLAGS], (role, args)
        assert (req, lim) == (1, 1)  # a GPU pool requests its GPU by default
        assert (cfg.block_size, cfg.max_num_batched_tokens, cfg.gpu_memory_utilization, cfg.kv_cache_bytes,
                cfg.preemption_mode, cfg.swap_space) == (16, 2048, 0.9, None, "recompute", 0.0)


def test_cpu_pool_requests_no_gpu():
    d = by_kind(objects({"workers": {"device": "cpu"}, "prefill": {"gpus": 0}, "decode": {"gpus": 0}}), "Deployment")
    for pool in ("prefill", "decode"):
        assert "nvidia.com/gpu" not in json.dumps(pod_template(d[f"{FULL}-{pool}"]))


def test_bad_engine_values_are_refused():
    for bad in ({"decode": {"gpuMemoryUtilization": 1.5}}, {"decode": {"gpuMemoryUtilization": 0}},
                {"prefill": {"preemptionMode": "evict"}}, {"decode": {"swapSpace": -1}},
                {"workers": {"blockSize": 0}}, {"workers": {"maxModelLen": "8k"}},
                {"decode": {"kvCacheBytes": "60Gi"}}, {"prefill": {"maxNumBatchedTokens": 0}}):
        with pytest.raises(helm.HelmError):
            render(bad)
    with pytest.raises(helm.HelmError, match="decode.preemptionMode swap needs decode.swapSpace"):
        render({"decode": {"preemptionMode": "swap"}})


def test_rendered_decode_flags_build_an_engine_that_swaps(tiny_llama, monkeypatch):
    """The chain values -> args -> flags -> EngineConfig -> Engine, on the tiny checkpoint and CPU: the decode pool's
    rendered flags give a 14-block pool of 4-token blocks that must preempt six sequences, by swap into the host pool
    the swap space buys, and the greedy tokens equal an unconstrained engine's."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams

    vals = {"mode": "disagg", "workers": {"device": "cpu", "blockSize": 4, "maxModelLen": 128},
            "decode": {"gpus": 0, "numGpuBlocks": 14, "maxNumSeqs": 6, "maxNumBatchedTokens": 64,
                       "preemptionMode": "swap", "swapSpace": 0.001}}
    cfg = worker_configs(vals, monkeypatch)["decode"][0]
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 32, 9, 40, 16)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng = Engine.from_pretrained(tiny_llama, cfg)
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, greedy)]
    assert eng.scheduler.num_preemptions["swap"] > 0 and eng.block_manager.num_cpu_blocks > 0
    ref = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=256))
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, greedy)]
