"""`POST /v1/responses` through a real deployment (`pdserve up`: redis, router, a `both` worker, the gateway), with
the official clients: `client.responses.create/parse/stream` and an OpenAI Agents SDK agent on its default model
(OpenAIResponsesModel). The checkpoint is tiny and random, carrying Qwen2.5's chat template (Hermes tool calls),
so: plain text is checked token for token against the offline engine on transformers' rendering of the same
conversation; structured output and forced calls (a grammar) are checked against their schemas; a tool's result
is checked to reach the next prompt by its length in tokens (transformers' rendering of the whole history).
"""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pdserve.services.up_process import UpProcess
from tests.conftest import make_checkpoint
from tests.e2e.conftest import _env
from tests.engine.test_chat_template import TEMPLATES

WEATHER = {"type": "function", "name": "get_weather", "description": "current weather", "strict": True,
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Köln", "Rom", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}
FORCED = {"type": "function", "name": "get_weather"}
BLOCKS = 512


class Forecast(pydantic.BaseModel):
    city: Literal["Köln", "Rom", "Oslo"]
    rain: bool


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    # a longer context than the shared tiny checkpoint's: Qwen's tool preamble alone is ~1,000 byte tokens
    model = make_checkpoint(tmp_path_factory.mktemp("resp") / "tk", "llama", max_pos=4096)
    (model / "chat_template.jinja").write_text((TEMPLATES / "qwen2.5.jinja").read_text())
    d = UpProcess(["--model", str(model), "--num-gpu-blocks", str(BLOCKS), "--mode", "colocated", "--workers", "1"],
                  _env(), 120)
    d.model_dir = model
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_ids(model_dir, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: transformers renders the conversation, the checkpoint's tokenizer encodes it."""
    from transformers import PreTrainedTokenizerFast

    from pdserve.engine.tokenizer import Tokenizer
    ref = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    text = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    tok = Tokenizer(model_dir)
    return tok.encode(text, add_special_tokens=not (tok.bos_token and text.startswith(tok.bos_token)))


def test_create_text_is_the_offline_engines_greedy_answer(up, client):
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    ids = reference_ids(up.model_dir, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Weather in Rome?"}])
    eng = Engine.from_pretrained(str(up.model_dir), EngineConfig(num_gpu_blocks=BLOCKS))
    want = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    r = client.responses.create(model="tk", input="Weather in Rome?", instructions="Be brief.", temperature=0,
                                max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.instructions == "Be brief."
    assert r.output_text == want.text
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)
    cut = len(want.token_ids) == 8 and want.finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    if cut:
        assert r.incomplete_details.reason == "max_output_tokens"
    # the same conversation as items (a system message and a user message with text parts) is the same prompt
    r2 = client.responses.create(model="tk", temperature=0, max_output_tokens=8, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]}])
    assert r2.output_text == want.text and r2.usage.input_tokens == len(ids)


