"""Tool calling pieces: the parsers on model output in each format, the grammars that enforce
`required` / named choices (checked with xgrammar itself: a valid call in the format is in the language, a call
breaking the schema or the syntax is not), streaming reassembly, the request's checks, and the prompt a tool
history renders to (against transformers' apply_chat_template)."""
from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.tools.hermes import HermesParser
from pdserve.services.gateway.tools.llama3 import Llama3JsonParser
from pdserve.services.gateway.tools.mistral import MistralParser
from pdserve.services.gateway.tools.output import ToolOutput
from pdserve.services.gateway.tools.registry import PARSERS, pick
from pdserve.services.gateway.tools.request import tool_request
from tests.engine.test_chat_template import TEMPLATES, WEATHER_TOOL

WEATHER = WEATHER_TOOL["function"]
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"},
                                                                             "h24": {"type": "boolean"}},
                                           "required": ["tz", "h24"]}}
TOOLS = [WEATHER_TOOL, {"type": "function", "function": TIME}]

# the same two calls, written as each model family writes them
OUTPUTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "h24": true}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Köln"}}; '
                   '{"name": "get_time", "parameters": {"tz": "CET", "h24": true}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Köln"}}, '
               '{"name": "get_time", "arguments": {"tz": "CET", "h24": true}}]',
}
CONTENT = {"hermes": "Let me check.", "llama3_json": None, "mistral": "Let me check."}
WANT = [("get_weather", {"city": "Köln"}), ("get_time", {"tz": "CET", "h24": True})]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_parser_reads_its_format(name):
    out = PARSERS[name]().parse(OUTPUTS[name])
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == WANT
    assert out.content == CONTENT[name]
    assert len({c.id for c in out.calls}) == 2 and all(c.id.startswith("call_") for c in out.calls)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("text", ["The weather is fine.", "", "<tool_call>\n{\"name\": 3}\n</tool_call>",
                                  "[TOOL_CALLS][{\"nam\": \"x\"}]", "{\"name\": \"f\", \"parameters\": [1]}",
                                  "{not json"])
def test_anything_else_is_content(name, text):
    out = PARSERS[name]().parse(text)
    assert out.calls == [] and out.content == text


