"""Qwen3, Qwen3-MoE and Mixtral beyond the logits checks of test_model.py: scheduling does not change their greedy
tokens (chunked prefill, prefix-cache hits), the native decoder stack stays off for their layers, bf16 agrees with
transformers in bf16, and what is not supported (MoE with tensor parallelism) is refused by name."""
from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch
import transformers as tf

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.errors import CheckpointError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.preflight import check_model, check_tp_degrees
from tests.conftest import make_checkpoint
from tests.engine.test_model import engine_logits

PROMPTS = [list(range(10, 10 + n)) for n in (3, 17, 32, 9, 40, 16)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ARCHS = {
    "qwen3": dict(arch="qwen3", head_dim=32),
    "qwen3-moe": dict(arch="qwen3_moe", norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(arch="mixtral"),
    "gpt-oss": dict(arch="gpt_oss"),  # layer 0 windowed (6 tokens, shorter than most prompts), layer 1 full
    "deepseek-v3": dict(arch="deepseek_v3"),  # latent attention; layer 0 dense, layer 1 MoE with a shared expert
    "phi3": dict(arch="phi3", sliding_window=8),  # fused checkpoint projections; Llama's layer once loaded
}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), **ARCHS[request.param])


def run(ckpt, prompts=PROMPTS, **cfg) -> tuple[list[list[int]], Engine]:
    eng = Engine.from_pretrained(ckpt, EngineConfig(block_size=4, **{"num_gpu_blocks": 128, **cfg}))
    return [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)], eng


def test_chunked_prefill_and_prefix_cache_same_tokens(checkpoint):
    reference, _ = run(checkpoint, enable_chunked_prefill=False, enable_prefix_caching=False,
                       max_num_batched_tokens=4096)
    chunked, eng = run(checkpoint, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert chunked == reference
    assert max(t for _, t in eng.batch_sizes) == 7  # prompts of up to 40 tokens really were chunked
    eng = Engine.from_pretrained(checkpoint, EngineConfig(block_size=4, num_gpu_blocks=128))
    first = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]
    again = eng.generate(PROMPTS, GREEDY)  # every full block of every prompt is cached now
    assert first == reference and [o.outputs[0].token_ids for o in again] == reference
    assert again[4].num_cached_tokens == 36
    assert eng.block_manager.blocks_in_use == 0


def test_decoder_stack_stays_off_and_layers_take_their_form(checkpoint):
    """The native stack computes q/k norms (Qwen3) and softmax top-k experts on the native MoE kernel (Qwen3-MoE,
    Mixtral), not sinks, latents or DeepSeek's / gpt-oss's experts: those models keep the per-layer Python loop.
    Phi-3 is Llama's layer once its fused projections are split: the stack takes it."""
    eng = Engine.from_pretrained(checkpoint, EngineConfig(block_size=4, num_gpu_blocks=32))
    model = eng.runner.model
    cfg = json.loads((checkpoint / "config.json").read_text())
    if model.stacks is not None:
        assert model.stacks.enabled == (cfg["architectures"][0] in ("Phi3ForCausalLM", "Qwen3ForCausalLM",
                                                                     "Qwen3MoeForCausalLM", "MixtralForCausalLM"))
    sparse = [layer.moe is not None for layer in model.layers]
    if cfg["architectures"][0] in ("Qwen3ForCausalLM", "Phi3ForCausalLM"):
        assert sparse == [False, False]
        assert all((layer.q_norm is not None) == cfg["architectures"][0].startswith("Qwen3") for layer in model.layers)
    elif cfg["architectures"][0] == "Qwen3MoeForCausalLM":
        assert sparse == [True, False]  # mlp_only_layers=[1]
    elif cfg["architectures"][0] == "DeepseekV3ForCausalLM":
        assert sparse == [False, True]  # first_k_dense_replace=1
        assert all(layer.mla is not None and layer.qkv is None for layer in model.layers)
    else:
        assert sparse == [True, True] and all(layer.q_norm is None for layer in model.layers)


def test_bfloat16_logits_close_to_transformers_bfloat16(checkpoint):
    """In bf16 the routing weights' rounding differs by architecture (moe.py); transformers in bf16 is the reference.
    bf16 keeps ~3 significant digits: 0.05 is a few units in the last place of these logits (|logit| < 4)."""
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    engine = Engine.from_pretrained(checkpoint, EngineConfig(num_gpu_blocks=64, block_size=4, dtype="bfloat16"))
    for prompt in PROMPTS[:3]:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (engine_logits(engine, prompt) - ref).abs().max().item() <= 0.05


def test_moe_refused_with_tensor_parallelism_by_name(tmp_path):
    d = make_checkpoint(tmp_path / "mx", "mixtral")
    with pytest.raises(CheckpointError, match="experts of a mixture-of-experts model are not sharded"):
        Engine.from_pretrained(d, EngineConfig(tensor_parallel_size=2))
    args = Namespace(mode="disagg", model=str(d), tensor_parallel_size=1, prefill_tp=2, decode_tp=1)
    problem = check_tp_degrees(args)
    assert problem is not None and "--prefill-tp 2" in problem.what and "not sharded" in problem.what


def test_preflight_accepts_new_architectures_and_names_unsupported(checkpoint, tmp_path):
    assert check_model(str(checkpoint)) is None
    cfg = json.loads((checkpoint / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["Llama4ForCausalLM"]}))
    problem = check_model(str(bad))
    assert "unsupported architecture 'Llama4ForCausalLM'" in problem.what
    assert "Qwen3MoeForCausalLM" in problem.fix and "MixtralForCausalLM" in problem.fix


