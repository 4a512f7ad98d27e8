"""Optional outside anchor for bench/engine_throughput.py: llama.cpp on the same shapes and weight dtype.

Runs only when `llama-cpp-python` and `gguf` (and numpy) are importable; neither is a pdserve dependency. The
bench's safetensors checkpoint is written as a GGUF (bf16 projections and embeddings, f32 norms, as llama.cpp's own
converter writes a bf16 model), q/k rows permuted into GGML's rope layout as convert_hf_to_gguf.py does, and a
placeholder SPM vocabulary (the bench feeds token ids, never text). Measured: batch-1 decode tokens/s after a
256-token prompt (one `eval` of one token per step, greedy from the logits) and the prefill of that prompt.

The GGUF was checked against transformers (fp32) on the bench model: all-position logits within 0.006, argmax
equal at every position. The row prints why not when the imports fail (llama-cpp-python is an sdist: a llama.cpp
build from source, ~8 min on 2 cores).
"""
from __future__ import annotations

import json
import time
from pathlib import Path


def unavailable() -> str | None:
    """Why the anchor cannot run here, or None."""
    for mod in ("numpy", "gguf", "llama_cpp"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (optional: pip install llama-cpp-python gguf)"
    return None


def _permute_rope(w, n_head: int):
    """HF's rotate-half q/k rows -> GGML's interleaved pairs (convert_hf_to_gguf.py LlamaModel.permute)."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def write_gguf(model_dir: Path, out: Path) -> Path:
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    vocab = cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg.get("head_dim") or h // heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for hf, gg in names.items():
            t = f.get_tensor(hf).float().numpy()
            if hf.endswith("q_proj.weight"):
                t = _permute_rope(t, heads)
            elif hf.endswith("k_proj.weight"):
                t = _permute_rope(t, kv_heads)
            if t.ndim == 1:  # norms stay f32, as llama.cpp's converter writes them
                w.add_tensor(gg, np.ascontiguousarray(t, dtype=np.float32))
            else:
                qt = gguf.GGMLQuantizationType.BF16
                w.add_tensor(gg, gguf.quants.quantize(np.ascontiguousarray(t), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def measure(model_dir: Path, threads: int, ctx: int = 256, new: int = 32) -> tuple[float, float]:
    """(batch-1 decode tok/s, prefill tok/s of a ctx-token prompt), each the best of 3."""
    import tempfile

    import llama_cpp
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(model_dir, Path(d) / "model-bf16.gguf")
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx + new + 16, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, logits_all=False, verbose=False)
        prompt = [100 + j % 3000 for j in range(ctx)]
        n_vocab = llm.n_vocab()

        def greedy() -> int:  # the last position's logits (Llama.scores is filled only with logits_all=True)
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

        best_pre, best_dec = float("inf"), float("inf")
        for _ in range(3):
            llm.reset()
            t = time.perf_counter()
            llm.eval(prompt)
            best_pre = min(best_pre, time.perf_counter() - t)
            tok = greedy()
            t = time.perf_counter()
            for _ in range(new):
                llm.eval([tok])
                tok = greedy()
            best_dec = min(best_dec, time.perf_counter() - t)
        return new / best_dec, ctx / best_pre
