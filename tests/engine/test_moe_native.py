"""The native MoE kernel (csrc/moe_experts.cpp) against float64 math on the same weights, for fp32, bf16 and int8
experts and a rank's range of them; which layers take it; greedy tokens equal with and without it. Logits against
transformers with the kernel on are test_model.py's and test_architectures.py's (decode steps and small prefill
chunks there take it)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.moe import NATIVE_MAX_TOKENS, NATIVE_MOE_ENV
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import make_checkpoint

QWEN3_MOE = dict(arch="qwen3_moe", norm_topk_prob=True, hidden=64, num_experts=8, num_experts_per_tok=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3moe"), **QWEN3_MOE)


def sparse_layer(engine: Engine):
    moe = next(layer.moe for layer in engine.runner.model.layers if layer.moe is not None)
    if moe.stacked is None or moe.native_ops is None:
        pytest.skip("native kernels unavailable here")
    return moe


def reference(x, chosen, weights, w13, s13, w2, s2, first=0) -> torch.Tensor:
    """float64: sum over each token's chosen experts held of weight * down(silu(gate) * up)."""
    w13, w2 = w13.double(), w2.double()
    if s13 is not None:
        w13, w2 = w13 * s13.double()[..., None], w2 * s2.double()[..., None]
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j]) - first
            if not 0 <= e < w13.shape[0]:
                continue
            gu = w13[e] @ x[t].double()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (w2[e] @ act)
    return out


@torch.no_grad()
def route(moe, x):
    scores = torch.nn.functional.linear(x, moe.router.to(x.dtype))
    return moe._route(scores, x.dtype)


@pytest.mark.parametrize("dtype,quant,tol", [("float32", "none", 1e-5), ("bfloat16", "none", 3e-2),
                                             ("float32", "int8", 1e-5)])
def test_kernel_matches_float64(ckpt, dtype, quant, tol):
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4, dtype=dtype,
                                                       quantization=quant))
    moe = sparse_layer(engine)
    assert moe.stacked[0].dtype == {"none": getattr(torch, dtype), "int8": torch.int8}[quant]
    torch.manual_seed(1)
    for tokens in (1, 3, NATIVE_MAX_TOKENS):
        x = torch.randn(tokens, 64).to(getattr(torch, dtype))
        weights, chosen = route(moe, x)
        got = moe._native(x, weights, chosen).double()
        ref = reference(x, chosen, weights, *moe.stacked)
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= tol * max(scale, 1.0)
        loop = moe._loop(x, weights, chosen).double()  # the Python loop agrees too (its own rounding in bf16)
        assert (loop - got).abs().max().item() <= tol * max(scale, 1.0)


def test_a_ranks_range_of_experts(ckpt):
    """Expert parallelism: a rank holding experts 2..5 adds only their share; tokens with none of them get 0."""
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4))
    moe = sparse_layer(engine)
    w13, _, w2, _ = moe.stacked
    x = torch.randn(5, 64)
    chosen = torch.tensor([[0, 2, 7], [3, 4, 5], [0, 1, 6], [5, 2, 3], [1, 7, 4]])
    weights = torch.rand(5, 3)
    out = torch.empty_like(x)
    moe.native_ops.moe_experts(out, x, chosen, weights, w13[2:6].contiguous(), None, w2[2:6].contiguous(), None, 2)
    ref = reference(x, chosen, weights, w13[2:6], None, w2[2:6], None, first=2)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    assert out[2].abs().max().item() == 0.0  # experts 0, 1, 6: none held here


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm,rounded", [(True, False), (False, True)])
def test_native_router_matches_torch(ckpt, dtype, norm, rounded):
    """moe_route (the native path's router: logits, fp32 softmax, top k, renormalisation, load counts) picks the
    experts torch's ops pick, with weights within an fp32 / bf16 unit of theirs; a token's result does not depend on
    the other tokens of the call."""
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4, dtype=dtype))
    moe = sparse_layer(engine)
    moe.norm_topk_prob, moe.round_router_weights = norm, rounded
    assert moe.routes_native(getattr(torch, dtype))
    torch.manual_seed(2)
    x = torch.randn(NATIVE_MAX_TOKENS, 64).to(getattr(torch, dtype))
    want_w, want_c = route(moe, x)
    before = moe.routed.clone()
    got_w, got_c = moe._route_native(x)
    assert got_w.dtype == torch.float32 and got_c.dtype == torch.long
    # near ties (in bf16 the logits are rounded) may order two equal-looking experts differently: compare as sets
    # wherever the weights are not tied
    for t in range(x.shape[0]):
        assert sorted(got_c[t].tolist()) == sorted(want_c[t].tolist()) or \
            (want_w[t].float().unique().numel() < want_w.shape[1])
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert (got_w - want_w.float()).abs().max().item() <= tol
    assert (moe.routed - before).sum().item() == got_c.numel()
    assert torch.equal(moe.routed - before, torch.bincount(got_c.flatten(), minlength=moe.routed.numel()))
    one_w, one_c = moe._route_native(x[3:4].contiguous())  # batch invariance
    assert torch.equal(one_w[0], got_w[3]) and torch.equal(one_c[0], got_c[3])


def test_bad_shapes_named(ckpt):
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4))
    moe = sparse_layer(engine)
    w13, _, w2, _ = moe.stacked
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="moe_experts: want x"):
        moe.native_ops.moe_experts(torch.empty(2, 64), x, torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3),
                                   w2, None, w13, None, 0)
    with pytest.raises(ValueError, match="int64"):
        moe.native_ops.moe_experts(torch.empty(2, 64), x, torch.zeros(2, 3, dtype=torch.int32), torch.rand(2, 3),
                                   w13, None, w2, None, 0)
    with pytest.raises(ValueError, match="moe_route: want x"):
        moe.native_ops.moe_route(torch.empty(2, 3), torch.empty(2, 3, dtype=torch.long), x, moe.router.t(),
                                 None, True, False)
    with pytest.raises(ValueError, match="moe_route: routed"):
        moe.native_ops.moe_route(torch.empty(2, 3), torch.empty(2, 3, dtype=torch.long), x, moe.router,
                                 torch.zeros(3, dtype=torch.long), True, False)


def test_which_layers_take_it(tmp_path, monkeypatch):
    """gpt-oss (expert biases, clamped gate) keeps the loop; PDSERVE_NATIVE_MOE=0 keeps it for every model."""
    oss = make_checkpoint(tmp_path / "oss", arch="gpt_oss")
    engine = Engine.from_pretrained(oss, EngineConfig(num_gpu_blocks=16, block_size=4))
    assert all(layer.moe.stacked is None for layer in engine.runner.model.layers if layer.moe is not None)
    qwen = make_checkpoint(tmp_path / "qwen", **QWEN3_MOE)
    monkeypatch.setenv(NATIVE_MOE_ENV, "0")
    engine = Engine.from_pretrained(qwen, EngineConfig(num_gpu_blocks=16, block_size=4))
    assert all(layer.moe.stacked is None for layer in engine.runner.model.layers if layer.moe is not None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_equal_with_and_without(ckpt, dtype, monkeypatch):
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    native = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=64, block_size=4, dtype=dtype))
    sparse_layer(native)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    monkeypatch.setenv(NATIVE_MOE_ENV, "0")
    loop = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=64, block_size=4, dtype=dtype))
    assert [o.outputs[0].token_ids for o in loop.generate(prompts, params)] == got
