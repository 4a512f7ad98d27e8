"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call."""
from __future__ import annotations

import json
import re

from pdserve.engine.sampling_params import GuidedSpec
from pdserve.services.gateway.tools.base import (
    ParsedOutput,
    ToolCallParser,
    call_from,
    call_schema,
    lit,
)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = ("<tool_call>",)
    call_end = "</tool_call>"
    # the head is complete once the arguments' `{` arrived: matched earlier, the whitespace before it would be the
    # first argument fragment (" "), which incremental JSON parsers (the openai SDK's) refuse
    call_head = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,'
                           r'\s*"arguments"\s*:\s*(?=\{)')

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for body in _BLOCK.findall(text[start:]):
            try:
                call = call_from(json.loads(body))
            except ValueError:
                call = None
            if call is None:  # not a call after all: the whole text is the answer
                return ParsedOutput(text, [])
            calls.append(call)
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)

    def constraint(self, functions: list[dict], parallel: bool) -> GuidedSpec:
        call = f'{lit("<tool_call>" + chr(10))} json_root {lit(chr(10) + "</tool_call>")}'
        root = f"root ::= call ({lit(chr(10))} call)*" if parallel else "root ::= call"
        return GuidedSpec(json_schema=json.dumps(call_schema(functions)), grammar=f"{root}\ncall ::= {call}")

    def forced_call(self, name: str) -> tuple[str, str]:
        return f'<tool_call>\n{{"name": {lit(name)}, "arguments": ', "}\n</tool_call>"

    @staticmethod
    def detect(template: str) -> bool:
        return "<tool_call>" in template
