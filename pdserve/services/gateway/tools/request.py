"""`tools`, `tool_choice`, `parallel_tool_calls` and the tool history of a chat body, checked strictly."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.services.gateway.params import bad

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule


@dataclass
class ToolRequest:
    tools: list[dict]  # as the client gave them ({"type": "function", "function": {...}}): what the template sees
    functions: list[dict]  # their `function` objects
    choice: str  # "none", "auto", "required", or "function" (one named function: `named`)
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """`required` and named choices are enforced with a grammar; `auto` lets the model choose."""
        return self.choice in ("required", "function")

    def allowed(self) -> list[dict]:
        return [f for f in self.functions if self.named is None or f["name"] == self.named]


def _function(t, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise bad(f"tools[{i}].type", "must be 'function'")
    for k in t:
        if k not in ("type", "function"):
            raise bad(f"tools[{i}].{k[:60]}", "unknown parameter")
    f = t.get("function")
    if not isinstance(f, dict):
        raise bad(f"tools[{i}].function", "must be an object")
    for k in f:
        if k not in ("name", "description", "parameters", "strict"):
            raise bad(f"tools[{i}].function.{k[:60]}", "unknown parameter")
    if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
        raise bad(f"tools[{i}].function.name", "must be 1-64 letters, digits, '_' or '-'")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad(f"tools[{i}].function.description", "must be a string")
    if f.get("parameters") is not None:
        if not isinstance(f["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        try:
            json.dumps(f["parameters"], allow_nan=False)
        except (ValueError, RecursionError):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object") from None
    if f.get("strict") is not None and not isinstance(f["strict"], bool):
        raise bad(f"tools[{i}].function.strict", "must be true or false")
    return f


def tool_request(body: dict) -> ToolRequest | None:
    """None when the body has no tools (a `tool_choice` other than "none" without tools is a 400)."""
    tools, tc, par = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise bad("parallel_tool_calls", "must be true or false")
    if tools is None:
        if tc is not None and tc != "none":
            raise bad("tool_choice", "is only allowed when tools are given")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise bad("tools", f"must be a list of 1..{MAX_TOOLS} tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad("tools", "function names must be unique")
    req = ToolRequest(tools, functions, "auto", parallel=par is not False)
    if tc is None or tc in ("none", "auto", "required"):
        req.choice = tc or "auto"
    elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict) \
            and isinstance(tc["function"].get("name"), str):
        if tc["function"]["name"] not in names:
            raise bad("tool_choice.function.name", f"{tc['function']['name'][:64]!r} is not one of the tools")
        req.choice, req.named = "function", tc["function"]["name"]
    else:
        raise bad("tool_choice", "must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
    return req


def history_message(m: dict, i: int) -> dict:
    """A message's tool parts checked, and an assistant's call arguments given to the template as objects (as
    transformers' templates expect them: `tool_call.arguments | tojson`)."""
    role = m["role"]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id", "must be a string (the id of the call this answers)")
    elif m.get("tool_call_id") is not None:
        raise bad(f"messages[{i}].tool_call_id", "is only for role 'tool'")
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if role != "assistant":
        raise bad(f"messages[{i}].tool_calls", "is only for role 'assistant'")
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls", "must be a list")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("id"), str):
            raise bad(where, "must be {'id': str, 'type': 'function', 'function': {'name', 'arguments'}}")
        f = c.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise bad(f"{where}.function", "must have a name and arguments (JSON text)")
        try:
            args = json.loads(f["arguments"])
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):  # as OpenAI takes them: any text; the template gets it as written
            args = f["arguments"]
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": args}})
    return {**m, "tool_calls": out}
