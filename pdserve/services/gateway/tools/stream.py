"""One streamed choice of a request with tools: its text as content deltas until a call starts, then the calls
as OpenAI `tool_calls` deltas (per call: id, type and name with empty arguments, then the arguments).

Text that could be the start of a call marker is held back until it is known not to be one. Once a marker was
seen, the rest is buffered. A format whose calls each end with a closing tag (`call_end`, Hermes'
`</tool_call>`) and start with a recognizable head (`call_head`) streams each call: id and name once the head is
complete, then argument fragments as they arrive; the other formats send each call whole (name, then its
arguments as one fragment) when the choice ends (`finish`). Text after the marker that is not a valid call goes
out as content.
"""
from __future__ import annotations

from pdserve.services.gateway.tools.base import ToolCall, ToolCallParser, new_call_id


class ToolStreamer:
    def __init__(self, parser: ToolCallParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text = ""  # the whole output so far
        self.sent = 0  # characters of it sent as content
        self.in_call = False
        self.calls_sent = 0  # calls already sent (formats with `call_end`)
        self.parsed_to = 0  # where the text of the calls sent ends
        self.open: int | None = None  # where the arguments of a call being streamed start
        self.open_sent = 0  # characters of them sent

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """New text -> the content that can go out now, and the tool_calls deltas of calls completed by it."""
        self.text += delta
        if not self.in_call:
            out = self._content()
            if not self.in_call:
                return out, []
            return out, self._complete_calls()
        return "", self._complete_calls()

    def _content(self) -> str:
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

    def _complete_calls(self) -> list[dict]:
        """Deltas for what arrived since the last look (only for formats with `call_end`): a call whose head
        (`call_head`: the marker, the name, the start of the arguments) is complete gets its id and name, then
        its arguments as they come (everything up to the last `}` seen, which may be the call's own end, is
        held); a call written otherwise goes out whole when its end tag arrives."""
        end_tag = self.parser.call_end
        if end_tag is None:
            return []
        out = []
        while True:
            if self.open is not None:
                out += self._open_fragment()
                if self.open is not None:
                    return out  # the open call has not ended yet
                continue
            if self.max_calls is not None and self.calls_sent >= self.max_calls:
                return out
            at = max(self.parsed_to, self.sent)
            head = self.parser.call_head.match(self.text, at) if self.parser.call_head is not None else None
            if head is not None:
                k = self.calls_sent
                out.append({"index": k, "id": new_call_id(), "type": "function",
                            "function": {"name": head.group(1), "arguments": ""}})
                self.open, self.open_sent = head.end(), 0
                continue
            end = self.text.find(end_tag, at)
            if end < 0:
                return out
            end += len(end_tag)
            parsed = self.parser.parse(self.text[:end])
            if not parsed.calls:
                return out  # not a call after all: `finish` sends the text
            self.parsed_to = end
            out += self._deltas(parsed.calls)

    def _open_fragment(self, final: bool = False) -> list[dict]:
        """The open call's arguments that can go out; at its end tag (or `final`) the rest, and the call closes."""
        tag = self.text.find(self.parser.call_end, self.open)
        region = self.text[self.open:] if tag < 0 else self.text[self.open:tag]
        if tag < 0 and not final:
            cut = region.rfind("}")  # the last one may close the call: held until more arrives
            cut = len(region) if cut < 0 else cut
            piece = region[self.open_sent:cut] if cut > self.open_sent else ""
        else:  # the call's text is complete: its arguments are all but the object's closing brace
            body = region.rstrip()
            args = body[:-1].rstrip() if body.endswith("}") else body
            piece = args[self.open_sent:]
            self.parsed_to = len(self.text) if tag < 0 else tag + len(self.parser.call_end)
        self.open_sent += len(piece)
        out = [{"index": self.calls_sent, "function": {"arguments": piece}}] if piece else []
        if tag >= 0 or final:
            self.open = None
            self.calls_sent += 1
        return out

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        new = calls[self.calls_sent:]
        if self.max_calls is not None:
            new = new[:max(0, self.max_calls - self.calls_sent)]
        out = []
        for c in new:
            k = self.calls_sent
            out.append({"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            out.append({"index": k, "function": {"arguments": c.arguments}})
            self.calls_sent += 1
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The choice ended: the content still held and the remaining tool_calls deltas."""
        if self.open is not None:  # ended (EOS, a stop, the length limit) inside a call: what it has
            return "", self._open_fragment(final=True)
        parsed = self.parser.parse(self.text) if self.in_call or self.parser.leading_only else None
        if self.calls_sent and parsed is not None and 0 < len(parsed.calls) <= self.calls_sent:
            return "", []  # every call went out; text after them is not part of the answer (as in `parse`)
        if parsed is not None and parsed.calls:
            return "", self._deltas(parsed.calls)
        if self.calls_sent:  # calls went out, then text that is not one: it is content
            rest = self.text[self.parsed_to:].strip()
            self.sent = len(self.text)
            return rest, []
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, []
