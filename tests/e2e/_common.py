"""Checks shared by the disagg and colocated modules (each runs them against its own deployment)."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai

from tests.e2e.conftest import PROMPTS, SEEDED, metric, wait_until


def check_greedy_batch(up, offline_greedy):
    def one(p):
        r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": p, "max_tokens": 12,
                                                              "temperature": 0, "return_token_ids": True}, timeout=30)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["token_ids"], c["text"]

    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrently: they batch on the workers
        got = [tuple(x) for x in ex.map(one, PROMPTS)]
    offline_greedy = [tuple(x) for x in offline_greedy]
    assert got == offline_greedy, (got, offline_greedy)
    # gateway latency histograms carry the router's decision (observed as each response completes, which may
    # trail the client's read of the body by a moment)
    mode = up.info["mode"]
    assert wait_until(lambda: metric(up.port, "pdserve_ttft_seconds_count", f'{{mode="{mode}"}}') >= len(PROMPTS), 5)
    assert wait_until(lambda: metric(up.port, "pdserve_tpot_seconds_count", f'{{mode="{mode}"}}') >= len(PROMPTS), 5)


def check_openai_client(up):
    c = openai.OpenAI(base_url=up.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in c.models.list().data] == ["ck"]
    r = c.completions.create(model="ck", prompt="the quick brown fox", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 5
    text = r.choices[0].text
    chunks = list(c.completions.create(model="ck", prompt="the quick brown fox", max_tokens=5, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    msgs = [{"role": "user", "content": "judge my vow"}]
    r = c.chat.completions.create(model="ck", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    chat_text = r.choices[0].message.content
    s = c.chat.completions.create(model="ck", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    parts, usage = [], None
    for ch in s:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == chat_text
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    # logprobs, both APIs
    r = c.completions.create(model="ck", prompt="the quick brown fox", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(len(t) == 2 for t in lp.top_logprobs)
    r = c.chat.completions.create(model="ck", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                  top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in r.choices[0].logprobs.content)
    # n > 1 with a seed: n choices, reproducible
    a = c.completions.create(model="ck", prompt="judge my vow", max_tokens=4, n=2, seed=5, temperature=1.0)
    b = c.completions.create(model="ck", prompt="judge my vow", max_tokens=4, n=2, seed=5, temperature=1.0)
    assert [x.index for x in a.choices] == [0, 1] and [x.text for x in a.choices] == [x.text for x in b.choices]
    # errors: 400 naming the field, 404 unknown model
    try:
        c.completions.create(model="ck", prompt="x", temperature=-1)
        raise AssertionError("expected 400")
    except openai.BadRequestError as e:
        assert e.body["param"] == "temperature"
    try:
        c.completions.create(model="nope", prompt="x")
        raise AssertionError("expected 404")
    except openai.NotFoundError:
        pass


def check_disconnect_frees_blocks(up):
    """Abort mid-stream: every worker's pdserve_kv_blocks_in_use returns to 0."""
    body = {"model": "ck", "prompt": "the quick brown fox", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    for _ in range(2):
        with httpx.stream("POST", up.base_url + "/v1/completions", json=body, timeout=30) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    n += 1
                    if n == 3:
                        break  # leaving the context manager closes the connection mid-stream
            assert n == 3
    for w in up.workers():
        assert wait_until(lambda: metric(w["metrics_port"], "pdserve_kv_blocks_in_use") == 0, 15), \
            f"{w['name']} still holds blocks"
    # the cancellation reached the engine (not just a finished request)
    assert any(metric(w["metrics_port"], "pdserve_requests_terminal_total", '{state="CANCELLED"}') >= 1
               for w in up.workers())


def seeded_ids(up):
    r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": PROMPTS[0], **SEEDED,
                                                          "return_token_ids": True}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]
