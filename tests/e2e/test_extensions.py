"""pdserve's sampling extensions reach the engine through a real deployment: each one changes
the answer the way it says (a constraint is met, a stop token stops, prompt log-probs come back), and a grammar
the worker cannot compile is a 400 naming the client's field."""
from __future__ import annotations

import json
import re

import httpx
import pytest


@pytest.fixture
def up(colocated_ck):
    return colocated_ck  # shared (tests/e2e/conftest.py); stopped with a clean-exit check after its last test


def post(up, body: dict, chat: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(up.base_url + path, json=body, timeout=60)


def ok(up, body: dict, chat: bool = False) -> dict:
    r = post(up, body, chat)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


P = {"prompt": "the quick brown fox", "temperature": 0}


def test_guided_choice_regex_and_json(up):
    for seed in range(3):
        c = ok(up, {**P, "temperature": 1.0, "seed": seed, "max_tokens": 20, "guided_choice": ["Köln", "Rom"]})
        assert c["text"] in ("Köln", "Rom") and c["finish_reason"] == "stop"
    c = ok(up, {**P, "max_tokens": 20, "guided_regex": "[ab]{3}-[0-9]"})
    assert re.fullmatch("[ab]{3}-[0-9]", c["text"]), c
    c = ok(up, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0,
                "guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}}, chat=True)
    assert c["message"]["content"] in ('{"ok":true}', '{"ok":false}')  # compact: no whitespace between tokens


def test_token_level_extensions(up):
    base = ok(up, {**P, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True})["token_ids"]
    assert len(base) == 6
    allowed = [base[0], 200, 201]
    c = ok(up, {**P, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed})
    assert set(c["token_ids"]) <= set(allowed)
    # a stop token: the answer ends at its first occurrence (the stop token itself is not part of it)
    stop = base[3]
    c = ok(up, {**P, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "stop_token_ids": [stop]})
    assert c["finish_reason"] == "stop" and c["token_ids"][:base.index(stop)] == base[:base.index(stop)]
    assert len(c["token_ids"]) <= base.index(stop) + 1
    # typical_p and no_repeat_ngram_size are accepted and sampled with
    ok(up, {**P, "max_tokens": 4, "typical_p": 0.5, "no_repeat_ngram_size": 2, "temperature": 1.0, "seed": 1})


def test_prompt_logprobs_come_back(up):
    c = ok(up, {**P, "max_tokens": 1, "prompt_logprobs": 2, "return_token_ids": True})
    plp = c["prompt_logprobs"]
    r = post(up, {**P, "max_tokens": 1, "echo": True, "logprobs": 2})
    echoed = r.json()["choices"][0]["logprobs"]
    n_prompt = len(echoed["tokens"]) - 1  # the echo's tokens: the prompt's, then the one generated
    assert len(plp) == n_prompt and plp[0] is None
    # the same numbers the echo path reports for the prompt's tokens
    for e, lp in zip(plp[1:], echoed["token_logprobs"][1:n_prompt]):
        assert any(abs(v["logprob"] - lp) < 1e-4 for v in e.values())


def test_a_grammar_the_worker_cannot_compile_names_the_field(up):
    for field, value in (("guided_regex", "(unclosed"), ("guided_grammar", "root ::= nothing_defined")):
        r = post(up, {**P, "max_tokens": 4, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_beam_search_extension(up, tiny_llama):
    """beam_width over HTTP -> gateway -> router (a `both` worker) -> engine: the n best beams transformers finds
    (tests/engine/test_beam.py holds the engine to transformers across widths, penalties and stop modes)."""
    import torch
    import transformers as tf

    from pdserve.engine.tokenizer import Tokenizer
    r = post(up, {**P, "max_tokens": 8, "beam_width": 3, "n": 2, "length_penalty": 0.5, "early_stopping": "never",
                  "return_token_ids": True})
    assert r.status_code == 200, r.text
    got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    ids = torch.tensor([Tokenizer(tiny_llama).encode(P["prompt"])])
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=2,
                          do_sample=False, length_penalty=0.5, early_stopping="never", max_new_tokens=8,
                          pad_token_id=1)[:, ids.shape[1]:].tolist()
    assert got == ref and r.json()["usage"]["completion_tokens"] == 16
    # streamed: nothing can be shown before the search ends; then the same two choices arrive whole
    texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    body = {**P, "max_tokens": 8, "beam_width": 3, "n": 2, "length_penalty": 0.5, "early_stopping": "never",
            "stream": True}
    streamed: dict[int, str] = {}
    with httpx.stream("POST", up.base_url + "/v1/completions", json=body, timeout=60) as sr:
        assert sr.status_code == 200
        for line in sr.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == texts
    for body, param in (({"beam_width": 2, "top_p": 0.5}, "top_p"), ({"beam_width": 2, "n": 3}, "n"),
                        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping")):
        r = post(up, {**P, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
