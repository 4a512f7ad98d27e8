"""KV pool sizing: the arithmetic (checked against hand-computed figures), the precedence of the knobs, and the
worker flags / PDSERVE_* variables that set them."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_sizing import (
    CPU_DEFAULT_KV_BYTES,
    KVSizingError,
    MemoryProfile,
    block_bytes_for,
    graph_logits_bytes,
    heaviest_sampling,
    num_blocks,
    pool_blocks,
    swap_blocks,
)

GIB = 1 << 30


def test_block_bytes_llama3_8b_bf16():
    # 32 layers x K,V x 16 tokens x 8 KV heads x 128 dims x 2 bytes = 2 MiB
    assert block_bytes_for(32, 16, 8, 128, torch.bfloat16) == 2 * 1024 * 1024
    assert block_bytes_for(2, 4, 2, 16, torch.float32) == 2 * 2 * 4 * 2 * 16 * 4


def test_pool_takes_what_is_left_under_the_fraction():
    # H200-like: 141 GiB x 0.9 = 126.9 GiB; 16 GiB weights, 3 GiB activations, 0.5 GiB context -> 107.4 GiB left
    prof = MemoryProfile(total_bytes=141 * GIB, weight_bytes=16 * GIB, activation_peak_bytes=3 * GIB,
                         non_torch_bytes=GIB // 2)
    left = int(141 * GIB * 0.9) - 16 * GIB - 3 * GIB - GIB // 2
    assert pool_blocks(prof, 0.9, 2 << 20) == left // (2 << 20)
    assert pool_blocks(prof, 0.9, 2 << 20) == 54988  # 107.39 GiB / 2 MiB, by hand
    assert pool_blocks(prof, 0.5, 2 << 20) < pool_blocks(prof, 0.9, 2 << 20)


def test_no_room_names_the_parts():
    prof = MemoryProfile(total_bytes=24 * GIB, weight_bytes=16 * GIB, activation_peak_bytes=6 * GIB,
                         non_torch_bytes=GIB)
    with pytest.raises(KVSizingError,
                       match=r"weights 16\.00 \+ activations 6\.00 \+ CUDA context 1\.00 \+ CUDA graphs 0\.00 GiB"):
        pool_blocks(prof, 0.9, 2 << 20)


def test_cuda_graphs_logits_buffer_is_reserved():
    # one fp32 buffer for the largest captured batch: 256 x 128256 x 4 bytes = 125.25 MiB; 12 sequences are
    # captured up to 16 (1, 2, 4, 8, 16)
    assert graph_logits_bytes(256, 128256) == 256 * 128256 * 4
    assert graph_logits_bytes(12, 1000) == 16 * 1000 * 4
    assert graph_logits_bytes(2048, 10) == 512 * 10 * 4  # capture stops at 512
    base = dict(total_bytes=141 * GIB, weight_bytes=16 * GIB, activation_peak_bytes=3 * GIB, non_torch_bytes=GIB)
    without = pool_blocks(MemoryProfile(**base), 0.9, 2 << 20)
    with_graphs = pool_blocks(MemoryProfile(**base, graph_bytes=GIB), 0.9, 2 << 20)
    assert without - with_graphs == 512  # 1 GiB / 2 MiB
    with pytest.raises(KVSizingError, match=r"CUDA graphs 2\.00 GiB"):
        pool_blocks(MemoryProfile(**{**base, "weight_bytes": 122 * GIB}, graph_bytes=2 * GIB), 0.9, 2 << 20)


def test_profiled_sampling_runs_the_whole_pipeline():
    """The pool sizing's sampler call (profile_cuda) takes every stage a request can ask for, so its peak is the
    sampler's largest working set; checked here on CPU with the sampler the engine uses."""
    from pdserve.engine.logits_processors import FILTERS
    from pdserve.engine.sampler import Sampler, _active
    V = 1000
    states = heaviest_sampling(4, V, torch.device("cpu"))
    p = states[0].params
    assert all(_active(p, V)[f] for f in FILTERS)
    assert p.repetition_penalty != 1 and p.frequency_penalty and p.presence_penalty and p.seed is not None
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float() * 3
    results = Sampler(V).sample(logits, states)
    assert len(results) == 4
    for row, r in zip(logits, results):
        assert r.token_id in set(row.topk(50).indices.tolist())  # inside top-k's support
        assert len(r.top_logprobs) == 20


