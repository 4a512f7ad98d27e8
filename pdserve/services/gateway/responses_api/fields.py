"""Every field `POST /v1/responses` takes, in one table: the name check and the `/openapi.json` schema.

A field not in the table is a 400 naming it; an OpenAI Responses field pdserve does not serve is in `UNSUPPORTED`
and is a 400 saying why, unless its value is one that changes nothing. docs/api.md lists the same table
(tests/services/gateway/test_responses.py keeps the two in step).
"""
from __future__ import annotations

from pdserve.services.gateway.fields import MAX_PRIORITY, Field, check_fields
from pdserve.services.gateway.params import INT32_MAX

RESPONSES = "responses"

_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_NUM = {"type": "number"}
_INT = {"type": "integer"}
_CLOSED = {"additionalProperties": False}  # the keys request.py accepts, no more (an extra one is a 400 there)
_ECHOED = {"id": _STR, "status": _STR}  # what an SDK copies back from an earlier output item
_TEXT_PART = {"type": "object", "required": ["type", "text"], **_CLOSED, "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": _STR, "annotations": {"type": "array"},
    "logprobs": {"type": "array"}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], **_CLOSED, "properties": {
    "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
    "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]}, **_ECHOED}}
_CALL = {"type": "object", "required": ["type", "call_id", "name", "arguments"], **_CLOSED, "properties": {
    "type": {"const": "function_call"}, "call_id": _STR, "name": _STR, "arguments": _STR, **_ECHOED}}
_CALL_OUTPUT = {"type": "object", "required": ["type", "call_id", "output"], **_CLOSED, "properties": {
    "type": {"const": "function_call_output"}, "call_id": _STR,
    "output": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]}, **_ECHOED}}
INPUT = {"oneOf": [{**_STR, "minLength": 1},
                   {"type": "array", "minItems": 1, "items": {"oneOf": [_MESSAGE, _CALL, _CALL_OUTPUT]}}]}
TOOL = {"type": "object", "required": ["type", "name"], **_CLOSED, "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": _STR, "parameters": {"type": "object"}, "strict": _BOOL}}
TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": _STR}}]}
FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "name", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": _STR, "schema": {"type": "object"}, "description": _STR,
        "strict": _BOOL}}]}
TEXT = {"type": "object", "properties": {"format": FORMAT, "verbosity": {"enum": ["medium"]}}}

