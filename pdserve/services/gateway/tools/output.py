"""How one request's choices are read back: the deployment's parser and the request's `parallel_tool_calls`."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.gateway.tools.base import ParsedOutput, ToolCallParser
from pdserve.services.gateway.tools.stream import ToolStreamer


@dataclass
class ToolOutput:
    parser: ToolCallParser
    parallel: bool = True  # False: at most one call per choice (the first)

    def parse(self, text: str) -> ParsedOutput:
        out = self.parser.parse(text)
        if not self.parallel:
            out.calls = out.calls[:1]
        return out

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self.parser, max_calls=None if self.parallel else 1)

    def message(self, text: str) -> tuple[dict, bool]:
        """A whole choice's assistant message, and whether it holds calls."""
        out = self.parse(text)
        if not out.calls:
            return {"role": "assistant", "content": text}, False
        return {"role": "assistant", "content": out.content,
                "tool_calls": [c.to_json() for c in out.calls]}, True
