"""`/tokenize`, `/detokenize`, `/tokenizer_info` (vLLM's shapes) on the real app: tokens checked against
transformers' own tokenizer and chat template on the same checkpoint (the built-in model), errors naming the
field, the API key required as on every endpoint, and the body limit. That the counts are what the generation
endpoints bill, and lm-eval's probe: tests/e2e/test_tokenizer_endpoints.py."""
from __future__ import annotations

import json

import pytest

from pdserve.builtin import builtin_model_dir
from tests.services.gateway.test_hostile import KEYS, Gateway

CONFIG = builtin_model_dir() / "tokenizer_config.json"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a fortune."}]


@pytest.fixture(scope="module")
def gw():
    g = Gateway(max_body_bytes=64 << 10)
    yield g
    g.close()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    from pdserve.builtin import builtin_model_dir
    return AutoTokenizer.from_pretrained(str(builtin_model_dir()))


def post(gw, path: str, body: dict, headers: dict | None = None):
    return gw.post(path, json.dumps(body).encode(), headers)


@pytest.mark.parametrize("special", [True, False])
def test_completion_form_matches_transformers(gw, hf, special):
    text = "Q: Why did the chicken cross the road?\nA: ünïcode ✓"
    r = post(gw, "/tokenize", {"model": "builtin", "prompt": text, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    # the checkpoint's tokenizer_config says `add_bos_token` (transformers 4's Llama tokenizers add it; this
    # tokenizer.json has no post-processor that would)
    bos = [hf.bos_token_id] if special and json.loads(CONFIG.read_text()).get("add_bos_token") else []
    want = bos + hf(text, add_special_tokens=False)["input_ids"]
    assert r.json() == {"count": len(want), "max_model_len": 1024, "tokens": want, "token_strs": None}
    strs = post(gw, "/tokenize", {"prompt": text, "return_token_strs": True, "add_special_tokens": special})
    assert strs.json()["token_strs"] == hf.convert_ids_to_tokens(want)
    back = post(gw, "/detokenize", {"model": "builtin", "tokens": want})
    assert back.status_code == 200 and back.json() == {"prompt": hf.decode(want)}


def test_chat_form_matches_transformers_and_the_chat_endpoint(gw, hf):
    r = post(gw, "/tokenize", {"model": "builtin", "messages": MSGS})
    assert r.status_code == 200, r.text
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    starts_bos = hf.bos_token is not None and text.startswith(hf.bos_token)
    assert r.json()["tokens"] == hf(text, add_special_tokens=not starts_bos)["input_ids"]
    no_gen = post(gw, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()["tokens"]
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=False)
    assert no_gen == hf(text, add_special_tokens=not starts_bos)["input_ids"]
    cont = MSGS + [{"role": "assistant", "content": "You will"}]
    r = post(gw, "/tokenize", {"messages": cont, "add_generation_prompt": False, "continue_final_message": True,
                               "add_special_tokens": False})
    text = hf.apply_chat_template(cont, tokenize=False, continue_final_message=True)
    assert r.json()["tokens"] == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": MSGS, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
])
def test_bad_input_is_a_4xx_naming_the_field(gw, path, body, param):
    r = post(gw, path, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_bounded_by_the_body_limit(gw):
    r = post(gw, "/tokenize", {"prompt": "x" * (70 << 10)})
    assert r.status_code == 413
    r = post(gw, "/tokenize", {"prompt": "fortune " * 7000})  # ~56 KB: tokenized on the pool, not inline
    assert r.status_code == 200 and r.json()["count"] > 7000


def test_tokenizer_info_is_what_lm_eval_probes_for(gw, hf):
    info = gw.get("/tokenizer_info").json()
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["model_max_length"] == 1024


def test_an_api_key_is_required(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    g = Gateway(api_keys_file=str(keys))
    try:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
            assert post(g, path, body).status_code == 401
            assert post(g, path, body, {"Authorization": "Bearer sk-wrong"}).status_code == 401
            assert post(g, path, body, {"Authorization": "Bearer sk-plain"}).status_code == 200
        assert g.get("/tokenizer_info").status_code == 401
        assert g.get("/tokenizer_info", {"Authorization": "Bearer sk-plain"}).status_code == 200
    finally:
        g.close()
