"""Strict parameters and strict types: every field is supported or a 400 naming it.

Against the real app (create_gateway behind an in-process ASGI client, router on a closed port): a body that passes
every check ends as 503 `no_workers`, so a 503 is the proof a field was accepted and a 400 the proof it was not.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.services.gateway.fields import FIELDS, UNSUPPORTED
from pdserve.services.gateway.params import APIError, choice_grammar, to_sampling_params
from tests.services.gateway.test_hostile import Gateway

DOCS = Path(__file__).resolve().parents[3] / "docs" / "api.md"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CMPL = {"prompt": "hi"}


@pytest.fixture(scope="module")
def gw():
    g = Gateway()
    yield g
    g.close()


def post(gw, body: dict, chat: bool):
    return gw.post("/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())


def refused(gw, body: dict, chat: bool, param: str) -> dict:
    r = post(gw, {**(CHAT if chat else CMPL), **body}, chat)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, r.text
    return err


def accepted(gw, body: dict, chat: bool) -> None:
    r = post(gw, {**(CHAT if chat else CMPL), **body}, chat)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text


# ---- unknown and unsupported fields ----

@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", ["temprature", "max_token", "topk", "frobnicate", "Stream"])
def test_unknown_field_is_a_400_naming_it(gw, chat, name):
    err = refused(gw, {name: 1}, chat, name)
    assert "unknown parameter" in err["message"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name,value", [("suffix", "x"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
                                        ("service_tier", "flex"), ("store", True), ("metadata", {"a": "b"}),
                                        ("modalities", ["text", "audio"]), ("audio", {}),
                                        ("prediction", {"type": "content", "content": "x"}),
                                        ("reasoning_effort", "low")])
def test_unsupported_openai_field_is_a_400(gw, chat, name, value):
    refused(gw, {name: value}, chat, name)


@pytest.mark.parametrize("chat", [False, True])
def test_unsupported_fields_pass_with_the_value_that_changes_nothing(gw, chat):
    accepted(gw, {"store": False, "service_tier": "auto", "modalities": ["text"], "suffix": None, "user": "u1"},
             chat)


@pytest.mark.parametrize("chat,name,value", [(True, "prompt", "x"), (True, "echo", True), (True, "best_of", 1),
                                             (False, "messages", []), (False, "max_completion_tokens", 3),
                                             (False, "top_logprobs", 2)])
def test_the_other_endpoints_field_is_a_400(gw, chat, name, value):
    err = refused(gw, {name: value}, chat, name)
    assert "parameter" in err["message"]


def test_unknown_stream_option_is_named(gw):
    refused(gw, {"stream": True, "stream_options": {"include_usage": True, "continuous": True}}, False,
            "stream_options.continuous")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=1, max_size=30).filter(
    lambda s: s not in {f.name for f in FIELDS} | set(UNSUPPORTED) and s.encode("utf-8", "ignore").decode() == s),
    chat=st.booleans())
def test_any_other_name_is_refused(gw, name, chat):
    refused(gw, {name: 1}, chat, name)


# ---- strict types: no coercion ----

@pytest.mark.parametrize("chat,body,param", [
    (False, {"stream": "false"}, "stream"),
    (True, {"stream": 0}, "stream"),
    (False, {"ignore_eos": "false"}, "ignore_eos"),
    (True, {"logprobs": "yes"}, "logprobs"),
    (True, {"logprobs": 1}, "logprobs"),
    (False, {"allow_degrade": "no"}, "allow_degrade"),
    (False, {"return_token_ids": 1}, "return_token_ids"),
    (True, {"user": 5}, "user"),
    (True, {"user": {"id": 1}}, "user"),
    (False, {"include_stop_str_in_output": "true"}, "include_stop_str_in_output"),
    (False, {"skip_special_tokens": 0}, "skip_special_tokens"),
    (False, {"echo": "true"}, "echo"),
    (False, {"logprobs": True}, "logprobs"),
    (False, {"max_tokens": "8"}, "max_tokens"),
    (False, {"max_tokens": True}, "max_tokens"),
    (True, {"temperature": "0.5"}, "temperature"),
    (False, {"n": 1.5}, "n"),
    (False, {"seed": "1"}, "seed"),
    (True, {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    (True, {"messages": [{"role": {"r": "user"}, "content": "x"}]}, "messages[0].role"),
    (True, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (True, {"messages": [{"role": "user", "content": 12}]}, "messages[0].content"),
    (True, {"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    (True, {"messages": [{"role": "user", "name": 3, "content": "x"}]}, "messages[0].name"),
])
def test_mistyped_field_is_a_400_naming_it(gw, chat, body, param):
    refused(gw, body, chat, param)


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_non_text_content_part_is_a_400_naming_its_type(gw, part):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]
    err = refused(gw, {"messages": msgs}, True, "messages[0].content[1].type")
    assert part["type"] in err["message"]


def test_developer_role_is_accepted(gw):
    accepted(gw, {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
             True)


@pytest.mark.parametrize("chat,name", [(False, "max_tokens"), (True, "max_tokens"),
                                       (True, "max_completion_tokens")])
def test_max_tokens_beyond_the_context_is_a_400(gw, chat, name):
    max_len = gw.gateway.parser.max_len
    prompt_len = len(gw.gateway.tokenizer.encode("hi"))
    err = refused(gw, {name: max_len}, chat, name)
    assert err["code"] == "context_length_exceeded"
    if not chat:  # the exact boundary: prompt + max_tokens == context fits
        accepted(gw, {name: max_len - prompt_len}, chat)
        refused(gw, {name: max_len - prompt_len + 1}, chat, name)


# ---- the extensions: mapped to the engine's parameters, validated like the standard ones ----

def sp(body, chat=False):
    return to_sampling_params(body, chat=chat, vocab_size=320)


def test_extensions_reach_the_sampling_params():
    p = sp({"typical_p": 0.5, "no_repeat_ngram_size": 3, "stop_token_ids": [4, 5],
            "include_stop_str_in_output": True, "skip_special_tokens": False, "bad_words": ["ab", "c d"],
            "allowed_token_ids": [7, 8, 9], "prompt_logprobs": 2, "top_k": 5, "min_p": 0.2, "min_tokens": 2,
            "repetition_penalty": 1.3, "ignore_eos": True})
    assert (p.typical_p, p.no_repeat_ngram_size, p.stop_token_ids, p.include_stop_str_in_output,
            p.skip_special_tokens, p.bad_words, p.allowed_token_ids, p.prompt_logprobs, p.top_k, p.min_p,
            p.min_tokens, p.repetition_penalty, p.ignore_eos) == \
        (0.5, 3, [4, 5], True, False, ["ab", "c d"], [7, 8, 9], 2, 5, 0.2, 2, 1.3, True)
    d = sp({})
    assert (d.typical_p, d.stop_token_ids, d.skip_special_tokens, d.allowed_token_ids, d.prompt_logprobs,
            d.guided) == (1.0, [], True, None, None, None)
    assert sp({"guided_regex": "[a-z]+"}).guided.regex == "[a-z]+"
    assert sp({"guided_grammar": 'root ::= "x"'}).guided.grammar == 'root ::= "x"'
    assert json.loads(sp({"guided_json": {"type": "object"}}).guided.json_schema) == {"type": "object"}
    assert json.loads(sp({"guided_json": '{"type": "integer"}'}).guided.json_schema) == {"type": "integer"}
    assert sp({"guided_choice": ["yes", "no"]}).guided.grammar == choice_grammar(["yes", "no"])


@pytest.mark.parametrize("body,param", [
    ({"typical_p": 0}, "typical_p"), ({"typical_p": 1.5}, "typical_p"), ({"typical_p": "x"}, "typical_p"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids"), ({"stop_token_ids": [320]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"), ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "x"}, "bad_words"), ({"bad_words": [1]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [999]}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "echo": True}, "prompt_logprobs"),
    ({"guided_regex": ""}, "guided_regex"), ({"guided_regex": 5}, "guided_regex"),
    ({"guided_grammar": ["x"]}, "guided_grammar"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"), ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_json": 5}, "guided_json"), ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_extension_validation_names_the_field(body, param):
    with pytest.raises(APIError) as e:
        sp(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_guided_choice_grammar_accepts_exactly_the_choices():
    xgr = pytest.importorskip("xgrammar")
    from pdserve.builtin import builtin_model_dir
    from pdserve.engine.grammar import get_compiler
    from pdserve.engine.tokenizer import Tokenizer
    tok = Tokenizer(builtin_model_dir())
    choices = ['say "hi"', "naïve\nline", "back\\slash", "yes"]
    compiled = get_compiler(tok, tok.vocab_size).compile_grammar(choice_grammar(choices))
    for c in choices:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(c) and m.is_completed(), c
    for other in ("ye", "yess", "say hi", "naive\nline"):
        m = xgr.GrammarMatcher(compiled)
        assert not (m.accept_string(other) and m.is_completed()), other


@pytest.mark.parametrize("chat", [False, True])
def test_every_extension_passes_the_gateway(gw, chat):
    accepted(gw, {"typical_p": 0.9, "stop_token_ids": [2], "include_stop_str_in_output": False,
                  "skip_special_tokens": True, "bad_words": ["zz"], "allowed_token_ids": [5, 6, 7],
                  "prompt_logprobs": 1, "guided_choice": ["a", "b"], "no_repeat_ngram_size": 2, "top_k": 3,
                  "min_p": 0.1, "min_tokens": 1, "ignore_eos": False, "timeout": 5, "allow_degrade": True,
                  "return_token_ids": True, "repetition_penalty": 1.1, "max_tokens": 4}, chat)


# ---- one table, documented ----

def test_docs_table_lists_every_field_with_its_endpoints():
    text = DOCS.read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_]+)` \|.*$", text, re.MULTILINE)}
    for f in FIELDS:
        assert f.name in rows, f"docs/api.md has no row for {f.name}"
        if f.extension:
            assert "extension" in rows[f.name], f.name
    for name in UNSUPPORTED:
        assert name in rows and "400" in rows[name], name


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=5), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                              max_size=3), max_leaves=6)


def _typed(kind: str):
    return [(f.name, ep == "chat") for f in FIELDS for ep in f.endpoints
            if f.schema.get("type") == kind]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(_typed("boolean")), value=_JSON.filter(lambda v: v is not None and not isinstance(v, bool)))
def test_every_boolean_field_takes_only_booleans(gw, case, value):
    name, chat = case
    refused(gw, {name: value}, chat, name)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(_typed("integer")),
       value=_JSON.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))))
def test_every_integer_field_takes_only_numbers(gw, case, value):
    name, chat = case
    refused(gw, {name: value}, chat, name)


def test_priority_may_only_lower_urgency(gw):
    from pdserve.services.gateway.schema import GenerateCall
    call = GenerateCall("cmpl", [[1]], sp({}), priority=5)
    assert call.priority_for(1) == 5 and call.priority_for(9) == 9  # never more urgent than the key's class
    assert GenerateCall("cmpl", [[1]], sp({})).priority_for(3) == 3
    accepted(gw, {"priority": 7}, False)
    for v in (-1, 1001, "1", True, 1.5):
        refused(gw, {"priority": v}, True, "priority")


# ---- every field the OpenAI API defines is classified: served, or refused with a reason ----

def _openai_fields(chat: bool) -> set[str]:
    """The request fields of the installed openai SDK's `create` (its TypedDicts, streaming variant included)."""
    import typing
    if chat:
        from openai.types.chat import completion_create_params as m
    else:
        from openai.types import completion_create_params as m
    return set(typing.get_type_hints(m.CompletionCreateParamsBase)) | \
        set(typing.get_type_hints(m.CompletionCreateParamsStreaming))