def test_llama_single_call_without_tag_and_single_mistral_object():
    out = Llama3JsonParser().parse('{"name": "get_weather", "parameters": {"city": "Rom"}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Rom"})]
    out = MistralParser().parse('[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Rom"}}')
    assert out.calls[0].name == "get_weather" and out.content is None


def test_parser_choice():
    for name in ("qwen2.5", "llama3", "mistral"):
        source = (TEMPLATES / f"{name}.jinja").read_text()
        assert pick(None, source).name == {"qwen2.5": "hermes", "llama3": "llama3_json", "mistral": "mistral"}[name]
    assert pick(None, "{{ messages }}").name == "hermes" and pick(None, None).name == "hermes"
    assert pick("mistral", "<tool_call>").name == "mistral"  # the flag wins
    with pytest.raises(ValueError):
        pick("nope", None)
    from pdserve.cli import TOOL_CALL_PARSERS
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


# ---- the grammars: in the language exactly the calls the schema allows, in the parser's syntax ----

@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("xgrammar")
    from pdserve.builtin import builtin_model_dir
    from pdserve.engine.grammar import get_compiler
    from pdserve.engine.tokenizer import Tokenizer
    tok = Tokenizer(builtin_model_dir())
    return get_compiler(tok, tok.vocab_size)


def accepts(compiler, spec, text: str) -> bool:
    import xgrammar as xgr

    from pdserve.engine.grammar import wrapped_json_ebnf
    m = xgr.GrammarMatcher(compiler.compile_grammar(wrapped_json_ebnf(spec.grammar, spec.json_schema)))
    return m.accept_string(text) and m.is_completed()


# the grammars' JSON is compact: no whitespace between its tokens (engine/grammar.py)
CALL = {"hermes": lambda n, a: f'<tool_call>\n{{"name":"{n}","arguments":{a}}}\n</tool_call>',
        "llama3_json": lambda n, a: f'{{"name":"{n}","parameters":{a}}}',
        "mistral": lambda n, a: f'[TOOL_CALLS][{{"name":"{n}","arguments":{a}}}]'}
JOIN = {"hermes": "\n", "llama3_json": "; "}


@pytest.mark.parametrize("name", sorted(CALL))
def test_constraint_grammar(compiler, name):
    p, call = PARSERS[name](), CALL[name]
    spec = p.constraint([WEATHER, TIME], parallel=False)
    good = call("get_weather", '{"city":"Köln"}')
    assert accepts(compiler, spec, good)
    assert not accepts(compiler, spec, call("get_weather", '{"city": "Köln"}'))  # no free whitespace
    assert p.parse(good).calls[0].name == "get_weather"  # what the grammar makes, the parser reads
    assert accepts(compiler, spec, call("get_time", '{"tz":"UTC","h24":false}'))
    assert not accepts(compiler, spec, call("get_weather", '{"city":5}'))  # argument type
    assert not accepts(compiler, spec, call("get_weather", '{}'))  # required argument missing
    assert not accepts(compiler, spec, call("get_time", '{"tz":"UTC"}'))
    assert not accepts(compiler, spec, call("get_news", '{"city":"Köln"}'))  # no such function
    assert not accepts(compiler, spec, "Sure! " + good)  # nothing but the call
    named = p.constraint([TIME], parallel=False)
    assert not accepts(compiler, named, good) and accepts(compiler, named, call("get_time", '{"tz":"a","h24":true}'))
    two = call("get_weather", '{"city":"A"}'), call("get_time", '{"tz":"B","h24":true}')
    if name == "mistral":
        pair = two[0][:-1] + "," + two[1][len("[TOOL_CALLS]["):]
    else:
        pair = JOIN[name].join(two)
    assert not accepts(compiler, spec, pair)  # parallel=False: one call
    par = p.constraint([WEATHER, TIME], parallel=True)
    assert accepts(compiler, par, pair) and accepts(compiler, par, good)
    assert len(p.parse(pair).calls) == 2


# ---- streaming: content until the marker, then id + name, then arguments ----

def reassemble(name: str, text: str, step: int, parallel: bool = True) -> tuple[str, list]:
    s = ToolOutput(PARSERS[name](), parallel).streamer()
    content, deltas = "", []
    for i in range(0, len(text), step):
        out, ds = s.feed(text[i:i + step])
        content, deltas = content + out, deltas + ds
    rest, more = s.finish()
    deltas += more
    calls: dict[int, dict] = {}
    for d in deltas:  # as a client accumulates them
        c = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in d:
            assert c["id"] is None and d["function"]["arguments"] == ""
            c["id"], c["name"] = d["id"], d["function"]["name"]
        else:
            assert c["id"] is not None  # the name came first
        c["arguments"] += d["function"]["arguments"]
    return content + rest, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_calls_reassemble(name, step):
    content, calls = reassemble(name, OUTPUTS[name], step)
    assert calls == WANT
    assert content.strip() == (CONTENT[name] or "")
    assert reassemble(name, OUTPUTS[name], step, parallel=False)[1] == WANT[:1]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("text", ["Plain answer with < and [ and { inside.", "<tool_cal", "[TOOL_CALLS]oops"])
def test_streamed_text_without_calls_is_all_content(name, text):
    for step in (1, 2, 50):
        assert reassemble(name, text, step) == (text, [])


# ---- the request's checks ----

@pytest.mark.parametrize("body,param", [
    ({"tools": {}}, "tools"), ({"tools": []}, "tools"), ({"tools": [{"type": "code"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "false"}, "parallel_tool_calls"),
])
def test_tool_request_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        tool_request(body)
    assert e.value.status == 400 and e.value.param == param


def test_tool_request_choices():
    assert tool_request({}) is None and tool_request({"tool_choice": "none"}) is None
    r = tool_request({"tools": TOOLS})
    assert r.choice == "auto" and r.parallel and not r.constrained and len(r.allowed()) == 2
    r = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                      "parallel_tool_calls": False})
    assert r.constrained and r.named == "get_time" and [f["name"] for f in r.allowed()] == ["get_time"]
    assert not r.parallel and tool_request({"tools": TOOLS, "tool_choice": "required"}).constrained


# ---- the tool history renders as transformers renders it ----

OPENAI_HISTORY = [
    {"role": "user", "content": "Wie ist das Wetter in München?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"München\"}"}}]},
    {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp_c\": 21, \"sky\": \"heiter\"}"},
    {"role": "assistant", "content": "Heiter, 21 °C."},
    {"role": "user", "content": "Und morgen?"}]


