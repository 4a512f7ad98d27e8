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
    """The native stack computes neither q/k norms nor experts: these models keep the per-layer Python loop."""
    eng = Engine.from_pretrained(checkpoint, EngineConfig(block_size=4, num_gpu_blocks=32))
    model = eng.runner.model
    if model.stacks is not None:
        assert not model.stacks.enabled
    cfg = json.loads((checkpoint / "config.json").read_text())
    sparse = [layer.moe is not None for layer in model.layers]
    if cfg["architectures"][0] == "Qwen3ForCausalLM":
        assert sparse == [False, False] and all(layer.q_norm is not None for layer in model.layers)
    elif cfg["architectures"][0] == "Qwen3MoeForCausalLM":
        assert sparse == [True, False]  # mlp_only_layers=[1]
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
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["DeepseekV3ForCausalLM"]}))
    problem = check_model(str(bad))
    assert "unsupported architecture 'DeepseekV3ForCausalLM'" in problem.what
    assert "Qwen3MoeForCausalLM" in problem.fix and "MixtralForCausalLM" in problem.fix


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpt-oss-features"), "gpt_oss", layers=4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_gpt_oss_preemption_keeps_greedy_tokens(gpt_oss, mode):
    """A pool too small for all six prompts at once: sequences are preempted and resumed (recomputed or swapped
    back), and each layer's window and sinks still see the same keys."""
    reference, _ = run(gpt_oss)
    small, eng = run(gpt_oss, num_gpu_blocks=24, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    assert eng.scheduler.num_preemptions[mode] > 0
    assert small == reference


@pytest.mark.parametrize("extra", [dict(speculative="ngram", num_speculative_tokens=3), dict(deterministic=True)],
                         ids=["ngram-speculation", "deterministic"])
def test_gpt_oss_speculation_and_deterministic_mode_keep_greedy_tokens(gpt_oss, extra):
    """Verify steps (several query rows per sequence over the windowed layers) and deterministic mode (every row
    a single-query attention) give the tokens of plain decoding."""
    reference, _ = run(gpt_oss)
    assert run(gpt_oss, **extra)[0] == reference


def test_gpt_oss_n_copies_share_the_prompt(gpt_oss):
    """n=3 greedy copies fork one prefill (copy-on-write blocks) and all equal the single greedy answer."""
    reference, _ = run(gpt_oss, prompts=PROMPTS[:2])
    eng = Engine.from_pretrained(gpt_oss, EngineConfig(block_size=4, num_gpu_blocks=128))
    outs = eng.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r] * 3 for r in reference]
