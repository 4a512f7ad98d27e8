"""Malformed or unsupported checkpoints give one clear error naming the problem."""
from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.errors import CheckpointError
from pdserve.engine.tokenizer import Tokenizer


@pytest.fixture()
def ckpt(tiny_llama, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_llama, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("breakage, message", [
    (lambda d: edit_config(d, architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (lambda d: (d / "config.json").unlink(), "missing config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "malformed JSON"),
    (lambda d: edit_config(d, hidden_size=None), "hidden_size"),
    (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}"), "unreadable"),
    (lambda d: (d / "tokenizer.json").unlink(), "missing tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text("[]"), "malformed tokenizer.json"),
    (lambda d: edit_config(d, num_hidden_layers=3), "model.layers.2"),
    (lambda d: edit_config(d, rope_parameters={"rope_type": "longrope", "factor": 2.0}), "unsupported rope"),
    (lambda d: edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 2.0}),
     "yarn rope scaling needs original_max_position_embeddings"),
])
def test_clear_errors(ckpt, breakage, message):
    breakage(ckpt)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        Engine.from_pretrained(ckpt)


def test_missing_shard_named(tiny_llama, tmp_path):
    from tests.conftest import make_checkpoint
    d = make_checkpoint(tmp_path / "sh", sharded=True)
    victim = sorted(d.glob("model-0000*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        Engine.from_pretrained(d)


def test_tokenizer_bos_and_chat_template(tiny_llama):
    tok = Tokenizer(tiny_llama)
    ids = tok.encode("the quick fox")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "the quick fox"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "user: hi\nassistant:"
    assert tok.eos_token_ids == [tok.hf.token_to_id("</s>")]
