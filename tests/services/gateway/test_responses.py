"""`/v1/responses` before any worker: the translation into a chat body, checked against chat
bodies written out by hand; every refusal a 400 naming the Responses field; the events a chat stream becomes;
and the field table, the OpenAPI document and docs/api.md in step.

Against the real app (router on a closed port), a body that passes every check ends as 503 `no_workers`.
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import pytest

from pdserve.services.gateway.responses_api.events import EventWriter, events
from pdserve.services.gateway.responses_api.fields import FIELDS, UNSUPPORTED
from pdserve.services.gateway.responses_api.request import to_chat
from tests.services.gateway.test_hostile import Gateway

DOCS = Path(__file__).resolve().parents[3] / "docs" / "api.md"
TOOL = {"type": "function", "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


@pytest.fixture(scope="module")
def gw():
    g = Gateway()
    yield g
    g.close()


def post(gw, body: dict):
    return gw.post("/v1/responses", json.dumps(body).encode())


def test_translation_is_the_chat_body_it_means():
    t = to_chat({"model": "m", "instructions": "be brief", "temperature": 0.5, "top_p": 0.9, "stream": True,
                 "max_output_tokens": 20, "parallel_tool_calls": False, "tools": [TOOL],
                 "tool_choice": "auto",
                 "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                     "strict": True}},
                 "input": [{"role": "user", "content": "hi"},
                           {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                            "content": [{"type": "output_text", "text": "let me ", "annotations": []},
                                        {"type": "output_text", "text": "look"}]},
                           {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                           {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                           {"type": "function_call_output", "call_id": "c2",
                            "output": [{"type": "input_text", "text": "rain"}]},
                           {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
                           {"role": "developer", "content": "more"}]})
    call = lambda i: {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}  # noqa: E731
    assert t.chat == {
        "model": "m", "temperature": 0.5, "top_p": 0.9, "stream": True, "parallel_tool_calls": False,
        "stream_options": {"include_usage": True}, "max_completion_tokens": 20,
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                    "parameters": TOOL["parameters"], "strict": True}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                   "strict": True}},
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "let me look", "tool_calls": [call("c1"), call("c2")]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                     {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                     {"role": "assistant", "content": None, "tool_calls": [call("c3")]},
                     {"role": "developer", "content": "more"}]}
    assert t.where == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]", "input[6]", "input[7]"]
    assert to_chat({"input": "hello"}).chat == {"messages": [{"role": "user", "content": "hello"}]}
    # a forced call is the answer: the text format has nothing to shape, and chat refuses the two together
    fmt = {"format": {"type": "json_object"}}
    forced = to_chat({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                      "text": fmt}).chat
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "response_format" not in forced
    assert "response_format" not in to_chat({"input": "x", "tools": [TOOL], "tool_choice": "required",
                                             "text": fmt}).chat
    assert to_chat({"input": "x", "tools": [TOOL], "tool_choice": "none", "text": fmt}).chat["response_format"] \
        == {"type": "json_object"}


def test_a_valid_body_is_accepted(gw):
    r = post(gw, {"input": "hi", "instructions": "x", "tools": [TOOL], "tool_choice": "required", "store": False,
                  "include": [], "metadata": {"k": "v"}, "truncation": "disabled", "user": "u", "temperature": 0,
                  "max_output_tokens": 5, "text": {"format": {"type": "text"}}, "reasoning": None,
                  "previous_response_id": None, "service_tier": "auto", "safety_identifier": "s",
                  "stream_options": {"include_obfuscation": False}})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text


BAD = [({"input": 5}, "input"), ({"input": []}, "input"), ({}, "input"),
       ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
       ({"input": [{"role": "user"}]}, "input[0].content"),
       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type"),
       ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour"),
       ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
       ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
       ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0].type"),
       ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
       ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
       ({"input": "x", "instructions": 3}, "instructions"),
       ({"input": "x", "temperature": -1}, "temperature"),
       ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
       ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
       ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
       ({"input": "x", "tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
       ({"input": "x", "tools": [{**TOOL, "colour": 1}]}, "tools[0].colour"),
       ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
       ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
       ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
       ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
       ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
       ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
       ({"input": "x", "conversation": "conv_1"}, "conversation"),
       ({"input": "x", "background": True}, "background"),
       ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
       ({"input": "x", "truncation": "auto"}, "truncation"),
       ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
       ({"input": "x", "stream_options": {"include_obfuscation": 1}}, "stream_options.include_obfuscation"),
       ({"input": "x", "safety_identifier": 1}, "safety_identifier"),
       ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
       ({"input": "x", "messages": []}, "messages"),
       ({"input": "x", "max_tokens": 3}, "max_tokens"),
       ({"input": "x", "model": "other"}, "model")]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_refused_naming_the_field(gw, body, param):
    r = post(gw, body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param, r.text
    assert f"'{param}'" in err["message"] or param == "model", err


def test_previous_response_id_is_refused_saying_why(gw):
    err = post(gw, {"input": "x", "previous_response_id": "resp_1"}).json()["error"]
    assert "not stored" in err["message"]


def _chunks(*objs) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


def _run(chunks: list[bytes]) -> list[dict]:
    async def gen():
        for c in chunks:
            yield c

    async def main():
        w = EventWriter("chatcmpl-abc", 7, "m", {"tools": []})
        return [e async for e in events(gen(), w)]
    out = []
    for raw in asyncio.run(main()):
        head, data = raw.decode().split("\n", 1)
        ev = json.loads(data[len("data: "):])
        assert head == f"event: {ev['type']}" and raw.endswith(b"\n\n")
        out.append(ev)
    return out


def _choice(delta: dict, fr=None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": fr}]}


def test_a_chat_stream_becomes_the_typed_events():
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 2}}
    evs = _run(_chunks(_choice({"role": "assistant", "content": ""}), _choice({"content": "Hel"}),
                       _choice({"content": "lo"}),
                       _choice({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                "function": {"name": "f", "arguments": ""}}]}),
                       _choice({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}),
                       _choice({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
                       _choice({}, "tool_calls"), {"choices": [], "usage": usage}))
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["response"]["id"] == "resp_abc" and evs[0]["response"]["status"] == "in_progress"
    assert evs[6]["text"] == "Hello" and evs[8]["item"]["content"][0]["text"] == "Hello"
    assert evs[9]["output_index"] == 1 and evs[9]["item"]["call_id"] == "call_1"
    assert evs[12]["arguments"] == '{"a": 1}' and evs[13]["item"]["status"] == "completed"
    done = evs[-1]["response"]
    assert done["status"] == "completed" and [i["type"] for i in done["output"]] == ["message", "function_call"]
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}


def test_a_cut_or_failed_stream_says_so():
    evs = _run(_chunks(_choice({"content": "ab"}), _choice({}, "length")))
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert evs[-2]["item"]["status"] == "incomplete"
    evs = _run([f"data: {json.dumps(_choice({'content': 'ab'}))}\n\n".encode(),
                b'data: {"error": {"message": "late", "type": "timeout_error", "code": "timed_out"}}\n\n'])
    assert [e["type"] for e in evs][-2:] == ["response.output_item.done", "response.failed"]
    assert evs[-1]["response"]["error"] == {"code": "timed_out", "message": "late"}
    evs = _run(_chunks(_choice({}, "stop")))  # an empty answer: an empty message, as the non-streamed one
    assert [e["type"] for e in evs][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]


def test_openapi_document_and_docs_list_the_table(gw):
    doc = gw.get("/openapi.json").json()
    op = doc["paths"]["/v1/responses"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    assert set(schema["properties"]) == {f.name for f in FIELDS} and schema["required"] == ["input"]
    assert v.is_valid({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "x"}})
    assert not v.is_valid({"input": "hi", "frobnicate": 1}) and not v.is_valid({"input": 3})
    text = DOCS.read_text()
    section = text[text.index("## Responses API"):]
    listed = set(re.findall(r"^\| (?:takes|refuses) \| `([a-z_]+)` \|", section, re.M))
    assert listed == {f.name for f in FIELDS} | set(UNSUPPORTED), listed ^ ({f.name for f in FIELDS} | set(UNSUPPORTED))


def test_closing_the_event_stream_closes_the_chat_stream():
    """A client that leaves: the front door closes the outer stream, which must close the chat stream it reads
    (whose closing aborts the upstream calls)."""
    closed = []

    async def gen():
        try:
            for c in _chunks(_choice({"content": "a"}), _choice({"content": "b"})):
                yield c
        finally:
            closed.append(True)

    async def main():
        out = events(gen(), EventWriter("chatcmpl-x", 1, "m", {}))
        got = [await out.__anext__() for _ in range(4)]  # created, in_progress, item added, part added
        await out.aclose()
        return got
    got = asyncio.run(main())
    assert b"response.content_part.added" in got[-1] and closed == [True]


def test_every_field_the_installed_openai_sdk_sends_is_classified():
    """A field the Responses API defines is served or refused with a reason, never an unknown parameter."""
    from openai.types.responses import response_create_params as p

    from pdserve.services.gateway.responses_api.fields import BY_NAME
    sdk = set(p.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert sdk - set(BY_NAME) - set(UNSUPPORTED) == set()
