"""`/openapi.json` describes what the gateway really accepts: its request schemas agree with the
gateway's own verdict on bodies it accepts and bodies it refuses, and `/v1/models` carries root and
max_model_len."""
from __future__ import annotations

import jsonschema
import pytest

from pdserve.services.gateway.fields import FIELDS, UNSUPPORTED
from tests.services.gateway import test_fields as F
from tests.services.gateway.test_hostile import Gateway
from tests.services.gateway.test_tools import TOOLS


@pytest.fixture(scope="module")
def gw():
    g = Gateway()
    yield g
    g.close()


@pytest.fixture(scope="module")
def doc(gw):
    r = gw.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def validator(doc, chat: bool):
    schema = doc["components"]["schemas"]["ChatCompletionRequest" if chat else "CompletionRequest"]
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_document_shape(doc):
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/") and "400" in op["responses"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and chat["required"] == ["messages"]
    names = {f.name for f in FIELDS if "chat" in f.endpoints}
    assert set(chat["properties"]) == names | set(UNSUPPORTED)
    assert chat["properties"]["guided_regex"]["x-pdserve-extension"] is True
    assert "suffix" in chat["x-pdserve-refused"]


ACCEPTED = [
    (False, {"prompt": "hi", "max_tokens": 3, "stream": False, "echo": True, "logprobs": 2}),
    (False, {"prompt": [[1, 2], [3]], "n": 2, "seed": 4, "stop": ["x"], "logit_bias": {"5": -3}}),
    (True, {**F.CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False, "user": "u", "top_logprobs": 2, "logprobs": True}),
    (True, {"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]},
                         {"role": "user", "content": "q"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "temperature": 0.5}),
    (False, {"prompt": "hi", "typical_p": 0.9, "stop_token_ids": [2], "guided_choice": ["a", "b"],
             "allowed_token_ids": [5], "prompt_logprobs": 1, "timeout": 5}),
    (False, {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1, "top_k": 50}),
    (False, {"prompt": [5.0, 6], "stop_token_ids": [7.0], "model": "builtin"}),
    (False, {"prompt": "hi", "beam_width": 2, "top_p": 1, "top_k": -1, "stop": [], "store": False}),
    (True, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "safety_identifier": "s", "verbosity": "medium",
        "prompt_cache_key": "k", "stream_options": {"include_obfuscation": False}, "stream": True}),
]


@pytest.mark.parametrize("chat,body", ACCEPTED)
def test_what_the_gateway_accepts_validates(gw, doc, chat, body):
    F.accepted(gw, {k: v for k, v in body.items()}, chat)
    validator(doc, chat).validate(body)


REFUSED = [(False, {"temprature": 1}), (True, {"stream": "false"}), (False, {"ignore_eos": "false"}),
           (True, {"logprobs": "yes"}), (False, {"allow_degrade": "no"}), (True, {"user": 5}),
           (True, {"messages": [{"role": 1, "content": "x"}]}), (True, {"messages": [{"role": "user", "content": 3}]}),
           (True, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
           (False, {"n": 0}), (False, {"top_p": 0}), (False, {"typical_p": 2}), (True, {"prompt": "x"}),
           (True, {"tool_choice": "always", "tools": TOOLS}), (True, {"tools": [{"type": "code"}]}),
           (False, {"suffix": "x"}), (False, {"stop_token_ids": [True]}),
           # what a schema-valid body was refused for: the schema now says it too
           (True, {"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}),
           (True, {"messages": [{"role": "user"}]}), (True, {"messages": [{"role": "tool", "content": "x"}]}),
           (True, {"messages": [{"role": "assistant", "content": None}]}),
           (False, {"top_k": 10 ** 6}), (True, {"top_logprobs": 2}), (True, {"top_logprobs": 2, "logprobs": False}),
           (False, {"max_tokens": 0}), (False, {"echo": True, "stream": True}), (True, {"max_tokens": 0}),
           (False, {"prompt": [10 ** 6]}), (False, {"model": "another"}), (True, {"tool_choice": "required"}),
           (False, {"beam_width": 2, "top_p": 0.5}), (True, {"logprobs": 2}), (False, {"logprobs": True}),
           (False, {"max_tokens": 10 ** 6}), (False, {"prompt_logprobs": 1, "echo": True})]


@pytest.mark.parametrize("chat,body", REFUSED)
def test_what_the_gateway_refuses_does_not_validate(gw, doc, chat, body):
    full = {**(F.CHAT if chat else F.CMPL), **body}
    r = F.post(gw, full, chat)
    assert r.status_code == (404 if "model" in body else 400), r.text
    assert not validator(doc, chat).is_valid(full), body


def test_models_carry_root_and_max_model_len(gw):
    for r in (gw.get("/v1/models").json()["data"][0], gw.get("/v1/models/builtin").json()):
        assert r["id"] == "builtin" and r["root"] == "builtin"
        assert r["max_model_len"] == gw.gateway.parser.max_len > 0
