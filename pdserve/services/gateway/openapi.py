"""`/openapi.json`: the request bodies as the gateway really checks them (issue 18, item 4).

The endpoints read their bodies themselves (parse.py, params.py), so FastAPI's generated document would show no
body at all. This one is built from the field table (fields.py): each endpoint's fields with their types and
ranges, the extensions marked `x-pdserve-extension`, `additionalProperties: false` (an unknown field is a 400),
and the error body. Clients and fuzzers (schemathesis) can generate requests from it.
"""
from __future__ import annotations

from pdserve.services.gateway.fields import UNSUPPORTED, fields_for
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
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "name": {"type": "string"}, "tool_call_id": {"type": "string"},
    "tool_calls": {"type": "array", "items": _TOOL_CALL}}}
_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}
_TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
# where the table's schema is only the outline, the full one
_DETAIL = {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
           "tools": {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": _TOOL},
           "tool_choice": _TOOL_CHOICE}


def request_schema(chat: bool) -> dict:
    props, required = {}, []
    for f in fields_for(chat).values():
        s = dict(_DETAIL.get(f.name, f.schema))
        if f.doc:
            s["description"] = f.doc
        if f.extension:
            s["x-pdserve-extension"] = True
        # null means the default: every optional field takes it
        props[f.name] = s if f.required else {"anyOf": [s, {"type": "null"}], **(
            {"description": f.doc} if f.doc else {}), **({"x-pdserve-extension": True} if f.extension else {})}
        if f.required:
            required.append(f.name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False,
            "x-pdserve-refused": {k: v[0] for k, v in UNSUPPORTED.items()}}


def _endpoint(summary: str, chat: bool) -> dict:
    name = "ChatCompletionRequest" if chat else "CompletionRequest"
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"post": {
        "summary": summary, "operationId": "createChatCompletion" if chat else "createCompletion",
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{name}"}}}},
        "responses": {
            "200": {"description": "the answer (JSON), or server-sent events with `stream: true`",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "invalid request; `error.param` names the field", **err},
            "401": {"description": "missing or invalid API key", **err},
            "404": {"description": "unknown model", **err},
            "429": {"description": "rate limit or quota", **err},
            "503": {"description": "no capacity or no workers", **err},
            "504": {"description": "the request's deadline passed", **err}}}}


def document(title: str, version: str) -> dict:
    model = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "root": {"type": "string"}, "max_model_len": {"type": "integer"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible API; fields and extensions: docs/api.md"},
        "paths": {
            "/v1/completions": _endpoint("text completion", False),
            "/v1/chat/completions": _endpoint("chat completion (tools: docs/api.md, Tool calling)", True),
            "/v1/responses": responses_openapi.path_item(),
            "/v1/models": {"get": {"summary": "the served model", "operationId": "listModels", "responses": {
                "200": {"description": "list", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"object": {"const": "list"},
                                                     "data": {"type": "array", "items": model}}}}}}}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "one model", "operationId": "retrieveModel",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {"application/json": {
                    "schema": model}}}, "404": {"description": "unknown model"}}}},
            "/health": {"get": {"summary": "200 when workers can serve", "operationId": "health",
                                "responses": {"200": {"description": "ready"},
                                              "503": {"description": "not ready"}}}},
        },
        "components": {"schemas": {"CompletionRequest": request_schema(False),
                                   "ChatCompletionRequest": request_schema(True), "Error": _ERROR,
                                   **responses_openapi.schemas()}},
    }