@pytest.mark.parametrize("name", ["qwen2.5", "llama3", "mistral"])
def test_openai_tool_history_renders_as_transformers(tmp_path, name):
    """The OpenAI-shaped history (arguments as JSON text) through the gateway's message checks renders exactly
    as transformers renders the same conversation (arguments as objects, as its templates expect)."""
    from pdserve.services.gateway.parse import RequestParser
    from tests.engine.test_chat_template import TOOL_HISTORY, both, write_checkpoint
    ours, ref = both(write_checkpoint(tmp_path / name, name, (TEMPLATES / f"{name}.jinja").read_text(), False))
    parser = RequestParser(ours, ours.vocab_size, 4096, "m")
    got = parser.render(parser.messages({"messages": OPENAI_HISTORY}), [WEATHER_TOOL])
    want = ref.apply_chat_template(TOOL_HISTORY, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert got == want and "München" in got


def test_the_sdks_own_assistant_message_goes_back_in():
    """What `resp.choices[0].message.model_dump(exclude_none=True)` gives for a tool call has no `content` key: it
    was a 500 (`KeyError: 'content'`); it renders (then no router behind this gateway: 503)."""
    from openai.types.chat import ChatCompletionMessage

    from tests.services.gateway.test_hostile import Gateway
    msg = ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"München\"}"}}]}).model_dump(exclude_none=True)
    assert "content" not in msg
    body = {"messages": [OPENAI_HISTORY[0], msg, *OPENAI_HISTORY[2:]], "tools": [WEATHER_TOOL]}
    gw = Gateway()
    try:
        r = gw.post("/v1/chat/completions", json.dumps(body).encode())
    finally:
        gw.close()
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text


@pytest.mark.parametrize("msg,param", [
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "a"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f"}}]},
     "messages[1].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls[0]"),
])
def test_tool_history_errors_name_the_field(msg, param):
    from pdserve.services.gateway.parse import RequestParser
    with pytest.raises(APIError) as e:
        RequestParser.messages({"messages": [{"role": "user", "content": "hi"}, msg]})
    assert e.value.param == param


def test_hermes_streams_name_then_argument_fragments():
    s = ToolOutput(HermesParser()).streamer()
    text = OUTPUTS["hermes"]
    head_end = text.index('"arguments": ') + len('"arguments": ')
    first_end = text.index("</tool_call>") + len("</tool_call>")
    content, deltas = s.feed(text[:head_end - 3])
    assert content == "Let me check.\n" and deltas == []  # the head is not complete yet
    _, deltas = s.feed(text[head_end - 3:head_end])
    assert deltas == []  # the space before the arguments must not be their first fragment (SDKs parse them)
    _, deltas = s.feed("{")
    assert len(deltas) == 2 and deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"]
    assert deltas[1]["function"]["arguments"] == "{"
    fragments = ["{"]
    for ch in text[head_end + 1:first_end]:  # one character at a time: fragments before the call ends
        _, ds = s.feed(ch)
        assert all("id" not in d and d["index"] == 0 for d in ds)
        fragments += [d["function"]["arguments"] for d in ds]
    assert len(fragments) > 3 and json.loads("".join(fragments)) == {"city": "Köln"}
    _, deltas = s.feed(text[first_end:])
    assert deltas[0]["index"] == 1 and deltas[0]["function"]["name"] == "get_time"
    assert json.loads(deltas[1]["function"]["arguments"]) == {"tz": "CET", "h24": True}
    assert s.finish() == ("", []) and s.called  # nothing sent twice
    # nested objects and braces inside strings: the fragments still rebuild the arguments exactly
    args = {"q": {"a": [1, {"b": "}}"}]}, "s": "x}"}
    out = "<tool_call>\n" + json.dumps({"name": "f", "arguments": args}) + "\n</tool_call>"
    s = ToolOutput(HermesParser()).streamer()
    ds = [d for ch in out for d in s.feed(ch)[1]] + s.finish()[1]
    assert json.loads("".join(d["function"]["arguments"] for d in ds)) == args
    # cut off inside the arguments (max_tokens): what arrived, and still a call
    s = ToolOutput(HermesParser()).streamer()
    ds = s.feed(out[:-25])[1] + s.finish()[1]
    assert ds[0]["function"]["name"] == "f" and s.called


