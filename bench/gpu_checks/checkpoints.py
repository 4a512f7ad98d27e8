"""Random-weight checkpoints written locally (nothing downloaded): llama, qwen2 or a sparse-MoE qwen3_moe in
transformers' own format, with a word-level tokenizer of exactly the model's vocabulary."""
from __future__ import annotations

import json
from pathlib import Path


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with exactly the model's vocabulary (t0, t1, ...; t1 is the EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))


def write_checkpoint(out: Path, arch: str, dtype, *, vocab: int = 512, hidden: int = 128, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, inter: int = 344, scale: float = 0.08) -> Path:
    import torch
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5)
    cfg, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)}[arch]
    if arch == "qwen3_moe":  # 8 experts, top 2 (normalised), q/k norms: the sparse layer and router on the device;
        # 96: transformers' grouped_mm wants 16-byte strides
        common.update(head_dim=hidden // heads, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    model = cls(cfg(**common)).to(dtype)
    if scale:
        with torch.no_grad():  # random init is near-uniform; scale up so greedy choices are decisive
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, scale)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, vocab)
    return out
