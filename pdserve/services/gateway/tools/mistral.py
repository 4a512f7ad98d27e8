"""Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (the marker is a special token in Mistral's
tokenizers, so the text keeps special tokens)."""
from __future__ import annotations

import json

from pdserve.engine.sampling_params import GuidedSpec
from pdserve.services.gateway.tools.base import (
    ParsedOutput,
    ToolCallParser,
    call_from,
    call_schema,
    lit,
)

_MARK = "[TOOL_CALLS]"


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = (_MARK,)
    skip_special_tokens = False

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(_MARK)
        if start < 0:
            return ParsedOutput(text, [])
        body = text[start + len(_MARK):].strip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return ParsedOutput(text, [])
        calls = [call_from(o) for o in (obj if isinstance(obj, list) else [obj])]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].strip() or None, calls)

    def constraint(self, functions: list[dict], parallel: bool) -> GuidedSpec:
        schema = {"type": "array", "items": call_schema(functions), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return GuidedSpec(json_schema=json.dumps(schema), grammar=f"root ::= {lit(_MARK)} json_root")

    def forced_call(self, name: str) -> tuple[str, str]:
        return f'{_MARK}[{{"name": {lit(name)}, "arguments": ', "}]"

    @staticmethod
    def detect(template: str) -> bool:
        return "[TOOL_CALLS]" in template