def test_hermes_call_not_in_the_usual_key_order_goes_out_whole():
    out = '<tool_call>\n{"arguments": {"city": "Rom"}, "name": "get_weather"}\n</tool_call>'
    s = ToolOutput(HermesParser()).streamer()
    _, ds = s.feed(out[:-3])
    assert ds == []
    _, ds = s.feed(out[-3:])
    assert ds[0]["function"]["name"] == "get_weather" and json.loads(ds[1]["function"]["arguments"]) == {"city": "Rom"}
    # a second block that is not a call: the first call stands, the rest is content
    s = ToolOutput(HermesParser()).streamer()
    _, ds = s.feed(out + "\n<tool_call>\nnot json\n</tool_call>")
    assert len(ds) == 2
    rest, more = s.finish()
    assert more == [] and rest == "<tool_call>\nnot json\n</tool_call>" and s.called


# ---- a whole choice and its stream say the same, cut by max_tokens or not ----

def streamed_message(out: ToolOutput, text: str, step: int, finish_reason: str) -> tuple[str, list[dict]]:
    r = out.streamer()
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, ds = r.feed(text[i:i + step])
        content, deltas = content + c, deltas + ds
    c, ds = r.finish(finish_reason)
    return content + c, deltas + ds


def _calls(msg: dict) -> list:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_whole_and_streamed_choices_agree_when_cut(name):
    from pdserve.services.gateway.tools.output import assemble
    text = OUTPUTS[name]
    for cut in range(1, len(text) + 1, 5):
        part, fr = text[:cut], "length" if cut < len(text) else "stop"
        for parallel in (True, False):
            out = ToolOutput(PARSERS[name](), parallel)
            msg, called = out.message(part, fr)
            for step in (1, 4, 1000):
                content, deltas = streamed_message(out, part, step, fr)
                assert _calls({"tool_calls": assemble(deltas)}) == _calls(msg), (cut, step)
                assert (content.strip() or None) == (msg["content"].strip() or None if msg["content"] else None)
                assert called == bool(deltas)
    # complete calls stay calls when the next one is cut (Hermes: the cut one too, with the arguments it has)
    if name == "hermes":
        cut_in_second = text[:text.rindex('"h24"')]
        msg, _ = ToolOutput(HermesParser()).message(cut_in_second, "length")
        assert [c[0] for c in _calls(msg)] == ["get_weather", "get_time"]
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Köln"}
        assert msg["tool_calls"][1]["function"]["arguments"] == '{"tz": "CET", '


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_a_named_choice_samples_only_the_arguments(name):
    p = PARSERS[name]()
    head, tail = p.forced_call("get_weather")
    # the head, the arguments and the tail are one call in the parser's own format
    assert p.parse(head + '{"city":"Köln"}' + tail).calls[0].name == "get_weather"
    out = ToolOutput(p, False, (head, tail))
    msg, called = out.message('{"city":"Köln"}', "stop")
    assert called and [(n, json.loads(a)) for n, a in _calls(msg)] == [("get_weather", {"city": "Köln"})]
    assert msg["content"] is None
    for step in (1, 3):
        content, deltas = streamed_message(out, '{"city":"Köln"}', step, "stop")
        assert content == "" and deltas[0]["function"]["name"] == "get_weather"
        first_args = next(d["function"]["arguments"] for d in deltas if d["function"]["arguments"])
        assert first_args.startswith("{")  # what an incremental JSON parser can start on
        from pdserve.services.gateway.tools.output import assemble
        assert _calls({"tool_calls": assemble(deltas)}) == _calls(msg)
