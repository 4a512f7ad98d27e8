"""Stop conditions and streaming safety (spec §3.4, [D03])."""
from __future__ import annotations

import random

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sampling_state import SamplingState
from pdserve.engine.stop import OutputProcessor


class ChunkTokenizer:
    """Token i decodes to CHUNKS[i] (ids >= 100 are special and skipped): lets a test choose exact
    token boundaries, as in the spec's [D03] demo."""

    def __init__(self, chunks):
        self.chunks = chunks

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.chunks[i] for i in ids if not (skip_special_tokens and i >= 100))


def run(params, tok, ids, eos=(), prompt=()):
    st = SamplingState(params, list(prompt), 1000, list(eos))
    op = OutputProcessor(params, tok, list(eos))
    deltas, reason = [], None
    for t in ids:
        st.append(t)
        d, reason = op.step(t, st)
        deltas.append(d)
        if reason:
            break
    return op, deltas, reason


CH = {0: "abc", 1: "S", 2: "TO", 3: "P", 4: "X", 5: "ab", 6: "cST", 7: "d", 100: "<eos>"}
TOK = ChunkTokenizer(CH)


def test_d03_stop_string_across_three_chunks():
    op, deltas, reason = run(SamplingParams(stop=["STOP"], max_tokens=50), TOK, [0, 1, 2, 3, 4])
    assert reason == "stop" and "".join(deltas) == "abc"
    assert deltas == ["abc", "", "", ""]  # nothing of 'S', 'ST', 'STO' leaked early
    assert op.num_generated == 4 and op.num_emitted == 1


def test_d03_no_match_flush_recovers_everything():
    op, deltas, reason = run(SamplingParams(stop=["STOP"], max_tokens=50), TOK, [5, 6])
    assert reason is None and deltas == ["ab", "c"]
    assert "".join(deltas) + op.flush() == "abcST"
    op, deltas, reason = run(SamplingParams(stop=["STOP"], max_tokens=50), TOK, [0, 1, 2, 4])
    assert reason is None and "".join(deltas) == "abcSTOX"


def test_include_stop_str_and_length():
    _, deltas, reason = run(SamplingParams(stop=["STOP"], include_stop_str_in_output=True), TOK, [0, 1, 2, 3])
    assert (reason, "".join(deltas)) == ("stop", "abcSTOP")
    op, deltas, reason = run(SamplingParams(stop=["STOP"], max_tokens=3), TOK, [0, 1, 2, 3])
    assert (reason, "".join(deltas)) == ("length", "abcSTO")  # held-back text released at the end
    assert op.num_emitted == 3


def test_eos_stop_tokens_ignore_eos_min_tokens():
    _, deltas, reason = run(SamplingParams(max_tokens=10), TOK, [0, 100, 7], eos=[100])
    assert (reason, "".join(deltas)) == ("stop", "abc")
    _, deltas, reason = run(SamplingParams(max_tokens=3, ignore_eos=True), TOK, [0, 100, 7], eos=[100])
    assert (reason, "".join(deltas)) == ("length", "abcd")
    _, deltas, reason = run(SamplingParams(stop_token_ids=[7]), TOK, [0, 7])
    assert (reason, "".join(deltas)) == ("stop", "abc")
    _, deltas, reason = run(SamplingParams(stop_token_ids=[7], include_stop_str_in_output=True), TOK, [0, 7])
    assert (reason, "".join(deltas)) == ("stop", "abcd")
    # min_tokens=4: "STOP" completed at token 3 and EOS as token 4 are ignored; EOS as token 5 stops
    op, deltas, reason = run(SamplingParams(min_tokens=4, stop=["STOP"]), TOK, [1, 2, 3, 100, 100], eos=[100])
    assert reason == "stop" and "".join(deltas) == "STOP" and op.num_generated == 5


def test_grammar_terminated_and_dead_end_finish_with_stop():
    params = SamplingParams()
    st = SamplingState(params, [], 1000, [])
    op = OutputProcessor(params, TOK, [])
    st.append(0)
    st.grammar_terminated = True
    assert op.step(0, st) == ("abc", "stop")
    st = SamplingState(params, [], 1000, [])
    op = OutputProcessor(params, TOK, [])
    st.append(4)
    st.dead_end = True
    assert op.step(4, st) == ("", "stop")
    with pytest.raises(RuntimeError):
        op.step(4, st)


def test_engine_finish_length_flushes():
    op, deltas, _ = run(SamplingParams(stop=["STOP"]), TOK, [0, 1])
    assert op.finish("length") == "S" and op.finish_reason == "length"


STREAM_TEXTS = ["你好，世界！", "Emoji 😀🎉🚀 👍🏽", " mixed 中文 ", "STOP", "ST", "OP", "🚀", "abc", "S"]


@pytest.mark.parametrize("seed", range(40))
def test_stream_with_stop_and_multibyte_matches_non_streamed(bpe_tokenizer, seed):
    tok = bpe_tokenizer
    rnd = random.Random(seed)
    text = "".join(rnd.choice(STREAM_TEXTS) for _ in range(rnd.randint(1, 8)))
    stop = rnd.choice(["STOP", "🚀", "世界", "好，世", "ZZZ"])
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == text
    op, deltas, reason = run(SamplingParams(stop=[stop], max_tokens=None), tok, ids, prompt=[5, 6, 7])
    streamed = "".join(deltas) + op.flush()
    i = full.find(stop)
    assert streamed == (full[:i] if i >= 0 else full)
    assert reason == ("stop" if i >= 0 else None)
    assert not any("\ufffd" in d for d in deltas)
    # nothing streamed before the match ever extended into the stop string
    acc = ""
    for d in deltas:
        acc += d
        assert i < 0 or len(acc) <= i
