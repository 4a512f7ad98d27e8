"""Tool calling through a real deployment (`pdserve up`: redis, router, a `both` worker, the gateway; and the
built-in model, whose template ignores tools): a tiny random checkpoint carrying Qwen2.5's published chat template
(Hermes `<tool_call>` format, detected from the template). A random model writes no calls by itself, so:

- `required` and a named function must still yield a call whose arguments validate against the function's schema
  (the grammar does it), non-streamed and streamed (deltas reassembled by the official `openai` client);
- `auto` parses what the model wrote: the output is forced into the Hermes format with `guided_grammar`, and the
  answer must be `tool_calls`; with `none` the same text comes back as plain content;
- a multi-turn history with `tool` messages renders through the template: its prompt has exactly the tokens of
  transformers' own rendering.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pdserve.services.up_process import UpProcess
from tests.conftest import make_checkpoint
from tests.e2e.conftest import _env
from tests.engine.test_chat_template import TEMPLATES, TOOL_HISTORY
from tests.services.gateway.test_tools import OPENAI_HISTORY

WEATHER = {"name": "get_weather", "description": "current weather",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Köln", "Rom", "Oslo"]},
               "unit": {"type": "string", "enum": ["C", "F"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
ALARM = {"name": "set_alarm", "parameters": {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"},
    "label": {"type": "string", "maxLength": 6}},
    "required": ["hour", "loud", "label"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ALARM}]
SCHEMAS = {"get_weather": WEATHER["parameters"], "set_alarm": ALARM["parameters"]}
MSGS = [{"role": "user", "content": "Weather in Rome?"}]
DEFAULT_MAX = 7  # --default-max-tokens of this deployment
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rom", "unit": "C"}}\n</tool_call>'


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    # a longer context than the shared tiny checkpoint's: Qwen's tool preamble alone is ~1,000 byte tokens
    model = make_checkpoint(tmp_path_factory.mktemp("tools") / "tk", "llama", max_pos=4096)
    (model / "chat_template.jinja").write_text((TEMPLATES / "qwen2.5.jinja").read_text())
    d = UpProcess(["--model", str(model), "--num-gpu-blocks", "512", "--mode", "colocated", "--workers", "1",
                   "--default-max-tokens", str(DEFAULT_MAX)], _env(), 120)
    d.model_dir = model
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "set_alarm"}),
    ({"type": "function", "function": {"name": "set_alarm"}}, {"set_alarm"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
])
def test_required_and_named_give_a_valid_call(client, choice, names):
    r = client.chat.completions.create(model="tk", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=120,
                                       temperature=0, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert len(ch.message.tool_calls) == 1
    check_calls(ch.message.tool_calls, names)


def test_sampled_required_calls_validate(client):
    """Not only the greedy path: sampled outputs under the grammar are valid calls too (parallel allowed)."""
    for seed in range(3):
        r = client.chat.completions.create(model="tk", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, temperature=1.0, seed=seed, n=2)
        for ch in r.choices:
            calls = ch.message.tool_calls
            if ch.finish_reason == "length":  # a random model may go on calling: the calls before the cut stand
                assert calls and len(r.choices) == 2, ch
                calls = [c for c in calls if not _cut(c)]
                assert len(calls) >= len(ch.message.tool_calls) - 1
            else:
                assert ch.finish_reason == "tool_calls", ch
            check_calls(calls, {"get_weather", "set_alarm"})


def _cut(call) -> bool:
    try:
        json.loads(call.function.arguments)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_streamed_calls_reassemble_with_the_openai_client(client, choice):
    kw = dict(model="tk", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    with client.beta.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls"
    check_calls(ch.message.tool_calls, {"get_weather", "set_alarm"})
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    # the raw chunks: per call its id + name with empty arguments, then argument fragments (several: they are
    # sent as the tokens arrive)
    deltas = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            deltas.extend(c.delta.tool_calls or [])
    assert deltas[0].id and deltas[0].function.name and deltas[0].function.arguments == ""
    assert len(deltas) > 2 and all(d.id is None and d.index == 0 for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas[1:])) == json.loads(whole[0].function.arguments)


def test_auto_parses_the_models_own_format(client):
    kw = dict(model="tk", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=0,
              extra_body={"guided_grammar": "root ::= " + json.dumps(HERMES_CALL)})
    ch = client.chat.completions.create(**kw, tool_choice="auto").choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == \
        [("get_weather", {"city": "Rom", "unit": "C"})]
    # none: the very same output is the answer's text
    ch = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert ch.message.content == HERMES_CALL and not ch.message.tool_calls and ch.finish_reason == "stop"
    # and streamed, auto: the call as deltas, no content
    with client.beta.chat.completions.stream(**kw, tool_choice="auto") as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert final.message.tool_calls[0].function.name == "get_weather"


def test_tool_history_renders_through_the_template(up, client):
    from transformers import PreTrainedTokenizerFast

    from pdserve.engine.tokenizer import Tokenizer
    ref = PreTrainedTokenizerFast.from_pretrained(str(up.model_dir))
    tools = [{"type": "function", "function": WEATHER}]
    text = ref.apply_chat_template(TOOL_HISTORY, tools=tools, tokenize=False, add_generation_prompt=True)
    tok = Tokenizer(up.model_dir)
    want = len(tok.encode(text, add_special_tokens=not (tok.bos_token and text.startswith(tok.bos_token))))
    r = client.chat.completions.create(model="tk", messages=OPENAI_HISTORY, tools=tools, max_tokens=4,
                                       temperature=0)
    assert r.usage.prompt_tokens == want
    # a history that breaks the rules is a 400 naming the message, from the real server too
    bad = httpx.post(up.base_url + "/v1/chat/completions", timeout=30, json={
        "messages": [*MSGS, {"role": "tool", "content": "21"}], "tools": tools})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].tool_call_id"


def test_default_max_tokens_caps_a_request_without_one(client):
    """`--default-max-tokens` (passed by `pdserve up` to its gateway): a body without max_tokens gets at most that
    many tokens; an explicit max_tokens is the client's."""
    r = client.chat.completions.create(model="tk", messages=MSGS, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == DEFAULT_MAX and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="tk", messages=MSGS, temperature=0, max_tokens=DEFAULT_MAX + 5,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == DEFAULT_MAX + 5


@pytest.fixture
def builtin_client(colocated_builtin):
    """The built-in model: its chat template ignores tools (no detection: the default Hermes parser). The deployment
    is shared (tests/e2e/conftest.py) and stopped with a clean-exit check after its last test."""
    return openai.OpenAI(base_url=colocated_builtin.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_builtin_model_gives_valid_calls(builtin_client, choice):
    kw = {"model": "builtin", "messages": MSGS, "tools": TOOLS, "tool_choice": choice, "max_tokens": 150,
          "temperature": 0, "parallel_tool_calls": False}
    ch = builtin_client.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls", ch
    check_calls(ch.message.tool_calls, {"get_weather", "set_alarm"} if choice == "required" else {"set_alarm"})
    with builtin_client.beta.chat.completions.stream(**kw) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]


class Lookup(pydantic.BaseModel):
    """A one-string-field tool, as a pydantic model (the SDK's helpers make it a strict function)."""
    query: str


LOOKUP = openai.pydantic_function_tool(Lookup)
NAMED = {"type": "function", "function": {"name": "Lookup"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_sdk_stream_helper_parses_strict_pydantic_tools(builtin_client, choice):
    """`chat.completions.stream` parses a strict tool's arguments as they arrive: a first fragment it cannot
    start a JSON value on (whitespace) raised `ValueError: EOF while parsing a value`."""
    kw = {"model": "builtin", "messages": MSGS, "tools": [LOOKUP], "tool_choice": choice, "max_tokens": 150,
          "temperature": 0, "parallel_tool_calls": False}
    with builtin_client.chat.completions.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_completion().choices[0]
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    call = final.message.tool_calls[0]
    assert final.finish_reason == "tool_calls" and call.function.name == "Lookup"
    assert isinstance(call.function.parsed_arguments, Lookup)
    whole = builtin_client.chat.completions.parse(**kw).choices[0].message.tool_calls[0]
    assert whole.function.arguments == call.function.arguments  # the same greedy call, whole and streamed


def test_a_named_call_of_a_one_string_tool_fits_48_tokens(builtin_client):
    """The call's head is in the prompt: the 48 tokens pay for the arguments only (and they are compact JSON).
    Greedy: how long a sampled string runs is the model's choice."""
    r = builtin_client.chat.completions.create(
        model="builtin", messages=MSGS, tools=[LOOKUP], tool_choice=NAMED, max_tokens=48, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    args = ch.message.tool_calls[0].function.arguments
    assert isinstance(json.loads(args)["query"], str) and ": " not in args.replace(json.loads(args)["query"], "")
    assert r.usage.completion_tokens <= 48


def _streamed(client, **kw) -> tuple[str | None, list, str]:
    content, calls, fr = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                d = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                d["name"] = d["name"] or (tc.function.name if tc.function else None)
                d["arguments"] += (tc.function.arguments or "") if tc.function else ""
            fr = c.finish_reason or fr
    return content.strip() or None, [(d["name"], d["arguments"]) for _, d in sorted(calls.items())], fr


@pytest.mark.parametrize("max_tokens", [6, 20, 35, 60, 150])
def test_whole_and_streamed_answers_agree_when_cut(builtin_client, max_tokens):
    """Cut by max_tokens, a whole answer and its stream report the same calls (and the same content)."""
    kw = {"model": "builtin", "messages": MSGS, "tools": TOOLS, "tool_choice": "required",
          "max_tokens": max_tokens, "temperature": 0, "parallel_tool_calls": True}
    ch = builtin_client.chat.completions.create(**kw).choices[0]
    whole = ((ch.message.content or "").strip() or None,
             [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []], ch.finish_reason)
    assert _streamed(builtin_client, **kw) == whole


def test_n_choices_stream_one_per_chunk(builtin_client):
    """As OpenAI streams `n` > 1: every chunk carries one choice; each choice has its own role chunk and end."""
    stream = builtin_client.chat.completions.create(model="builtin", messages=MSGS, n=2, stream=True, max_tokens=6,
                                                    temperature=1, seed=5)
    seen: dict[int, list] = {0: [], 1: []}
    for chunk in stream:
        assert len(chunk.choices) == 1, chunk
        seen[chunk.choices[0].index].append(chunk.choices[0])
    for i in (0, 1):
        assert seen[i][0].delta.role == "assistant" and seen[i][-1].finish_reason is not None
    comp = builtin_client.completions.create(model="builtin", prompt="hello", n=2, stream=True, max_tokens=6, seed=5)
    assert all(len(c.choices) == 1 for c in comp)
