"""Many-token MoE steps' grouped experts (engine/moe_grouped.py, csrc/moe_combine.cpp): against float64 math and
transformers' Qwen3MoeSparseMoeBlock on the same tiny random weights, in fp32 and bf16, with top-k > 1, experts
that get no token and a rank's range of the experts; the buckets that keep oneDNN's GEMM shapes few; greedy tokens
equal with and without the grouped path; the deterministic mode keeps the loop."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.moe import GROUPED_MOE_ENV, NATIVE_MAX_TOKENS
from pdserve.engine.moe_grouped import bucket, grouped_experts, plan
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import make_checkpoint
from tests.engine.test_moe_native import QWEN3_MOE, reference, route, sparse_layer

TOKENS = (NATIVE_MAX_TOKENS + 1, 97, 300)  # past the native kernel's size: the grouped path's steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3moe-grouped"), **QWEN3_MOE)


def engine_of(ckpt, dtype: str) -> Engine:
    return Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=128, block_size=4, dtype=dtype))


def no_loop(moe, monkeypatch) -> None:
    """Fail the test if a step falls back to the Python loop over the experts."""
    def loop(*_):
        raise AssertionError("took the Python loop, not the grouped path")
    monkeypatch.setattr(moe, "_loop", loop)


def test_buckets_are_few_and_tight():
    sizes = [bucket(m) for m in range(1, 4097)]
    assert all(b >= m for m, b in zip(range(1, 4097), sizes))
    assert all(b - m < max(16, m // 8) for m, b in zip(range(1, 4097), sizes))  # <= 1/8 of the octave padded
    assert sizes == sorted(sizes)
    assert len(set(sizes)) <= 8 * 8 + 1  # ~8 shapes an octave: oneDNN builds each once


def test_plan_groups_pairs_by_expert():
    """Every held pair gets its own row in its expert's padded segment, which holds the pair's token there;
    pairs of experts not held get -1; experts with no token get no segment."""
    chosen = torch.tensor([[0, 2, 7], [3, 2, 5], [0, 6, 1], [5, 2, 3], [7, 4, 0]])
    src, pos, segments = plan(chosen, 2, 4)  # experts 2..5 held; none picks 4? token 4 does; 6, 7, 0, 1 not held
    assert [e for e, _, _ in segments] == [0, 1, 2, 3]  # local ids of experts 2, 3, 4, 5
    for t in range(5):
        for j in range(3):
            e = int(chosen[t, j]) - 2
            if not 0 <= e < 4:
                assert pos[t, j] == -1
                continue
            _, a, b = segments[e]
            assert a <= pos[t, j] < b and src[pos[t, j]] == t
    held = pos[pos >= 0]
    assert len(set(held.tolist())) == held.numel()  # no two pairs share a row
    assert all(b - a == bucket(b - a) for _, a, b in segments)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_matches_float64(ckpt, dtype, tol):
    """Routed by the layer's router (top 3 of 8), then with experts 1 and 6 never chosen, then a rank's range."""
    moe = sparse_layer(engine_of(ckpt, dtype))
    w13, _, w2, _ = moe.stacked
    torch.manual_seed(2)
    for tokens in TOKENS:
        x = torch.randn(tokens, 64).to(getattr(torch, dtype))
        weights, chosen = route(moe, x)
        skipped = torch.tensor([0, 2, 3, 4, 5, 7])[torch.randint(0, 6, chosen.shape)]  # no token for 1 and 6
        for ch, first, held in ((chosen, 0, 8), (skipped, 0, 8), (chosen, 2, 4)):
            got = grouped_experts(x, weights, ch, w13[first:first + held], w2[first:first + held], first,
                                  moe.native_ops).double()
            ref = reference(x, ch, weights, w13[first:first + held], None, w2[first:first + held], None, first)
            assert (got - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)


def test_long_steps_go_in_slices(ckpt, monkeypatch):
    """Past MAX_TOKENS a step runs in slices, as in one pass (within a bf16 unit: the GEMMs' shapes differ)."""
    from pdserve.engine import moe_grouped
    moe = sparse_layer(engine_of(ckpt, "bfloat16"))
    w13, _, w2, _ = moe.stacked
    x = torch.randn(100, 64).bfloat16()
    weights, chosen = route(moe, x)
    whole = grouped_experts(x, weights, chosen, w13, w2, 0, moe.native_ops)
    monkeypatch.setattr(moe_grouped, "MAX_TOKENS", 33)
    sliced = grouped_experts(x, weights, chosen, w13, w2, 0, moe.native_ops)
    assert sliced.shape == whole.shape
    assert (sliced.float() - whole.float()).abs().max().item() <= 1e-2 * max(whole.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_layer_matches_transformers_block(ckpt, dtype, tol, monkeypatch):
    """The whole sparse layer (router, top-k, grouped experts) on a many-token chunk against transformers'
    Qwen3MoeSparseMoeBlock of the same checkpoint in the same dtype."""
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    block = hf.model.layers[0].mlp
    moe = sparse_layer(engine_of(ckpt, dtype))
    no_loop(moe, monkeypatch)
    torch.manual_seed(3)
    for tokens in TOKENS:
        x = torch.randn(tokens, 64).to(getattr(torch, dtype))
        with torch.no_grad():
            ref = block(x[None])[0].float()
            got = moe(x).float()
        assert (got - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_equal_with_and_without(ckpt, dtype, monkeypatch):
    """Prompts of 40-120 tokens, prefilled in one chunk each (grouped), then decoded."""
    prompts = [[(7 * i + 3 * n) % 300 + 10 for i in range(n)] for n in (40, 120, 75)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    grouped = engine_of(ckpt, dtype)
    no_loop(sparse_layer(grouped), monkeypatch)
    got = [o.outputs[0].token_ids for o in grouped.generate(prompts, params)]
    monkeypatch.setenv(GROUPED_MOE_ENV, "0")
    assert [o.outputs[0].token_ids for o in engine_of(ckpt, dtype).generate(prompts, params)] == got


def test_prefill_logits_match_transformers(ckpt):
    """A 100-token prompt in one prefill chunk (the grouped path), fp32: logits within test_model.py's 2e-4."""
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = engine_of(ckpt, "float32")
    prompt = [(11 * i) % 300 + 5 for i in range(100)]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max().item() <= 2e-4


def test_deterministic_mode_keeps_the_loop(ckpt, monkeypatch):
    """Batch-invariant mode (row tiles) never takes the grouped path: its GEMM shapes follow the row count."""
    moe = sparse_layer(engine_of(ckpt, "float32"))
    monkeypatch.setattr(moe, "row_tile", 16)
    assert not moe._takes_grouped(torch.zeros(100, 64))
    monkeypatch.setattr(moe, "row_tile", None)
    assert moe._takes_grouped(torch.zeros(100, 64))