def test_parse_and_stream_structured_output(client):
    kw = dict(model="tk", input="Forecast for Oslo as JSON.", temperature=0, max_output_tokens=200)
    r = client.responses.parse(text_format=Forecast, **kw)
    assert r.status == "completed" and isinstance(r.output_parsed, Forecast)
    with client.responses.stream(text_format=Forecast, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    n = types.count("response.output_text.delta")
    assert n >= 2 and types == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == r.output_text  # greedy: the streamed answer is the non-streamed one
    assert final.output_parsed == r.output_parsed and final.id == events[0].response.id
    assert final.usage.output_tokens == r.usage.output_tokens > 0


def test_function_call_round_trip(up, client):
    kw = dict(model="tk", tools=[WEATHER], temperature=0, max_output_tokens=200)
    question = {"role": "user", "content": "Weather in Rome?"}
    r = client.responses.create(input=[question], tool_choice=FORCED, **kw)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    # streamed: the same call, its arguments as deltas
    with client.responses.stream(input=[question], tool_choice=FORCED, **kw) as s:
        events = list(s)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"], types
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and json.loads("".join(deltas)) == args == json.loads(events[-3].arguments)
    # the call and its output go back as input items; the answer is text, and its prompt holds the result
    result = '{"temp_c": 18, "sky": "sunny"}'
    items = [question, calls[0].model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}]
    r2 = client.responses.create(input=items, tool_choice="none", **{**kw, "max_output_tokens": 4})
    assert [i.type for i in r2.output] == ["message"]
    want = reference_ids(up.model_dir, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": result}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert r2.usage.input_tokens == len(want)


def test_bad_input_is_a_400_naming_the_field(up):
    r = httpx.post(up.base_url + "/v1/responses", timeout=30, json={
        "model": "tk", "input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "1"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].call_id", r.text
    r = httpx.post(up.base_url + "/v1/responses", timeout=30, json={"input": "x", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_previous_response_id_continues_the_stored_conversation(up, client):
    """The stored conversation (input and output items, not the instructions) comes before the new input: the
    prompt has the tokens of transformers' rendering of the whole history; streamed answers are stored too;
    `store: false` stores nothing."""
    kw = dict(model="tk", temperature=0, max_output_tokens=4)
    r1 = client.responses.create(input="My name is Ada.", instructions="Be brief.", **kw)
    assert r1.store is True
    with client.responses.stream(input="And yours?", previous_response_id=r1.id, **kw) as s:
        events = list(s)
    r2 = events[-1].response
    assert r2.previous_response_id == r1.id and r2.store is True
    r3 = client.responses.create(input="What is my name?", previous_response_id=r2.id, **kw)
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": r1.output_text},
               {"role": "user", "content": "And yours?"}, {"role": "assistant", "content": r2.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert r3.usage.input_tokens == len(reference_ids(up.model_dir, history))
    r4 = client.responses.create(input="x", store=False, **kw)
    assert r4.store is False
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="y", previous_response_id=r4.id, **kw)
    assert e.value.body["param"] == "previous_response_id"


def test_agents_sdk_agent_calls_a_tool_and_uses_its_result(up):
    """The Agents SDK's default model (the Responses API) with a forced call: the tool runs with the model's
    arguments, its result is in the next request's input, and the run ends with the model's answer. The agent
    has an output type: the random model never ends a free text by itself, and the SDK treats an answer cut at
    max_output_tokens as a failure, while a schema's grammar ends the answer."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    ran: list[str] = []
    bodies: list[dict] = []

    @function_tool
    def get_weather(city: Literal["Köln", "Rom", "Oslo"]) -> str:
        """Current weather in a city."""
        ran.append(city)
        return f"sunny in {city}, 18 C"

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            bodies.append(json.loads(request.content))

    async def main():
        async with httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120) as http:
            oai = openai.AsyncOpenAI(base_url=up.base_url + "/v1", api_key="unused", max_retries=0,
                                     http_client=http)
            agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                          output_type=Forecast,
                          model=OpenAIResponsesModel(model="tk", openai_client=oai),
                          model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200))
            return await Runner.run(agent, "Weather in Rome?", max_turns=3)

    result = asyncio.run(main())
    assert len(ran) == 1 and ran[0] in ("Köln", "Rom", "Oslo")
    assert len(bodies) == 2, bodies  # the call, then the answer (tool_choice is reset after a tool ran)
    outputs = [i for i in bodies[1]["input"] if i.get("type") == "function_call_output"]
    assert [o["output"] for o in outputs] == [f"sunny in {ran[0]}, 18 C"]
    assert isinstance(result.final_output, Forecast)
    # the turn with the forced call sent the output type too: the call, not the format, shaped that answer
    assert bodies[0]["tool_choice"] == FORCED and bodies[0]["text"]["format"]["type"] == "json_schema"
    assert bodies[1].get("tool_choice") in (None, "auto")


def test_a_client_that_leaves_mid_stream_cancels_the_request(up):
    """The stream is the chat path's, wrapped: closing it reaches the engine (CANCELLED) and frees the KV."""
    from tests.e2e.conftest import metric, wait_until
    body = {"model": "tk", "input": "Weather in Rome?", "max_output_tokens": 1500, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", up.base_url + "/v1/responses", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                n += 1
                if n == 3:
                    break  # leaving the context manager closes the connection mid-stream
    assert n == 3
    (w,) = up.workers()
    assert wait_until(lambda: metric(w["metrics_port"], "pdserve_engine_requests_terminal_total",
                                     '{state="CANCELLED"}') >= 1, 15)
    assert wait_until(lambda: metric(w["metrics_port"], "pdserve_kv_blocks_in_use") == 0, 15)
