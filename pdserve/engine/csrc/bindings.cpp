// Python bindings of the native CPU kernels (one extension module: pdserve/engine/kernels.py builds it).
#include <torch/extension.h>

#include "kernels.h"
#include "simd.h"

void bind_decoder_stack(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused [gate | up] projection");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, fp32 accumulation");
  m.def("rope_", &rope_, "rotary embedding in place (rotate-half convention)");
  m.def("prefill_attention_supported", &prefill_attention_supported, "whether paged_prefill_attention runs here");
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal (chunked-)prefill attention over the pool");
  m.def("compiled_isa", [] { return std::string(pdserve::compiled_isa()); },
        "the ISA level this build targets (cpu_isa.LEVELS)");
  m.def("weight_gemv", &weight_gemv, "x @ (scales * weight).T for int8 / bf16-stored weights (decode GEMVs)",
        py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("scales") = py::none());
  m.def("moe_experts", &moe_experts, "a sparse MoE layer's routed experts for a few tokens in one call",
        py::arg("out"), py::arg("x"), py::arg("chosen"), py::arg("weights"), py::arg("w13"), py::arg("s13"),
        py::arg("w2"), py::arg("s2"), py::arg("first"));
  m.def("moe_route", &moe_route, "a softmax top-k router for a few tokens: weights, chosen experts, load counts",
        py::arg("weights"), py::arg("chosen"), py::arg("x"), py::arg("router"), py::arg("routed"),
        py::arg("norm_topk_prob"), py::arg("round_weights"));
  m.def("moe_combine", &moe_combine, "a grouped MoE step's routing-weighted sum of each token's expert rows",
        py::arg("out"), py::arg("y"), py::arg("pos"), py::arg("weights"));
  m.def("write_kv", &write_kv, "a step's new K/V rows stored at their pool slots (one layer)");
  m.def("argmax_logsumexp", &argmax_logsumexp, "per-row argmax (lowest index on ties) and log-sum-exp");
  bind_decoder_stack(m);
}
