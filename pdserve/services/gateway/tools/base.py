"""The parser interface: one model output format <-> OpenAI tool calls, and the grammar that produces it."""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import GuidedSpec


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None  # the text outside the calls (None when there is none)
    calls: list[ToolCall]


def call_from(obj, args_key: str = "arguments") -> ToolCall | None:
    """{"name": str, "<args_key>": object} -> a ToolCall; anything else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_schema(functions: list[dict], args_key: str = "arguments") -> dict:
    """The JSON schema of one call object to any of `functions` (OpenAI function definitions)."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 args_key: f.get("parameters") or {"type": "object"}},
                "required": ["name", args_key], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def lit(s: str) -> str:
    """An EBNF string literal."""
    return json.dumps(s, ensure_ascii=False)


class ToolCallParser(ABC):
    name: str
    # text that starts the calls; `leading_only`: only at the very start of the output (after whitespace)
    markers: tuple[str, ...]
    leading_only: bool = False
    call_end: str | None = None  # text that ends each call (a streamed call goes out when it arrives)
    call_head: re.Pattern | None = None  # with call_end: a call's start up to its arguments, group 1 the name
    skip_special_tokens: bool = True  # False where the marker is a special token the text must keep

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The model's whole output -> content and calls (no calls: the text as content)."""

    @abstractmethod
    def constraint(self, functions: list[dict], parallel: bool) -> GuidedSpec:
        """A grammar whose language is one call (`parallel`: one or more) to `functions`, in this format, each
        call's arguments following its function's JSON schema."""

    @abstractmethod
    def forced_call(self, name: str) -> tuple[str, str]:
        """A call to `name` in this format, around its arguments: (the text before them, the text after). A named
        tool choice writes the text before into the prompt (the model continues a call already begun) and
        samples only the arguments, which is what a client's token budget pays for."""

    @staticmethod
    def detect(template: str) -> bool:
        return False
