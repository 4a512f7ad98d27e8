"""Llama 3.1-3.3 JSON calls: the output is `{"name": "f", "parameters": {...}}` (optionally after
`<|python_tag|>`); several calls are separated by `; `."""
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

_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = (_TAG, "{", "[")
    leading_only = True
    skip_special_tokens = False  # <|python_tag|> is a special token

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):].strip()
        if not body.startswith(("{", "[")):
            return ParsedOutput(text, [])
        dec, objs, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, at = dec.raw_decode(body, at)
                objs.extend(obj if isinstance(obj, list) else [obj])
                while at < len(body) and body[at] in "; \n\t":
                    at += 1
        except ValueError:
            return ParsedOutput(text, [])
        calls = [call_from(o, "parameters") for o in objs]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)

    def constraint(self, functions: list[dict], parallel: bool) -> GuidedSpec:
        root = f"root ::= json_root ({lit('; ')} json_root)*" if parallel else "root ::= json_root"
        return GuidedSpec(json_schema=json.dumps(call_schema(functions, "parameters")), grammar=root)

    def forced_call(self, name: str) -> tuple[str, str]:
        return f'{{"name": {lit(name)}, "parameters": ', "}"

    @staticmethod
    def detect(template: str) -> bool:
        return "<|python_tag|>" in template or "ipython" in template
