"""The tokenizer endpoints on a real deployment (`pdserve up --model builtin`), as their clients use them:

- lm-eval 0.4.13's `local-completions` with its default `tokenizer_backend="auto"` first probes
  `GET /tokenizer_info` (it must carry `eos_token`) and `POST /tokenize {"prompt": "test", "add_special_tokens":
  false}` (it must answer a `tokens` list), then uses them instead of loading a tokenizer from the hub; its
  log-likelihood requests send those token ids with `echo`, `logprobs: 1`, `max_tokens: 1`. The requests below
  are the ones its source (lm_eval/utils.py `check_remote_tokenizer_support`, `RemoteTokenizer`;
  lm_eval/models/openai_completions.py `_create_payload`) sends.
- the token counts are the ones the generation endpoints bill (`usage.prompt_tokens`), chat and completion forms.
"""
from __future__ import annotations

import httpx
import pytest

MSGS = [{"role": "user", "content": "Tell me a fortune."}]


@pytest.fixture
def base(colocated_builtin):
    return colocated_builtin.base_url  # shared (tests/e2e/conftest.py); stopped with a clean-exit check


def test_lm_eval_remote_tokenizer_probe_and_loglikelihood(base):
    completions_url = base + "/v1/completions"  # what lm-eval is given as base_url
    server = completions_url.replace("/v1/completions", "").rstrip("/")
    info = httpx.get(f"{server}/tokenizer_info").json()
    assert isinstance(info, dict) and info["eos_token"] == "</s>"
    probe = httpx.post(f"{server}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(probe["tokens"], list) and probe["tokens"]
    # RemoteTokenizer.eos_token_id: the first token of the EOS text, encoded without special tokens
    eos = httpx.post(f"{server}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]  # config.json's eos_token_id
    ctx = httpx.post(f"{server}/tokenize", json={"prompt": "A penny saved", "add_special_tokens": False}).json()
    cont = httpx.post(f"{server}/tokenize", json={"prompt": " is a penny", "add_special_tokens": False}).json()
    ids = ctx["tokens"] + cont["tokens"]
    r = httpx.post(completions_url, json={"model": "builtin", "prompt": [ids], "temperature": 0, "max_tokens": 1,
                                          "logprobs": 1, "seed": 1234, "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) + 1 and lps[0] is None  # the prompt's tokens, then the sampled one
    scored = lps[len(ctx["tokens"]):-1]  # lm-eval's parse_logprobs
    assert len(scored) == len(cont["tokens"]) and all(isinstance(x, float) and x <= 0 for x in scored)
    back = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == "A penny saved is a penny"


def test_counts_are_what_the_generation_endpoints_bill(base):
    chat = httpx.post(base + "/tokenize", json={"model": "builtin", "messages": MSGS}).json()
    r = httpx.post(base + "/v1/chat/completions", json={"model": "builtin", "messages": MSGS, "max_tokens": 1},
                   timeout=60).json()
    assert chat["count"] == r["usage"]["prompt_tokens"] and chat["max_model_len"] == 1024
    text = "Q: what is a fortune? A:"
    cmpl = httpx.post(base + "/tokenize", json={"model": "builtin", "prompt": text}).json()
    r = httpx.post(base + "/v1/completions", json={"model": "builtin", "prompt": text, "max_tokens": 1,
                                                   "return_token_ids": True, "echo": True, "logprobs": 0},
                   timeout=60).json()
    assert cmpl["count"] == r["usage"]["prompt_tokens"]
