"""Weight-only int8 and bf16-stored weights (engine/quant.py, csrc/weight_gemv.cpp) against float64 references.

- quantize/dequantize: the per-channel scale math written out in float64;
- the quantized linear (native GEMV at decode batch sizes, widened GEMM above, torch fallbacks) against x @ W.T in
  float64 with W the dequantized weight: |error| <= 1e-5 * sum_k |x_k w_k| (fp32 activations) or one bf16
  rounding of the output (bf16 activations);
- whole-model greedy tokens of a tiny transformers-built Llama: int8 equals transformers run in float64 on the
  dequantized weights, and stays within INT8_TIE of the unquantized model (below).
The native kernels run here with whatever ISA the module was built for: `PDSERVE_CPU_ISA=avx2 pytest ...` runs
the AVX2 path (tests/engine/test_kernels.py does the same for the other kernels).
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

from pdserve.engine import cpu_isa
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.kernels import native_ops
from pdserve.engine.model import Linear, can_pack
from pdserve.engine.quant import (
    BATCH1_GEMV_ENV,
    BF16_WEIGHTS_ENV,
    DUAL_GEMV_MAX_ROWS,
    GEMV_COPY_MAX_ROWS,
    GEMV_MAX_ROWS,
    DualLinear,
    WeightOnlyLinear,
    batch1_gemv_wanted,
    choose_weight_storage,
    dequantize_int8,
    quantize_int8,
    weights_label,
)
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import make_checkpoint

OPS = native_ops()
# the GEMV copies of packed bf16 projections need the native kernels and oneDNN's bf16 linear
needs_gemv_copies = pytest.mark.skipif(OPS is None or not can_pack(torch.empty(0, dtype=torch.bfloat16)),
                                       reason="native kernels or oneDNN's bf16 linear unavailable here")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 61))]
# Greedy int8 vs unquantized: tokens equal up to the first difference, and there the unquantized model's own
# logit margin between the two tokens is at most INT8_TIE. The int8 weight error moves this model's logits
# (|logit| < ~3) by at most 0.073 over PROMPTS (measured, teacher-forced): LOGIT_TOL bounds that, and a greedy
# flip needs a margin under twice it.
LOGIT_TOL = 0.1
INT8_TIE = 0.2


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.double()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scale[:, None]).clamp(-127, 127), scale


def test_quantize_matches_float64_scale_math():
    torch.manual_seed(0)
    w = torch.randn(96, 200) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different magnitudes
    w[7] = 0.0  # an all-zero row: scale 1, q 0, no division by zero
    q, s = quantize_int8(w)
    rq, rs = ref_quantize(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (96,)
    torch.testing.assert_close(s.double(), rs, rtol=1e-7, atol=0)
    # w / scale in fp32 vs float64 may round a value sitting on .5 the other way: allow a rare off-by-one
    diff = (q.double() - rq).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert q.abs().max() <= 127 and (q[7] == 0).all() and s[7] == 1.0
    back = dequantize_int8(q, s, torch.float64)
    assert ((back - w.double()).abs() <= s.double()[:, None] * (0.5 + 1e-6) + (diff > 0) * s.double()[:, None]).all()
    # the row maximum is represented exactly (q = ±127)
    assert (q.abs().amax(dim=1)[torch.arange(96) != 7] == 127).all()


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.1)
        if bias:
            lin.bias.normal_(0, 0.1)
    return lin


def _check(out: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, b64: torch.Tensor | None, roundings: int) -> None:
    prod = x.double() @ w64.T
    ref = prod + (b64 if b64 is not None else 0)
    mag = x.double().abs() @ w64.abs().T + (b64.abs() if b64 is not None else 0)
    if x.dtype == torch.float32:
        tol = 1e-5 * mag + 1e-6
    else:  # bf16: `roundings` bf16 roundings (2^-8 relative each, of the product, then of product + bias) plus
        # the fp32 accumulation's own error
        tol = (prod.abs() + ref.abs()) * roundings * 2.0 ** -8 + 1e-5 * mag + 1e-6
    assert out.dtype == x.dtype and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max err {err.max().item():.3g} vs tol {tol.flatten()[err.argmax()].item():.3g}"


ROWS = sorted({1, 2, 3, 4, 5, 8, 16, *(r + d for r in GEMV_MAX_ROWS.values() for d in (0, 1)), 37, 65})
SHAPES = [(48, 64), (33, 100), (130, 257)]  # K not a multiple of the vector width: the scalar tail


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_weight_only_linear_vs_float64(kind, xdtype, native, bias):
    if native and OPS is None:
        pytest.skip("native kernels unavailable here")
    for n, k in SHAPES:
        lin = _linear(n, k, bias)
        if xdtype == torch.bfloat16 and bias:
            lin = lin.to(torch.bfloat16)
        m = WeightOnlyLinear.int8(lin) if kind == "int8" else WeightOnlyLinear.bf16(lin)
        m.native_ops = OPS if native else None
        w64 = (dequantize_int8(m.weight, m.scales, torch.float64) if kind == "int8"
               else lin.weight.detach().to(torch.bfloat16).double())
        b64 = lin.bias.detach().double() if bias else None
        for rows in ROWS:
            x = torch.randn(rows, k).to(xdtype)
            # the native GEMV rounds once; the widened GEMM rounds its output, then the scaled output (and the
            # bias add); torch's int8 kernel (bf16, no native module) also takes its scales rounded to bf16
            roundings = 1 if native and rows <= GEMV_MAX_ROWS[xdtype] and not bias else 3
            _check(m(x), x, w64, b64, roundings)


def test_native_gemv_rejects_bad_inputs():
    if OPS is None:
        pytest.skip("native kernels unavailable here")
    x, w, s = torch.randn(2, 16), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8)
    out = torch.empty(2, 8)
    with pytest.raises(ValueError, match="need contiguous fp32 scales"):
        OPS.weight_gemv(out, x, w, None)
    with pytest.raises(ValueError, match="bf16 weights take no scales"):
        OPS.weight_gemv(out, x, w.bfloat16(), s)
    with pytest.raises(ValueError, match="want x"):
        OPS.weight_gemv(out, torch.randn(2, 15), w, s)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        OPS.weight_gemv(out.half(), x.half(), w, s)
    with pytest.raises(ValueError, match="int8 or bfloat16"):
        OPS.weight_gemv(out, x, w.float(), s)


def test_weight_storage_choice():
    f32, bf16 = torch.float32, torch.bfloat16
    assert choose_weight_storage("avx2", bf16, f32, "cpu", True) == "dual"  # bf16 for GEMVs + fp32 for GEMMs
    assert choose_weight_storage("avx512", bf16, f32, "cpu", True) == "dual"
    assert choose_weight_storage("avx2", bf16, f32, "cpu", True, "1") == "bfloat16"  # the lean opt-in
    assert choose_weight_storage("avx2", bf16, f32, "cpu", True, "0") == "same"  # opted out
    assert choose_weight_storage("avx2", bf16, f32, "cpu", False) == "same"  # no GEMV to read bf16 with
    assert choose_weight_storage("avx2", f32, f32, "cpu", True) == "same"  # nothing to save
    assert choose_weight_storage("amx", bf16, bf16, "cpu", True) == "same"  # native bf16 compute
    assert choose_weight_storage("scalar", bf16, f32, "cpu", True) == "same"
    assert choose_weight_storage("", bf16, bf16, "cuda", True) == "same"
    assert weights_label("dual", f32) == "bfloat16+float32" and weights_label("same", f32) == "float32"


def test_batch1_gemv_choice():
    bf16, f32 = torch.bfloat16, torch.float32
    assert batch1_gemv_wanted("avx512_bf16", bf16, "cpu", True)  # measured there (Zen 4): on by default
    assert batch1_gemv_wanted("amx", bf16, "cpu", True)  # measured there too (Intel model 207): on by default
    assert not batch1_gemv_wanted("amx", bf16, "cpu", True, "0")  # ... unless forbidden
    assert not batch1_gemv_wanted("avx512", bf16, "cpu", True)  # no vdpbf16ps: oneDNN
    assert not batch1_gemv_wanted("avx512_bf16", bf16, "cpu", True, "0")  # forbidden
    assert not batch1_gemv_wanted("avx512_bf16", f32, "cpu", True, "1")  # fp32 compute: dual storage's business
    assert not batch1_gemv_wanted("avx512_bf16", bf16, "cpu", False, "1")  # no native GEMV to run
    assert not batch1_gemv_wanted("", bf16, "cuda", True, "1")


class _RowSpy:
    """The native module, recording the rows of each weight_gemv call."""

    def __init__(self, real):
        self.real, self.rows = real, []

    def weight_gemv(self, out, x, w, s):
        self.rows.append(x.shape[0])
        return self.real.weight_gemv(out, x, w, s)


@needs_gemv_copies
def test_packed_bf16_linear_keeps_a_gemv_copy_for_small_batches():
    """A packed bf16 projection that keeps its plain weight: up to GEMV_COPY_MAX_ROWS rows run the native GEMV
    (vdpbf16ps where the CPU has it), more rows oneDNN; both equal the float64 product within one bf16 rounding of
    the output."""
    for n, k, bias in ((48, 64, False), (33, 100, True), (130, 257, False), (96, 768, False)):
        lin = Linear(k, n, bias=bias)
        with torch.no_grad():
            lin.weight.normal_(0, 0.1)
            if bias:
                lin.bias.normal_(0, 0.1)
        lin = lin.to(torch.bfloat16)
        w64, b64 = lin.weight.detach().double(), (lin.bias.detach().double() if bias else None)
        lin.pack(keep_gemv=True)
        assert lin.gemv_weight is not None and lin.weight.numel() == 0
        lin.native_ops = spy = _RowSpy(OPS)
        sizes = sorted({1, 2, GEMV_COPY_MAX_ROWS, GEMV_COPY_MAX_ROWS + 1, 5})
        for rows in sizes:
            x = torch.randn(rows, k).to(torch.bfloat16)
            _check(lin(x), x, w64, b64, 1 if rows <= GEMV_COPY_MAX_ROWS and not bias else 2)
        assert spy.rows == [r for r in sizes if r <= GEMV_COPY_MAX_ROWS]  # larger steps never reach the GEMV


@needs_gemv_copies
def test_batch1_gemv_greedy_close_to_float64(ckpt, monkeypatch):
    """bf16 decode with the plain copies forced on: single-sequence steps (one row) run the GEMV; greedy tokens
    equal transformers in float64 on the same bf16 weights up to the first difference, and there float64's own
    margin between the two tokens is within a tie for bf16 compute (INT8_TIE)."""
    monkeypatch.setenv(BATCH1_GEMV_ENV, "1")
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=64, block_size=4, dtype="bfloat16"))
    model = engine.runner.model
    assert engine.info.linear == "onednn+gemv" and model.gemv_bytes > 0
    assert model.weight_bytes_read(1) == model.weight_bytes - model.gemv_bytes  # one copy of the two is read
    model.lm_head.native_ops = spy = _RowSpy(engine.runner.native_ops)
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).double().eval()
    for prompt in PROMPTS:
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        _assert_greedy_within_tie(hf, prompt, out.outputs[0].token_ids, 10)
    assert spy.rows.count(1) >= 9 * len(PROMPTS)  # every decode step's LM head went through the GEMV
    monkeypatch.setenv(BATCH1_GEMV_ENV, "0")
    off = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4, dtype="bfloat16"))
    assert off.info.linear == "onednn" and off.runner.model.gemv_bytes == 0


def test_dual_linear_takes_each_path_by_rows():
    """DualLinear: up to DUAL_GEMV_MAX_ROWS rows through the bf16 GEMV, beyond through the fp32 GEMM; both equal
    the float64 product of the bf16 weights (what the checkpoint holds) within fp32 accumulation error."""
    if OPS is None:
        pytest.skip("native kernels unavailable here")
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    lin.weight.data = lin.weight.data.to(torch.bfloat16).float()  # a bf16 checkpoint's values, held in fp32
    dual = DualLinear(lin)
    dual.gemv.native_ops = OPS
    calls = []
    real = OPS.weight_gemv

    class Spy:
        def weight_gemv(self, *a):
            calls.append(a[0].shape[0])
            return real(*a)
    dual.gemv.native_ops = Spy()
    for rows in (1, DUAL_GEMV_MAX_ROWS, DUAL_GEMV_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64)
        ref = x.double() @ lin.weight.double().T + lin.bias.double()
        torch.testing.assert_close(dual(x).double(), ref, atol=1e-4, rtol=1e-4)
    assert calls == [1, DUAL_GEMV_MAX_ROWS]  # larger batches never reach the GEMV


def test_quantization_flag_is_validated(tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        EngineConfig(quantization="int4").validate()
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda").validate()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("q"), "llama", hidden=128, layers=2)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()


def _assert_greedy_within_tie(hf, prompt: list[int], ours: list[int], n: int) -> None:
    """`ours` equals `hf`'s greedy tokens up to the first difference, and there `hf`'s own logit margin between the
    two tokens is at most INT8_TIE (a near-tie the other arithmetic may flip)."""
    ref = _hf_greedy(hf, prompt, n)
    i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is not None:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        assert logits[ref[i]] - logits[ours[i]] <= INT8_TIE, (prompt, i, ours, ref)


def _fake_quant_hf(ckpt, dtype=torch.float64):
    """transformers' model with every nn.Linear's weight replaced by its int8 dequantization (float64 math)."""
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, nn.Linear):
                q, s = ref_quantize(mod.weight.float())
                mod.weight.copy_((q * s[:, None]).to(dtype))
    return hf


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_int8_greedy_equals_dequantized_float64_reference(ckpt, native):
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=64, block_size=4, quantization="int8",
                                                       native_kernels=native))
    assert engine.runner.model.weight_storage == "int8" and engine.info.weights == "int8"
    assert "weights=int8" in engine.info.line()
    hf = _fake_quant_hf(ckpt)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 10), prompt


def test_int8_greedy_close_to_unquantized(ckpt):
    engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=64, block_size=4, quantization="int8"))
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hfq = _fake_quant_hf(ckpt, torch.float32)
    with torch.no_grad():
        for prompt in PROMPTS:  # teacher-forced: how far int8 moves the logits
            x = torch.tensor([prompt])
            assert (hf(x).logits - hfq(x).logits).abs().max() <= LOGIT_TOL
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        _assert_greedy_within_tie(hf, prompt, out.outputs[0].token_ids, 10)


def test_int8_changes_the_kv_fingerprint(ckpt):
    a = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4))
    b = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4, quantization="int8"))
    assert a.fingerprint != b.fingerprint  # int8 KV never hits (or is pulled by) an unquantized deployment


def test_bf16_storage_under_auto_without_native_bf16(tmp_path, monkeypatch):
    """A bf16 checkpoint on an AVX2 CPU under dtype=auto: fp32 compute with the projections held twice (bf16 for
    the decode GEMVs, fp32 for larger batches) by default, in bf16 alone with PDSERVE_BF16_WEIGHTS=1, in fp32
    alone with =0. Greedy tokens equal transformers in fp32 either way (bf16 widens to fp32 exactly)."""
    if OPS is None:
        pytest.skip("native kernels unavailable here")
    path = make_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    cpu_isa.detected_level.cache_clear()
    engines = {}
    try:
        dual = Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=64, block_size=4))
        assert dual.runner.model.weight_storage == "dual" and dual.info.weights == "bfloat16+float32"
        assert dual.runner.model.layers[0].qkv.gemv.weight.dtype == torch.bfloat16
        engines["dual"] = dual
        monkeypatch.setenv(BF16_WEIGHTS_ENV, "0")
        fp32 = Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16, block_size=4))
        assert fp32.runner.model.weight_storage == "same" and fp32.info.weights == "float32"
        monkeypatch.setenv(BF16_WEIGHTS_ENV, "1")
        engine = Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=64, block_size=4))
        assert engine.kv_cache.data.dtype == torch.float32
        assert engine.runner.model.weight_storage == "bfloat16" and engine.info.weights == "bfloat16"
        assert engine.runner.model.layers[0].qkv.weight.dtype == torch.bfloat16
        engines["bfloat16"] = engine
        explicit = Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16, block_size=4, dtype="float32"))
        assert explicit.runner.model.weight_storage == "same"  # --dtype float32: fp32 throughout
    finally:
        cpu_isa.detected_level.cache_clear()
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for kind, eng in engines.items():
        outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 8), (kind, prompt)


def test_dual_storage_yields_to_host_memory(tmp_path, monkeypatch, caplog):
    """Where the bf16 copies would not fit in the host's available memory beside the KV pool, `auto` holds fp32
    alone and says so; the arithmetic: 2 bytes a projection weight + the reserve within 90% of what is free."""
    if OPS is None:
        pytest.skip("native kernels unavailable here")
    from pdserve.engine import quant
    lin = nn.Sequential(nn.Linear(100, 50), nn.Linear(50, 10))
    extra = (100 * 50 + 50 * 10) * 2
    assert quant.dual_fits(lin, 1000, int((extra + 1000) / 0.9) + 1)
    assert not quant.dual_fits(lin, 1000, extra + 1000)
    assert quant.dual_fits(lin, 1 << 40, None)  # unknown: assume it fits
    free = quant.mem_available_bytes()  # this host's, read from /proc/meminfo
    assert free is None or 0 < free <= 1 << 50
    path = make_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    monkeypatch.setattr(quant, "mem_available_bytes", lambda: 64 << 20)  # 64 MiB free: the 256 MiB pool alone fails
    cpu_isa.detected_level.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            engine = Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16, block_size=4))
    finally:
        cpu_isa.detected_level.cache_clear()
    assert engine.runner.model.weight_storage == "same" and engine.info.weights == "float32"
    assert "not holding bf16 copies" in caplog.text and BF16_WEIGHTS_ENV in caplog.text


def test_worker_and_up_flags_reach_the_engine(monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.services.worker import engine_config_from_args
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["worker"])).quantization == "none"
    assert engine_config_from_args(parse(["worker", "--quantization", "int8"])).quantization == "int8"
    assert parse(["up", "--quantization", "int8"]).quantization == "int8"
    monkeypatch.setenv("PDSERVE_QUANTIZATION", "int8")
    assert engine_config_from_args(parse(["worker"])).quantization == "int8"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(quantization="int8", tensor_parallel_size=2).validate()


@needs_gemv_copies
def test_batch1_gemv_copies_yield_to_host_memory(ckpt, monkeypatch, caplog):
    """The plain copies are the projections' size again: where they would not fit beside the KV pool, oneDNN
    alone, and the log says so."""
    from pdserve.engine import quant
    monkeypatch.setenv(BATCH1_GEMV_ENV, "1")
    monkeypatch.setattr(quant, "mem_available_bytes", lambda: 64 << 20)  # the 256 MiB pool alone does not fit
    with caplog.at_level("WARNING"):
        engine = Engine.from_pretrained(ckpt, EngineConfig(num_gpu_blocks=16, block_size=4, dtype="bfloat16"))
    assert engine.info.linear == "onednn" and engine.runner.model.gemv_bytes == 0
    assert "not keeping plain copies" in caplog.text


def test_int8_reaches_the_experts_and_greedy_equals_dequantized_reference(tmp_path):
    """Mixtral under --quantization int8: every expert's fused gate/up and down are int8 (per output row, as the
    dense projections), the router stays in the compute dtype (a quantized router would change which experts a
    token reaches); greedy tokens equal transformers' with the same weights dequantized (float32), experts
    included, router not."""
    from pdserve.engine.quant import WeightOnlyLinear
    ck = make_checkpoint(tmp_path / "mx", "mixtral")
    engine = Engine.from_pretrained(ck, EngineConfig(num_gpu_blocks=64, block_size=4, quantization="int8"))
    moe = engine.runner.model.layers[0].moe
    assert all(isinstance(m, WeightOnlyLinear) for m in [*moe.gate_up, *moe.down])
    assert moe.router.dtype == torch.float32
    hf = _fake_quant_hf(ck, torch.float32)  # transformers' grouped expert GEMM takes no float64
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, out, in]
                for e in range(p.shape[0]):
                    q, s = ref_quantize(p[e].float())
                    p[e].copy_((q * s[:, None]).to(p.dtype))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 10), prompt
