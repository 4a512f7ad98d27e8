"""The decoder layers as one native call (engine/decoder_stack.py) against the Python layer loop it replaces.

The stack runs the same kernels in the same order, so a decode step's logits must be *equal* to the loop's, not
close, for every way a projection can be held (fp32 / bf16 prepacked or plain, DualLinear, int8, packed with a
plain GEMV copy), with biases (Qwen2), GQA and a sliding window. That the loop itself matches transformers is
tests/engine/test_model.py's and test_quant.py's business; greedy decoding through the stack against transformers
is checked here too, since the stack is what those decode steps now run.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from pdserve.engine import cpu_isa
from pdserve.engine.decoder_stack import GEMV, MAX_ROWS, STACK_ENV, DecoderStacks, projection_plan
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.kernels import native_ops
from pdserve.engine.model import Linear, can_pack
from pdserve.engine.quant import BATCH1_GEMV_ENV, DUAL_GEMV_MAX_ROWS, GEMV_MAX_ROWS, DualLinear
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq
from tests.conftest import make_checkpoint

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="native kernels unavailable here")

VARIANTS = {
    "llama-gqa": dict(arch="llama"),
    "qwen2-qkv-bias": dict(arch="qwen2"),
    "mistral-sliding-window-5": dict(arch="mistral", sliding_window=5),
}


def _engine(path, **kw) -> Engine:
    return Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=256, block_size=4, max_num_seqs=64, **kw))


def _decode_batch(engine: Engine, n: int) -> list[ScheduledSeq]:
    """n sequences past their prompts (lengths 3..n+9, so contexts differ and cross blocks), each with its next
    decode slot allocated."""
    for i in range(n):
        engine.add_request(f"r{i}", [(7 * i + j) % 300 + 2 for j in range(3 + i % 10)],
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while any(s.is_prefill for r in engine.requests.values() for s in r.seqs):
        engine.step()
    engine.step()  # one ordinary decode step as well
    batch = []
    for r in engine.requests.values():
        seq = r.seqs[0]
        engine.block_manager.allocate(seq, 1)
        batch.append(ScheduledSeq(seq, 1))
    return batch


def _both_paths(engine: Engine, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(logits through the stack, logits through the Python loop, whether the stack ran). Writing the step's K/V
    twice stores the same values at the same slots, so the second run sees the pool the first one saw."""
    runner, model = engine.runner, engine.runner.model
    ids, pos, meta, rows, _ = runner.prepare(batch)
    x = model.embed.weight
    ran = model.stacks.applies(meta, ids.numel(), engine.kv_cache.data, x) and \
        model.stacks.get(ids.numel(), x.dtype) is not None
    stacked = model(ids, pos, engine.kv_cache.data, meta, rows)
    model.stacks.enabled = False
    try:
        looped = model(ids, pos, engine.kv_cache.data, meta, rows)
    finally:
        model.stacks.enabled = True
    return stacked, looped, ran


@pytest.fixture(scope="module", params=list(VARIANTS))
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen2", dtype=torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, DUAL_GEMV_MAX_ROWS + 1])
@pytest.mark.parametrize("storage", ["fp32", "int8"])
def test_stack_equals_python_layers(ckpt, storage, rows):
    engine = _engine(ckpt, **({"quantization": "int8"} if storage == "int8" else {}))
    stacked, looped, ran = _both_paths(engine, _decode_batch(engine, rows))
    assert ran  # fp32 activations: int8 takes the GEMV up to 32 rows, fp32 the GEMM at any size
    assert stacked.shape == (rows, engine.runner.model.cfg.vocab_size)
    assert torch.equal(stacked, looped)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("form", ["bf16", "bf16+gemv-copies", "dual"])
def test_stack_equals_python_layers_bf16_weights(bf16_ckpt, form, rows, monkeypatch):
    """bf16 compute (prepacked where oneDNN has bf16, plain otherwise; with the plain GEMV copies forced on), and a
    bf16 checkpoint computed in fp32 with the projections held twice (DualLinear)."""
    if form == "bf16+gemv-copies" and not can_pack(torch.empty(0, dtype=torch.bfloat16)):
        pytest.skip("oneDNN's bf16 linear unavailable here: no packed projections to keep copies of")
    monkeypatch.setenv(BATCH1_GEMV_ENV, "1" if form == "bf16+gemv-copies" else "0")
    if form == "dual":  # what dtype=auto holds on CPUs without native bf16, made here on any CPU
        monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    cpu_isa.detected_level.cache_clear()
    try:
        engine = _engine(bf16_ckpt, **({} if form == "dual" else {"dtype": "bfloat16"}))
    finally:
        cpu_isa.detected_level.cache_clear()
    model = engine.runner.model
    assert isinstance(model.layers[0].qkv, DualLinear) == (form == "dual")
    plan = projection_plan(model.layers[0].qkv, rows, model.embed.weight.dtype)
    if form != "bf16":
        assert (plan.kind == GEMV) == (rows <= (2 if form == "bf16+gemv-copies" else DUAL_GEMV_MAX_ROWS))
    stacked, looped, ran = _both_paths(engine, _decode_batch(engine, rows))
    assert ran and torch.equal(stacked, looped)


