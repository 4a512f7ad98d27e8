"""`/openapi.json`: the request bodies as the gateway really checks them.

The endpoints read their bodies themselves (parse.py, params.py), so FastAPI's generated document would show no
body at all. This one is built from the field table (fields.py): each endpoint's fields with their types and
ranges, the extensions marked `x-pdserve-extension`, `additionalProperties: false` (an unknown field is a 400),
and the error body. Clients and fuzzers (schemathesis) can generate requests from it.
"""
from __future__ import annotations

from pdserve.services.gateway.fields import UNSUPPORTED, fields_for
from pdserve.services.gateway.parse import MAX_MESSAGES, MAX_PROMPTS
from pdserve.services.gateway.responses_api import openapi as responses_openapi
from pdserve.services.gateway.tools.request import MAX_TOOLS

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "required": ["id", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"},
        # the JSON text of an object (an annotation: JSON Schema cannot check what a string parses to)
        "arguments": {"type": "string", "contentMediaType": "application/json",
                      "contentSchema": {"type": "object"}}}}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}


def _message(roles: list[str], required: list[str], **props) -> dict:
    """One kind of message, as parse.py reads it: `tool_call_id` only (and always) on a tool message, content
    required except for an assistant's tool calls."""
    return {"type": "object", "required": ["role", *required], "additionalProperties": False,
            "properties": {"role": {"enum": roles}, "content": _CONTENT, "name": {"type": "string"}, **props}}


_MESSAGE = {"anyOf": [
    _message(["system", "developer", "user"], ["content"]),
    _message(["assistant"], ["content"], tool_calls={"type": "array", "items": _TOOL_CALL}),
    _message(["assistant"], ["tool_calls"], content={"type": "null"},
             tool_calls={"type": "array", "minItems": 1, "items": _TOOL_CALL}),
    _message(["tool"], ["content", "tool_call_id"], tool_call_id={"type": "string"})]}
_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}
_TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}


def _given(name: str, schema: dict) -> dict:
    """`name` is present with a value matching `schema` (a positive schema, null excluded: generators handle
    those where `not` multiplies their branches)."""
    return {"required": [name], "properties": {name: schema}}


def _server_detail(chat: bool, vocab: int, max_len: int, model: str) -> dict:
    """Where the table's schema is only the outline: the full one, with this server's vocabulary and context."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    room = max_len - 1  # a prompt has at least one token
    d = {"messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _MESSAGE},
         "tools": {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": _TOOL},
         "tool_choice": _TOOL_CHOICE,
         "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                              {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                               "items": {"type": "string", "minLength": 1}},
                              {**ids, "maxItems": room},
                              {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                               "items": {**ids, "maxItems": room}}]},
         "top_k": {"type": "integer", "minimum": -1, "maximum": vocab},
         "allowed_token_ids": ids, "stop_token_ids": {**ids, "minItems": 0, "maxItems": 64},
         "max_tokens": {"type": "integer", "minimum": 1 if chat else 0, "maximum": room},
         "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": room},
         "min_tokens": {"type": "integer", "minimum": 0, "maximum": room},
         "logprobs": {"type": "boolean"} if chat else {"type": "integer", "minimum": 0, "maximum": 20},
         # token ids as decimal strings; fewer digits than the vocabulary's size has: every one a token
         "logit_bias": {"type": "object", "propertyNames": {"pattern": f"^(0|[1-9][0-9]{{0,{len(str(vocab)) - 2}}})$"},
                        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}}
    d["model"] = {"enum": [model]}  # another is a 404
    d["guided_choice"] = {"type": "array", "minItems": 1, "maxItems": 256,
                          "items": {"type": "string", "minLength": 1, "maxLength": 1024}}
    d["guided_regex"] = {"type": "string", "minLength": 1, "format": "regex"}
    d["guided_grammar"] = {"type": "string", "minLength": 1}
    d["guided_json"] = {"type": "object"}  # (its JSON text is taken too: a string no generator makes valid)
    d["bad_words"] = {"type": "array", "maxItems": 64, "items": {"type": "string", "minLength": 1, "maxLength": 1024}}
    d["response_format"] = {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}]}
    return d


# one constraint per request (params.py): each pair of these given together is refused
_CONSTRAINTS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "response_format")
# what beam search does not combine with (SamplingParams._BEAM_EXCLUSIVE), as body fields and their "off" values
_BEAM_OFF = {"best_of": (), "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "typical_p": (1,), "min_tokens": (0,),
             "stop": ([],), "repetition_penalty": (1,), "frequency_penalty": (0,), "presence_penalty": (0,),
             "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],), "no_repeat_ngram_size": (0,),
             "prompt_logprobs": (), "guided_json": (), "guided_regex": (), "guided_grammar": (), "guided_choice": ()}


_NULL = {"type": "null"}
_NOT_TRUE = {"enum": [False, None]}


def _is(**props) -> dict:
    """The body's fields that are present match these schemas (an absent field matches anything)."""
    return {"properties": props}