@pytest.mark.parametrize("util", [0.0, 1.5, -0.1])
def test_bad_fraction(util):
    with pytest.raises(KVSizingError):
        pool_blocks(MemoryProfile(GIB, 0, 0, 0), util, 1024)


def test_precedence_on_cpu():
    """num_gpu_blocks > kv_cache_bytes > the CPU default (no model is touched on these paths)."""
    cpu = torch.device("cpu")
    assert num_blocks(EngineConfig(num_gpu_blocks=7, kv_cache_bytes=1 << 20), None, cpu, 1024) == 7
    assert num_blocks(EngineConfig(kv_cache_bytes=10 * 1024 + 5), None, cpu, 1024) == 10
    assert num_blocks(EngineConfig(kv_cache_bytes=5), None, cpu, 1024) == 1
    assert num_blocks(EngineConfig(), None, cpu, 1 << 20) == CPU_DEFAULT_KV_BYTES >> 20


def test_swap_blocks_from_gib():
    assert swap_blocks(EngineConfig(), 1024) == 0
    assert swap_blocks(EngineConfig(swap_space=1.5), 1 << 20) == 1536
    assert swap_blocks(EngineConfig(swap_space=1.0, num_cpu_blocks=3), 1 << 20) == 3  # the explicit count wins
    with pytest.raises(KVSizingError, match="swap-space"):
        swap_blocks(EngineConfig(swap_space=1e-9), 1 << 20)


@pytest.mark.parametrize("kw", [dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.01),
                                dict(kv_cache_bytes=0), dict(max_model_len=1), dict(attention="flash"),
                                dict(preemption_mode="swap"), dict(preemption_mode="evict", swap_space=1.0),
                                dict(swap_space=-1.0), dict(swap_space=float("nan"))])
def test_engine_config_rejects(kw):
    with pytest.raises(ValueError):
        EngineConfig(**kw).validate()


