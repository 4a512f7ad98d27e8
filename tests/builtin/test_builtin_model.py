"""The shipped demo checkpoint (pdserve/builtin/model): complete, small, Llama+GQA, and actually trained."""
from __future__ import annotations

import json
import math
import re

import jinja2
import pytest

from pdserve.builtin import builtin_model_dir

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "heldout.txt",
}
MAX_BYTES = 25 * 1024 * 1024
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


@pytest.fixture(scope="module")
def model_dir():
    return builtin_model_dir()


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok_config(model_dir):
    return json.loads((model_dir / "tokenizer_config.json").read_text())


@pytest.fixture(scope="module")
def model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(model_dir)
    m.eval()
    return m


def _heldout_texts(model_dir) -> list[str]:
    from pdserve.builtin.train import read_heldout

    return read_heldout(model_dir / "heldout.txt")


def test_files_present_and_small(model_dir):
    names = {p.name for p in model_dir.iterdir() if p.is_file()}
    assert EXPECTED_FILES <= names, EXPECTED_FILES - names
    assert not any(n.endswith(".bin") or n.startswith("model-0") for n in names), "expect one model.safetensors"
    size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    assert size <= MAX_BYTES, f"{size} bytes"


def test_config_is_llama_with_gqa(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert (cfg.get("torch_dtype") or cfg.get("dtype")) == "bfloat16"
    assert cfg["max_position_embeddings"] >= 512
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == cfg["bos_token_id"] == 1
    assert 2 in gen["eos_token_id"]


def test_safetensors_bf16(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_dtype() == "BF16"


def test_tokenizer_specials_and_roundtrip(tok, tok_config, model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert tok.get_vocab_size(with_added_tokens=True) == cfg["vocab_size"]
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i
    assert tok_config["bos_token"] == "<s>" and tok_config["eos_token"] == "</s>" and tok_config["pad_token"] == "<pad>"
    assert tok_config["add_bos_token"] is True
    assert tok_config["model_max_length"] == cfg["max_position_embeddings"]
    text = "The quick brown fox jumps over the lazy dog.\n\tIt's 42 degrees -- isn't it?  \"Yes!\" (said Bob)"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert len(enc.ids) < len(text) / 2  # BPE merges actually learned
    # BOS policy: no post-processor in tokenizer.json; add_bos_token in tokenizer_config.
    assert tok.encode("Hello", add_special_tokens=True).ids == tok.encode("Hello", add_special_tokens=False).ids
    chat = "<s><|user|>Hi<|end|><|assistant|>"
    ids = tok.encode(chat, add_special_tokens=False).ids
    assert ids[0] == 1 and ids[1] == tok.token_to_id("<|user|>") and ids[-1] == tok.token_to_id("<|assistant|>")


def test_pdserve_tokenizer_wrapper_adds_one_bos(model_dir):
    from pdserve.engine.tokenizer import Tokenizer

    t = Tokenizer(model_dir, eos_token_ids=json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"])
    assert t.encode("Hello world")[0] == 1 and t.encode("Hello world")[1] != 1
    prompt = t.apply_chat_template([{"role": "user", "content": "Tell me a fortune."}], add_generation_prompt=True)
    ids = t.encode(prompt)
    assert ids[0] == 1 and ids[1] != 1
    assert set(t.eos_token_ids) == {2, 6}


@pytest.mark.parametrize("env_kwargs", [{}, {"trim_blocks": True, "lstrip_blocks": True}])
def test_chat_template_renders(tok_config, env_kwargs):
    tmpl = jinja2.Environment(**env_kwargs).from_string(tok_config["chat_template"])
    msgs = [
        {"role": "system", "content": "You are a fortune cookie."},
        {"role": "user", "content": "Tell me a fortune."},
        {"role": "assistant", "content": "You will be hungry again in an hour."},
        {"role": "user", "content": "Another?"},
    ]
    out = tmpl.render(messages=msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert out == (
        "<s><|system|>You are a fortune cookie.<|end|><|user|>Tell me a fortune.<|end|>"
        "<|assistant|>You will be hungry again in an hour.<|end|><|user|>Another?<|end|><|assistant|>"
    )
    assert out.endswith("<|assistant|>")
    closed = tmpl.render(messages=msgs[:2], add_generation_prompt=False, bos_token="<s>", eos_token="</s>")
    assert closed.endswith("<|end|>") and not closed.endswith("<|assistant|>")


def test_greedy_continuation_is_english_like(model, tok):
    import torch

    ids = torch.tensor([tok.encode("<s>The meaning of life is", add_special_tokens=False).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
    text = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert len(text) >= 20, repr(text)
    letters_spaces = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    assert letters_spaces / len(text) > 0.7, repr(text)
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 5, repr(text)


def test_heldout_loss_shows_training(model, tok, model_dir):
    import torch

    texts = _heldout_texts(model_dir)
    assert len(texts) >= 16
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts[:16]:
            ids = torch.tensor([tok.encode("<s>" + text + "</s>", add_special_tokens=False).ids])
            logits = model(input_ids=ids).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    loss = total / count
    uniform = math.log(tok.get_vocab_size(with_added_tokens=True))
    assert loss < 5.0 < uniform, f"held-out loss {loss:.3f} (uniform {uniform:.2f})"


def test_builtin_model_dir_missing_is_clear(tmp_path, monkeypatch):
    import pdserve.builtin as b

    monkeypatch.setattr(b, "__file__", str(tmp_path / "__init__.py"))
    with pytest.raises(FileNotFoundError, match="built-in demo model"):
        b.builtin_model_dir()