@pytest.mark.parametrize("chat", [False, True])
def test_every_openai_field_is_classified_and_documented(chat):
    from pdserve.services.gateway.fields import fields_for
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_]+)` \|.*$", DOCS.read_text(), re.MULTILINE)}
    names = _openai_fields(chat)
    assert {"model", "stream", "max_tokens"} <= names  # the types were read
    unclassified = sorted(n for n in names if n not in fields_for(chat) and n not in UNSUPPORTED)
    assert not unclassified, f"OpenAI fields neither served nor refused with a reason: {unclassified}"
    assert not [n for n in names if n not in rows], "docs/api.md lacks rows"
    from openai.types.chat.chat_completion_stream_options_param import ChatCompletionStreamOptionsParam
    served = next(f for f in FIELDS if f.name == "stream_options").schema["properties"]
    assert set(ChatCompletionStreamOptionsParam.__annotations__) <= set(served)


@pytest.mark.parametrize("chat", [False, True])
def test_fields_current_sdks_send_are_served(gw, chat):
    accepted(gw, {"safety_identifier": "u-1", "prompt_cache_key": "conv-7",
                  "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}, chat)
    if chat:
        accepted(gw, {"verbosity": "medium", "prompt_cache_retention": "in_memory"}, chat)
        err = refused(gw, {"verbosity": "high"}, chat, "verbosity")
        assert "verbosity setting" in err["message"]
    refused(gw, {"prompt_cache_key": 3}, chat, "prompt_cache_key")
    refused(gw, {"stream_options": {"include_obfuscation": "yes"}}, chat, "stream_options.include_obfuscation")


@pytest.mark.parametrize("chat", [False, True])
def test_a_repetition_penalty_past_float32_is_a_400(gw, chat):
    """3.2e307 passed the checks and became inf in the sampler's float32 tensor: the worker failed (a 500)."""
    err = refused(gw, {"repetition_penalty": 3.2e307}, chat, "repetition_penalty")
    assert "10000" in err["message"]
    accepted(gw, {"repetition_penalty": 1e4}, chat)