def _unconstrained(name: str) -> dict:
    return {"anyOf": [_NULL, _is(type={"const": "text"})]} if name == "response_format" else _NULL


def _beam_rule(chat: bool) -> dict:
    props = {k: {"anyOf": [_NULL, *({"const": v} for v in offs)]} for k, offs in _BEAM_OFF.items()
             if k in fields_for(chat)}
    props["logprobs"] = {"enum": [False, None]} if chat else _NULL
    props["response_format"] = _unconstrained("response_format")
    if chat:  # a required or named tool choice is a grammar too
        props["tool_choice"] = {"enum": ["none", "auto", None]}
    return {"anyOf": [_is(beam_width=_NULL), _is(**props)]}


def _rules(chat: bool) -> list[dict]:
    """What one field's value asks of another (params.py refuses the rest). Each is "A is off, or B holds" as an
    anyOf of positive schemas: schemathesis' generator gives up on several if/then or `not` rules together."""
    # (one constraint per request is left to the server: as this anyOf it has six branches, and the generator
    # declines the product of all the rules' branches past some 64)
    rules = [{"anyOf": [_is(prompt_logprobs=_NULL), _is(stream=_NOT_TRUE, echo=_NOT_TRUE)]}, _beam_rule(chat)]
    if chat:
        rules += [{"anyOf": [_is(top_logprobs=_NULL), _given("logprobs", {"const": True})]},
                  {"anyOf": [_is(tool_choice={"enum": ["none", None]}), _given("tools", {"type": "array"})]},
                  # a required or named choice is a grammar: not with another constraint
                  {"anyOf": [_is(tool_choice={"enum": ["none", "auto", None]}),
                             _is(**{c: _unconstrained(c) for c in _CONSTRAINTS})]}]
    else:
        rules += [{"anyOf": [_is(max_tokens={"anyOf": [_NULL, {"type": "integer", "minimum": 1}]}),
                             _given("echo", {"const": True})]},
                  {"anyOf": [_is(echo=_NOT_TRUE), _is(stream=_NOT_TRUE)]}]
    return rules


def request_schema(chat: bool, vocab: int, max_len: int, model: str) -> dict:
    props, required = {}, []
    detail = _server_detail(chat, vocab, max_len, model)
    for f in fields_for(chat).values():
        s = dict(detail.get(f.name, f.schema))
        if f.doc:
            s["description"] = f.doc
        if f.extension:
            s["x-pdserve-extension"] = True
        # null means the default: every optional field takes it
        props[f.name] = s if f.required else {"anyOf": [s, {"type": "null"}], **(
            {"description": f.doc} if f.doc else {}), **({"x-pdserve-extension": True} if f.extension else {})}
        if f.required:
            required.append(f.name)
    for name, (why, noop) in UNSUPPORTED.items():  # refused, except for the values that change nothing
        props[name] = {"anyOf": [*({"const": v} for v in noop), {"type": "null"}],
                       "description": f"not supported: {why}"}
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False,
            "allOf": _rules(chat), "x-pdserve-refused": {k: v[0] for k, v in UNSUPPORTED.items()}}


