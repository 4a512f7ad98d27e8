"""Incremental detokenizer: streaming equals the full decode, and no U+FFFD is streamed for a
multi-byte character that is still arriving (byte-level BPE splits CJK / emoji across tokens)."""
from __future__ import annotations

import random

from pdserve.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "你好，世界！",
    "Emoji 😀🎉🚀 👍🏽 done",
    "混合 mixed 文本 with 🚀 rockets and 数字 12345",
    "plain ascii only",
    "新しい日本語のテキスト🙂",  # characters mostly absent from the training corpus: raw bytes
]


def stream(tok, ids, prompt=(), skip=True):
    d = IncrementalDetokenizer(tok, list(prompt), skip)
    deltas = [d.step(t) for t in ids]
    deltas.append(d.flush())
    return deltas


def test_stream_equals_full_decode_and_never_replacement_char(bpe_tokenizer):
    tok = bpe_tokenizer
    rnd = random.Random(0)
    for text in TEXTS + ["".join(rnd.choice(TEXTS)) for _ in range(10)]:
        ids = tok.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()  # really split
        prompt = tok.encode("prompt 你", add_special_tokens=False)
        deltas = stream(tok, ids, prompt)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(bpe_tokenizer):
    tok = bpe_tokenizer
    eos = tok.eos_token_ids[0]
    ids = tok.encode("你好", add_special_tokens=False) + [eos] + tok.encode("ok", add_special_tokens=False)
    assert "".join(stream(tok, ids, skip=True)) == "你好ok"
    assert "".join(stream(tok, ids, skip=False)) == "你好<eos>ok"


def test_invalid_bytes_released_at_flush(bpe_tokenizer):
    tok = bpe_tokenizer
    # first byte of a 3-byte character alone: never completes, so it only appears at flush
    lead = [i for i in range(tok.vocab_size) if tok.id_to_token(i) == "ä"][0]  # byte 0xE4 in ByteLevel
    d = IncrementalDetokenizer(tok, [], True)
    assert d.step(tok.encode("a", add_special_tokens=False)[0]) == "a"
    assert d.step(lead) == ""
    assert d.flush() == "\ufffd"


class _Refuses:
    """A DecodeStream that refuses every step, as the library does when its prefix check fails."""

    def step(self, tokenizer, token_id):
        raise Exception("InvalidPrefix")


def _two_decodes(tok, ids, prompt, skip, switch_at=None):
    """Deltas with the library stream (switched to the two-decode path at `switch_at`, as on a refused step)."""
    d = IncrementalDetokenizer(tok, list(prompt), skip)
    deltas = []
    for k, t in enumerate(ids):
        if k == switch_at:
            d._stream = _Refuses()
        deltas.append(d.step(t))
    return deltas + [d.flush()]


def test_library_stream_equals_the_two_decodes_and_falls_back_mid_sequence(bpe_tokenizer):
    """The DecodeStream path and the two-decode path give the same deltas step by step (byte-level pieces of CJK
    and emoji, special tokens skipped and kept, invalid bytes at the end); a stream that refuses a step hands
    over with its window, so the deltas are unchanged whatever step it happens at."""
    tok = bpe_tokenizer
    assert IncrementalDetokenizer(tok, [], True)._stream is not None  # the library path is the one tested
    rnd = random.Random(1)
    eos = tok.eos_token_ids[0]
    lead = [i for i in range(tok.vocab_size) if tok.id_to_token(i) == "ä"][0]
    for trial in range(30):
        ids = tok.encode("".join(rnd.choice(TEXTS) for _ in range(3)), add_special_tokens=False)
        ids = [t for i in ids for t in ([i, eos] if rnd.random() < 0.05 else [i])] + ([lead] if trial % 3 == 0 else [])
        prompt = tok.encode(rnd.choice(TEXTS), add_special_tokens=False)
        skip = trial % 2 == 0
        reference = _two_decodes(tok, ids, prompt, skip, switch_at=0)  # refused from the first step: two decodes
        for switch in (None, 1, len(ids) // 2, len(ids) - 1):
            assert _two_decodes(tok, ids, prompt, skip, switch) == reference, (trial, switch)
        full = tok.decode(prompt[-5:] + ids, skip_special_tokens=skip)[len(tok.decode(prompt[-5:], skip_special_tokens=skip)):]
        assert "".join(reference) == full