@pytest.fixture(scope="module", params=["gpt_oss", "deepseek_v3"])
def featured(request, tmp_path_factory):
    """The architectures with their own attention path (sinks and per-layer windows; latent attention)."""
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, layers=4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_tokens(featured, mode):
    """A pool too small for all six prompts at once: sequences are preempted and resumed (recomputed or swapped
    back), and each layer's window and sinks (or latents) still give the same keys."""
    reference, _ = run(featured)
    small, eng = run(featured, num_gpu_blocks=24, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    assert eng.scheduler.num_preemptions[mode] > 0
    assert small == reference


@pytest.mark.parametrize("extra", [dict(speculative="ngram", num_speculative_tokens=3), dict(deterministic=True)],
                         ids=["ngram-speculation", "deterministic"])
def test_speculation_and_deterministic_mode_keep_greedy_tokens(featured, extra):
    """Verify steps (several query rows per sequence over the windowed or latent layers) and deterministic mode
    (every row a single-query attention) give the tokens of plain decoding."""
    reference, _ = run(featured)
    assert run(featured, **extra)[0] == reference


def test_n_copies_share_the_prompt(featured):
    """n=3 greedy copies fork one prefill (copy-on-write blocks) and all equal the single greedy answer."""
    reference, _ = run(featured, prompts=PROMPTS[:2])
    eng = Engine.from_pretrained(featured, EngineConfig(block_size=4, num_gpu_blocks=128))
    outs = eng.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r] * 3 for r in reference]


def test_mla_pool_holds_latents_fewer_bytes_than_per_head_kv(tmp_path):
    """DeepSeek's pool holds, per token and layer, the latent (kv_lora_rank=32) and the shared rotated key
    (qk_rope_head_dim=16); the same model caching per-head K (16 + 16) and V (24) for its 4 heads would hold 224.
    The P/D layout says "mla", and the pool's blocks are what a hand-off moves (KVCache.block_bytes)."""
    ckpt = make_checkpoint(tmp_path / "ds", "deepseek_v3", layers=3)
    eng = Engine.from_pretrained(ckpt, EngineConfig(block_size=4, num_gpu_blocks=16))
    cfg = json.loads((ckpt / "config.json").read_text())
    latent = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # fp32
    per_head = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 4
    assert eng.kv_cache.bytes_per_token == latent == 3 * 48 * 4
    assert eng.kv_cache.block_bytes == 4 * latent
    assert per_head == 3 * 4 * 56 * 4 and latent * 4 < per_head  # 576 vs 2688 bytes per token
    assert eng.kv_cache.layout()["kv_kind"] == "mla"
    llama = Engine.from_pretrained(make_checkpoint(tmp_path / "ll", "llama"), EngineConfig(block_size=4,
                                                                                          num_gpu_blocks=16))
    assert llama.kv_cache.layout()["kv_kind"] == "mha"


@pytest.mark.parametrize("rope,error", [({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
                                        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                          "original_max_position_embeddings": 64}, "unsupported rope scaling type 'longrope'")])
def test_phi_rope_forms_not_run_are_refused_by_name(tmp_path, rope, error):
    """Phi-4-mini rotates 3/4 of each head, Phi-3's 128k variants switch RoPE factors with the sequence length
    (longrope): neither is computed, and loading says which."""
    ckpt = make_checkpoint(tmp_path / "phi", "phi3")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **rope}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=error):
        Engine.from_pretrained(ckpt, EngineConfig(block_size=4, num_gpu_blocks=16))


def test_expert_tokens_count_what_transformers_router_chooses(tmp_path):
    """The engine's per-expert counts after one prompt equal the top-k choices of transformers' own router logits
    (Mixtral: top 2 of 4 per token and layer) on the same prompt; warm-up forwards are not counted."""
    from pdserve.engine.warmup import warm_up
    ckpt = make_checkpoint(tmp_path / "mx", "mixtral")
    eng = Engine.from_pretrained(ckpt, EngineConfig(block_size=4, num_gpu_blocks=64))
    warm_up(eng)
    assert eng.stats().expert_tokens == [[0] * 4, [0] * 4]
    prompt = PROMPTS[4]
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # one prefill, no decode step
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    want = [torch.bincount(lg.reshape(len(prompt), -1).topk(2, dim=-1).indices.flatten(), minlength=4).tolist()
            for lg in logits]
    assert eng.stats().expert_tokens == want
    assert all(sum(row) == 2 * len(prompt) for row in want)


def test_sink_attention_in_query_tiles_equals_float64(monkeypatch):
    """sink_attention takes queries a tile at a time (memory); with tiles of 3 over 10 queries (a chunk after 4
    cached tokens, GQA 4:2) it equals the softmax-with-sink computed whole in float64."""
    from pdserve.engine import attention as A
    monkeypatch.setattr(A, "SINK_QUERY_TILE", 3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, t, 8, generator=g) for n, t in ((4, 10), (2, 14), (2, 14)))
    sinks = torch.randn(4, generator=g)
    mask = A.causal_mask(10, 14, None, "cpu")
    got = A.sink_attention(q, k, v, mask, sinks, 0.3)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = (q.double() @ kk.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    ref = (e @ vv) / (e.sum(-1, keepdim=True) + torch.exp(sinks.double().view(1, 4, 1, 1) - s.amax(-1, keepdim=True)))
    assert (got.double() - ref).abs().max() < 1e-5