def test_int8_past_the_gemv_rows_keeps_the_python_loop(bf16_ckpt):
    """int8 with bf16 activations widens the weight per call past GEMV_MAX_ROWS[bf16]: no native form, so steps of
    that size run the Python loop (and still produce the same logits as a run without the stack)."""
    engine = _engine(bf16_ckpt, dtype="bfloat16", quantization="int8")
    rows = GEMV_MAX_ROWS[torch.bfloat16] + 1
    assert engine.runner.model.stacks.get(rows, torch.bfloat16) is None
    assert engine.runner.model.stacks.get(rows - 1, torch.bfloat16) is not None
    stacked, looped, ran = _both_paths(engine, _decode_batch(engine, rows))
    assert not ran and torch.equal(stacked, looped)


def test_greedy_through_the_stack_matches_transformers(ckpt):
    """Batches of 1 and 4 sequences decode through the stack; tokens equal transformers' greedy in fp32."""
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = _engine(ckpt)
    built = []
    original = DecoderStacks.get

    def spy(self, rows, dtype):
        stack = original(self, rows, dtype)
        built.append((rows, stack is not None))
        return stack

    DecoderStacks.get = spy
    try:
        prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 61)), [3]]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        single = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    finally:
        DecoderStacks.get = original
    assert (4, True) in built and (1, True) in built
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    assert single.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_stack_off_by_env_and_for_large_or_mixed_steps(ckpt, monkeypatch):
    monkeypatch.setenv(STACK_ENV, "0")
    assert not _engine(ckpt).runner.model.stacks.enabled
    monkeypatch.delenv(STACK_ENV)
    engine = _engine(ckpt)
    model = engine.runner.model
    assert model.stacks.enabled
    batch = _decode_batch(engine, 2)
    _, _, meta, _, _ = engine.runner.prepare(batch)
    x = model.embed.weight
    assert model.stacks.applies(meta, 2, engine.kv_cache.data, x)
    assert not model.stacks.applies(meta, MAX_ROWS + 1, engine.kv_cache.data, x)  # rows disagree / too many
    engine.add_request("p", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=2))
    seq = engine.requests["p"].seqs[0]
    engine.block_manager.allocate(seq, 8)
    _, _, mixed, _, _ = engine.runner.prepare([*batch, ScheduledSeq(seq, 8)])  # a prefill chunk in the step
    assert not model.stacks.applies(mixed, 10, engine.kv_cache.data, x)


def test_stack_rejects_inconsistent_plans():
    lin = Linear(8, 8)
    with pytest.raises(ValueError):
        OPS.DecoderStack([lin.weight.detach()] * 2, [0, 0, 0], [lin.weight.detach()] * 3, [torch.empty(0)] * 3,
                         [torch.empty(0)] * 3, [8] * 3, 2, 1, 4, 1e-5)
    with pytest.raises(ValueError):  # qkv width 8 != (2 + 2 * 1) * 4 = 16
        OPS.DecoderStack([lin.weight.detach()[0]] * 2, [2] * 4, [lin.weight.detach()] * 4, [torch.empty(0)] * 4,
                         [torch.empty(0)] * 4, [8] * 4, 2, 1, 4, 1e-5)


