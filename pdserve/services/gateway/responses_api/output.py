"""The Response object: built from a chat completion's answer, and the skeleton the streamed events carry."""
from __future__ import annotations

import secrets

# echoed from the request as the Response object names them (absent: these defaults)
_ECHOED = {"instructions": None, "max_output_tokens": None, "parallel_tool_calls": True, "temperature": 1.0,
           "top_p": 1.0, "tool_choice": "auto", "tools": [], "metadata": {}, "user": None}


def response_id(rid: str) -> str:
    """The Response's id: the request's own id (billing, logs) under the Responses API's prefix."""
    return "resp_" + rid.split("-", 1)[-1]


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def echo(body: dict) -> dict:
    """The request's settings as the Response object reports them."""
    out = {k: body[k] if body.get(k) is not None else v for k, v in _ECHOED.items()}
    text = body.get("text") or {}
    out["text"] = {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"}
    return {**out, "store": False, "truncation": "disabled", "previous_response_id": body.get("previous_response_id"),
            "reasoning": None, "background": False, "service_tier": "default"}


def skeleton(rid: str, created: int, model: str, settings: dict, status: str = "in_progress") -> dict:
    return {"id": response_id(rid), "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": None, "model": model, "output": [], "usage": None, **settings}


def usage(u: dict | None) -> dict | None:
    """A chat `usage` as the Responses API counts it."""
    if u is None:
        return None
    out = {"input_tokens": u["prompt_tokens"],
           "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
           "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": u["total_tokens"]}
    if "stage_times" in u:
        out["stage_times"] = u["stage_times"]
    return out


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(iid: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def finished(resp: dict, finish_reason: str | None, u: dict | None) -> dict:
    """`resp` completed, or incomplete when the answer was cut at max_output_tokens."""
    cut = finish_reason == "length"
    resp.update(status="incomplete" if cut else "completed", usage=usage(u),
                incomplete_details={"reason": "max_output_tokens"} if cut else None)
    return resp


def from_chat(chat: dict, model: str, settings: dict) -> dict:
    """A non-streamed chat completion (one choice) -> the Response object."""
    choice = chat["choices"][0]
    msg, fr = choice["message"], choice["finish_reason"]
    status = "incomplete" if fr == "length" else "completed"
    out = skeleton(chat["id"], chat["created"], model, settings)
    if msg.get("content") or not msg.get("tool_calls"):  # an empty answer is an empty message, not nothing
        out["output"].append(message_item(item_id("msg"), msg.get("content") or "", status))
    for c in msg.get("tool_calls") or []:
        out["output"].append(call_item(item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                       "completed"))
    return finished(out, fr, chat.get("usage"))