def test_worker_flags_and_env_reach_the_engine_config(monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.services.worker import engine_config_from_args
    monkeypatch.setenv("PDSERVE_GPU_MEMORY_UTILIZATION", "0.8")
    monkeypatch.setenv("PDSERVE_MAX_NUM_BATCHED_TOKENS", "4096")
    monkeypatch.setenv("PDSERVE_SWAP_SPACE", "2.5")
    args = build_parser().parse_args(["worker", "--role", "both", "--kv-cache-bytes", "1048576", "--block-size",
                                      "32", "--max-model-len", "8192", "--max-num-seqs", "128",
                                      "--dtype", "bfloat16", "--preemption-mode", "swap"])
    cfg = engine_config_from_args(args)
    assert (cfg.gpu_memory_utilization, cfg.max_num_batched_tokens, cfg.kv_cache_bytes, cfg.block_size,
            cfg.max_model_len, cfg.max_num_seqs, cfg.dtype) == (0.8, 4096, 1 << 20, 32, 8192, 128, "bfloat16")
    assert (cfg.preemption_mode, cfg.swap_space) == ("swap", 2.5)
    cfg.validate()
    monkeypatch.delenv("PDSERVE_SWAP_SPACE")
    unset = engine_config_from_args(build_parser().parse_args(["worker", "--role", "both"]))
    assert unset.kv_cache_bytes is None and unset.block_size == 16 and unset.max_model_len is None
    assert (unset.preemption_mode, unset.swap_space) == ("recompute", 0.0)


@pytest.mark.parametrize("argv,want", [
    (["--gpu-memory-utilization", "1.2"], "'1.2' must be <= 1"),
    (["--gpu-memory-utilization", "0"], "'0' must be > 0"),
    (["--kv-cache-bytes", "8GiB"], "'8GiB' is not an integer"),
    (["--max-model-len", "1"], "'1' must be >= 2"),
    (["--block-size", "0"], "'0' must be >= 1"),
    (["--preemption-mode", "evict"], "invalid choice: 'evict'"),
    (["--swap-space", "-1"], "'-1' must be >= 0"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, want):
    from pdserve.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["worker", "--role", "both", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert want in err and argv[0] in err and len(err.strip().splitlines()) == 1


def test_profiling_step_runs_the_largest_step(tiny_llama):
    """The forward and sampler call that profile_cuda measures (never run on CPU otherwise): a full chunk of
    prompt tokens over a scratch pool, logits for max_num_seqs rows, the heaviest sampling over them."""
    from pdserve.engine.engine import Engine
    from pdserve.engine.kv_sizing import profiling_step
    engine = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=8, block_size=4, attention="torch"))
    model = engine.runner.model
    cfg = model.cfg
    scratch = profiling_step(model, torch.device("cpu"), 64, 8, 4)
    assert scratch == block_bytes_for(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32) * 16


# ---- spec §4.1's KV bytes per token, generalised (KVFootprint) ---------------------------------------------------
# The published config.json fields of the two models, as ModelConfig reads them (no weights needed).
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "vocab_size": 129280, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "n_shared_experts": 1, "n_group": 8,
               "topk_group": 4, "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}
GPT_OSS_120B = {"architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
                "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                "vocab_size": 201088, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
                "torch_dtype": "bfloat16"}


def _config(tmp_path, cfg):
    import json

    from pdserve.engine.config import ModelConfig
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_dir(tmp_path)


def test_mla_bytes_per_token_deepseek_v3(tmp_path):
    """61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) = 576 values per token per layer, 2 bytes in bf16:
    70,272 bytes a token, against 61 x 128 heads x (128 + 64 + 128) x 2 = 4,996,096 for per-head K and V."""
    from pdserve.engine.kv_sizing import KVFootprint
    kv = KVFootprint.of_config(_config(tmp_path, DEEPSEEK_V3), 2)
    assert kv.values_per_layer == (576,) * 61 and kv.windows == (None,) * 61
    assert kv.bytes_per_token == 61.0 * 576.0 * 2.0 == 70272.0
    assert kv.bytes_held(4096) == 70272.0 * 4096.0 == 287834112.0
    assert 61 * 128 * (128 + 64 + 128) * 2 / kv.bytes_per_token == pytest.approx(71.1, abs=0.05)
    # the engine's pool for it (config.py: one "head" of (512 + 64) / 2, K and V) holds the same bytes per block
    mc = _config(tmp_path, DEEPSEEK_V3)
    assert block_bytes_for(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.bfloat16) == 16 * 70272


def test_sliding_window_bytes_gpt_oss_120b(tmp_path):
    """36 layers alternating a 128-token window and full attention, 8 KV heads x 64 dims: 2 x 8 x 64 = 1024 values
    per token per layer, 2048 bytes in bf16. A token held by every layer: 36 x 2048 = 73,728 bytes. One sequence of
    c tokens with windows honoured: 2048 x (18 c + 18 min(c, 128))."""
    from pdserve.engine.kv_sizing import KVFootprint
    kv = KVFootprint.of_config(_config(tmp_path, GPT_OSS_120B), 2)
    assert kv.windows == (128, None) * 18 and kv.values_per_layer == (1024,) * 36
    assert kv.bytes_per_token == 73728.0
    assert kv.bytes_held(100) == 2048.0 * 36 * 100 == 7372800.0          # inside the window: every layer holds all
    assert kv.bytes_held(4096) == 2048.0 * (18 * 4096 + 18 * 128) == 155713536.0
    assert kv.bytes_held(131072) / (73728.0 * 131072) == pytest.approx(0.5 + 0.5 * 128 / 131072)  # -> half at long ctx
    # a step's reads: 3 sequences of 1000 tokens each read 1000 in a full layer, 128 in a windowed one
    assert kv.bytes_read(3000, 3) == 2048.0 * (18 * 3000 + 18 * 3 * 128)
    with pytest.raises(ValueError, match="windows"):
        KVFootprint((4, 4), (None,), 2)