def test_forward_releases_the_gil():
    """While one thread is inside DecoderStack.forward, another runs Python: its longest pause during the call
    stays far below the call's length (a call holding the GIL would pause it for the whole call). On a loaded box
    the looping thread can also lose its core for a while, so up to 3 tries: a call that held the GIL fails all."""
    import threading
    import time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tries = []
    try:
        g = torch.Generator().manual_seed(0)
        hidden, heads, hd, inter, layers, rows, bs = 512, 8, 64, 2048, 8, 64, 4

        def w(*shape):
            return torch.randn(*shape, generator=g) * 0.02

        proj = [w(3 * heads * hd, hidden), w(hidden, heads * hd), w(2 * inter, hidden), w(hidden, inter)]
        stack = OPS.DecoderStack([torch.ones(hidden)] * (2 * layers), [2] * (4 * layers), proj * layers,
                                 [torch.empty(0)] * (4 * layers), [torch.empty(0)] * (4 * layers),
                                 [p.shape[0] for p in proj] * layers, heads, heads, hd, 1e-5)
        kv = torch.zeros(rows, layers, 2, bs, heads, hd)
        ids = torch.arange(rows)
        args = (torch.randn(rows, hidden, generator=g), torch.ones(rows, 1, hd // 2), torch.zeros(rows, 1, hd // 2),
                kv, ids, torch.zeros(rows, dtype=torch.long), ids, ids.unsqueeze(1), torch.ones(rows, dtype=torch.long),
                hd ** -0.5, 0)
        with torch.inference_mode():
            stack.forward(*args)
            for _ in range(3):
                t = time.perf_counter()
                stack.forward(*args)
                call = time.perf_counter() - t
                done = threading.Event()
                worker = threading.Thread(target=lambda: (stack.forward(*args), done.set()))
                longest, last = 0.0, time.perf_counter()
                worker.start()
                while not done.is_set():
                    now = time.perf_counter()
                    longest, last = max(longest, now - last), now
                worker.join()
                tries.append((longest, call))
                if longest < call / 2:
                    break
    finally:
        torch.set_num_threads(threads)
    assert all(call > 0.02 for _, call in tries), ("the call is too short to tell", tries)
    assert any(longest < call / 2 for longest, call in tries), tries


def test_plans_follow_a_change_of_weight_storage(ckpt, monkeypatch):
    """Plans hold the projections' tensors: after the model's weights change form (here fp32 -> int8, after steps
    that built plans), the stack computes with the new ones, equal to the Python loop over them."""
    monkeypatch.setenv(cpu_isa.FP32_PACK_ENV, "0")  # plain fp32 weights, which int8 can be made from
    engine = _engine(ckpt)
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    model = engine.runner.model
    assert model.stacks.get(1, torch.float32) is not None
    model.store_weights("int8", engine.runner.native_ops)
    stacked, looped, ran = _both_paths(engine, _decode_batch(engine, 1))
    assert ran and torch.equal(stacked, looped)


# Qwen3's q/k norms and sparse MoE layers with softmax top-k routers (Qwen3-MoE with a dense layer among the sparse
# ones, Mixtral) on the native MoE kernel.
QK_MOE_VARIANTS = {
    "qwen3-qk-norm": dict(arch="qwen3", head_dim=32),
    "qwen3-moe": dict(arch="qwen3_moe", norm_topk_prob=True, num_experts=8, num_experts_per_tok=3,
                      mlp_only_layers=[1]),
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module", params=list(QK_MOE_VARIANTS))
def qk_moe_ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), **QK_MOE_VARIANTS[request.param])


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_stack_equals_python_layers_qk_norm_and_moe(qk_moe_ckpt, dtype, rows):
    """Logits equal to the Python loop's, and the expert-load counts advance alike."""
    kw = {"quantization": "int8"} if dtype == "int8" else {"dtype": dtype}
    engine = _engine(qk_moe_ckpt, **kw)
    model = engine.runner.model
    assert model.stacks.enabled
    batch = _decode_batch(engine, rows)
    before = model.expert_tokens()
    stacked, looped, ran = _both_paths(engine, batch)
    assert ran and torch.equal(stacked, looped)
    if before is not None:  # each path counted the step's tokens once per expert: the same counts twice
        after = torch.tensor(model.expert_tokens()) - torch.tensor(before)
        assert after.sum() == 2 * rows * model.cfg.num_experts_per_tok * len([x for x in model.layers if x.moe])
        assert torch.equal(after % 2, torch.zeros_like(after))


def test_moe_steps_past_the_kernel_keep_the_python_loop(tmp_path, monkeypatch):
    from pdserve.engine.moe import NATIVE_MAX_TOKENS, NATIVE_MOE_ENV
    ckpt = make_checkpoint(tmp_path / "m", **QK_MOE_VARIANTS["qwen3-moe"])
    engine = _engine(ckpt)
    assert engine.runner.model.stacks.get(NATIVE_MAX_TOKENS + 1, torch.float32) is None
    assert engine.runner.model.stacks.get(NATIVE_MAX_TOKENS, torch.float32) is not None
    monkeypatch.setenv(NATIVE_MOE_ENV, "0")  # experts not stacked: every step keeps the loop
    assert not _engine(ckpt).runner.model.stacks.enabled


def test_greedy_moe_through_the_stack_matches_transformers(qk_moe_ckpt):
    hf = tf.AutoModelForCausalLM.from_pretrained(qk_moe_ckpt, dtype=torch.float32).eval()
    engine = _engine(qk_moe_ckpt)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 61))]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert any(s is not None for s in engine.runner.model.stacks._by_rows.values())
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