def _endpoint(summary: str, schema: str, operation: str,
              answer: str = "the answer (JSON), or server-sent events with `stream: true`") -> dict:
    """A generation endpoint: its request schema by name, the answer and every error the gateway gives."""
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"post": {
        "summary": summary, "operationId": operation,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": answer,
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "invalid request; `error.param` names the field", **err},
            "401": {"description": "missing or invalid API key", **err},
            "404": {"description": "unknown model", **err},
            "429": {"description": "rate limit or quota", **err},
            "503": {"description": "no capacity or no workers", **err},
            "504": {"description": "the request's deadline passed", **err}}}}


def _tokenizer_paths(vocab: int, max_len: int, served: str) -> dict:
    """/tokenize and /detokenize (tokenize.py), vLLM's shapes."""
    model = {"anyOf": [{"enum": [served]}, _NULL]}
    flag = {"anyOf": [{"type": "boolean"}, _NULL]}
    completion = {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
        "model": model, "prompt": {"type": "string"}, "add_special_tokens": flag, "return_token_strs": flag}}
    chat = {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _MESSAGE},
        "add_generation_prompt": flag, "continue_final_message": {"enum": [False, None]},
        "add_special_tokens": flag, "return_token_strs": flag,
        "tools": {"anyOf": [{"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": _TOOL}, _NULL]}}}
    detok = {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
        "model": model, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}}}
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    def op(op_id: str, schema: dict, answer: str) -> dict:
        return {"post": {"summary": answer, "operationId": op_id, "requestBody": {"required": True, "content": {
            "application/json": {"schema": schema}}}, "responses": {
            "200": {"description": answer, "content": {"application/json": {"schema": {"type": "object"}}}},
            "400": {"description": "invalid request", **err}, "401": {"description": "missing or invalid API key",
                                                                      **err}}}}
    return {"/tokenize": op("tokenize", {"oneOf": [completion, chat]},
                            f"{{count, max_model_len ({max_len}), tokens, token_strs}}"),
            "/detokenize": op("detokenize", detok, "{prompt}")}


def document(title: str, version: str, vocab: int, max_len: int, served: str) -> dict:
    """The document of a server with this vocabulary size, context length (token ids, lengths) and model."""
    model = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "root": {"type": "string"}, "max_model_len": {"type": "integer"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible API; fields and extensions: docs/api.md"},
        "paths": {
            "/v1/completions": _endpoint("text completion", "CompletionRequest", "createCompletion"),
            "/v1/chat/completions": _endpoint("chat completion (tools: docs/api.md, Tool calling)",
                                              "ChatCompletionRequest", "createChatCompletion"),
            "/v1/responses": _endpoint(responses_openapi.SUMMARY, responses_openapi.NAME, "createResponse",
                                       responses_openapi.ANSWER),
            "/v1/models": {"get": {"summary": "the served model", "operationId": "listModels", "responses": {
                "200": {"description": "list", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"object": {"const": "list"},
                                                     "data": {"type": "array", "items": model}}}}}}}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "one model", "operationId": "retrieveModel",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {"application/json": {
                    "schema": model}}}, "404": {"description": "unknown model"}}}},
            **_tokenizer_paths(vocab, max_len, served),
            "/health": {"get": {"summary": "200 when workers can serve", "operationId": "health",
                                "responses": {"200": {"description": "ready"},
                                              "503": {"description": "not ready"}}}},
        },
        "components": {"schemas": {"CompletionRequest": request_schema(False, vocab, max_len, served),
                                   "ChatCompletionRequest": request_schema(True, vocab, max_len, served),
                                   "Error": _ERROR, **responses_openapi.schemas(served)}},
    }
