"""A Responses body -> the chat completions body it means, each Responses field checked under its own name.

The chat body then takes the chat path's own checks (parse.py, params.py, tools/request.py); an error those
raise names a chat field, which `rename` turns back into the Responses field the client wrote (`messages[3]` is
the input item it came from, `max_completion_tokens` is `max_output_tokens`, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdserve.services.gateway.params import APIError, bad
from pdserve.services.gateway.parse import MAX_MESSAGES
from pdserve.services.gateway.responses_api.fields import check_known

ROLES = ("user", "system", "developer", "assistant")
# keys an item may carry besides its content: what the API's own output items hold (`id`, `status`), so that a
# client can send a previous answer's items back as input
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"}}
_PART_TYPES = ("input_text", "output_text", "text")
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
# the Responses body's fields that pass to the chat body unchanged
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed", "top_k", "timeout",
         "priority")


@dataclass
class Translated:
    chat: dict  # the chat completions body
    where: list[str] = field(default_factory=list)  # the Responses path of each chat message


def input_items(items) -> list[dict]:
    """The input as items (a string is one user message)."""
    return [{"role": "user", "content": items}] if isinstance(items, str) else list(items)


def to_chat(body: dict, earlier: list[dict] | None = None) -> Translated:
    """`earlier`: the stored conversation `previous_response_id` names (store.py), before this input."""
    check_known(body)
    out = Translated({k: body[k] for k in _SAME if body.get(k) is not None})
    _envelope(body)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "must be a string")
        _append(out, {"role": "system", "content": instructions}, "instructions")
    if earlier:
        _input(earlier, out, "previous_response_id")
    _input(body.get("input"), out)
    if body.get("max_output_tokens") is not None:
        out.chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        out.chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out.chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None and not _forced(out.chat):
        # a forced call is the whole answer, so the text format has nothing to shape (the Agents SDK sends both
        # on the turn where a tool is forced and the agent has an output type); chat refuses the two together
        out.chat["response_format"] = fmt
    if body.get("stream") is True:
        out.chat["stream_options"] = {"include_usage": True}  # the last event carries the usage
    return out


def _forced(chat: dict) -> bool:
    return chat.get("tools") is not None and (chat.get("tool_choice") == "required"
                                              or isinstance(chat.get("tool_choice"), dict))


def _envelope(body: dict) -> None:
    """The fields that only change what the answer echoes, or nothing."""
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise bad("store", "must be true or false")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", "only 'disabled' is supported: an input too long for the context is a 400")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", "must be an object")
        for k, v in so.items():
            if k != "include_obfuscation":
                raise bad(f"stream_options.{k[:60]}", "unknown parameter")
            if v is not None and not isinstance(v, bool):
                raise bad("stream_options.include_obfuscation", "must be true or false")
    if body.get("safety_identifier") is not None and not isinstance(body["safety_identifier"], str):
        raise bad("safety_identifier", "must be a string")
    inc = body.get("include")
    if inc is not None:
        if not isinstance(inc, list) or not all(isinstance(x, str) for x in inc):
            raise bad("include", "must be a list of strings")
        if "message.output_text.logprobs" in inc:
            raise bad("include", "log-probs are not supported on /v1/responses (use /v1/chat/completions)")
    md = body.get("metadata")
    if md is not None:
        if not isinstance(md, dict) or len(md) > 16:
            raise bad("metadata", "must be an object of at most 16 keys")
        for k, v in md.items():
            if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
                raise bad(f"metadata.{k[:64]}", "keys are at most 64 characters, values strings of at most 512")


def _append(out: Translated, msg: dict, where: str) -> None:
    out.chat.setdefault("messages", []).append(msg)
    out.where.append(where)


def _input(items, out: Translated, base: str = "input") -> None:
    if isinstance(items, str):
        _append(out, {"role": "user", "content": items}, "input")
        return
    if not isinstance(items, list) or not items:
        raise bad("input", "must be a string or a non-empty list of items")
    if len(items) > MAX_MESSAGES:
        raise bad("input", f"at most {MAX_MESSAGES} items per request (got {len(items)})")
    for i, item in enumerate(items):
        where = f"{base}[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object")
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            why = "refers to a stored item; nothing is stored" if kind == "item_reference" else \
                "is not supported (message, function_call, function_call_output)"
            raise bad(f"{where}.type", f"{str(kind)[:40]!r} {why}")
        for k in item:
            if k not in _ITEM_KEYS[kind]:
                raise bad(f"{where}.{k[:60]}", "unknown parameter")
        if kind == "message":
            _message(item, where, out)
        elif kind == "function_call":
            _call(item, where, out)
        else:
            _append(out, {"role": "tool", "tool_call_id": _string(item, "call_id", where),
                          "content": _text(item.get("output"), f"{where}.output")}, where)


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise bad(f"{where}.{key}", "must be a string")
    return item[key]


def _text(content, where: str) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(at, "must be a content part object with a type")
        if part["type"] not in _PART_TYPES:
            raise bad(f"{at}.type", f"{part['type'][:40]!r} content parts are not supported (text only)")
        for k in part:
            if k not in _PART_KEYS:
                raise bad(f"{at}.{k[:60]}", "unknown parameter")
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}.text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _message(item: dict, where: str, out: Translated) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    if item.get("content") is None:
        raise bad(f"{where}.content", "is required")
    _append(out, {"role": role, "content": _text(item["content"], f"{where}.content")}, where)


def _call(item: dict, where: str, out: Translated) -> None:
    """A call the model made: joined to the assistant message it follows (one chat message holds its text and
    its calls), else an assistant message of its own."""
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
    msgs = out.chat.get("messages") or []
    if msgs and msgs[-1]["role"] == "assistant":
        msgs[-1].setdefault("tool_calls", []).append(call)
        return
    _append(out, {"role": "assistant", "content": None, "tool_calls": [call]}, where)


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools[{i}].type", f"only function tools are supported (got {str(kind)[:40]!r})")
        for k in t:
            if k not in _TOOL_KEYS:
                raise bad(f"tools[{i}].{k[:60]}", "unknown parameter")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}})
    return out


def _tool_choice(tc):
    if tc in ("none", "auto", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        if not isinstance(tc.get("name"), str):
            raise bad("tool_choice.name", "must be a string")
        return {"type": "function", "function": {"name": tc["name"]}}
    raise bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
                             "(only function tools are supported)")


def _format(text):
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "must be an object")
    for k in text:
        if k not in ("format", "verbosity"):
            raise bad(f"text.{k[:60]}", "unknown parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", "this model has no verbosity setting (only 'medium', the default)")
    f = text.get("format")
    if f is None:
        return None
    if not isinstance(f, dict) or not isinstance(f.get("type"), str):
        raise bad("text.format", "must be an object with a 'type'")
    if f["type"] in ("text", "json_object"):
        return {"type": f["type"]}
    if f["type"] != "json_schema":
        raise bad("text.format.type", f"unsupported type {f['type'][:40]!r} (text, json_object, json_schema)")
    if not isinstance(f.get("name"), str):
        raise bad("text.format.name", "must be a string")
    if not isinstance(f.get("schema"), dict):
        raise bad("text.format.schema", "must be a JSON schema object")
    js = {"name": f["name"], "schema": f["schema"]}
    if f.get("strict") is not None:
        js["strict"] = f["strict"]
    return {"type": "json_schema", "json_schema": js}


# chat field -> the Responses field it came from (a prefix: `response_format.json_schema.schema`)
_RENAMED = [("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("tool_choice.function", "tool_choice")]
_MESSAGE = re.compile(r"^messages\[(\d+)\]")
_TOOL = re.compile(r"^tools\[(\d+)\]\.function")


def responses_param(param: str, where: list[str]) -> str:
    m = _MESSAGE.match(param)
    if m:
        i = int(m.group(1))
        return (where[i] if i < len(where) else "input") + param[m.end():]
    if param == "messages":
        return "input"
    m = _TOOL.match(param)
    if m:
        return f"tools[{m.group(1)}]" + param[m.end():]
    for old, new in _RENAMED:
        if param == old or param.startswith(old + "."):
            return new + param[len(old):]
    return param


def rename(e: APIError, where: list[str]) -> APIError:
    """A chat check's error under the Responses field's name (in `param` and in the message)."""
    if e.param is None:
        return e
    new = responses_param(e.param, where)
    if new != e.param:
        e.message = e.message.replace(f"'{e.param}'", f"'{new}'", 1)
        e.param = new
    return e
