"""A migrated request resumes on another engine exactly where the first one stopped (engine/resume.py).

Reference: the same request run uninterrupted on an engine, streamed step by step. For each cut point k, a second
engine (a fresh one: the "other worker", nothing cached) gets the prompt and the first k output tokens as a resume;
its stream must be the uninterrupted one's remainder: the same tokens (greedy, seeded sampling, penalties, bad
words, n-gram bans, a grammar) and, concatenated after the text the uninterrupted stream had sent by token k, the
same full text (stop-string hold-back and the detokenizer's window carried over).
"""
from __future__ import annotations

import pytest

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams

PROMPT = list(range(10, 27))


def _engine(ckpt) -> Engine:
    return Engine.from_pretrained(ckpt, EngineConfig(block_size=4, num_gpu_blocks=128))


def _stream(eng: Engine, rid: str, params: SamplingParams, resume: list[int] | None = None):
    """(per-token ids, text sent once each token's message went out, finish reason)."""
    eng.add_request(rid, PROMPT, params, resume_token_ids=resume)
    ids, sent, text, reason = [], [], "", None
    while eng.has_unfinished():
        for out in eng.step():
            c = out.outputs[0]
            text += c.new_text
            for t in c.new_token_ids:
                ids.append(t)
                sent.append(text)  # one token per step here: the text out after it
            reason = c.finish_reason or reason
    return ids, sent, text, reason


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return _engine(tiny_llama), _engine(tiny_llama)


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    "seeded_plain": SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.7, seed=99, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                                presence_penalty=0.8, repetition_penalty=1.3),
    "greedy_penalties": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                                       no_repeat_ngram_size=2),
    "min_tokens": SamplingParams(temperature=1.0, seed=3, max_tokens=24, min_tokens=20),
    "guided": SamplingParams(temperature=1.0, seed=11, max_tokens=24, guided=GuidedSpec(regex="[a-e]{3,30}")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_resume_continues_the_uninterrupted_stream(engines, name):
    a, b = engines
    params = CASES[name]
    ids, sent, text, reason = _stream(a, f"ref-{name}", params)
    assert len(ids) >= 6, ids
    if name in ("penalties", "greedy_penalties"):  # the penalties really act: without them the output differs
        plain = SamplingParams(temperature=params.temperature, seed=params.seed, max_tokens=24, ignore_eos=True)
        assert _stream(a, f"plain-{name}", plain)[0] != ids
    for k in (1, 3, len(ids) // 2, len(ids) - 1):
        got, _, rest, got_reason = _stream(b, f"res-{name}-{k}", params, resume=ids[:k])
        assert got == ids[k:], (k, got, ids[k:])
        assert sent[k - 1] + rest == text, (k, sent[k - 1], rest, text)
        assert got_reason == reason
    assert b.block_manager.blocks_in_use == 0 and not b.requests


def test_resume_keeps_stop_string_hold_back(engines):
    """A stop string cut from the uninterrupted text: the run stops there, and every cut before it (including
    cuts whose sent text ends in a held-back prefix of the stop string) resumes to the same text."""
    a, b = engines
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, _, full, _ = _stream(a, "stop-base", base)
    # a two-character stop string first seen a few characters in (the tiny random model writes odd characters)
    at = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stop = full[at:at + 2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    ids, sent, text, reason = _stream(a, "stop-ref", params)
    assert reason == "stop" and text == full[:at]
    held = [k for k in range(1, len(ids)) if sent[k - 1].endswith(stop[0]) is False
            and a.tokenizer.decode(ids[:k]).endswith(stop[0])]
    for k in range(1, len(ids)):
        got, _, rest, got_reason = _stream(b, f"stop-res-{k}", params, resume=ids[:k])
        assert got == ids[k:] and sent[k - 1] + rest == text and got_reason == "stop", (k, got, rest)
    assert held, "no cut point had text held back: the test would not test the hold-back"


def test_resume_refuses_what_cannot_be_a_live_output(engines):
    _, b = engines
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="already ends"):
        b.add_request("r-len", PROMPT, p, resume_token_ids=[30, 31, 32, 33])  # max_tokens reached by token 3
    with pytest.raises(ValueError, match="vocabulary"):
        b.add_request("r-voc", PROMPT, p, resume_token_ids=[10**6])
    with pytest.raises(ValueError, match="single-branch"):
        b.add_request("r-n", PROMPT, SamplingParams(temperature=1.0, n=2, max_tokens=4), resume_token_ids=[30])
    assert not b.requests and b.block_manager.blocks_in_use == 0
