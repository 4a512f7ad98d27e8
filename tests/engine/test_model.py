"""Logits and greedy continuations against HF transformers on tiny random checkpoints (fp32).

Tolerance: max |logit difference| <= 2e-4 (fp32, different kernels and summation orders); greedy tokens equal.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq
from tests.conftest import make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 61)), [3]]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied": dict(arch="llama", rope_scaling=LLAMA3, tie=True),
    "mistral": dict(arch="mistral"),
    "mistral-sliding-window-8": dict(arch="mistral", sliding_window=8),
    "qwen2-qkv-bias": dict(arch="qwen2"),
    "llama-sharded-mha": dict(arch="llama", sharded=True, kv_heads=4),
    # q/k norms; head_dim 32 with hidden 64 and 4 heads: q is wider than the hidden state
    "qwen3-qk-norm-head-dim-32": dict(arch="qwen3", head_dim=32),
    # layer 0 sparse (weights renormalised over the top 2), layer 1 dense by mlp_only_layers
    "qwen3-moe-norm-topk-dense-layer": dict(arch="qwen3_moe", norm_topk_prob=True, mlp_only_layers=[1]),
    # layer 1 sparse by decoder_sparse_step=2, raw softmax weights; top 3 of 6 experts
    "qwen3-moe-sparse-step-2": dict(arch="qwen3_moe", decoder_sparse_step=2, num_experts=6, num_experts_per_tok=3),
    "mixtral": dict(arch="mixtral"),
    # attention sinks, windowed layers 0 and 2 (window 6) and full layers 1 and 3, YaRN rope, biased router and
    # experts with the clamped gate
    "gpt-oss": dict(arch="gpt_oss", layers=4),
    # fused qkv_proj and gate_up_proj in the checkpoint; with Mistral's one window for every layer
    "phi3": dict(arch="phi3"),
    "phi3-sliding-window-8": dict(arch="phi3", sliding_window=8),
    # latent attention with interleaved rope, a dense layer then 2 MoE layers (grouped router, shared expert)
    "deepseek-v3": dict(arch="deepseek_v3", layers=3),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def engine_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through the paged path (chunked in 3 pieces to exercise the cache)."""
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=1))
    seq = engine.requests["probe"].seqs[0]
    rows = []
    cuts = sorted({0, len(prompt) // 3, 2 * len(prompt) // 3, len(prompt)})
    for a, b in zip(cuts, cuts[1:]):
        engine.block_manager.allocate(seq, b - a)
        logits, _ = engine.runner.execute([ScheduledSeq(seq, b - a)], prompt_logits={0})
        seq.num_computed_tokens += b - a
        rows.append(logits)
    engine.abort("probe")
    engine.step()
    return torch.cat(rows)


def test_logits_match_transformers(checkpoint):
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(checkpoint, EngineConfig(num_gpu_blocks=64, block_size=4))
    for prompt in PROMPTS:
        ours = engine_logits(engine, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 2e-4
    assert engine.block_manager.blocks_in_use == 0


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "torch-decode"])
def test_greedy_batch_matches_transformers(checkpoint, native):
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(checkpoint, EngineConfig(num_gpu_blocks=64, block_size=4, native_kernels=native))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
def test_bfloat16_close_to_fp32(tiny_llama, native):
    """bf16 through the native kernels (prefill attention over the pool, chunked here; norms, rope, SwiGLU) and
    through the torch ops, each against the fp32 engine (itself checked against transformers above)."""
    e32 = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=32, block_size=4))
    e16 = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=32, block_size=4, dtype="bfloat16",
                                                          native_kernels=native))
    if native and e16.runner.native_ops is not None:
        import os
        assert e16.runner.native_prefill or os.environ.get("PDSERVE_NATIVE_KERNELS") == "0" or \
            not e16.runner.native_ops.prefill_attention_supported(e16.kv_cache.data, 4)
    a, b = engine_logits(e32, PROMPTS[0]), engine_logits(e16, PROMPTS[0])
    assert e16.kv_cache.data.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits; the argmax at each position must agree where fp32 is decisive
    decisive = (a.topk(2).values[:, 0] - a.topk(2).values[:, 1]) > 0.1
    assert torch.equal(a.argmax(-1)[decisive], b.argmax(-1)[decisive])
    assert (a - b).abs().max().item() < 0.1


def test_prompt_logprobs_match_transformers(tiny_llama):
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(tiny_llama, EngineConfig(num_gpu_blocks=64, block_size=4,
                                                             max_num_batched_tokens=5))  # prompt spans chunks
    prompt = PROMPTS[2]
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # warm the prefix cache
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for j in range(1, len(prompt)):
        assert got[j].token_id == prompt[j]
        assert abs(got[j].logprob - ref[j - 1, prompt[j]].item()) < 1e-4
        assert [t for t, _ in got[j].top_logprobs] == ref[j - 1].topk(3).indices.tolist()


def test_float16_checkpoint_runs_and_agrees(tmp_path):
    fp16 = make_checkpoint(tmp_path / "fp16", dtype=torch.float16)
    e16 = Engine.from_pretrained(fp16, EngineConfig(num_gpu_blocks=32, block_size=4, dtype="float16"))
    assert e16.kv_cache.data.dtype == torch.float16
    e32 = Engine.from_pretrained(fp16, EngineConfig(num_gpu_blocks=32, block_size=4))
    assert e32.kv_cache.data.dtype == torch.float32  # "auto" on a CPU computes fp16 checkpoints in fp32
    a, b = engine_logits(e32, PROMPTS[2]), engine_logits(e16, PROMPTS[2])
    assert (a - b).abs().max().item() < 0.05


@pytest.mark.parametrize("variant", ["llama", "llama3-rope-tied"])
def test_rope_frequencies_stay_float32_in_a_bf16_model(tmp_path, variant):
    """transformers keeps RoPE's inverse frequencies in fp32 when the weights are bf16; rounded to bf16 they turn
    distant positions by a different angle (0.5623 -> 0.5625 rad/token is 0.2 rad apart after 1000 tokens)."""
    ckpt = make_checkpoint(tmp_path, **VARIANTS[variant], dtype=torch.bfloat16)
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4, dtype="bfloat16"))
    ours = engine.runner.model.inv_freq
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).model.rotary_emb.inv_freq
    assert engine.kv_cache.data.dtype == torch.bfloat16
    assert ours.dtype == hf.dtype == torch.float32
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)
