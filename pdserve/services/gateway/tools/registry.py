"""Which parser a deployment uses: `--tool-call-parser` (or PDSERVE_TOOL_CALL_PARSER), else the one whose syntax
the model's chat template writes, else Hermes (the format most open models are tuned on)."""
from __future__ import annotations

from pdserve.services.gateway.tools.base import ToolCallParser
from pdserve.services.gateway.tools.hermes import HermesParser
from pdserve.services.gateway.tools.llama3 import Llama3JsonParser
from pdserve.services.gateway.tools.mistral import MistralParser

PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
_DETECT_ORDER = (HermesParser, MistralParser, Llama3JsonParser)  # Llama's test ("ipython") is the loosest


def pick(name: str | None, template: str | None) -> ToolCallParser:
    if name:
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(PARSERS)})")
        return PARSERS[name]()
    for cls in _DETECT_ORDER:
        if template and cls.detect(template):
            return cls()
    return HermesParser()
