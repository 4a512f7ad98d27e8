"""One streamed choice of a request with tools: its text as content deltas until a call starts, then the calls
as OpenAI `tool_calls` deltas (per call: id, type and name with empty arguments, then the arguments).

Text that could be the start of a call marker is held back until it is known not to be one. Once a marker was
seen, the rest is buffered and parsed when the choice ends (`finish`): the arguments go out as one fragment per
call, after the call's name. If the text after the marker is not a valid call, it goes out as content.
"""
from __future__ import annotations

from pdserve.services.gateway.tools.base import ToolCallParser


class ToolStreamer:
    def __init__(self, parser: ToolCallParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text = ""  # the whole output so far
        self.sent = 0  # characters of it sent as content
        self.in_call = False
        self.called = False  # the choice ended with calls

    def feed(self, delta: str) -> str:
        """New text -> the content that can go out now."""
        self.text += delta
        if self.in_call:
            return ""
        p, pending = self.parser, self.text[self.sent:]
        if p.leading_only:
            head = self.text.lstrip()
            if not head:
                return ""
            if any(head.startswith(m) or m.startswith(head) for m in p.markers):
                if any(head.startswith(m) for m in p.markers):
                    self.in_call = True
                return ""  # a call, or maybe one: hold
            out, self.sent = pending, len(self.text)
            return out
        at = min((i for i in (self.text.find(m, self.sent) for m in p.markers) if i >= 0), default=-1)
        if at >= 0:
            self.in_call = True
            out, self.sent = self.text[self.sent:at], at
            return out
        hold = max((k for m in p.markers for k in range(1, len(m)) if pending.endswith(m[:k])), default=0)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The choice ended: the content still held and the tool_calls deltas (OpenAI shape)."""
        parsed = self.parser.parse(self.text) if self.in_call or self.parser.leading_only else None
        if parsed is None or not parsed.calls:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        self.called = True
        deltas = []
        for k, c in enumerate(parsed.calls[:self.max_calls]):
            deltas.append({"index": k, "id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": ""}})
            deltas.append({"index": k, "function": {"arguments": c.arguments}})
        return "", deltas