FIELDS: list[Field] = [
    Field("model", _STR, "the served model name (404 for another)", (RESPONSES,)),
    Field("input", INPUT, "a string (one user message) or items: messages (roles user, system, developer, "
                          "assistant; text content), `function_call`, `function_call_output`", (RESPONSES,),
          required=True),
    Field("instructions", _STR, "a system message before the input", (RESPONSES,)),
    Field("tools", {"type": "array", "items": TOOL, "minItems": 1, "maxItems": 128},
          "function tools (`{type: function, name, description, parameters, strict}`)", (RESPONSES,)),
    Field("tool_choice", TOOL_CHOICE, "`required` and `{type: function, name}` are enforced by a grammar",
          (RESPONSES,)),
    Field("parallel_tool_calls", _BOOL, "false: at most one call", (RESPONSES,)),
    Field("text", TEXT, "`format`: `text`, `json_object`, or `json_schema` (`name`, `schema`, `strict`)",
          (RESPONSES,)),
    Field("max_output_tokens", {**_INT, "minimum": 1, "maximum": INT32_MAX},
          "input + max_output_tokens must fit the context (else 400)", (RESPONSES,)),
    Field("temperature", {**_NUM, "minimum": 0}, "0 is greedy", (RESPONSES,)),
    Field("top_p", {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "nucleus sampling", (RESPONSES,)),
    Field("stream", _BOOL, "typed server-sent events (`response.created` ... `response.completed`)", (RESPONSES,)),
    Field("stream_options", {"type": "object", "properties": {"include_obfuscation": _BOOL},
                             "additionalProperties": False},
          "`include_obfuscation` accepted: nothing is padded (the usage is always in the last event)", (RESPONSES,)),
    Field("store", _BOOL, "default true: the conversation is kept for `previous_response_id` (an hour, for this "
                          "tenant; needs Redis)", (RESPONSES,)),
    Field("previous_response_id", {"type": "string", "pattern": "^resp_[0-9a-f]{24}$"},
          "continue a stored response: its conversation comes before `input` (not its `instructions`)",
          (RESPONSES,)),
    Field("include", {"type": "array", "items": _STR}, "accepted; no includable item is produced", (RESPONSES,)),
    Field("metadata", {"type": "object", "additionalProperties": _STR, "maxProperties": 16},
          "echoed in the answer", (RESPONSES,)),
    Field("user", _STR, "accepted and not used", (RESPONSES,)),
    Field("safety_identifier", _STR, "as `user`: accepted and not used", (RESPONSES,)),
    Field("truncation", {"enum": ["disabled"]}, "`disabled` only: an input too long is a 400", (RESPONSES,)),
    # ---- pdserve's extensions, as on /v1/chat/completions ----
    Field("seed", {**_INT, "minimum": 0, "maximum": 2**63 - 1}, "reproducible sampling", (RESPONSES,),
          extension=True),
    Field("top_k", {**_INT, "minimum": -1}, "-1 or 0: off; at most the vocabulary size", (RESPONSES,),
          extension=True),
    Field("timeout", {**_NUM, "exclusiveMinimum": 0}, "seconds; capped by the tenant's / server's maximum",
          (RESPONSES,), extension=True),
    Field("priority", {**_INT, "minimum": 0, "maximum": MAX_PRIORITY},
          "scheduling class, lower is more urgent; never more urgent than the API key's", (RESPONSES,),
          extension=True),
]

# Responses fields pdserve does not serve -> (why, the values that change nothing and are let through)
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "conversation": ("conversations are not stored: send the whole conversation as input", ()),
    "background": ("background responses are not supported", (False,)),
    "prompt": ("stored prompt templates are not supported", ()),
    "reasoning": ("this model has no reasoning settings", ({},)),
    "service_tier": ("service tiers are not supported", ("auto", "default")),
    "max_tool_calls": ("built-in tools are not supported, so nothing counts tool calls", ()),
    "top_logprobs": ("log-probs are not supported on /v1/responses (use /v1/chat/completions)", (0,)),
    "prompt_cache_key": ("prompt cache keys are not supported on /v1/responses", ()),
    "prompt_cache_retention": ("prompt cache retention is not supported", ()),
    "context_management": ("context management is not supported", ()),
    "prompt_cache_options": ("prompt cache options are not supported", ()),
    "background_options": ("background responses are not supported", ()),
    "moderation": ("moderation is not supported", ()),
    "image": ("image options are not supported (text only)", ()),
    "access_programs": ("access programs are not supported", ()),
}

BY_NAME = {f.name: f for f in FIELDS}


def check_known(body: dict) -> None:
    """400 for a field /v1/responses does not take: unknown, or not served (with the reason)."""
    check_fields(body, BY_NAME, UNSUPPORTED)


def request_schema(served: str | None = None) -> dict:
    """The JSON schema of a Responses body (`/openapi.json`), from the table; `served`: the one model name this
    gateway answers (another is a 404)."""
    props = {}
    for f in FIELDS:
        s = {**f.schema, **({"description": f.doc} if f.doc else {})}
        if f.extension:
            s["x-pdserve-extension"] = True
        if f.name == "model" and served is not None:
            s = {**s, "enum": [served]}
        props[f.name] = s if f.required else {"anyOf": [s, {"type": "null"}]}
    # a tool_choice other than "none" needs tools (tools/request.py), as one positive anyOf (see gateway/openapi.py)
    needs_tools = {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", None]}}},
                             {"required": ["tools"], "properties": {"tools": {"type": "array"}}}]}
    return {"type": "object", "properties": props, "required": [f.name for f in FIELDS if f.required],
            "additionalProperties": False, "allOf": [needs_tools],
            "x-pdserve-refused": {k: v[0] for k, v in UNSUPPORTED.items()}}
