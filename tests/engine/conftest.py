"""Shared fixtures: a small byte-level BPE tokenizer trained on mixed ASCII / Chinese / emoji text,
so multi-byte characters really are split across tokens."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.engine.tokenizer import Tokenizer

CORPUS = [
    "Hello world, this is a small test corpus for streaming detokenization.",
    "你好，世界！今天天气很好。我们在测试增量解码。",
    "Emoji time 😀🎉🚀 and more 👍🏽 mixed with text 中文 and ASCII.",
    '{"name": "alice", "age": 30, "tags": ["a", "b"], "ok": true, "none": null}',
    "The quick brown fox jumps over the lazy dog. STOP here. 数字 12345 67890.",
]


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<eos>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(CORPUS * 20, trainer)
    d = tmp_path_factory.mktemp("bpe")
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return Tokenizer(d)
